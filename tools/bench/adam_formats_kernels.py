#!/usr/bin/env python3
"""Adam state format kernels, elements per second of one thread: each format's fused kernel
(bf16 or int8 moments, fp32 or bf16 master) beside the fp32 kernel (optim/cpu_adam), and the
same against another build of the native library (``--baseline-lib``, e.g. a commit before a
kernel change).

Why a tool: the planner takes the formats' kernel rates (planner/step_time.py
``KERNEL_ELEMENTS_PER_S``) from these figures, and a kernel change is judged by them. Each
(library, round) is a fresh process, the libraries alternate round by round, and within a
process the contenders rotate; a contender's figure is its median over rounds of
elements / CPU seconds of the calling thread (one thread: CPU time is what a loaded machine
distorts least), wall rates beside it. Ratios are to the fp32 kernel of the same process.

Run (from the repository root):
    python3 tools/bench/adam_formats_kernels.py --rounds 5
    python3 tools/bench/adam_formats_kernels.py --rounds 5 --baseline-lib /tmp/old/libinfinity_native.so
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CONTENDERS = ("fp32", "bf16 / fp32 master", "bf16 / bf16 master", "int8 / fp32 master",
              "int8 / bf16 master")
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def worker(numel: int, steps: int, rotate: int) -> dict:
    """One process: every contender ``steps`` steps of ``numel`` elements, one thread."""
    import torch

    from infinity.base.native_info import native_info
    from infinity.optim import adam_formats as F
    from infinity.optim.cpu_adam import adam_step_flat

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=gen) * 1e-2
    runs = {}
    for name in CONTENDERS:
        moments, _, master = name.partition(" / ")
        param = torch.randn(numel, generator=gen)
        if master.startswith("bf16"):
            param = param.bfloat16()
        if moments == "fp32":
            m, v = torch.zeros(numel), torch.zeros(numel)

            def step(s, p=param, m=m, v=v):
                adam_step_flat(p, grad, m, v, step=s, threads=1, **HYPER)
        elif moments == "bf16":
            st = F.new_moments(numel, "bf16")

            def step(s, p=param, st=st):
                F.step_bf16_moments(p, grad, st["exp_avg"], st["exp_avg_sq"], step=s,
                                    threads=1, **HYPER)
        else:
            st = F.new_moments(numel, "int8")

            def step(s, p=param, st=st):
                F.step_int8_moments(p, grad, st["exp_avg"], st["exp_avg_sq"],
                                    st["exp_avg_absmax"], st["exp_avg_sq_absmax"], step=s,
                                    threads=1, **HYPER)
        runs[name] = step
    order = list(CONTENDERS[rotate % len(CONTENDERS):] + CONTENDERS[:rotate % len(CONTENDERS)])
    out = {}
    for name in order:
        runs[name](1)                       # warm-up: page the buffers in
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for s in range(2, steps + 2):
            runs[name](s)
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        out[name] = {"cpu_rate": numel * steps / cpu, "wall_rate": numel * steps / wall}
    info = native_info()
    return {"rates": out, "library": info["library"], "kernel": info["adam_kernel"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-lib", default=None,
                    help="another build of libinfinity_native.so to measure beside this one")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.numel, args.steps, args.worker)))
        return 0
    libs = {"this": None}
    if args.baseline_lib:
        if not Path(args.baseline_lib).is_file():
            raise SystemExit(f"--baseline-lib {args.baseline_lib!r} is not a file")
        libs["baseline"] = args.baseline_lib
    results: dict[str, list[dict]] = {k: [] for k in libs}
    for r in range(args.rounds):
        for label in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            env = dict(os.environ)
            env.pop("INFINITY_NATIVE_LIB", None)
            if libs[label]:
                env["INFINITY_NATIVE_LIB"] = libs[label]
            cmd = [sys.executable, __file__, "--worker", str(r), "--numel", str(args.numel),
                   "--steps", str(args.steps)]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                            text=True).stdout.strip().splitlines()[-1])
            results[label].append(res)
            print(f"round {r + 1} {label}: " + ", ".join(
                f"{n} {v['cpu_rate'] / 1e6:.0f}" for n, v in res["rates"].items()) + " M/s",
                flush=True)
    print(f"\n{args.numel:,} elements, {args.steps} steps, one thread, median of {args.rounds} "
          f"rounds; kernel {results['this'][0]['kernel']}; load {os.getloadavg()[0]:.1f}")
    head = "| contender | " + " | ".join(
        f"{k}: M elements/CPU s (wall) | {k}: / fp32" for k in libs) + \
        (" | this / baseline |" if "baseline" in libs else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in CONTENDERS:
        cells, med = [], {}
        for label in libs:
            cpu = statistics.median(r["rates"][name]["cpu_rate"] for r in results[label])
            wall = statistics.median(r["rates"][name]["wall_rate"] for r in results[label])
            ratio = statistics.median(r["rates"][name]["cpu_rate"] / r["rates"]["fp32"]["cpu_rate"]
                                      for r in results[label])
            med[label] = cpu
            cells += [f"{cpu / 1e6:.0f} ({wall / 1e6:.0f})", f"{ratio:.2f}"]
        extra = f" {med['this'] / med['baseline']:.2f} |" if "baseline" in libs else ""
        print(f"| {name} | " + " | ".join(cells) + " |" + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
