#!/usr/bin/env python3
"""compute_dtype "auto" (bf16 on a CPU with native bf16) against fp32 forced, same run (issue 28).

Run (from the repository root):
    python3 tools/bench/bf16_auto.py                          # 0.49B, early step, 2 rounds
    python3 tools/bench/bf16_auto.py --sizes tiny --steps 2 --rounds 1 --io-reps 1   # smoke
Writes JSON lines to --out (default /var/tmp/infinity-bench/bf16_auto-<time>.jsonl) and a
Markdown table beside it (.md), as well as the screen.

Each round runs out_of_core.py's "ours" worker (stage 3, parameters and optimizer on NVMe, the
host budget, a fresh process each) twice: once with infinity.compute_dtype "auto" and once with
"fp32", the order alternating between rounds, so that the ratio pairs two runs minutes apart.
Then out_of_core's "io" worker replays each dtype's median swap bytes per step alone (the I/O
floor of that run: bf16 moves 2-byte parameters but keeps a separate fp32 master). Reported per
dtype: median step, peak RSS (VmHWM), swap bytes per step, what the engine chose and why
(native_info()'s in_use["compute_dtype"] and cpu_bf16); per round: fp32 / auto.
Bars (issue 28): auto >= 1.3x faster than fp32, or within 1.1x of its own I/O floor.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import out_of_core as O  # noqa: E402

DTYPES = ("auto", "fp32")
SPEEDUP_BAR, FLOOR_BAR = 1.3, 1.1


def run_size(drv: O.Driver, size: str, args) -> dict:
    got: dict = {"size": size, "rounds": [], "io": {}}
    schedule = args.schedules[0]
    for rnd in range(args.rounds):
        order = DTYPES if rnd % 2 == 0 else DTYPES[::-1]
        runs = {}
        for dtype in order:
            dsc = O.ds_config("@NVME@", args, schedule)
            dsc["infinity"]["compute_dtype"] = dtype
            if rnd == 0:
                print(f"ds_config ({size}, {dtype}):\n{json.dumps(dsc, indent=1)}", flush=True)
            runs[dtype] = drv.run("ours", size, drv.spec(size, schedule=schedule, ds_config=dsc,
                                                          nvme_placeholder="@NVME@"),
                                  tag=O.round_tag(f"ours-{dtype}", rnd))
        got["rounds"].append(runs)
    if args.io_reps > 0:
        for dtype in DTYPES:
            res = got["rounds"][0][dtype]
            if not res.get("ok"):
                continue
            st = res["median_stats"]
            sub_bytes = res["engine_sizes"]["sub_group_numel"] * 4
            chunk = min(64 * C.MiB, max(4 * C.MiB, sub_bytes // 4096 * 4096))
            spec = drv.spec(size, read_bytes=int(st["io_read_bytes"]),
                            write_bytes=int(st["io_write_bytes"]),
                            file_bytes=int(max(st["nvme_bytes"], res["engine_sizes"]["nvme_bytes"])),
                            aio=dict(res["aio"]), chunk=chunk, inflight=args.io_inflight,
                            reps=args.io_reps)
            got["io"][dtype] = drv.run("io", size, spec, tag=f"io-{dtype}")
    return got


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(per_size: list[dict], machine: dict) -> str:
    lines = [f"machine: {machine.get('cpu')}, {machine.get('cpus')} CPUs, "
             f"load {machine.get('loadavg')}", ""]
    rows = []
    for got in per_size:
        for dtype in DTYPES:
            runs = [r[dtype] for r in got["rounds"] if r[dtype].get("ok")]
            if not runs:
                rows.append([got["size"], dtype, "FAILED", "-", "-", "-", "-", "-"])
                continue
            med = C.median([r["median_step_s"] for r in runs])
            st = runs[0]["median_stats"]
            io = got["io"].get(dtype, {})
            floor = io.get("median_step_s") if io.get("ok") else None
            rows.append([got["size"], dtype, str(runs[0].get("engine_compute_dtype", "?")),
                         _f(med), ", ".join(_f(r["median_step_s"]) for r in runs),
                         f"{st['io_read_bytes'] / C.GiB:.2f} / {st['io_write_bytes'] / C.GiB:.2f}",
                         _f(floor), _f(max(C.gib(r.get("vm_hwm_bytes")) or 0 for r in runs))])
        ratios = [r["fp32"]["median_step_s"] / r["auto"]["median_step_s"] for r in got["rounds"]
                  if r["auto"].get("ok") and r["fp32"].get("ok")]
        got["ratios"] = ratios
    lines.append(C.markdown_table(
        ["size", "compute_dtype", "chose", "median step s", "per round", "swap GiB/step read / write",
         "I/O floor s", "peak RSS GiB"], rows))
    lines.append("")
    for got in per_size:
        ratios = got["ratios"]
        if not ratios:
            continue
        med = C.median(ratios)
        auto = [r["auto"] for r in got["rounds"] if r["auto"].get("ok")]
        io = got["io"].get("auto", {})
        floor = io.get("median_step_s") if io.get("ok") else None
        to_floor = (C.median([r["median_step_s"] for r in auto]) / floor) if floor else None
        met = med >= SPEEDUP_BAR or (to_floor is not None and to_floor <= FLOOR_BAR)
        lines.append(f"{got['size']}: fp32 / auto per round {', '.join(_f(x) for x in ratios)}, "
                     f"median **{_f(med)}x** (bar >= {SPEEDUP_BAR}x, or auto <= {FLOOR_BAR}x its "
                     f"I/O floor: {_f(to_floor)}x): {'met' if met else 'not met'}")
        why = auto[0].get("native_info", {}) if auto else {}
        lines.append(f"  chosen: {why.get('in_use', {}).get('compute_dtype')}")
    return "\n".join(lines)


def main() -> int:
    ap = O.parser()
    ap.description = __doc__.splitlines()[0]
    ap.set_defaults(sizes="0.49B", schedules="auto", rounds=2, steps=4, only="ours,io")
    args = ap.parse_args()
    if args.worker:
        return O.main()
    O._lists(args)
    if not args.out:
        args.out = str(Path(args.scratch) / f"bf16_auto-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    drv = O.Driver(args)
    machine = C.machine_info()
    C.append_jsonl(drv.out, {"bench": "bf16_auto", "kind": "header", "machine": machine,
                             "argv": sys.argv})
    per_size = []
    for size in args.sizes:
        got = run_size(drv, size, args)
        for runs in got["rounds"]:
            for res in runs.values():
                used = (res.get("native_info") or {}).get("in_use", {}).get("compute_dtype", "")
                res["engine_compute_dtype"] = used.split(" ", 1)[0] or "?"
        per_size.append(got)
    text = report(per_size, machine)
    print(text)
    drv.out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {drv.out} and {drv.out.with_suffix('.md')}")
    return 0 if all(r.get("ok") for r in drv.results) else 1


if __name__ == "__main__":
    sys.exit(main())
