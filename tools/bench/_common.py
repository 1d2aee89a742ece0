"""Helpers shared by the engine benchmarks (zero_offload.py, out_of_core.py).

Why a module: both benchmarks run every contender in a fresh worker process (so peak RSS is
per contender), build the same Llama-style model from the same shapes as the DeepSpeed peer
script (shared/peers/ds_e2e.py), feed the same token batches, sample RSS the same way and write
the same JSON lines; one copy of that keeps the two comparable.

Worker protocol: the driver runs ``python <script> --worker <kind> --spec '<json>'``; the worker
moves fd 1 onto stderr (DeepSpeed, transformers and C ops print to stdout), does its job and writes
exactly one JSON object on the saved stdout; everything else goes to stderr, which the driver keeps
in a log file and shows the tail of on failure.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

GiB = 1 << 30
MiB = 1 << 20

# Llama shapes of the benchmarks: (hidden, layers, heads, intermediate, vocab). The two issue-6
# sizes; issue 5 uses the first. ds_e2e.py's own "1B" is 16 layers (0.94B).
LLAMA_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (512, 2, 8, 1024, 2000),
    "0.49B": (2048, 7, 16, 5504, 32000),
    "1.04B": (2048, 18, 16, 5504, 32000),
}


def size_shape(name: str) -> tuple[int, int, int, int, int]:
    """Shape of a named size, or of ``HxLxAxIxV`` (hidden x layers x heads x intermediate x vocab)."""
    if name in LLAMA_SIZES:
        return LLAMA_SIZES[name]
    try:
        h, layers, heads, inter, vocab = (int(x) for x in name.lower().split("x"))
    except ValueError:
        raise ValueError(f"unknown size {name!r}: use one of {sorted(LLAMA_SIZES)} or "
                         "HIDDENxLAYERSxHEADSxINTERMEDIATExVOCAB, e.g. 512x2x8x1024x2000") from None
    return h, layers, heads, inter, vocab


def llama_params(shape: Sequence[int]) -> int:
    """Parameter count of the Llama model of ``shape`` (untied embeddings, no biases)."""
    h, layers, _, inter, vocab = shape
    return layers * (4 * h * h + 3 * h * inter + 2 * h) + 2 * vocab * h + h


def llama_config(shape: Sequence[int], seq: int):
    """The transformers LlamaConfig ds_e2e.py builds for the same shape (sdpa, no dropout)."""
    from transformers import LlamaConfig

    h, layers, heads, inter, vocab = shape
    cfg = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=max(2048, seq), tie_word_embeddings=False,
                      use_cache=False, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def token_batches(seed: int, steps: int, vocab: int, seq: int, mbs: int) -> list:
    """The token batches ds_e2e.py draws for the same seed (so every contender sees the same data)."""
    import torch

    g = torch.Generator().manual_seed(seed + 12345)
    return [torch.randint(0, vocab, (mbs, seq), generator=g) for _ in range(steps)]


# --------------------------------------------------------------------------- memory and I/O
def proc_status(keys: Sequence[str] = ("VmHWM", "VmRSS")) -> dict[str, int]:
    """Fields of /proc/self/status in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) * 1024
    return out


def proc_io() -> dict[str, int]:
    """/proc/self/io counters (read_bytes/write_bytes count O_DIRECT traffic too)."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key.strip()] = int(value)
    except OSError:
        pass
    return out


def cpu_usage() -> tuple[float, float, int]:
    """(user s, system s, minor page faults) of this process so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def cpu_usage_since(start: tuple[float, float, int]) -> dict[str, float]:
    """CPU seconds (user, system) and minor page faults since ``start`` (``cpu_usage()``): on
    a machine with few cores, a step that needs more CPU than compute alone cannot overlap its
    way under it; fresh pages (faulted in and zeroed) are a large part of system time."""
    user, system, faults = cpu_usage()
    return {"cpu_user_s": user - start[0], "cpu_sys_s": system - start[1],
            "minor_faults": faults - start[2]}


