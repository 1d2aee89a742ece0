#!/usr/bin/env python3
"""How much CPU a machine's disk I/O takes from compute: matrix products alone vs the same
products while our AioEngine streams O_DIRECT reads and writes, interleaved rep by rep.

Why: the out-of-core step overlaps forward/backward with the NVMe traffic of parameters and
Adam states, and its bar is 1.3x the largest of compute alone and I/O alone. That is only
reachable where I/O costs the cores little. On a virtual disk the host's emulation of each
request can run on the CPU time of the guest's own vCPUs (it shows as "steal" in /proc/stat,
not as time of this process), so the two floors do not overlap however the engine schedules
them. This bench measures that property of the machine, with the engine's own I/O path.

    python3 tools/bench/io_steal.py --gib 1 --reps 3 --matmuls 20

Per rep: compute alone (``--matmuls`` products of 2048x2048 by 2048x5504 fp32, the bench
model's MLP shape, on all threads), then compute again while a thread keeps ``--inflight``
requests of ``--block`` bytes in flight over a ``--gib`` file (alternating 4-request read and
write batches), then I/O alone for as long as the compute took. Reported: compute seconds alone
and with I/O (ratio = with / alone), GB/s of the I/O with and without compute, and the share of
the machine's CPU time that was busy, idle and stolen in each phase.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def cpu_times() -> list[int]:
    """The machine's /proc/stat CPU counters: user nice system idle iowait irq softirq steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def shares(before: list[int], after: list[int]) -> dict[str, float]:
    d = [b - a for a, b in zip(before, after)]
    total = sum(d) or 1
    return {"busy": (d[0] + d[1] + d[2] + d[5] + d[6]) / total, "idle": (d[3] + d[4]) / total,
            "steal": d[7] / total}


class Streamer:
    """Keeps reads and writes of one file in flight from a thread until stopped."""

    def __init__(self, path: str, nbytes: int, block: int, inflight: int) -> None:
        import torch

        from infinity.io import AioConfig, AioEngine, aligned_empty, wait_all

        self._wait_all = wait_all
        self.engine = AioEngine(AioConfig(block_size=block, queue_depth=32))
        self.file = self.engine.open(path, "rw", create=True)
        self.piece = 64 << 20
        self.pieces = max(1, nbytes // self.piece)
        self.buffers = [aligned_empty(self.piece) for _ in range(inflight)]
        for b in self.buffers:
            b.copy_(torch.randint(0, 255, (self.piece,), dtype=torch.uint8))
        for i in range(self.pieces):      # the file exists and has its blocks allocated
            self.engine.write(self.buffers[0], self.file, i * self.piece).wait()
        self.moved = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            write = (i // len(self.buffers)) % 2 == 1
            requests = []
            for k, buf in enumerate(self.buffers):
                offset = ((i + k) % self.pieces) * self.piece
                requests.append(self.engine.write(buf, self.file, offset) if write
                                else self.engine.read(buf, self.file, offset))
            self._wait_all(requests)
            self.moved += len(self.buffers) * self.piece
            i += len(self.buffers)

    def start(self) -> None:
        self.moved = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def close(self) -> None:
        self.file.close()
        self.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the file the I/O cycles over")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--matmuls", type=int, default=20)
    ap.add_argument("--block", type=int, default=1 << 20, help="aio block size, bytes")
    ap.add_argument("--inflight", type=int, default=4, help="64 MiB requests in flight")
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench")
    args = ap.parse_args()

    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 5504)

    def compute() -> float:
        start = time.perf_counter()
        for _ in range(args.matmuls):
            torch.mm(a, b)
        return time.perf_counter() - start

    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="io-steal-", suffix=".dat", dir=args.scratch)
    os.close(fd)
    rows = []
    streamer = None
    try:
        streamer = Streamer(path, int(args.gib * (1 << 30)), args.block, args.inflight)
        compute()      # warm-up
        for rep in range(args.reps):
            c0 = cpu_times()
            alone = compute()
            c1 = cpu_times()
            streamer.start()
            together = compute()
            streamer.stop()
            c2 = cpu_times()
            io_with = streamer.moved / together
            streamer.start()
            time.sleep(alone)
            streamer.stop()
            c3 = cpu_times()
            io_alone = streamer.moved / alone
            row = {"alone_s": alone, "with_io_s": together, "ratio": together / alone,
                   "io_with_gbs": io_with / 1e9, "io_alone_gbs": io_alone / 1e9,
                   "cpu_alone": shares(c0, c1), "cpu_with_io": shares(c1, c2),
                   "cpu_io_alone": shares(c2, c3)}
            rows.append(row)
            print(f"rep {rep}: compute {alone:.2f} s alone, {together:.2f} s with I/O "
                  f"(x{row['ratio']:.2f}); I/O {row['io_alone_gbs']:.2f} GB/s alone, "
                  f"{row['io_with_gbs']:.2f} with compute; steal {row['cpu_alone']['steal']:.0%}"
                  f" / {row['cpu_with_io']['steal']:.0%} / {row['cpu_io_alone']['steal']:.0%} "
                  "(alone / with I/O / I/O alone), idle with I/O "
                  f"{row['cpu_with_io']['idle']:.0%}", flush=True)
    finally:
        if streamer is not None:
            streamer.close()
        os.unlink(path)
    print(f"median over {len(rows)} reps: compute with I/O / alone = "
          f"{statistics.median(r['ratio'] for r in rows):.2f}, I/O with compute / alone = "
          f"{statistics.median(r['io_with_gbs'] / r['io_alone_gbs'] for r in rows):.2f}, "
          f"steal with I/O {statistics.median(r['cpu_with_io']['steal'] for r in rows):.0%} "
          f"of the machine's CPU time")


if __name__ == "__main__":
    main()
