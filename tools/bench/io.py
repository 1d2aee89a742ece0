#!/usr/bin/env python3
"""Our aio engine vs DeepSpeed's aio_handle: O_DIRECT write/read of a 2 GiB buffer, interleaved.

Run (from the repository root; DeepSpeed comes from the peers venv, started as a subprocess):
    python3 tools/bench/io.py --gib 2 --block-sizes 1MiB,4MiB --queue-depths 8,32 --reps 5
    python3 tools/bench/io.py --buffers thp     # same, DeepSpeed's buffers on huge pages too
    python3 tools/bench/io.py --buffers plain   # same, our buffers on 4 KiB pages too
Writes a JSON and a Markdown table to --out (default /var/tmp/infinity-bench/io-<time>.{json,md})
as well as the screen.

At every (block_size, queue_depth) point both sides get the same knobs (thread_count 1,
single_submit False, overlap_events True) and alternate rep by rep (the first side alternates
too). Neither side fsyncs (O_DIRECT, no flush of the device cache), the same rule on both sides.
Writes overwrite preallocated files; the two files swap sides every rep. Reads are cold: after the writes the
file is fsync'd and posix_fadvise(DONTNEED)'d, and mincore must show 0 resident pages before the
timed read. Every read is verified against the written pattern. CPU seconds per GB are
time.process_time() deltas (user + system, all threads of the process doing the I/O) around each
rep. GB/s are 1e9 bytes per second; ratio = ours / DeepSpeed of the medians.

Buffers matter as much as the engine on this (virtio) disk: a direct I/O from 4 KiB pages costs
~5x the CPU of one from 2 MiB pages. By default each side allocates the way its users do (ours:
aligned_empty, huge pages advised; DeepSpeed: new_cpu_locked_tensor of the handle that runs the
I/O, 4 KiB pages); --buffers thp/plain equalize the buffers to compare the engines alone. (How
4 KiB pages were faulted in matters too: populated at once they are often physically adjacent and
merge into larger segments; faulted by first touch they are not.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GiB = 1 << 30


def pattern(n: int, seed: int):
    import torch

    words = torch.arange(n // 8, dtype=torch.int64) * 2654435761 + seed
    return words.view(torch.uint8)


def drop_and_check(path: str) -> int:
    """fsync + DONTNEED; returns resident pages afterwards (must be 0 for a cold read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    from infinity.io import resident_pages

    return resident_pages(path)


def thp_fraction(t) -> float:
    """Fraction of a tensor's mapping (its VMA in /proc/self/smaps) backed by transparent huge pages."""
    addr = t.data_ptr()
    inside = False
    size = huge = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Size:":
                size = int(line.split()[1])
            elif inside and head == "AnonHugePages:":
                huge = int(line.split()[1])
    return huge / size if size else 0.0


def collapse_thp(t, tries: int = 5) -> float:
    """madvise(MADV_COLLAPSE) a tensor's memory into huge pages (retrying EAGAIN); returns thp_fraction."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge = 2 << 20
    start = (t.data_ptr() + huge - 1) & ~(huge - 1)
    end = (t.data_ptr() + t.numel() * t.element_size()) & ~(huge - 1)
    MADV_COLLAPSE = 25
    for _ in range(tries):
        if end <= start or libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
            break
        time.sleep(0.5)
    return thp_fraction(t)


# --------------------------------------------------------------------------- DeepSpeed side
def ds_worker() -> None:
    """Runs under the peers venv python: serves write/read commands on a JSON-lines pipe."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything DeepSpeed prints goes to stderr, the protocol stays clean
    import logging

    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    try:
        from deepspeed.utils import logger
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler):
                h.setStream(sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    aio = AsyncIOBuilder().load(verbose=False)
    torch.set_num_threads(1)
    handle = wbuf = rbuf = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict = {"ok": True}
        if op == "config":
            # Buffers must come from the handle that runs the I/O: a handle bounces every op
            # through a fresh locked copy of any buffer its own pinned-tensor manager did not
            # allocate (cpu_op_desc_t::_use_bounce_buffer), which would not be DeepSpeed's best.
            new = aio.aio_handle(cmd["block_size"], cmd["queue_depth"], cmd["single_submit"],
                                 cmd["overlap_events"], cmd["thread_count"])
            if handle is not None:
                handle.free_cpu_locked_tensor(wbuf)
                handle.free_cpu_locked_tensor(rbuf)
            handle = new
            ex = torch.empty(0, dtype=torch.uint8)
            wbuf = handle.new_cpu_locked_tensor(cmd["nbytes"], ex)
            rbuf = handle.new_cpu_locked_tensor(cmd["nbytes"], ex)
            if cmd.get("thp"):
                [collapse_thp(t) for t in (wbuf, rbuf)]
            out["thp"] = min(thp_fraction(t) for t in (wbuf, rbuf))
            wbuf.copy_(pattern(cmd["nbytes"], cmd["seed"]))
            rbuf.zero_()
            out["pinned"] = bool(handle.is_pinned(wbuf))
        elif op in ("write", "read"):
            buf = wbuf if op == "write" else rbuf
            if op == "read":
                rbuf.zero_()
            c0, t0 = time.process_time(), time.perf_counter()
            if op == "write":
                handle.async_pwrite(buf, cmd["path"])
            else:
                handle.async_pread(buf, cmd["path"])
            handle.wait()
            out["s"] = time.perf_counter() - t0
            out["cpu_s"] = time.process_time() - c0
            if op == "read":
                out["verified"] = bool(torch.equal(rbuf, wbuf))
        elif op == "quit":
            if handle is not None:
                handle.free_cpu_locked_tensor(wbuf)
                handle.free_cpu_locked_tensor(rbuf)
            proto.write(json.dumps(out) + "\n")
            return
        proto.write(json.dumps(out) + "\n")


class DeepSpeedSide:
    name = "deepspeed"

    def __init__(self, python: str, nbytes: int, thp: bool) -> None:
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--ds-worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        self.nbytes = nbytes
        self.thp = thp
        self.pinned = None

    def call(self, **cmd) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"DeepSpeed worker died (exit {self.proc.wait()}); see stderr")
        return json.loads(line)

    def configure(self, **knobs) -> None:
        r = self.call(op="config", nbytes=self.nbytes, seed=7, thp=self.thp, **knobs)
        self.pinned = r["pinned"]
        self.thp_fraction = r["thp"]

    def run(self, op: str, path: str) -> dict:
        return self.call(op=op, path=path)

    def close(self) -> None:
        self.call(op="quit")
        self.proc.wait(timeout=60)


