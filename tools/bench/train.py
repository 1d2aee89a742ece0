#!/usr/bin/env python3
"""``infinity train``: the out-of-core engine vs the in-memory torch baseline, same model and data.

Run (from the repository root; INFINITY_NATIVE_LIB may point at a fresh native build):
    python3 tools/bench/train.py --model-size 85M --steps 12 --rounds 3
    python3 tools/bench/train.py --rounds 3 --io-floor      # issue 28's bar for the main job
Writes a JSON and a Markdown table to --out (default /var/tmp/infinity-bench/train-<time>.{json,md})
as well as the screen.

Each round runs ``infinity train`` once per engine, in a fresh process each (so peak RSS is per
run), the order alternating between rounds; extra flags after ``--`` go to every run. A run's
figure is its median step time without the first (warm-up) step, from its --metrics file; the
process's peak RSS comes from wait4. Ratios (infinity / torch) are taken per round, between two
runs seconds apart, and their median is reported (robust to drifts in machine load). Both engines
compute in the same dtype: ``--engine torch`` follows the engine's compute dtype rule
(infinity/train/baseline.py), so "auto" is bf16 on both where the CPU has native bf16.

``--io-floor``: each round also measures the swap path's write and cold-read GB/s with
``infinity nvme-tune``'s own measurement (one point: the engine's default aio knobs, a file of
``--tune-size`` under ``--nvme-path``), right before the infinity run, and the run's I/O floor is
its median bytes a step over those rates, reads and writes one after the other (they share the
drive: the plan calibration measured their times adding up, BENCHMARKS.md "Plan calibration").
The bar of issue 28 for ``infinity train`` with defaults: step <= max(1.2 x torch's, 1.1 x the
I/O floor), per round.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infinity.base.sizes import parse_bytes

ENGINES = ("infinity", "torch")


def run_once(engine: str, args: argparse.Namespace, extra: list[str], workdir: Path) -> dict:
    metrics = workdir / f"{engine}-{time.time_ns()}.jsonl"
    cmd = [sys.executable, "-m", "infinity.cli", "train", "--engine", engine,
           "--model-size", args.model_size, "--steps", str(args.steps), "--metrics", str(metrics),
           "--progress-every", str(max(1, args.steps)), *extra]
    log = workdir / f"{engine}.log"
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # reap here to read the child's own peak RSS
    wall = time.perf_counter() - started
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{log.read_text()[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    metrics.unlink()
    timed = rows[1:] or rows
    return {"engine": engine, "wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20,
            "median_step_s": statistics.median(r["step_s"] for r in timed),
            "median_io_wait_s": statistics.median(r["io_wait_s"] for r in timed),
            "median_optimizer_s": statistics.median(r["optimizer_s"] for r in timed),
            "median_read_bytes": statistics.median(r["io_read_bytes"] for r in timed),
            "median_write_bytes": statistics.median(r["io_write_bytes"] for r in timed),
            "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def swap_rates(path: str, size: int) -> dict:
    """Write and cold-read GB/s of ``path`` at the engine's default aio knobs, measured as
    ``infinity nvme-tune`` measures one point (a private file, removed afterwards)."""
    from infinity.config.aio import AioConfig
    from infinity.train.nvme_tune import TuneFile, TunePoint

    knobs = AioConfig()
    point = TunePoint(backend=knobs.backend, block_size=knobs.block_size,
                      queue_depth=knobs.queue_depth, thread_count=knobs.thread_count)
    with TuneFile(path, size) as tune:
        backend, write, read, resident = tune.measure(point)
    return {"backend": backend, "write_gbps": write, "read_gbps": read, "cached": resident,
            "point": point.label()}


def io_floor_s(run: dict, rates: dict) -> float:
    """Seconds a step's swap bytes take at the measured rates, reads then writes."""
    return (run["median_read_bytes"] / (rates["read_gbps"] * 1e9)
            + run["median_write_bytes"] / (rates["write_gbps"] * 1e9))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="85M")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="output path stem (.json and .md are added)")
    parser.add_argument("--io-floor", action="store_true",
                        help="measure the swap path's rates each round and report the I/O floor")
    parser.add_argument("--nvme-path", default="/var/tmp",
                        help="where the runs swap (the demo's default) and the rates are measured")
    parser.add_argument("--tune-size", default="512MiB", help="bytes of the rate measurement")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    stem = Path(args.out or f"/var/tmp/infinity-bench/train-{time.strftime('%Y%m%d-%H%M%S')}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="infinity-bench-train-") as tmp:
        for round_index in range(args.rounds):
            order = ENGINES if round_index % 2 == 0 else ENGINES[::-1]
            row = {"round": round_index}
            for engine in order:
                if engine == "infinity" and args.io_floor:
                    row["rates"] = swap_rates(args.nvme_path, parse_bytes(args.tune_size))
                    print(f"round {round_index} swap path: {json.dumps(row['rates'])}", flush=True)
                row[engine] = run_once(engine, args, extra, Path(tmp))
                print(f"round {round_index} {engine}: {json.dumps(row[engine])}", flush=True)
            row["step_ratio"] = row["infinity"]["median_step_s"] / row["torch"]["median_step_s"]
            if args.io_floor:
                row["io_floor_s"] = io_floor_s(row["infinity"], row["rates"])
                row["floor_ratio"] = row["infinity"]["median_step_s"] / row["io_floor_s"]
                row["bar_s"] = max(1.2 * row["torch"]["median_step_s"], 1.1 * row["io_floor_s"])
                row["bar_met"] = row["infinity"]["median_step_s"] <= row["bar_s"]
            results.append(row)
    ratios = [r["step_ratio"] for r in results]
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "model_size": args.model_size,
              "steps": args.steps, "extra": extra, "rounds": results,
              "median_step_ratio": statistics.median(ratios)}
    if args.io_floor:
        report["median_floor_ratio"] = statistics.median(r["floor_ratio"] for r in results)
        report["rounds_bar_met"] = sum(r["bar_met"] for r in results)
    lines = [f"infinity train bench: {args.model_size}, {args.steps} steps x {args.rounds} rounds, "
             f"flags {' '.join(extra) or '(none)'}",
             "| round | infinity step s (io wait, optimizer) | torch step s | ratio | "
             "peak RSS GiB infinity / torch |",
             "|---|---|---|---|---|"]
    for r in results:
        i, t = r["infinity"], r["torch"]
        lines.append(f"| {r['round']} | {i['median_step_s']:.2f} ({i['median_io_wait_s']:.2f}, "
                     f"{i['median_optimizer_s']:.2f}) | {t['median_step_s']:.2f} | "
                     f"{r['step_ratio']:.2f} | {i['peak_rss_gib']:.2f} / {t['peak_rss_gib']:.2f} |")
    lines.append(f"median ratio infinity / torch: {report['median_step_ratio']:.2f}")
    if args.io_floor:
        lines.append("| round | write / read GB/s | bytes a step read / written GB | I/O floor s | "
                     "infinity / floor | bar s: max(1.2 torch, 1.1 floor) | met |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in results:
            i, q = r["infinity"], r["rates"]
            lines.append(f"| {r['round']} | {q['write_gbps']:.2f} / {q['read_gbps']:.2f} | "
                         f"{i['median_read_bytes'] / 1e9:.3f} / {i['median_write_bytes'] / 1e9:.3f} | "
                         f"{r['io_floor_s']:.3f} | {r['floor_ratio']:.2f} | {r['bar_s']:.3f} | "
                         f"{'yes' if r['bar_met'] else 'no'} |")
        lines.append(f"median infinity / I/O floor: {report['median_floor_ratio']:.2f}; bar met in "
                     f"{report['rounds_bar_met']} of {len(results)} rounds")
    text = "\n".join(lines)
    print(text)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
