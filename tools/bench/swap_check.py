#!/usr/bin/env python3
"""Cost of the swap-space integrity check (issue 23, item 7a): the 0.49B out-of-core step with
the check off, "sampled" and "full", interleaved step by step in one engine; and the page kernels
alone. See [Note: swap-space integrity check] in infinity/storage/integrity.py.

Run (from the repository root; INFINITY_NATIVE_LIB may point at a fresh native build):
    python3 tools/bench/swap_check.py                                  # 0.49B, early step on
    python3 tools/bench/swap_check.py --schedules on,off --rounds 6
    python3 tools/bench/swap_check.py --size tiny --rounds 2 --kernel-mib 256   # smoke run
Writes JSON lines to --out (default /var/tmp/infinity-bench/swap_check-<time>.jsonl) and a
Markdown summary beside it (.md), as well as the screen.

kernels   one worker: fingerprints of a --kernel-mib buffer (larger than the caches: what a swap-in
          finds is fresh from the disk) recorded and verified per mode and kernel; GB/s of the
          bytes covered, median of --kernel-reps.
step      one worker per schedule: the out-of-core bench's engine (tools/bench/out_of_core.py's
          ds_config: ZeRO-3, parameters and optimizer on NVMe, 3 GiB host budget), --warmup steps,
          then --rounds rounds; a round runs each arm (off, sampled, full; the order rotates by
          round) as engine.flush(), PageFingerprints.set_mode(arm), --pair steps of which only
          the last is timed (the first after a switch reads pages written under the previous
          mode, which are not checked). Reported per schedule: each arm's step over the same
          round's "off" step (median and min..max over rounds), and the check's own time per
          timed step (record + verify, from the PageFingerprints stats: noise-free, unlike the
          step ratio on a shared machine), with the pages read and compared.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import out_of_core as O  # noqa: E402

ARMS = ("off", "sampled", "full")
BAR = 1.02


# =========================================================================== workers
def worker(kind: str, spec: dict) -> None:
    with C.worker_stdout() as emit:
        res: dict = {"bench": "swap_check", "contender": kind, "ok": False, "git": C.git_state()}
        try:
            {"kernels": _kernels, "step": _step}[kind](spec, res)
            res["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the driver reports it with the log tail
            import traceback

            traceback.print_exc()
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        emit(res)


def _kernels(spec: dict, res: dict) -> None:
    import torch

    from infinity.io import aligned_empty
    from infinity.base.native_info import native_info
    from infinity.storage import integrity as I

    nbytes = spec["kernel_mib"] * C.MiB
    pages = nbytes // I.PAGE
    buf = aligned_empty(nbytes)
    buf.view(torch.int64).copy_(torch.arange(nbytes // 8, dtype=torch.int64) * 0x9E3779B97F4A7C15)
    table = torch.zeros(pages, dtype=torch.int32)
    lib = I.lib()
    kernels = [("sampled", 1, 1), ("full", 2, 1)]   # sampled: two loads a page, no SIMD kernel
    if I.kernel_name() == "sse4.2":
        kernels.append(("full", 2, 2))
    rows = []
    for mode, native_mode, kernel in kernels:
        rec, ver = [], []
        for _ in range(spec["kernel_reps"]):
            t0 = time.perf_counter()
            _ok(lib.inf_check_pages(native_mode, kernel, buf.data_ptr(), pages, table.data_ptr()))
            t1 = time.perf_counter()
            checked = ctypes.c_uint64()
            bad = lib.inf_check_verify(native_mode, kernel, buf.data_ptr(), pages,
                                       table.data_ptr(), ctypes.byref(checked), None, None)
            t2 = time.perf_counter()
            assert bad == 0 and checked.value == pages, (bad, checked.value)
            rec.append(t1 - t0)
            ver.append(t2 - t1)
        row = {"mode": mode, "kernel": I._KERNELS[kernel], "bytes": nbytes,
               "record_s": C.median(rec), "verify_s": C.median(ver),
               "record_gb_s": nbytes / C.median(rec) / 1e9,
               "verify_gb_s": nbytes / C.median(ver) / 1e9}
        rows.append(row)
        print(f"[kernels] {mode} {row['kernel']}: record {row['record_gb_s']:.1f} GB/s, verify "
              f"{row['verify_gb_s']:.1f} GB/s", file=sys.stderr, flush=True)
    res["rows"] = rows
    res["native_info"] = native_info()


def _ok(rc: int) -> None:
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))


def _step(spec: dict, res: dict) -> None:
    import torch
    import transformers

    import infinity

    torch.set_num_threads(spec["threads"])
    shape = C.size_shape(spec["size"])
    cfg = C.llama_config(shape, spec["seq"])
    arms = spec["arms"]
    n_steps = spec["warmup"] + spec["rounds"] * len(arms) * spec["pair"]
    data = C.token_batches(spec["seed"], n_steps, cfg.vocab_size, spec["seq"], spec["mbs"])
    nvme = tempfile.mkdtemp(prefix="swap-check-", dir=spec["scratch"])
    dsc = json.loads(json.dumps(spec["ds_config"]).replace("@NVME@", nvme))
    res["ds_config"] = dsc
    res["schedule"] = spec["schedule"]
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    try:
        with infinity.zero.Init(config=dsc):
            model = transformers.LlamaForCausalLM(cfg)
        res["n_params"] = sum(p.numel() for p in model.parameters())
        engine, *_ = infinity.initialize(model=model, config=dsc)
    except BaseException:
        try:
            os.rmdir(nvme)   # ours (mkdtemp above); left if a failed start left files in it
        except OSError:
            pass
        raise
    res["init_s"] = time.perf_counter() - t0
    batches = iter(data)
    steps: list[dict] = []

    def one_step(arm: str, timed: bool) -> dict:
        ids = next(batches)
        check = engine.manager.swap.integrity
        check.stats.reset()
        ta, ca = time.perf_counter(), _process_cpu()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        rec = {"arm": arm, "timed": timed, "step_s": time.perf_counter() - ta,
               "step_cpu_s": _process_cpu() - ca,
               "loss": float(out.loss), **{k: v for k, v in vars(check.stats).items()}}
        steps.append(rec)
        what = "timed" if timed else "prime"
        print(f"[{spec['schedule']}] {arm:8s} {what} {rec['step_s']:.2f} s "
              f"(cpu {rec['step_cpu_s']:.2f} s) "
              f"loss {rec['loss']:.4f} check {rec['record_s'] + rec['verify_s']:.3f} s wall "
              f"{rec['record_cpu_s'] + rec['verify_cpu_s']:.3f} s cpu, "
              f"{rec['record_calls'] + rec['verify_calls']} calls "
              f"({rec['pages_checked']}/{rec['pages_read']} pages read checked)",
              file=sys.stderr, flush=True)
        return rec

    try:
        res["early_step_in_use"] = bool(engine.optimizer.early_step)
        for _ in range(spec["warmup"]):
            one_step("sampled", False)
        rounds = []
        for rnd in range(spec["rounds"]):
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            got = {}
            for arm in order:
                engine.flush()                      # no write in flight while the mode changes
                engine.manager.swap.integrity.set_mode(arm)
                for i in range(spec["pair"]):
                    rec = one_step(arm, i == spec["pair"] - 1)
                got[arm] = rec
            rounds.append({"order": order, **{a: got[a] for a in arms}})
        res["rounds"] = rounds
        res["native_info"] = infinity.native_info()
    finally:
        engine.close()
        os.rmdir(nvme)   # ours (mkdtemp above); engine.close removed its swap files
    res["steps"] = steps
    summarize(res, arms)


def _process_cpu() -> float:
    """CPU seconds of this process, all threads (user + system)."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def summarize(res: dict, arms: list[str]) -> None:
    """Per arm: step ratios to the same round's "off" step, and the check's own time."""
    out = {}
    for arm in arms:
        ratios = [r[arm]["step_s"] / r["off"]["step_s"] for r in res["rounds"]]
        own = [r[arm]["record_s"] + r[arm]["verify_s"] for r in res["rounds"]]
        cpu = [r[arm]["record_cpu_s"] + r[arm]["verify_cpu_s"] for r in res["rounds"]]
        off = [r["off"]["step_s"] for r in res["rounds"]]
        cpu_ratios = [r[arm]["step_cpu_s"] / r["off"]["step_cpu_s"] for r in res["rounds"]
                      if "step_cpu_s" in r[arm]]
        out[arm] = {"median_step_s": C.median([r[arm]["step_s"] for r in res["rounds"]]),
                    "ratios": ratios, "median_ratio": C.median(ratios),
                    "min_ratio": min(ratios), "max_ratio": max(ratios),
                    "cpu_ratios": cpu_ratios, "median_cpu_ratio": C.median(cpu_ratios),
                    "check_s_per_step": C.median(own),
                    "check_cpu_s_per_step": C.median(cpu),
                    "check_cpu_share_of_off_step": C.median(cpu) / C.median(off),
                    "pages_read_per_step": C.median([r[arm]["pages_read"] for r in res["rounds"]]),
                    "pages_checked_per_step": C.median([r[arm]["pages_checked"]
                                                        for r in res["rounds"]])}
    res["summary"] = out


