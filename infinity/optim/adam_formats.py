"""Adam / AdamW with the optimizer states in fewer bytes (issue 38, opt-in): the binding of the
native kernels of ``native/include/inf_adam_formats.h``.

Why: out-of-core training moves every optimizer state byte between NVMe, host and the CPU Adam
at each step, and the step is bandwidth bound; the moments are two thirds of the states. Storing
them in bf16 or in blockwise 8 bits (bitsandbytes' 8-bit Adam, Dettmers et al. 2021) cuts both
the capacity and the traffic, while the step itself runs in fp32 registers exactly as the fp32
kernel's (``cpu_adam.adam_step_flat``): the same constants, the same operations in the same
order. Given the same (dequantized) moments, the fp32 master and its 16-bit copy come out bit for
bit as the fp32 kernel's; only the stored moments are rounded.

[Note: Adam state formats]
Bytes per parameter of the optimizer states (the 16-bit compute copy and the gradient are not
counted; they are the same in every format):

    format                            master   m        v        scales          total
    fp32 (cpu_adam, today)            4        4        4        -               12
    moments "bf16"                    4        2        2        -                8
    moments "int8"                    4        1        1        2 * 4 / 2048     6.004
    moments "bf16" + master "bf16_sr" 2        2        2        -                6
    moments "int8" + master "bf16_sr" 2        1        1        2 * 4 / 2048     4.004

- "bf16" moments: m and v rounded to bf16 stochastically (unbiased; NaN -> 0xFFFF), with
  random bits of the same hash as the bf16 master's (below): each stored (normal) value is one
  of its two bf16 neighbours, within 2^-7 of it. Not to nearest: v moves by (1 - beta2) = 1e-3
  of the way to g^2 a step, below half an ulp (2^-9..2^-8 of v), so rounded to nearest a stored
  v changes only when g^2 is more than ~2-4x away from it and never decays when gradients
  shrink (bf16 states' known stall, measured in docs/optimizer-formats.md); rounded
  stochastically it decays at its rate on average ([Note: stochastic rounding of bf16 moments]
  in native/src/adam_formats_internal.h).
- "int8" moments: blocks of QBLOCK = 2048 elements with one fp32 absmax per block per moment;
  m coded with the signed dynamic map, v with the unsigned one (``quantization_map``): 7 decades
  below the block's absmax, 2 to 7 significant bits each. A value x is stored as the nearest map
  entry to x / absmax; the error is at most half the gap between the two entries around it, times
  absmax (0.0070 * absmax near the top of the signed map, 0.0035 * absmax for v). An m below
  2.8e-7 * absmax is stored as 0; a positive v never is (it gets the smallest entry, 3.25e-7 *
  absmax): a v stored as 0 under a nonzero m would make the next update up to m / eps. The
  map's precision falls with the decade (7 significant bits at the top, 1-2 at the bottom), so
  accuracy depends on how widely gradient scales spread within a block: see the measured update
  cosines in tests/unit/test_adam_formats.py.
  Blocks never straddle two calls: a range's ``offset`` (its index in the flat state) must be a
  multiple of 2048; the last block of a range may be short.
- master "bf16_sr": the updated fp32 value rounded to bf16 stochastically (unbiased), with the
  random bits from a hash of (seed, step, offset + index): the same result on any thread count or
  SIMD width, and a different stream at every step. Then the master IS the 16-bit copy.
- A block whose updated int8 moment holds inf or NaN stores absmax NaN: the whole block reads
  back as NaN next step (fp32 moments would keep only that element NaN); a non-finite value is
  never silently made finite. In this step, the element's param gets what the fp32 kernel gives.
"""
from __future__ import annotations

import ctypes
import os
from typing import Literal

import torch

from infinity.base import native_library
from infinity.optim import _adam_native as N

__all__ = [
    "QBLOCK",
    "MasterFormat",
    "MomentsFormat",
    "dequantize_blockwise",
    "kernel_supported",
    "new_moments",
    "num_blocks",
    "quantization_bounds",
    "quantization_map",
    "quantize_blockwise",
    "state_bytes_per_param",
    "step_bf16_moments",
    "step_int8_moments",
]

QBLOCK = 2048
"""Elements per int8 block (INF_ADAM_QBLOCK): one fp32 absmax per block per moment."""

MomentsFormat = Literal["bf16", "int8"]
MasterFormat = Literal["fp32", "bf16_sr"]

_MOMENTS = {"bf16": 1, "int8": 2}
_MASTERS = {"fp32": 0, "bf16_sr": 1}
_GRAD_DTYPES = {torch.float32: N.DTYPE_F32, torch.bfloat16: N.DTYPE_BF16,
                torch.float16: N.DTYPE_F16}