def thread_cpu() -> dict[str, tuple[float, float]]:
    """CPU seconds (user, system) of each live thread of this process by name (Python's thread
    name where it has one, else the kernel's ``comm`` and thread id): which of the engine's
    threads competes with torch's for the cores. Threads that ended are not counted."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue       # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(int(tid), f"{comm}-{tid}")
        out[name] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def thread_cpu_since(start: dict[str, tuple[float, float]], steps: int) -> dict[str, list[float]]:
    """Per-thread (user, system) CPU seconds per step since ``start`` (``thread_cpu()``),
    threads that used under 10 ms a step left out."""
    out = {}
    for name, (user, system) in thread_cpu().items():
        u0, s0 = start.get(name, (0.0, 0.0))
        per = [round((user - u0) / steps, 3), round((system - s0) / steps, 3)]
        if sum(per) >= 0.01:
            out[name] = per
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


class RssSampler:
    """Samples this process's VmRSS from a thread; ``peak`` is the largest sample (bytes).

    VmHWM is the kernel's own high-water mark; the sampler is a second opinion and also gives the
    time series' peak per phase (call ``reset`` between phases)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self.window_peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = proc_status(("VmRSS",))["VmRSS"]
            self.peak = max(self.peak, rss)
            self.window_peak = max(self.window_peak, rss)
            self.samples += 1
            self._stop.wait(self.interval_s)

    def take_peak(self) -> int:
        """The peak since the last call (or the start), and start a new window."""
        peak, self.window_peak = self.window_peak, 0
        return peak

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def timed_call(sampler: "RssSampler", fn: Callable[[], Any]) -> dict:
    """Run ``fn``; its seconds and the RSS peak it added over the RSS before it."""
    before = proc_status(("VmRSS",))["VmRSS"]
    sampler.take_peak()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = max(sampler.take_peak(), proc_status(("VmRSS",))["VmRSS"])
    return {"s": round(seconds, 2), "rss_before_bytes": before, "rss_added_bytes": peak - before}


def dir_bytes(path: str | os.PathLike[str]) -> int:
    """Allocated bytes of the files under ``path`` (what a run put on disk)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


# --------------------------------------------------------------------------- workers
@contextmanager
def worker_stdout() -> Iterator[Callable[[dict], None]]:
    """Inside a worker: fd 1 goes to stderr; yields ``emit(dict)`` writing the one result line."""
    json_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # if RAM runs out, the kernel kills this worker, not a neighbour
    except OSError:
        pass

    def emit(result: dict) -> None:
        os.write(json_fd, (json.dumps(result) + "\n").encode())

    try:
        yield emit
    finally:
        os.close(json_fd)


def measured_worker(res: dict, body: Callable[[RssSampler], None]) -> None:
    """Inside a worker: run ``body(sampler)`` with an RSS sampler going, then emit ``res`` as
    the one result line with ``ok``, the error (its traceback on stderr) and the peak RSS
    (sampled and VmHWM). ``res`` also records the git state of the tree the worker runs."""
    with worker_stdout() as emit:
        res.setdefault("ok", False)
        res["git"] = git_state()   # the engine in the working tree may change between runs
        sampler = RssSampler().start()
        try:
            body(sampler)
            res["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the driver reports it with the log tail
            import traceback

            traceback.print_exc()
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["sampler_peak_rss_bytes"] = sampler.stop()
        res["vm_hwm_bytes"] = proc_status()["VmHWM"]
        emit(res)


def run_worker(cmd: list[str], *, log_path: Path, timeout_s: float,
               env: dict[str, str] | None = None) -> dict:
    """Run one worker process; returns its JSON line plus ``process_wall_s`` and ``wait4_maxrss``.

    A worker that fails, times out or prints no JSON gives ``{"ok": False, "error": ...}`` with the
    tail of its log, so one broken contender does not lose the others' results."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env)
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            out = proc.stdout.read() if proc.stdout else b""
            _, status, usage = os.wait4(proc.pid, 0)  # reap here to read the child's peak RSS
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
    result: dict[str, Any] | None = None
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                pass
    wall = time.perf_counter() - started
    if result is None:
        timed_out = wall >= timeout_s
        result = {"ok": False, "error": (f"timed out after {timeout_s:.0f} s" if timed_out else
                                         f"worker exited {proc.returncode} without a result")}
    result["returncode"] = proc.returncode
    result["process_wall_s"] = round(wall, 1)
    result["wait4_maxrss_bytes"] = usage.ru_maxrss * 1024
    result["log"] = str(log_path)
    if not result.get("ok"):
        result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-25:]
    return result


# --------------------------------------------------------------------------- reporting
def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def lscpu_model() -> str:
    """``lscpu``'s model name (what BENCHMARKS.md names the CPU by; "" without lscpu)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("Model name")), "")


def machine_info() -> dict:
    """What a reader needs to judge the numbers: CPU, cores, memory, kernel, load, versions."""
    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem_total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    return {"cpu": cpu, "cpus": os.cpu_count(), "mem_total_gib": round(mem_total / GiB, 1),
            "mem_available_gib": round(mem_available() / GiB, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "git": git_state(), "native_lib": os.environ.get("INFINITY_NATIVE_LIB")}


def git_state() -> dict:
    """The commit benchmarked and whether the engine's files had uncommitted changes."""
    repo = Path(__file__).resolve().parents[2]

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": git("status", "--porcelain", "--", "infinity", "native").splitlines()}


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def gib(x: float | None) -> float | None:
    return None if x is None else round(x / GiB, 3)
