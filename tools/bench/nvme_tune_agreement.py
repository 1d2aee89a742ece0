#!/usr/bin/env python3
"""Do `infinity nvme-tune` numbers agree with tools/bench/io.py's at the same settings? Interleaved.

Run (from the repository root):
    python3 tools/bench/nvme_tune_agreement.py --gib 1 --block-sizes 1MiB,4MiB --queue-depths 8,32 --reps 3
Writes a JSON and a Markdown table to --out (default /var/tmp/infinity-bench/nvme-tune-agree-<time>)
as well as the screen.

At each (block_size, queue_depth) point, rep by rep and alternating which goes first, it runs
tools/bench/io.py's own measurement of our engine (its ``InfinitySide``: one request for the whole
buffer, cold read after fsync + DONTNEED, no fsync on writes) and one nvme-tune measurement
(``infinity.train.nvme_tune.TuneFile.measure``, exactly what a sweep runs per point: chunked
requests from one buffer, cold read, no fsync). Each side keeps its own file for the whole run, so
every timed write overwrites that side's previous write, as in a sweep and in io.py. Both use backend io_uring (``--backend``), thread_count 1. It reports both medians,
their min..max over reps and the ratio nvme-tune / io.py; "agree" means each median lies within
the other side's min..max (run-to-run spread).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

GiB = 1 << 30


def load_io_bench():
    path = Path(__file__).with_name("io.py")
    spec = importlib.util.spec_from_file_location("bench_io", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--block-sizes", default="1MiB,4MiB")
    ap.add_argument("--queue-depths", default="8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="io_uring")
    ap.add_argument("--dir", default="/var/tmp/infinity-bench")
    ap.add_argument("--out", default=None, help="path stem for .json/.md results")
    a = ap.parse_args()

    from infinity.base.sizes import parse_bytes
    from infinity.train import nvme_tune as tune

    io_bench = load_io_bench()
    nbytes = int(a.gib * GiB) // 4096 * 4096
    os.makedirs(a.dir, exist_ok=True)
    stem = a.out or os.path.join(a.dir, time.strftime("nvme-tune-agree-%Y%m%d-%H%M%S"))
    io_file = os.path.join(a.dir, f"agree-io-{os.getpid()}.dat")
    ref = io_bench.InfinitySide(nbytes, a.backend)
    tune_file = tune.TuneFile(a.dir, nbytes)
    results = {"bench": "nvme_tune_agreement", "nbytes": nbytes, "reps": a.reps,
               "backend": a.backend, "command": " ".join(["python3"] + sys.argv), "points": []}
    try:
        ref.configure(block_size=1 << 20, queue_depth=8, thread_count=1, single_submit=False,
                      overlap_events=True)
        ref.run("write", io_file)  # untimed layout, as io.py does
        for bs in [parse_bytes(b) for b in a.block_sizes.split(",")]:
            for qd in [int(q) for q in a.queue_depths.split(",")]:
                ref.configure(block_size=bs, queue_depth=qd, thread_count=1, single_submit=False,
                              overlap_events=True)
                point = tune.TunePoint(a.backend, bs, qd, 1)
                samples = {k: [] for k in ("io_write", "io_read", "tune_write", "tune_read")}
                for rep in range(a.reps):
                    for side in (("io", "tune") if rep % 2 == 0 else ("tune", "io")):
                        if side == "io":
                            w = ref.run("write", io_file)
                            if io_bench.drop_and_check(io_file):
                                raise RuntimeError(f"{io_file} still cached before a cold read")
                            r = ref.run("read", io_file)
                            if not r["verified"]:
                                raise RuntimeError(f"io.py side read back wrong data at {point}")
                            samples["io_write"].append(nbytes / w["s"] / 1e9)
                            samples["io_read"].append(nbytes / r["s"] / 1e9)
                        else:
                            _, w, r, resident = tune_file.measure(point)
                            if resident:
                                raise RuntimeError(f"nvme-tune file {resident:.0%} cached before a cold read")
                            samples["tune_write"].append(w)
                            samples["tune_read"].append(r)
                row = {"block_size": bs, "queue_depth": qd}
                for key, xs in samples.items():
                    row[key] = round(statistics.median(xs), 3)
                    row[key + "_all"] = [round(x, 3) for x in xs]
                for op in ("write", "read"):
                    t, i = samples[f"tune_{op}"], samples[f"io_{op}"]
                    row[f"ratio_{op}"] = round(statistics.median(t) / statistics.median(i), 3)
                    row[f"agree_{op}"] = (min(i) <= statistics.median(t) <= max(i)
                                          or min(t) <= statistics.median(i) <= max(t))
                results["points"].append(row)
                print(line(row), flush=True)
    finally:
        ref.close()
        tune_file.close()
        if os.path.exists(io_file):
            os.unlink(io_file)
    table = markdown(results)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table)
    print(f"results: {stem}.json, {stem}.md")
    return 0


def line(p: dict) -> str:
    return (f"bs={_short(p['block_size'])} qd={p['queue_depth']}: write tune {p['tune_write']:.2f} "
            f"vs io.py {p['io_write']:.2f} GB/s ({p['ratio_write']:.2f}), read tune "
            f"{p['tune_read']:.2f} vs io.py {p['io_read']:.2f} GB/s ({p['ratio_read']:.2f})")


def _short(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{nbytes >> 10} KiB"


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}..{max(xs):.2f}"


def markdown(results: dict) -> str:
    lines = [
        f"Backend {results['backend']}, {results['nbytes'] / GiB:.1f} GiB, {results['reps']} reps "
        "interleaved (median, min..max), no fsync on writes, cold reads, GB/s = 1e9 B/s.",
        "",
        "| block | qd | write nvme-tune | write io.py | ratio | agree | read nvme-tune | read io.py "
        "| ratio | agree |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in results["points"]:
        lines.append(
            f"| {_short(p['block_size'])} | {p['queue_depth']} | {p['tune_write']:.2f} "
            f"({_span(p['tune_write_all'])}) | {p['io_write']:.2f} ({_span(p['io_write_all'])}) | "
            f"{p['ratio_write']:.2f} | {'yes' if p['agree_write'] else 'no'} | {p['tune_read']:.2f} "
            f"({_span(p['tune_read_all'])}) | {p['io_read']:.2f} ({_span(p['io_read_all'])}) | "
            f"{p['ratio_read']:.2f} | {'yes' if p['agree_read'] else 'no'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
