"""ctypes declarations of the native CPU Adam (``native/include/inf_adam.h``), declared once.

Kept apart from ``cpu_adam.py`` so that the optimizer, the benchmark and the tests share one set of
argtypes. ctypes releases the GIL during every call, so a step never blocks other Python threads.
"""
from __future__ import annotations

import ctypes

from infinity.base import native_library

DTYPE_NONE = -1
DTYPE_F32 = 0
DTYPE_BF16 = 1
DTYPE_F16 = 2

KERNELS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "neon": 4}
KERNEL_NAMES = {v: k for k, v in KERNELS.items()}


class HParams(ctypes.Structure):
    """Mirror of ``struct inf_adam_hparams``."""

    _fields_ = [
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("grad_scale", ctypes.c_double),
        ("step", ctypes.c_int64),
        ("adamw_mode", ctypes.c_int32),
        ("bias_correction", ctypes.c_int32),
    ]


class TensorRange(ctypes.Structure):
    """Mirror of ``struct inf_adam_tensor`` (raw addresses; numel elements each)."""

    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("half_out", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
    ]


class Addend(ctypes.Structure):
    """Mirror of ``struct inf_adam_addend``: values (numel elements of dtype) that add to
    elements [begin, begin + numel) of range ``range`` of the call."""

    _fields_ = [
        ("range", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("begin", ctypes.c_int64),
        ("numel", ctypes.c_int64),
        ("values", ctypes.c_void_p),
    ]


def _signatures() -> dict:
    c_int, vp, i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
    return {
        "inf_adam_step": (c_int, [ctypes.POINTER(HParams), ctypes.POINTER(TensorRange), c_int,
                                  c_int, c_int, c_int, c_int]),
        "inf_adam_step_norm": (c_int, [ctypes.POINTER(HParams), ctypes.POINTER(TensorRange),
                                       c_int, c_int, c_int, c_int, c_int,
                                       ctypes.POINTER(ctypes.c_double)]),
        "inf_adam_step_zero": (c_int, [ctypes.POINTER(HParams), ctypes.POINTER(TensorRange),
                                       c_int, c_int, c_int, c_int, c_int,
                                       ctypes.POINTER(ctypes.c_double)]),
        "inf_adam_step_fold": (c_int, [ctypes.POINTER(HParams), ctypes.POINTER(TensorRange),
                                       c_int, ctypes.POINTER(Addend), c_int, c_int, c_int, c_int,
                                       ctypes.POINTER(ctypes.c_double)]),
        "inf_grad_sq_sum": (c_int, [vp, i64, c_int, c_int, ctypes.POINTER(ctypes.c_double)]),
        "inf_adam_kernel_supported": (c_int, [c_int]),
        "inf_adam_kernel_best": (c_int, []),
        "inf_adam_kernel_name": (ctypes.c_char_p, [c_int]),
        "inf_adam_rmw_bandwidth": (c_int, [vp, vp, vp, vp, i64, c_int]),
    }


def lib() -> ctypes.CDLL:
    """The native library with the inf_adam_* signatures declared (raises NativeLibraryError when
    it is missing or was built before this component existed)."""
    return native_library.declare("CPU Adam", _signatures)


def kernel_supported(name: str) -> bool:
    """Whether the kernel ``name`` ("scalar", "avx2", "avx512", "neon") runs on this CPU and build."""
    return bool(lib().inf_adam_kernel_supported(KERNELS[name]))


def best_kernel() -> str:
    """The kernel "auto" resolves to on this CPU."""
    return KERNEL_NAMES[lib().inf_adam_kernel_best()]


def step(hp: HParams, ranges: ctypes.Array, grad_dtype: int, half_dtype: int, kernel: int,
         threads: int) -> None:
    """One native step over ``ranges`` (an array of TensorRange); raises OSError on a -errno."""
    ret = lib().inf_adam_step(ctypes.byref(hp), ranges, len(ranges), grad_dtype, half_dtype,
                              kernel, threads)
    native_library.check(ret, f"inf_adam_step({len(ranges)} ranges, kernel {KERNEL_NAMES.get(kernel)}, "
                       f"grad dtype {grad_dtype}, half dtype {half_dtype}, {threads} threads)")


def step_norm(hp: HParams, ranges: ctypes.Array, grad_dtype: int, half_dtype: int, kernel: int,
              threads: int) -> float:
    """``step``, returning the sum of the gradients' squares (as given, before 1/grad_scale)."""
    total = ctypes.c_double(0.0)
    ret = lib().inf_adam_step_norm(ctypes.byref(hp), ranges, len(ranges), grad_dtype, half_dtype,
                                   kernel, threads, ctypes.byref(total))
    native_library.check(ret, f"inf_adam_step_norm({len(ranges)} ranges, kernel "
                       f"{KERNEL_NAMES.get(kernel)}, grad dtype {grad_dtype}, {threads} threads)")
    return total.value


def step_zero(hp: HParams, ranges: ctypes.Array, grad_dtype: int, half_dtype: int, kernel: int,
              threads: int, norm: bool) -> float:
    """``step`` that also zeroes each range's gradient as it goes (in cache, chunk by chunk);
    with ``norm`` the sum of the gradients' squares (summed before the zeroing), else 0."""
    total = ctypes.c_double(0.0)
    ret = lib().inf_adam_step_zero(ctypes.byref(hp), ranges, len(ranges), grad_dtype, half_dtype,
                                   kernel, threads, ctypes.byref(total) if norm else None)
    native_library.check(ret, f"inf_adam_step_zero({len(ranges)} ranges, kernel "
                       f"{KERNEL_NAMES.get(kernel)}, grad dtype {grad_dtype}, {threads} threads)")
    return total.value


def step_fold(hp: HParams, ranges: ctypes.Array, addends: ctypes.Array, half_dtype: int,
              kernel: int, threads: int, norm: bool) -> float:
    """``step_zero`` of fp32 gradients, each completed first by ``addends`` (an array of
    Addend), chunk by chunk; with ``norm`` the completed gradients' sum of squares, else 0."""
    total = ctypes.c_double(0.0)
    ret = lib().inf_adam_step_fold(ctypes.byref(hp), ranges, len(ranges), addends, len(addends),
                                   half_dtype, kernel, threads,
                                   ctypes.byref(total) if norm else None)
    native_library.check(ret, f"inf_adam_step_fold({len(ranges)} ranges, {len(addends)} "
                       f"addends, kernel {KERNEL_NAMES.get(kernel)}, {threads} threads)")
    return total.value


def grad_sq_sum(address: int, numel: int, grad_dtype: int, threads: int) -> float:
    """sum(g**2) in float64 over ``numel`` elements at ``address`` (one read pass)."""
    total = ctypes.c_double(0.0)
    native_library.check(lib().inf_grad_sq_sum(address, numel, grad_dtype, threads, ctypes.byref(total)),
                  f"inf_grad_sq_sum({numel} elements, grad dtype {grad_dtype}, {threads} threads)")
    return total.value


def rmw_bandwidth(a: int, b: int, c: int, d: int, n: int, threads: int) -> None:
    """The 28 B/element read-modify-write reference kernel (a, c, d += b) on raw float32 addresses."""
    native_library.check(lib().inf_adam_rmw_bandwidth(a, b, c, d, n, threads),
                  f"inf_adam_rmw_bandwidth({n} elements, {threads} threads)")