# --------------------------------------------------------------------------- our side
class InfinitySide:
    name = "infinity"

    def __init__(self, nbytes: int, backend: str, plain: bool) -> None:
        from infinity.io import aligned_empty

        self.backend = backend
        if plain:  # 4 KiB pages, allocated the way DeepSpeed allocates its own
            self.wbuf, self.rbuf = plain_buffer(nbytes), plain_buffer(nbytes)
        else:
            self.wbuf, self.rbuf = aligned_empty(nbytes), aligned_empty(nbytes)
        self.wbuf.copy_(pattern(nbytes, 7))
        self.rbuf.zero_()
        self.eng = None

    def configure(self, **knobs) -> None:
        from infinity.io import AioConfig, AioEngine

        if self.eng is not None:
            self.eng.close()
        self.eng = AioEngine(AioConfig(backend=self.backend, **knobs))

    def run(self, op: str, path: str) -> dict:
        import torch

        eng = self.eng
        if op == "read":
            self.rbuf.zero_()
        c0, t0 = time.process_time(), time.perf_counter()
        with eng.open(path, "w" if op == "write" else "r", create=op == "write") as f:
            if op == "write":
                eng.write(self.wbuf, f, 0).wait()
            else:
                eng.read(self.rbuf, f, 0).wait()
        out = {"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
        if op == "read":
            out["verified"] = bool(torch.equal(self.rbuf, self.wbuf))
        return out

    def close(self) -> None:
        if self.eng is not None:
            self.eng.close()


def extents(path: str) -> int | None:
    """Number of extents of a file (filefrag), to report how fragmented the bench files are."""
    try:
        out = subprocess.run(["filefrag", path], capture_output=True, text=True, check=True).stdout
        return int(out.rsplit(":", 1)[1].split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def plain_buffer(nbytes: int):
    """Memory allocated exactly as DeepSpeed's new_cpu_locked_tensor does: posix_memalign + mlock."""
    import ctypes

    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ptr = ctypes.c_void_p()
    if libc.posix_memalign(ctypes.byref(ptr), 4096, nbytes) != 0:
        raise MemoryError(f"posix_memalign of {nbytes} bytes failed")
    if libc.mlock(ptr, nbytes) != 0:
        raise OSError(ctypes.get_errno(), "mlock of the plain buffer failed")
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr.value), dtype=torch.uint8)