_HALF_DTYPES = {torch.bfloat16: N.DTYPE_BF16, torch.float16: N.DTYPE_F16}
_ZERO_CODE = {True: 127, False: 0}  # the code of 0.0 in the signed / unsigned map


class FmtTensorRange(ctypes.Structure):
    """Mirror of ``struct inf_adam_fmt_tensor``."""

    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("exp_avg_absmax", ctypes.c_void_p),
        ("exp_avg_sq_absmax", ctypes.c_void_p),
        ("half_out", ctypes.c_void_p),
        ("offset", ctypes.c_int64),
        ("numel", ctypes.c_int64),
    ]


def _signatures() -> dict:
    c_int = ctypes.c_int
    fp = ctypes.POINTER(ctypes.c_float)
    return {
        "inf_adam_step_fmt": (c_int, [ctypes.POINTER(N.HParams), ctypes.POINTER(FmtTensorRange),
                                      c_int, c_int, c_int, c_int, c_int, ctypes.c_uint64, c_int,
                                      c_int]),
        "inf_adam_qmap": (c_int, [c_int, fp, fp]),
        "inf_adam_fmt_kernel_supported": (c_int, [c_int]),
    }


def _lib() -> ctypes.CDLL:
    return native_library.declare("Adam state formats", _signatures)


def num_blocks(numel: int) -> int:
    """Int8 blocks (absmax entries per moment) of a range of ``numel`` elements."""
    return (int(numel) + QBLOCK - 1) // QBLOCK


def state_bytes_per_param(moments: MomentsFormat | Literal["fp32"],
                          master: MasterFormat = "fp32") -> float:
    """Bytes per parameter of master + m + v (+ int8 scales); see [Note: Adam state formats]."""
    per_moment = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / QBLOCK}
    if moments not in per_moment:
        raise ValueError(f"moments must be 'fp32', 'bf16' or 'int8', got {moments!r}")
    if master not in _MASTERS:
        raise ValueError(f"master must be 'fp32' or 'bf16_sr', got {master!r}")
    return (4.0 if master == "fp32" else 2.0) + 2 * per_moment[moments]


def _qmap(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.empty(256, dtype=torch.float32)
    bounds = torch.empty(255, dtype=torch.float32)
    fp = ctypes.POINTER(ctypes.c_float)
    ret = _lib().inf_adam_qmap(0 if signed else 1, ctypes.cast(values.data_ptr(), fp),
                               ctypes.cast(bounds.data_ptr(), fp))
    native_library.check(ret, f"inf_adam_qmap({'signed' if signed else 'unsigned'})")
    return values, bounds


def quantization_map(signed: bool) -> torch.Tensor:
    """The 256 ascending values of the signed (m) or unsigned (v) map, from the library (the one
    definition): code c of a block stands for ``map[c] * absmax``."""
    return _qmap(signed)[0]


def quantization_bounds(signed: bool) -> torch.Tensor:
    """The map's 255 decision bounds: a value x / absmax gets code ``#{j: bounds[j] <= x}``."""
    return _qmap(signed)[1]


def new_moments(numel: int, moments: MomentsFormat) -> dict[str, torch.Tensor]:
    """Zero moments of a flat range in ``moments`` format, as the step functions take them
    (keys exp_avg, exp_avg_sq, and for int8 exp_avg_absmax, exp_avg_sq_absmax)."""
    n = int(numel)
    if moments == "bf16":
        return {"exp_avg": torch.zeros(n, dtype=torch.bfloat16),
                "exp_avg_sq": torch.zeros(n, dtype=torch.bfloat16)}
    if moments == "int8":
        return {"exp_avg": torch.full((n,), _ZERO_CODE[True], dtype=torch.uint8),
                "exp_avg_sq": torch.full((n,), _ZERO_CODE[False], dtype=torch.uint8),
                "exp_avg_absmax": torch.zeros(num_blocks(n), dtype=torch.float32),
                "exp_avg_sq_absmax": torch.zeros(num_blocks(n), dtype=torch.float32)}
    raise ValueError(f"moments must be 'bf16' or 'int8', got {moments!r}")


def quantize_blockwise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, absmax float32) of a 1-D float32 ``x`` (its element 0 starts a block), by
    the kernels' rule: absmax = max |x| of the block (NaN and inf make it NaN, codes the zero
    code), code = nearest map entry to x / absmax (x / 1 for an all-zero block). For converting
    fp32 moments (a checkpoint) to int8; the kernels requantize in their own pass."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"x must be a 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    n = x.numel()
    nb = num_blocks(n)
    pad = torch.zeros(nb * QBLOCK, dtype=torch.float32)
    pad[:n] = x
    blocks = pad.view(nb, QBLOCK)
    absmax = blocks.abs().amax(dim=1) if nb else torch.zeros(0)
    bad = ~torch.isfinite(blocks).all(dim=1)
    div = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    codes = torch.searchsorted(quantization_bounds(signed), (blocks / div[:, None]).reshape(-1),
                               right=True)
    if not signed:      # a positive v never gets code 0 (see [Note: Adam state formats])
        codes = torch.where((codes == 0) & (pad.view(-1) / div.repeat_interleave(QBLOCK) > 0),
                            torch.ones_like(codes), codes)
    codes = codes.view(nb, QBLOCK)
    codes[bad] = _ZERO_CODE[signed]
    absmax = torch.where(bad, torch.full_like(absmax, float("nan")), absmax)
    return codes.reshape(-1)[:n].to(torch.uint8), absmax.to(torch.float32)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """float32 values ``map[code] * absmax[block]`` (what the kernels read, one rounding)."""
    if codes.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise ValueError(f"codes must be uint8 and absmax float32, got {codes.dtype}, {absmax.dtype}")
    if absmax.numel() != num_blocks(codes.numel()):
        raise ValueError(f"absmax has {absmax.numel()} entries, {codes.numel()} codes need "
                         f"{num_blocks(codes.numel())} (one per {QBLOCK})")
    scale = absmax.repeat_interleave(QBLOCK)[:codes.numel()]
    return quantization_map(signed)[codes.long()] * scale


