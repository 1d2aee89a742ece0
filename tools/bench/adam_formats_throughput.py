#!/usr/bin/env python3
"""Adam state formats out of core, disk-bound: step time and NVMe bytes per format (issue 38).

Run (from the repository root):
    python3 tools/bench/adam_formats_throughput.py                        # 0.49B, early step on, 2 rounds
    python3 tools/bench/adam_formats_throughput.py --sizes tiny --steps 2 --rounds 1 --io-reps 1 \
        --load-wait 0                                                     # smoke
Writes JSON lines to --out (default /var/tmp/infinity-bench/adam_formats_throughput-<time>.jsonl)
and a Markdown table beside it (.md), as well as the screen; --report FILE rebuilds the table.

Each run is out_of_core.py's "ours" worker (infinity.zero.Init + initialize, ZeRO-3, offload_param
and offload_optimizer nvme, host budget 3 GiB, micro-batch 1 x 128, a fresh process) with
compute_dtype "bf16" for every format, so the fp32 baseline keeps a separate fp32 master (12 B of
Adam state per parameter, 24 B moved a step) and only the states' format changes:

  fp32        optimizer_moments fp32, optimizer_master fp32
  bf16        bf16 moments, fp32 master
  int8        int8 moments (blockwise, scales in host memory), fp32 master
  int8+bf16   int8 moments, bf16 master (the bf16 parameter itself, stochastic rounding)

A round runs the four formats in a fresh process each, the order rotated by one per round, per
schedule (--schedules on: early step, gradient_clipping 0; "off": the deferred schedule). Then
out_of_core's "io" worker replays each format's median NVMe bytes per step alone (its I/O floor).

Bytes come from the tier manager's counters (engine.step_stats()' io_read_bytes / io_write_bytes:
the manager resets them at the first forward of a step, so each step's stats are that step's
bytes). To split them, the worker wraps FlatStore.load_async / write_extent (this file only;
the engine is not changed) and tallies the same bytes by the store's kind (the name's last part:
params, master, exp_avg, exp_avg_sq, grad) and by who asked (the innermost infinity/optim or
infinity/zero frame on the stack: "optim" = the optimizer, "zero" = a fetch / write home), reset
with the counters and snapshot where the engine snapshots them. Bytes not made by a store (saved
activations with --offload-activations nvme) are the counters' rest.

  Adam-state bytes = master + exp_avg + exp_avg_sq (+ grad, deferred schedule) read + written,
                     plus, with a bf16 master (the parameter is the master), the params store's
                     writes and the optimizer's own reads of it. The issue's bar is on these.
  parameters       = the fetches' reads of the params store (forward and backward) and, with an
                     fp32 master, the written 16-bit copy.

Before the timed runs the driver waits (up to --load-wait s) for the 1-minute load average to fall
under --load-max and prints it; every run records the load before / after, each step's load (in
its stats) and the other processes' CPU during the run (/proc/stat busy minus the run's own).
Bars (issue 38): Adam-state bytes per trainable parameter per step: fp32 24, int8 <= 12.5,
int8+bf16 <= 8.5; step: int8+bf16 >= 1.8x faster than fp32 in the same round, or within 1.1x of
its own I/O floor.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import out_of_core as O  # noqa: E402

FORMATS: dict[str, tuple[str, str]] = {   # name -> (optimizer_moments, optimizer_master)
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "fp32"),
    "int8": ("int8", "fp32"),
    "int8+bf16": ("int8", "bf16"),
}
BYTES_BAR = {"fp32": 24.0, "int8": 12.5, "int8+bf16": 8.5}   # Adam-state B/param/step (issue 38)
SPEEDUP_BAR, FLOOR_BAR = 1.8, 1.1
KINDS = ("params", "master", "exp_avg", "exp_avg_sq", "grad", "store")   # "store": any other
ROLES = ("optim", "zero", "other")
DIRS = ("read", "write")


def tally_key(direction: str, kind: str, role: str) -> str:
    return f"nvme_{direction}_{kind}_{role}"


# =========================================================================== worker
def install_tally() -> None:
    """Count the NVMe bytes of every FlatStore by kind and caller, alongside the manager's
    counters (see the module docstring); adds the tallies and the 1-minute load to the dict
    ``engine.step_stats()`` returns."""
    from infinity.engine import engine as engine_mod
    from infinity.storage import manager as M

    lock = threading.Lock()
    keys = [tally_key(d, k, r) for d in DIRS for k in KINDS for r in ROLES]
    tally = dict.fromkeys(keys, 0)
    here = {"optim": os.sep + os.path.join("infinity", "optim") + os.sep,
            "zero": os.sep + os.path.join("infinity", "zero") + os.sep}

    def role() -> str:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            for r, part in here.items():
                if part in name:
                    return r
            f = f.f_back
        return "other"

    def kind(store) -> str:
        last = store.name.rsplit(".", 1)[-1]
        return last if last in KINDS else "store"

    def add(direction: str, store, nbytes: int) -> None:
        if nbytes:
            k = tally_key(direction, kind(store), role())
            with lock:
                tally[k] += nbytes

    load_async, write_extent = M.FlatStore.load_async, M.FlatStore.write_extent

    def counted_load(self, buf, start=0, count=None, shadow=False):
        if self._host is None:   # the bytes load_async adds to the counters
            n = self.padded - start if count is None else count
            try:
                add("read", self, self._check_range(start, n) * self.itemsize)
            except ValueError:
                pass             # load_async raises it below
        return load_async(self, buf, start, count, shadow)

    def counted_write(self, extent, buf, start, span):
        add("write", self, span * self.itemsize)
        return write_extent(self, extent, buf, start, span)

    M.FlatStore.load_async, M.FlatStore.write_extent = counted_load, counted_write

    reset = M.TierCounters.reset

    def counted_reset(self) -> None:
        with lock:
            reset(self)
            for k in tally:
                tally[k] = 0

    M.TierCounters.reset = counted_reset
    stats = engine_mod.step_stats

    def counted_stats(*args, **kwargs):
        with lock:
            out = stats(*args, **kwargs)
            out.update(tally)
        out["loadavg_1m"] = os.getloadavg()[0]
        return out

    engine_mod.step_stats = counted_stats


def worker(kind: str, spec: dict) -> None:
    if kind == "ours":
        install_tally()
    O.worker(kind, spec)


# =========================================================================== driver
def ds_config(args: argparse.Namespace, schedule: str, fmt: str) -> dict:
    dsc = O.ds_config("@NVME@", args, schedule)
    moments, master = FORMATS[fmt]
    dsc["infinity"].update({"compute_dtype": "bf16", "optimizer_moments": moments,
                            "optimizer_master": master})
    return dsc


def busy_jiffies() -> int:
    with open("/proc/stat") as f:
        cpu = f.readline().split()[1:]
    vals = [int(x) for x in cpu]
    return sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)   # minus idle, iowait


def wait_for_quiet(limit_s: float, load_max: float, what: str) -> dict:
    """Poll the 1-minute load average until it is under ``load_max`` (at most ``limit_s``)."""
    t0 = time.monotonic()
    load = os.getloadavg()
    print(f"{what}: load {tuple(round(x, 2) for x in load)}", flush=True)
    while load[0] >= load_max and time.monotonic() - t0 < limit_s:
        time.sleep(15)
        load = os.getloadavg()
        print(f"  waiting for 1-min load < {load_max}: {load[0]:.2f} "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    waited = time.monotonic() - t0
    quiet = load[0] < load_max
    print(f"{what}: {'quiet' if quiet else 'NOT quiet'} after {waited:.0f} s, load "
          f"{tuple(round(x, 2) for x in load)}", flush=True)
    return {"what": what, "waited_s": round(waited, 1), "loadavg": load, "quiet": quiet}


def measured_run(drv: O.Driver, size: str, spec: dict, tag: str) -> dict:
    """One "ours" run in this file's worker (the tallies), with the other processes' CPU."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "ours", "--spec", json.dumps(spec)]
    tick = os.sysconf("SC_CLK_TCK")
    j0, ru0, t0 = busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    res = drv.run("ours", size, cmd=cmd, tag=tag)
    j1, ru1, wall = busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - t0
    own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    res["machine_busy_cpu_s"] = (j1 - j0) / tick
    res["own_cpu_s"] = own
    res["others_cores_busy"] = max(0.0, ((j1 - j0) / tick - own) / wall) if wall else None
    return res