# --------------------------------------------------------------------------- harness
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--block-sizes", default="1MiB,4MiB")
    ap.add_argument("--queue-depths", default="8,32")
    ap.add_argument("--thread-count", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dir", default="/var/tmp/infinity-bench")
    ap.add_argument("--buffers", choices=["own", "thp", "plain"], default="own",
                    help="own: each side allocates its way (ours: aligned_empty, huge pages advised; "
                         "DeepSpeed: new_cpu_locked_tensor, 4 KiB pages); thp: DeepSpeed's buffers "
                         "also collapsed into huge pages; plain: ours allocated as DeepSpeed's "
                         "(posix_memalign + mlock, 4 KiB pages)")
    ap.add_argument("--out", default=None, help="path stem for .json/.md results")
    ap.add_argument("--ds-python", default=os.path.expanduser("~/.venvs/peers/bin/python"))
    ap.add_argument("--ds-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ds_worker:
        ds_worker()
        return 0

    import torch

    from infinity.base.sizes import parse_bytes

    # One intra-op thread on both sides: idle OpenMP workers spin after the untimed buffer fills
    # and would be billed to the timed I/O by process_time().
    torch.set_num_threads(1)

    nbytes = int(a.gib * GiB) // 4096 * 4096
    blocks = [parse_bytes(b) for b in a.block_sizes.split(",")]
    qds = [int(q) for q in a.queue_depths.split(",")]
    os.makedirs(a.dir, exist_ok=True)
    stem = a.out or os.path.join(a.dir, time.strftime("io-%Y%m%d-%H%M%S"))
    # Two files, swapped between the sides every rep: where a file's blocks landed on the disk
    # (extents, position) then counts equally for both sides instead of favouring one all run.
    files = [os.path.join(a.dir, f"bench-io-{i}-{os.getpid()}.dat") for i in (0, 1)]

    ours = InfinitySide(nbytes, a.backend, plain=a.buffers == "plain")
    ds = DeepSpeedSide(a.ds_python, nbytes, thp=a.buffers == "thp")
    sides = [ours, ds]
    knobs0 = dict(block_size=1 << 20, queue_depth=8, thread_count=a.thread_count,
                  single_submit=False, overlap_events=True)
    results: dict = {"bench": "io", "nbytes": nbytes, "reps": a.reps, "dir": a.dir,
                     "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                     "buffers": a.buffers, "points": []}
    created = []
    try:
        for s, path in zip(sides, files):  # preallocate (untimed): timed writes overwrite blocks
            s.configure(**knobs0)
            s.run("write", path)
            created.append(path)
        results["file_extents"] = [extents(p) for p in files]
        for bs in blocks:
            for qd in qds:
                knobs = dict(knobs0, block_size=bs, queue_depth=qd)
                for s in sides:
                    s.configure(**knobs)
                results["backend"] = ours.eng.backend
                results["ds_buffers_pinned"] = ds.pinned
                runs: dict = {(s.name, op): [] for s in sides for op in ("write", "read")}
                resident_before_read: list[int] = []
                for rep in range(a.reps):
                    order = sides if rep % 2 == 0 else sides[::-1]
                    path = {s.name: files[(i + rep) % 2] for i, s in enumerate(sides)}
                    for s in order:
                        runs[(s.name, "write")].append(s.run("write", path[s.name]))
                    for s in order:
                        res = drop_and_check(path[s.name])
                        resident_before_read.append(res)
                        if res:
                            raise RuntimeError(f"{res} pages of {path[s.name]} still cached before "
                                               "a cold read")
                        r = s.run("read", path[s.name])
                        if not r.get("verified"):
                            raise RuntimeError(f"{s.name} read back wrong data at bs={bs} qd={qd}")
                        runs[(s.name, "read")].append(r)
                point = {"block_size": bs, "queue_depth": qd, "thread_count": a.thread_count,
                         "thp_fraction_infinity": min(thp_fraction(ours.wbuf), thp_fraction(ours.rbuf)),
                         "thp_fraction_deepspeed": ds.thp_fraction}
                for (name, op), rs in runs.items():
                    gbps = [nbytes / r["s"] / 1e9 for r in rs]
                    cpu = [r["cpu_s"] / (nbytes / 1e9) for r in rs]
                    point[f"{name}_{op}_gbps"] = statistics.median(gbps)
                    point[f"{name}_{op}_gbps_all"] = [round(g, 3) for g in gbps]
                    point[f"{name}_{op}_cpu_s_per_gb"] = statistics.median(cpu)
                for op in ("write", "read"):
                    point[f"ratio_{op}"] = point[f"infinity_{op}_gbps"] / point[f"deepspeed_{op}_gbps"]
                point["max_resident_pages_before_read"] = max(resident_before_read)
                results["points"].append(point)
                print(row(point), flush=True)
    finally:
        for s in sides:
            s.close()
        for p in created:
            os.unlink(p)
    table = markdown(results)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table)
    print(table)
    print(f"results: {stem}.json, {stem}.md")
    return 0


def row(p: dict) -> str:
    return (f"bs={p['block_size'] >> 20}MiB qd={p['queue_depth']}: write {p['infinity_write_gbps']:.2f} vs "
            f"{p['deepspeed_write_gbps']:.2f} GB/s ({p['ratio_write']:.2f}), read "
            f"{p['infinity_read_gbps']:.2f} vs {p['deepspeed_read_gbps']:.2f} GB/s ({p['ratio_read']:.2f})")


def markdown(results: dict) -> str:
    lines = [
        f"Backend {results.get('backend')}, {results['nbytes'] / GiB:.1f} GiB, {results['reps']} reps "
        f"(medians), thread_count 1, single_submit False, overlap_events True, no fsync on either side; "
        f"DeepSpeed buffers mlocked: {results['ds_buffers_pinned']}; buffers: {results['buffers']}.",
        "",
        "| block | qd | write GB/s ours | write GB/s DS | ratio | read GB/s ours | read GB/s DS | ratio "
        "| CPU s/GB write ours / DS | CPU s/GB read ours / DS | huge pages ours / DS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in results["points"]:
        lines.append(
            f"| {p['block_size'] >> 20} MiB | {p['queue_depth']} | {p['infinity_write_gbps']:.2f} | "
            f"{p['deepspeed_write_gbps']:.2f} | {p['ratio_write']:.2f} | {p['infinity_read_gbps']:.2f} | "
            f"{p['deepspeed_read_gbps']:.2f} | {p['ratio_read']:.2f} | "
            f"{p['infinity_write_cpu_s_per_gb']:.3f} / {p['deepspeed_write_cpu_s_per_gb']:.3f} | "
            f"{p['infinity_read_cpu_s_per_gb']:.3f} / {p['deepspeed_read_cpu_s_per_gb']:.3f} | "
            f"{p['thp_fraction_infinity']:.0%} / {p['thp_fraction_deepspeed']:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