def kernel_supported(name: str) -> bool:
    """Whether the format kernel ``name`` ("scalar", "avx2", "avx512"; "neon" has none yet) runs
    on this CPU and build."""
    if name not in N.KERNELS:
        raise ValueError(f"kernel must be one of {sorted(N.KERNELS)}, got {name!r}")
    return bool(_lib().inf_adam_fmt_kernel_supported(N.KERNELS[name]))


# ---- checks ----

def _check_flat(name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int | None,
                what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):  # ValueError for every argument, as cpu_adam's checks
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}; the format kernels "
                         "run on the host")
    if t.layout != torch.strided or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a 1-D contiguous tensor (shape {tuple(t.shape)}, "
                         f"strides {t.stride() if t.layout == torch.strided else t.layout}); pass "
                         "a flat view of the range (t.view(-1) of a contiguous buffer)")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {what}, got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but param has {numel}: they must be "
                         "equal")
    if t.numel() and t.data_ptr() % t.element_size():
        raise ValueError(f"{name} starts at {t.data_ptr():#x}, not aligned to its {t.element_size()}"
                         f"-byte elements; copy it into a fresh tensor")
    return t


def _check_overlap(named: list[tuple[str, torch.Tensor]]) -> None:
    spans = [(n, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for n, t in named if t.numel()]
    for i, (na, a0, a1) in enumerate(spans):
        for nb, b0, b1 in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{na} and {nb} overlap in memory ([{a0:#x}, {a1:#x}) and "
                                 f"[{b0:#x}, {b1:#x})): each must be its own buffer")


def _step(moments: MomentsFormat, param: torch.Tensor, grad: torch.Tensor,
          exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, exp_avg_absmax: torch.Tensor | None,
          exp_avg_sq_absmax: torch.Tensor | None, offset: int, step: int, lr: float,
          beta1: float, beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
          bias_correction: bool, grad_scale: float, half_out: torch.Tensor | None, seed: int,
          kernel: str, threads: int | None) -> None:
    _check_flat("param", param, (torch.float32, torch.bfloat16), None,
                "float32 (fp32 master) or bfloat16 (bf16 master, stochastic rounding)")
    n = param.numel()
    master = "fp32" if param.dtype == torch.float32 else "bf16_sr"
    _check_flat("grad", grad, tuple(_GRAD_DTYPES), n, "float32, bfloat16 or float16")
    mdt = (torch.bfloat16,) if moments == "bf16" else (torch.uint8,)
    mwhat = "bfloat16 (bf16 moments)" if moments == "bf16" else "uint8 (int8 moment codes)"
    _check_flat("exp_avg", exp_avg, mdt, n, mwhat)
    _check_flat("exp_avg_sq", exp_avg_sq, mdt, n, mwhat)
    named = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    offset = int(offset)
    if offset < 0:
        raise ValueError(f"offset must be >= 0 (the range's index in its flat state), got {offset}")
    if moments == "int8":
        if offset % QBLOCK:
            raise ValueError(f"offset {offset} is not a multiple of the int8 block ({QBLOCK}): a "
                             "block must not straddle two calls; split ranges at multiples of "
                             f"{QBLOCK} elements")
        for name, t in (("exp_avg_absmax", exp_avg_absmax),
                        ("exp_avg_sq_absmax", exp_avg_sq_absmax)):
            if t is None:
                raise ValueError(f"{name} is required with int8 moments: float32, "
                                 f"{num_blocks(n)} entries (one per {QBLOCK} elements)")
            _check_flat(name, t, (torch.float32,), None, "float32")
            if t.numel() != num_blocks(n):
                raise ValueError(f"{name} has {t.numel()} entries but {n} elements need "
                                 f"{num_blocks(n)} (one per {QBLOCK}, the last block may be short)")
            named.append((name, t))
    elif exp_avg_absmax is not None or exp_avg_sq_absmax is not None:
        raise ValueError("exp_avg_absmax / exp_avg_sq_absmax are for int8 moments only")
    hdt = N.DTYPE_NONE
    if half_out is not None:
        if master == "bf16_sr":
            raise ValueError("half_out must be None with a bfloat16 param: the bf16 master is "
                             "itself the 16-bit copy")
        _check_flat("half_out", half_out, tuple(_HALF_DTYPES), n, "bfloat16 or float16")
        hdt = _HALF_DTYPES[half_out.dtype]
        named.append(("half_out", half_out))
    _check_overlap(named)
    if kernel not in N.KERNELS:
        raise ValueError(f"kernel must be one of {sorted(N.KERNELS)}, got {kernel!r}")
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    elif int(threads) < 1:
        raise ValueError(f"threads must be >= 1 (or None for the CPUs this process may use), "
                         f"got {threads}")
    hp = N.HParams(float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                   float(grad_scale), int(step), int(bool(adamw_mode)), int(bool(bias_correction)))
    r = FmtTensorRange(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                       exp_avg_sq.data_ptr(),
                       None if exp_avg_absmax is None else exp_avg_absmax.data_ptr(),
                       None if exp_avg_sq_absmax is None else exp_avg_sq_absmax.data_ptr(),
                       None if half_out is None else half_out.data_ptr(), offset, n)
    ret = _lib().inf_adam_step_fmt(ctypes.byref(hp), ctypes.byref(r), 1, _GRAD_DTYPES[grad.dtype],
                                   hdt, _MOMENTS[moments], _MASTERS[master],
                                   int(seed) & (2**64 - 1), N.KERNELS[kernel], int(threads))
    native_library.check(ret, f"inf_adam_step_fmt({n} elements, moments {moments}, master "
                              f"{master}, kernel {kernel}, step {step}, lr {lr}, betas ({beta1}, "
                              f"{beta2}), eps {eps}, grad_scale {grad_scale})")


def step_bf16_moments(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float,
                      beta2: float, eps: float, weight_decay: float, adamw_mode: bool = True,
                      bias_correction: bool = True, grad_scale: float = 1.0,
                      half_out: torch.Tensor | None = None, offset: int = 0, seed: int = 0,
                      kernel: str = "auto", threads: int | None = None) -> None:
    """One Adam/AdamW step of a flat range, in place, with bf16 moments.

    As ``cpu_adam.adam_step_flat`` (same hyperparameters, ``grad`` fp32/bf16/fp16 divided by
    ``grad_scale``, ``half_out`` the updated param as bf16/fp16), but ``exp_avg`` and
    ``exp_avg_sq`` are bfloat16, read and rewritten rounded stochastically with ``seed``.
    ``param`` float32 is the fp32 master; bfloat16 makes it a bf16 master rounded the same way
    (then ``half_out`` must be None); ``offset`` (the range's index in its flat state) is the
    roundings' element counter. ``kernel``: "auto", "scalar", "avx2", "avx512" (all give the
    same bits). Raises ValueError naming the argument on a mismatch, OSError on a native -errno.
    """
    _step("bf16", param, grad, exp_avg, exp_avg_sq, None, None, offset, step, lr, beta1, beta2,
          eps, weight_decay, adamw_mode, bias_correction, grad_scale, half_out, seed, kernel,
          threads)


def step_int8_moments(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, exp_avg_absmax: torch.Tensor,
                      exp_avg_sq_absmax: torch.Tensor, *, step: int, lr: float, beta1: float,
                      beta2: float, eps: float, weight_decay: float, adamw_mode: bool = True,
                      bias_correction: bool = True, grad_scale: float = 1.0,
                      half_out: torch.Tensor | None = None, offset: int = 0, seed: int = 0,
                      kernel: str = "auto", threads: int | None = None) -> None:
    """One Adam/AdamW step of a flat range, in place, with blockwise int8 moments.

    ``exp_avg`` / ``exp_avg_sq`` are uint8 codes into the signed / unsigned map, and
    ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` float32, one per 2048-element block of the range
    (``num_blocks(param.numel())``); all are read, dequantized, stepped in fp32 and rewritten
    (each block's new absmax from its updated values). ``offset`` must be a multiple of 2048 so
    that a block never straddles two calls. ``new_moments(n, "int8")`` gives a fresh state.
    Otherwise as ``step_bf16_moments``.
    """
    _step("int8", param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, offset,
          step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale,
          half_out, seed, kernel, threads)
