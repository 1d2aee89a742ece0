"""A gradient's sum of squares in float64: the global norm's part of it (clipping, the fp16
overflow check, ``get_global_grad_norm``), summed as the Adam kernel sums the early step's
gradients, whichever thread asks (the training thread's, the step stream's)."""
from __future__ import annotations

import math
import threading

import torch

from infinity.base.log import get_logger
from infinity.optim import _adam_native as N

__all__ = ["sum_of_squares", "NATIVE_GRAD_DTYPES", "say_not_finite"]

log = get_logger("optim")


def say_not_finite(sq_norm: float, *, stepped: str | None, scaled: bool) -> None:
    """Say what a step whose gradients hold inf or NaN did, where nothing else does: the
    deferred schedule skips it (the norm comes before any step: nothing changes, the lr
    schedule holds; torch would write the NaN into the weights), the early step has already
    stepped the units as their gradients came (``stepped`` says where), as torch's step
    would. fp16's skip is the loss scaler's to say (``scaled``); an fp32 or bf16 skip was
    said by nothing but the skipped count of the periodic log line."""
    norm = math.sqrt(sq_norm)       # inf or nan: a sum of squares is never negative
    if stepped is not None:
        log.warning("the gradient norm is not finite (%s) after %s stepped its units: the step "
                    "is taken, not skipped, as torch's would be (the weights may now hold inf "
                    "or NaN); with infinity.early_step \"off\" such a step is skipped. Lower the "
                    "learning rate or check the data", norm, stepped)
    elif not scaled:
        log.warning("step skipped: the gradient norm is not finite (%s); nothing was changed "
                    "and the lr schedule holds (the deferred schedule checks the norm before "
                    "stepping; torch would write the NaN into the weights). If it repeats, "
                    "lower the learning rate or check the data", norm)


def sum_of_squares(values: torch.Tensor, chunk: int = 1 << 18, threads: int = 1) -> float:
    """sum(values**2) in float64 (a float32 norm of 64M elements is ~1% off): one read pass
    of the native kernel (inf_grad_sq_sum, summed as the Adam kernel sums the early step's
    gradients: the same bits whatever the thread count) on ``threads`` threads: one beside
    compute (the step stream's), torch's where the training thread waits for it (the deferred
    step's norm, before any step can start: on one thread the 0.49B model's 2 GB took 0.24 s
    of an H200's 1.3 s step, the GPU idle). Without the native library, a chunk at a time through a
    float64 buffer kept per thread (no full-size float64 temporary, and no fresh allocation
    per chunk: with activations offloaded the malloc mmap threshold is 256 KiB, and a new
    2 MiB chunk each time cost ~1M page faults per speculated backward at 0.49B)."""
    native_dtype = NATIVE_GRAD_DTYPES.get(values.dtype)
    if native_dtype is not None and values.device.type == "cpu" and values.is_contiguous():
        try:
            return N.grad_sq_sum(values.data_ptr(), values.numel(), native_dtype, threads)
        except (ImportError, AttributeError, OSError):
            pass   # the library is missing: cpu_adam already warned once
    scratch = getattr(_norm_scratch, "buffer", None)
    if scratch is None or scratch.numel() < chunk:
        scratch = _norm_scratch.buffer = torch.empty(chunk, dtype=torch.float64)
    total = 0.0
    for start in range(0, values.numel(), chunk):
        part = values[start:start + chunk]
        wide = scratch[:part.numel()]
        wide.copy_(part)
        total += float(torch.dot(wide, wide))
    return total


NATIVE_GRAD_DTYPES = {torch.float32: N.DTYPE_F32, torch.bfloat16: N.DTYPE_BF16,
                      torch.float16: N.DTYPE_F16}
_norm_scratch = threading.local()   # each thread that norms (training, step stream) has its own
