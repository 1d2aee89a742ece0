#!/usr/bin/env python3
"""``infinity train``: the out-of-core engine vs the in-memory torch baseline, same model and data.

Run (from the repository root; INFINITY_NATIVE_LIB may point at a fresh native build):
    python3 tools/bench/train.py --model-size 85M --steps 12 --rounds 3
Writes a JSON and a Markdown table to --out (default /var/tmp/infinity-bench/train-<time>.{json,md})
as well as the screen.

Each round runs ``infinity train`` once per engine, in a fresh process each (so peak RSS is per
run), the order alternating between rounds; extra flags after ``--`` go to every run. A run's
figure is its median step time without the first (warm-up) step, from its --metrics file; the
process's peak RSS comes from wait4. Ratios (infinity / torch) are taken per round, between two
runs seconds apart, and their median is reported (robust to drifts in machine load).
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
            "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_s"] for r in timed),
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="85M")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="output path stem (.json and .md are added)")
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
                row[engine] = run_once(engine, args, extra, Path(tmp))
                print(f"round {round_index} {engine}: {json.dumps(row[engine])}", flush=True)
            row["step_ratio"] = row["infinity"]["median_step_s"] / row["torch"]["median_step_s"]
            results.append(row)
    ratios = [r["step_ratio"] for r in results]
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "model_size": args.model_size,
              "steps": args.steps, "extra": extra, "rounds": results,
              "median_step_ratio": statistics.median(ratios)}
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
    text = "\n".join(lines)
    print(text)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
