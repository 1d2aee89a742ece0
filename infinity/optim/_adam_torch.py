"""The pure-torch path of the CPU Adam step, with the native kernel's numbers bit for bit.

Why: a reference the tests compare the native kernels with, and the fallback on a platform where
the native library is not built. It performs the operations of native/include/inf_adam.h one
torch op at a time (each op rounds once: no alpha= arguments, whose kernels may fuse a
multiply-add; sqrt via float64), with the per-step constants computed exactly as native/src/adam.c computes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamConstants:
    """Per-step constants (Python floats; torch rounds each to float32 as the C code does)."""

    inv_scale: float
    l2: float             # weight decay added to the gradient (Adam mode), else 0
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    inv_bc2_sqrt: float
    eps: float
    decay: float          # 1 - lr * weight_decay (AdamW mode), else 1
    step_size: float
    use_l2: bool


def _power(x: float, n: int) -> float:
    """x**n by binary exponentiation in double, exactly as adam.c's power()."""
    r = 1.0
    while n > 0:
        if n & 1:
            r *= x
        x *= x
        n >>= 1
    return r


def adam_constants(*, step: int, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, adamw_mode: bool, bias_correction: bool,
                   grad_scale: float) -> AdamConstants:
    """The constants of one step, computed in double like native/src/adam.c make_consts()."""
    bc1 = 1.0 - _power(beta1, step) if bias_correction else 1.0
    bc2 = 1.0 - _power(beta2, step) if bias_correction else 1.0
    use_l2 = (not adamw_mode) and weight_decay != 0.0
    return AdamConstants(
        inv_scale=1.0 / grad_scale,
        l2=weight_decay if use_l2 else 0.0,
        beta1=beta1, one_minus_beta1=1.0 - beta1,
        beta2=beta2, one_minus_beta2=1.0 - beta2,
        inv_bc2_sqrt=1.0 / math.sqrt(bc2),
        eps=eps,
        decay=1.0 - lr * weight_decay if adamw_mode else 1.0,
        step_size=lr / bc1,
        use_l2=use_l2)


def step_torch(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               half: torch.Tensor | None, c: AdamConstants) -> None:
    """One step over flat tensors in place (p, m, v fp32; g fp32/bf16/fp16; half bf16/fp16)."""
    gi = torch.mul(g.float() if g.dtype != torch.float32 else g, c.inv_scale)
    if c.use_l2:
        gi.add_(torch.mul(p, c.l2))
    m.mul_(c.beta1).add_(torch.mul(gi, c.one_minus_beta1))
    gi2 = torch.mul(gi, c.one_minus_beta2).mul_(gi)
    v.mul_(c.beta2).add_(gi2)
    del gi, gi2
    # torch.sqrt on float32 is not correctly rounded for large tensors (a SLEEF 0.5001-ulp
    # kernel: ~20% of results differ from IEEE sqrt); via float64 it is exact after rounding.
    d = torch.sqrt(v.double()).float().mul_(c.inv_bc2_sqrt).add_(c.eps)
    torch.div(m, d, out=d)
    if not c.use_l2:
        p.mul_(c.decay)
    p.sub_(d.mul_(c.step_size))
    if half is not None:
        half.copy_(p)
