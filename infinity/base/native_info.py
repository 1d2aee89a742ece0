"""``native_info()``: what the loaded native library supports and which paths are in use."""
from __future__ import annotations

from typing import Any

from infinity.base import native_library
from infinity.base.cpu_bf16 import detect_cpu_bf16

_CPU_BITS = {"avx2": 1 << 0, "fma": 1 << 1, "f16c": 1 << 2, "avx512f": 1 << 3,
             "avx512bw": 1 << 4, "neon": 1 << 5}

# Components register what they are using (e.g. the I/O backend an engine opened, the Adam kernel
# chosen), so that native_info() reports the paths really taken, not only the ones available.
_in_use: dict[str, str] = {}


def record_in_use(component: str, choice: str) -> None:
    """Note that ``component`` (e.g. "io_backend", "adam_kernel") is running ``choice``."""
    _in_use[component] = choice


def native_info() -> dict[str, Any]:
    """Capabilities of the native library on this machine and the backends/kernels in use.

    Keys: ``version``, ``library`` (path), ``io_uring``, ``libaio``, ``avx2``, ``fma``, ``f16c``,
    ``avx512f``, ``avx512bw``, ``neon`` (bools), ``in_use`` (component -> choice), plus
    ``io_backend`` and ``adam_kernel`` (the choice in use, or the one that would be chosen), and
    ``cpu_bf16``: whether the CPU multiplies bf16 natively, its flags and why (see
    ``infinity.base.cpu_bf16``; the probe runs on the first call in a process). An engine records
    its compute dtype and the reason in ``in_use["compute_dtype"]``.
    """
    lib = native_library.lib()
    features = lib.inf_cpu_features()
    info: dict[str, Any] = {
        "version": lib.inf_version().decode(),
        "library": str(native_library.library_path()),
        "io_uring": bool(lib.inf_probe_io_uring()),
        "libaio": bool(lib.inf_probe_libaio()),
    }
    for name, bit in _CPU_BITS.items():
        info[name] = bool(features & bit)
    info["cpu_bf16"] = detect_cpu_bf16().to_dict()
    info["in_use"] = dict(_in_use)
    info["io_backend"] = _in_use.get("io_backend", _default_io_backend(info))
    info["adam_kernel"] = _in_use.get("adam_kernel", _default_adam_kernel(info))
    return info


def _default_io_backend(info: dict[str, Any]) -> str:
    if info["io_uring"]:
        return "io_uring"
    if info["libaio"]:
        return "libaio"
    return "threads"


def _default_adam_kernel(info: dict[str, Any]) -> str:
    if info["avx512f"]:
        return "avx512"
    if info["avx2"] and info["fma"]:
        return "avx2"
    if info["neon"]:
        return "neon"
    return "scalar"