# =========================================================================== driver
def report(results: list[dict], machine: dict, args: argparse.Namespace) -> str:
    lines = [f"# Swap-space integrity check ({args.size})", "",
             f"machine: {machine['lscpu_model'] or machine['cpu']}, {machine['cpus']} CPUs, "
             f"load {machine['loadavg']}; commit {machine['git']['commit'][:10]}", ""]
    for res in results:
        if res.get("contender") == "kernels" and res.get("ok"):
            lines += ["Kernels alone (GB/s of bytes covered, buffer "
                      f"{args.kernel_mib} MiB, median of {args.kernel_reps}):", ""]
            lines.append(C.markdown_table(
                ["mode", "kernel", "record GB/s", "verify GB/s"],
                [[r["mode"], r["kernel"], r["record_gb_s"], r["verify_gb_s"]]
                 for r in res["rows"]]))
            lines.append("")
    for res in results:
        if res.get("contender") != "step":
            continue
        if not res.get("ok"):
            lines += [f"step ({res.get('schedule')}): FAILED: {res.get('error')} "
                      f"(log {res.get('log')})", ""]
            continue
        s = res["summary"]
        lines += [f"Step, early_step {res['schedule']} (in use: {res['early_step_in_use']}), "
                  f"{len(res['rounds'])} rounds, pair {args.pair}:", ""]
        rows = []
        for arm, v in s.items():
            cr = v.get("cpu_ratios") or []
            rows.append([arm, v["median_step_s"], f"{v['median_ratio']:.3f}",
                         f"{v['min_ratio']:.3f}..{v['max_ratio']:.3f}",
                         f"{C.median(cr):.3f} ({min(cr):.3f}..{max(cr):.3f})" if cr else "-",
                         f"{v['check_cpu_s_per_step'] * 1e3:.0f} / "
                         f"{v['check_s_per_step'] * 1e3:.0f}",
                         f"{100 * v['check_cpu_share_of_off_step']:.2f}%",
                         f"{v['pages_checked_per_step']:.0f} / {v['pages_read_per_step']:.0f}"])
        lines.append(C.markdown_table(
            ["arm", "median step s", "step / off (median)", "spread (min..max)",
             "step cpu / off (median, min..max)", "check ms / step (cpu / wall)",
             "check cpu / off step", "pages checked / read"], rows))
        lines.append("")
    info = next((r.get("native_info") for r in reversed(results) if r.get("native_info")), None)
    if info:
        lines.append(f"native_info: {json.dumps(info)}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.49B", help="0.49B, 1.04B, tiny or HxLxAxIxV")
    ap.add_argument("--schedules", default="on", help="comma list of out_of_core.py schedules")
    ap.add_argument("--arms", default=",".join(ARMS), help="check modes to compare (off first)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pair", type=int, default=2, help="steps per arm per round (the last timed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kernel-mib", type=int, default=1024)
    ap.add_argument("--kernel-reps", type=int, default=5)
    ap.add_argument("--skip-kernels", action="store_true")
    # the out-of-core bench's settings (its ds_config reads these)
    O.add_run_arguments(ap)
    ap.add_argument("--offload-activations", choices=("none", "nvme"), default="none")
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per worker")
    ap.add_argument("--out", default=None,
                    help="results .jsonl (the summary goes beside it as .md)")
    ap.add_argument("--report", metavar="JSONL", help="print the summary of earlier results")
    ap.add_argument("--worker", choices=("kernels", "step"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap


def main() -> int:
    args = parser().parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0
    if args.report:
        records = [json.loads(ln) for ln in Path(args.report).read_text().splitlines() if ln]
        header = next(r for r in records if r.get("kind") == "header")
        results = [r for r in records if r.get("kind") != "header"]
        for r in results:
            if r.get("contender") == "step" and r.get("ok"):
                summarize(r, list(r["summary"]))   # with this version's fields
        print(report(results, header["machine"], parser().parse_args(header["argv"][1:])))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or arms[0] != "off" or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms {args.arms!r}: off first, then any of {', '.join(ARMS[1:])}")
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in schedules:
        if s not in O.SCHEDULES:
            raise SystemExit(f"--schedules: {s!r} is not one of {', '.join(O.SCHEDULES)}")
    C.size_shape(args.size)
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or scratch / f"swap_check-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_suffix(".logs")
    logs.mkdir(exist_ok=True)
    machine = dict(C.machine_info(), lscpu_model=C.lscpu_model())
    C.append_jsonl(out, {"bench": "swap_check", "kind": "header", "machine": machine,
                         "argv": sys.argv})
    results = []

    def run(kind: str, tag: str, spec: dict) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--spec",
               json.dumps(spec)]
        res = C.run_worker(cmd, log_path=logs / f"{tag}.log", timeout_s=args.timeout)
        res.update({"tag": tag, "loadavg_after": os.getloadavg()})
        C.append_jsonl(out, res)
        results.append(res)
        print(f"{tag}: {'ok' if res.get('ok') else 'FAILED: ' + str(res.get('error'))} "
              f"({res['process_wall_s']:.0f} s wall, log {res['log']})", flush=True)
        return res

    if not args.skip_kernels:
        run("kernels", "kernels", {"kernel_mib": args.kernel_mib, "kernel_reps": args.kernel_reps})
    for schedule in schedules:
        spec = {"size": args.size, "schedule": schedule, "arms": arms, "rounds": args.rounds,
                "pair": args.pair, "warmup": args.warmup, "seq": args.seq, "mbs": args.mbs,
                "seed": args.seed, "threads": args.threads, "scratch": str(scratch),
                "ds_config": O.ds_config("@NVME@", args, schedule)}
        run("step", f"step-{schedule}", spec).setdefault("schedule", schedule)
    text = report(results, machine, args)
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
