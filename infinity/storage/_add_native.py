"""ctypes binding of the native gradient add (native/src/adam.c ``inf_grad_accumulate``): a
gradient accumulated into its fp32 host home in one multi-threaded pass, widened in registers.

Why native: torch's mixed-dtype ``add_`` widens a 16-bit gradient into a float32 temporary and
adds it in a second pass (chunked in storage/transfers.py to keep that temporary off fresh
pages). On the second H200 pass the accumulate setup's adds ran at about 1 G elements/s; the
native add reads each byte once and shares the work over the process's CPUs."""
from __future__ import annotations

import ctypes

import torch

from infinity.base import native_library

__all__ = ["accumulate", "reads", "NATIVE_DTYPES"]

NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The gradient dtypes the native add reads (INF_ADAM_DTYPE_* in native/include/inf_adam.h)."""


def _signatures() -> dict:
    return {"inf_grad_accumulate": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p,
                                                   ctypes.c_int64, ctypes.c_int, ctypes.c_int])}


def reads(target: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the native add takes this pair: a contiguous float32 CPU ``target`` and a
    contiguous CPU ``grad`` of its numel in a ``NATIVE_DTYPES`` dtype."""
    return (target.dtype == torch.float32 and grad.dtype in NATIVE_DTYPES
            and target.numel() == grad.numel() and target.is_contiguous()
            and grad.is_contiguous() and target.device.type == grad.device.type == "cpu")


def accumulate(target: torch.Tensor, grad: torch.Tensor) -> None:
    """``target += grad`` for a pair the native add ``reads``, not overlapping: each element
    the bits of ``target.add_(grad.float())``. Uses torch's thread count."""
    if not reads(target, grad):
        raise ValueError(
            f"the native gradient add takes a contiguous float32 CPU target and a contiguous "
            f"CPU gradient of float32, bfloat16 or float16 of its size; got {target.dtype} "
            f"{tuple(target.shape)} on {target.device} and {grad.dtype} {tuple(grad.shape)} on "
            f"{grad.device}")
    lib = native_library.declare("gradient add", _signatures)
    n, threads = target.numel(), torch.get_num_threads()
    ret = lib.inf_grad_accumulate(target.data_ptr(), grad.data_ptr(), n,
                                  NATIVE_DTYPES[grad.dtype], threads)
    native_library.check(ret, f"inf_grad_accumulate({n} elements, {grad.dtype}, "
                              f"{threads} threads)")