def rotated(names: list[str], rnd: int) -> list[str]:
    k = rnd % len(names)
    return names[k:] + names[:k]


def run_size(drv: O.Driver, size: str, args: argparse.Namespace, quiet: list) -> dict:
    got: dict = {"size": size, "rounds": [], "io": {}}
    for rnd in range(args.rounds):
        if rnd > 0 and args.round_wait > 0:
            quiet.append(wait_for_quiet(args.round_wait, args.load_max, f"{size} round {rnd + 1}"))
        runs: dict = {}
        for schedule in args.schedules:
            for fmt in rotated(args.formats, rnd):
                dsc = ds_config(args, schedule, fmt)
                if rnd == 0:
                    print(f"ds_config ({size}, {schedule}, {fmt}):\n{json.dumps(dsc, indent=1)}",
                          flush=True)
                spec = drv.spec(size, schedule=schedule, ds_config=dsc, nvme_placeholder="@NVME@")
                res = measured_run(drv, size, spec, O.round_tag(f"ours-{schedule}-{fmt}", rnd))
                res.update({"format": fmt, "schedule": schedule, "round": rnd + 1})
                runs[(schedule, fmt)] = res
                if res.get("ok"):
                    b = split_bytes(res)
                    print(f"  {fmt} {schedule}: step {res['median_step_s']:.2f} s, NVMe "
                          f"{b['total']:.2f} B/param (Adam states {b['states']:.2f}, params "
                          f"{b['params']:.2f}), others' cores {res['others_cores_busy']:.2f}",
                          flush=True)
        got["rounds"].append(runs)
    if args.io_reps > 0 and "io" in args.only:
        quiet.append(wait_for_quiet(args.round_wait, args.load_max, f"{size} I/O replays"))
        for schedule in args.schedules:
            for fmt in args.formats:
                res = next((r[(schedule, fmt)] for r in got["rounds"]
                            if r[(schedule, fmt)].get("ok")), None)
                if res is None:
                    continue
                st = res["median_stats"]
                sub_bytes = res["engine_sizes"]["sub_group_numel"] * 4
                chunk = args.io_chunk or min(64 * C.MiB, max(4 * C.MiB, sub_bytes // 4096 * 4096))
                spec = drv.spec(size, read_bytes=int(st["io_read_bytes"]),
                                write_bytes=int(st["io_write_bytes"]),
                                file_bytes=int(max(st["nvme_bytes"],
                                                   res["engine_sizes"]["nvme_bytes"])),
                                aio=dict(res["aio"]), chunk=chunk, inflight=args.io_inflight,
                                reps=args.io_reps)
                io = drv.run("io", size, spec, tag=f"io-{schedule}-{fmt}")
                io.update({"format": fmt, "schedule": schedule})
                got["io"][(schedule, fmt)] = io
    return got


# =========================================================================== report
def split_bytes(res: dict) -> dict:
    """Median bytes per trainable parameter per step, split (see the module docstring)."""
    st, n = res["median_stats"], res["n_params"]
    fmt = res.get("format") or next(
        (f for f, (m, ma) in FORMATS.items()
         if (m, ma) == (res["ds_config"]["infinity"]["optimizer_moments"],
                        res["ds_config"]["infinity"]["optimizer_master"])), "?")

    def b(direction: str, kinds, roles=ROLES) -> float:
        return sum(st.get(tally_key(direction, k, r), 0) for k in kinds for r in roles)

    total_r, total_w = st["io_read_bytes"], st["io_write_bytes"]
    state_kinds = ("master", "exp_avg", "exp_avg_sq", "grad")
    sr, sw = b("read", state_kinds), b("write", state_kinds)
    pr_fetch, pr_opt = b("read", ("params",), ("zero", "other")), b("read", ("params",), ("optim",))
    pw = b("write", ("params",))
    bf16_master = FORMATS.get(fmt, ("", ""))[1] == "bf16"
    if bf16_master:   # the parameter is the master: its update's bytes are the master's
        sr, sw = sr + pr_opt, sw + pw
        params = pr_fetch
    else:
        params = pr_fetch + pr_opt + pw
    stores = b("read", KINDS) + b("write", KINDS)
    return {"total": (total_r + total_w) / n, "read": total_r / n, "write": total_w / n,
            "states": (sr + sw) / n, "states_read": sr / n, "states_write": sw / n,
            "params": params / n, "params_fetch_read": pr_fetch / n,
            "params_written": (0.0 if bf16_master else pw) / n,
            "moments": (b("read", ("exp_avg", "exp_avg_sq")) + b("write", ("exp_avg", "exp_avg_sq"))) / n,
            "master": (b("read", ("master",)) + b("write", ("master",))
                       + ((pr_opt + pw) if bf16_master else 0.0)) / n,
            "other": (total_r + total_w - stores) / n}


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(per_size: list[dict], args: argparse.Namespace, machine: dict, quiet: list) -> str:
    lines = [(f"Adam state formats, disk-bound (stage 3, params + optimizer on NVMe, host budget "
             f"{args.host_budget}, bf16 compute, mbs {args.mbs} x seq {args.seq}, {args.warmup} "
             f"warm-up + {args.steps} timed steps, {args.rounds} round(s), rotated order); "
             f"{machine.get('lscpu') or machine.get('cpu')}, {machine.get('cpus')} CPUs, "
             f"adam kernel {machine.get('adam_kernel')}, commit "
             f"{(machine.get('git') or {}).get('commit', '?')[:7]}, load at start "
             f"{tuple(round(x, 2) for x in machine.get('loadavg', ()))}")]
    for q in quiet:
        lines.append(f"  {q['what']}: waited {q['waited_s']:.0f} s, load "
                     f"{tuple(round(x, 2) for x in q['loadavg'])}{'' if q['quiet'] else ' (NOT quiet)'}")
    lines.append("")
    rows, bars = [], []
    for got in per_size:
        size = got["size"]
        for schedule in args.schedules:
            fp32_by_round = {i: r.get((schedule, "fp32")) for i, r in enumerate(got["rounds"])}
            for fmt in args.formats:
                runs = [r[(schedule, fmt)] for r in got["rounds"] if (schedule, fmt) in r]
                ok = [r for r in runs if r.get("ok")]
                if not ok:
                    err = next((r.get("error") for r in runs), "not run")
                    rows.append([size, schedule, fmt, "FAILED: " + str(err)[:80]] + ["-"] * 10)
                    continue
                med = C.median([r["median_step_s"] for r in ok])
                ratios = [fp32_by_round[i]["median_step_s"] / r[(schedule, fmt)]["median_step_s"]
                          for i, r in enumerate(got["rounds"])
                          if r.get((schedule, fmt), {}).get("ok")
                          and (fp32_by_round.get(i) or {}).get("ok")]
                b = split_bytes(ok[0])
                spread = max(abs(split_bytes(r)["total"] - b["total"]) for r in ok)
                io = got["io"].get((schedule, fmt)) or {}
                floor = io.get("median_step_s") if io.get("ok") else None
                st = ok[0]["median_stats"]
                split = (f"opt {st['optimizer_s']:.1f} (bg {st.get('optimizer_background_s', 0):.1f})"
                         f" / io wait {st['io_wait_s']:.1f} / compute {st['compute_s']:.1f}"
                         f"; cpu {st.get('cpu_user_s', 0):.1f}+{st.get('cpu_sys_s', 0):.1f}")
                loads = [r["median_stats"].get("loadavg_1m") for r in ok]
                others = [r.get("others_cores_busy") for r in ok]
                rows.append([
                    size, schedule, fmt, _f(med),
                    ", ".join(_f(r["median_step_s"]) for r in ok),
                    _f(C.median(ratios)) + (f" ({', '.join(_f(x) for x in ratios)})" if len(ratios) > 1 else ""),
                    f"{_f(b['total'])} ({_f(b['read'])} r / {_f(b['write'])} w)"
                    + (f" ±{spread:.2f}" if spread >= 0.01 else ""),
                    f"**{_f(b['states'])}** (m+v {_f(b['moments'])}, master {_f(b['master'])})",
                    f"{_f(b['params'])} (fetch {_f(b['params_fetch_read'])}, written "
                    f"{_f(b['params_written'])})" + (f"; other {_f(b['other'])}" if abs(b['other']) >= 0.01 else ""),
                    _f(floor), _f(med / floor if floor else None),
                    _f(max(C.gib(r["vm_hwm_bytes"]) for r in ok), 3), split,
                    ", ".join(_f(x, 1) for x in loads if x is not None) + " / "
                    + ", ".join(_f(x, 1) for x in others if x is not None)])
                if fmt in BYTES_BAR:
                    bar = BYTES_BAR[fmt]
                    verdict = ("reference" if fmt == "fp32" else
                               ("met" if b["states"] <= bar else "NOT met"))
                    bars.append(f"{size} {schedule} {fmt}: Adam-state bytes {b['states']:.2f} B/param/step "
                                f"(bar {'' if fmt == 'fp32' else '<= '}{bar}): {verdict}")
                if fmt == "int8+bf16":
                    to_floor = med / floor if floor else None
                    met = (ratios and C.median(ratios) >= SPEEDUP_BAR) or \
                        (to_floor is not None and to_floor <= FLOOR_BAR)
                    bars.append(f"{size} {schedule} int8+bf16: fp32 / int8+bf16 per round "
                                f"{', '.join(_f(x) for x in ratios) or '-'} (median "
                                f"{_f(C.median(ratios))}x, bar >= {SPEEDUP_BAR}x), step / own I/O "
                                f"floor {_f(to_floor)} (bar <= {FLOOR_BAR}): "
                                f"{'met' if met else 'NOT met'}")
    lines.append(C.markdown_table(
        ["size", "schedule", "format", "median step s", "per round", "fp32 / this (per round)",
         "NVMe B/param/step total", "Adam-state B/param", "params B/param", "I/O floor s",
         "step / floor", "peak RSS GiB", "split (median s; cpu user+sys)",
         "load 1-min per run / others' cores"], rows))
    lines += ["", *bars]
    return "\n".join(lines)


# =========================================================================== main
def parser() -> argparse.ArgumentParser:
    ap = O.parser()
    ap.description = __doc__.splitlines()[0]
    ap.set_defaults(sizes="0.49B", schedules="on", rounds=2, steps=4, warmup=1, io_reps=2,
                    only="ours,io")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma list of {', '.join(FORMATS)} (a round rotates this order)")
    ap.add_argument("--load-max", type=float, default=3.0,
                    help="wait for the 1-minute load average to fall under this before timing")
    ap.add_argument("--load-wait", type=float, default=1200,
                    help="seconds to wait for --load-max before the first run (then run anyway)")
    ap.add_argument("--round-wait", type=float, default=120,
                    help="seconds to wait for --load-max before each later round and the replays")
    return ap


def _lists(args: argparse.Namespace) -> None:
    O._lists(args)
    args.formats = [s.strip() for s in args.formats.split(",") if s.strip()]
    bad = [f for f in args.formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"--formats: unknown {bad}; choose from {','.join(FORMATS)}")
    for s in args.schedules:
        if s not in O.SCHEDULES:
            raise SystemExit(f"--schedules: {s!r} is not one of {', '.join(O.SCHEDULES)}")


def report_file(path: Path) -> str:
    """The table of an earlier results file (its header's settings, this version's report)."""
    records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    header = next(r for r in records if r.get("kind") == "header")
    args = parser().parse_args(header["argv"][1:])
    _lists(args)
    per_size = []
    for size in args.sizes:
        got: dict = {"size": size, "rounds": [{} for _ in range(args.rounds)], "io": {}}
        for r in records:
            if r.get("size_name") != size or not r.get("final"):
                continue
            if r.get("contender") == "io" or str(r.get("tag", "")).startswith("io-"):
                got["io"][(r["schedule"], r["format"])] = r
            elif "round" in r:
                got["rounds"][r["round"] - 1][(r["schedule"], r["format"])] = r
        per_size.append(got)
    quiet = next((r["quiet"] for r in records if r.get("kind") == "quiet"), header.get("quiet", []))
    return report(per_size, args, header["machine"], quiet)


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0
    if args.report:
        print(report_file(Path(args.report[0])))
        return 0
    _lists(args)
    for s in args.sizes:
        C.size_shape(s)
    if not args.out:
        args.out = str(Path(args.scratch) /
                       f"adam_formats_throughput-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    drv = O.Driver(args)
    # the driver's run() appends each result as it comes; ours carry format / round (added
    # after), so this file also writes them once more, complete, for --report
    quiet = [wait_for_quiet(args.load_wait, args.load_max, "before the timed runs")]
    import infinity

    machine = C.machine_info()
    machine["lscpu"] = C.lscpu_model()
    machine["adam_kernel"] = infinity.native_info().get("adam_kernel")
    C.append_jsonl(drv.out, {"bench": "adam_formats_throughput", "kind": "header",
                             "machine": machine, "argv": sys.argv, "quiet": quiet})
    per_size = []
    for size in args.sizes:
        got = run_size(drv, size, args, quiet)
        for runs in got["rounds"]:
            for res in runs.values():
                C.append_jsonl(drv.out, {**res, "final": True})
        for io in got["io"].values():
            C.append_jsonl(drv.out, {**io, "final": True})
        per_size.append(got)
    C.append_jsonl(drv.out, {"bench": "adam_formats_throughput", "kind": "quiet", "quiet": quiet})
    text = report(per_size, args, machine, quiet)
    print(text)
    drv.out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {drv.out} and {drv.out.with_suffix('.md')}")
    return 0 if all(r.get("ok") for r in drv.results) else 1


if __name__ == "__main__":
    sys.exit(main())
