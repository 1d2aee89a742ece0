"""Whether this CPU multiplies bf16 natively: its flags, confirmed by a timed matmul.

[Note: bf16 on CPUs]
On a CPU without native bf16 a bf16 matrix product is emulated and ~45x slower than fp32; on one
with AVX512_BF16 or AMX (AMD Zen 4+, Intel Sapphire Rapids+; ARMv8.6 BF16) it is ~3x faster. The
answer decides what ``compute_dtype: "auto"`` means on a CPU-only machine
(``infinity.planner.placement.choose_compute_dtype``), so it is taken in two steps: the CPU must
list a bf16 flag (/proc/cpuinfo), and a sub-second probe (a 512 x 512 matmul in bf16 and in fp32,
interleaved, best of a few) must show bf16 at least MIN_SPEEDUP times faster in this process's
torch build and thread setting. The probe runs on first use, never at import, once per process;
its result is logged. ``INFINITY_CPU_BF16=0`` (or ``1``) forces the answer without a probe (tests,
or a machine whose probe is not to be trusted).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any

from infinity.base.log import get_logger

__all__ = ["CpuBf16", "ENV", "MIN_SPEEDUP", "detect_cpu_bf16", "bf16_flags", "probe_matmul"]

ENV = "INFINITY_CPU_BF16"
"""``0``/``off``: no native bf16; ``1``/``on``: native bf16, unprobed; unset or ``auto``: flags + probe."""
MIN_SPEEDUP = 1.25
"""The probe's bf16 matmul must be this many times faster than fp32 to count as native."""
PROBE_N = 512
PROBE_REPS = 7
# x86: AVX512_BF16 (Zen 4+, Cooper Lake+), AMX-BF16 (Sapphire Rapids+); aarch64: the BF16 extension
_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

log = get_logger("cpu")


@dataclass(frozen=True)
class CpuBf16:
    """The answer, and why."""

    native: bool
    """bf16 matmuls are native here (flags and probe agree, or ``INFINITY_CPU_BF16`` says so)."""
    flags: tuple[str, ...]
    """The bf16 flags /proc/cpuinfo lists."""
    reason: str
    """One line: how the answer was reached (flags, the probe's times, or the environment)."""
    bf16_ms: float | None = None
    """The probe's best bf16 matmul time; None when it did not run."""
    fp32_ms: float | None = None
    """The probe's best fp32 matmul time; None when it did not run."""

    def to_dict(self) -> dict[str, Any]:
        return {"native": self.native, "flags": list(self.flags), "reason": self.reason,
                "bf16_ms": self.bf16_ms, "fp32_ms": self.fp32_ms}


def bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The bf16 flags of the CPU (the "flags" line on x86, "Features" on aarch64), from
    ``cpuinfo``'s text or /proc/cpuinfo; empty where there is none (or no /proc)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ()
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, rest = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            words.update(rest.split())
            break    # every core lists the same
    return tuple(flag for flag in _FLAGS if flag in words)


def probe_matmul(n: int = PROBE_N, reps: int = PROBE_REPS) -> tuple[float, float]:
    """Best-of-``reps`` seconds of an n x n matmul in bf16 and in fp32, interleaved (so that a
    neighbour's load hits both alike), after one untimed warm-up of each. On one thread: the
    ratio is the instruction set's, and one thread is not stalled by OpenMP threads spinning
    against other processes on a busy machine (the fp32 one takes ~2.5 ms on a Zen 4 core)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a32, b32 = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        torch.mm(a16, b16), torch.mm(a32, b32)
        best16 = best32 = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(a16, b16)
            best16 = min(best16, time.perf_counter() - start)
            start = time.perf_counter()
            torch.mm(a32, b32)
            best32 = min(best32, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best16, best32


def detect_cpu_bf16() -> CpuBf16:
    """Whether this CPU computes bf16 natively (see [Note: bf16 on CPUs]); the environment's
    answer if ``INFINITY_CPU_BF16`` gives one, else the flags and the probe, measured once."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("0", "off", "false", "no"):
        return CpuBf16(native=False, flags=bf16_flags(), reason=f"{ENV}={forced}")
    if forced in ("1", "on", "true", "yes"):
        return CpuBf16(native=True, flags=bf16_flags(), reason=f"{ENV}={forced}")
    return _measured()


@functools.lru_cache(maxsize=1)
def _measured() -> CpuBf16:
    flags = bf16_flags()
    if not flags:
        answer = CpuBf16(native=False, flags=(),
                         reason="the CPU lists no bf16 flag (avx512_bf16, amx_bf16, bf16)")
    else:
        t16, t32 = probe_matmul()
        speedup = t32 / t16 if t16 > 0 else float("inf")
        native = speedup >= MIN_SPEEDUP
        answer = CpuBf16(
            native=native, flags=flags, bf16_ms=round(t16 * 1e3, 4), fp32_ms=round(t32 * 1e3, 4),
            reason=(f"flags {', '.join(flags)}; a {PROBE_N}x{PROBE_N} matmul takes "
                    f"{t16 * 1e3:.3f} ms in bf16 and {t32 * 1e3:.3f} ms in fp32 ({speedup:.2f}x, "
                    f"{'at least' if native else 'under'} {MIN_SPEEDUP}x)"))
    log.info("cpu bf16 %s: %s", "native" if answer.native else "not native", answer.reason)
    return answer
