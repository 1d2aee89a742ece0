"""optim/_adam_torch.py at unit level: the pure-torch Adam step is the
reference the native kernels are compared with and the fallback where the library is not built, so
its constants and its step are checked against values computed here independently -- exact
powers, a float64 textbook Adam -- and, bit for bit, against the native scalar kernel."""
from __future__ import annotations

import math

import pytest
import torch
from fakes import reference_adam_f64

from infinity.optim._adam_torch import AdamConstants, _power, adam_constants, step_torch
from infinity.optim.cpu_adam import adam_step_flat, available_kernels

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def test_power_is_exact_where_the_powers_are_representable() -> None:
    """adam.c's power() by binary exponentiation: powers of 3 and 0.5 are exact in double, so each
    must come out exactly (a wrong bit test, shift or product changes them); n = 0 is 1."""
    for n in range(14):
        assert _power(3.0, n) == float(3 ** n), n
        assert _power(0.5, n) == 0.5 ** n, n
    assert _power(0.9, 0) == 1.0


def test_power_multiplies_in_binary_order() -> None:
    """The bias corrections must round like the C code's: x**13 as x * x**4 * x**8 with the
    squares taken in double, which differs in the last bit from repeated multiplication for 0.9."""
    x = 0.9
    x2 = x * x
    x4 = x2 * x2
    x8 = x4 * x4
    assert _power(x, 13) == ((x * x4) * x8)
    assert _power(x, 6) == (x2 * x4)


def test_constants_of_an_adamw_step_with_bias_correction() -> None:
    """Every field, with betas whose powers are exact: bc1 = 1 - 0.5**3, bc2 = 1 - 0.75**3."""
    c = adam_constants(step=3, lr=0.25, beta1=0.5, beta2=0.75, eps=1e-6, weight_decay=0.125,
                       adamw_mode=True, bias_correction=True, grad_scale=8.0)
    assert c == AdamConstants(
        inv_scale=0.125, l2=0.0, beta1=0.5, one_minus_beta1=0.5, beta2=0.75,
        one_minus_beta2=0.25, inv_bc2_sqrt=1.0 / math.sqrt(1.0 - 0.421875), eps=1e-6,
        decay=1.0 - 0.25 * 0.125, step_size=0.25 / 0.875, use_l2=False)


def test_constants_of_an_adam_step_with_weight_decay_as_l2() -> None:
    """Adam mode: the weight decay goes into the gradient (l2), the parameter is not decayed."""
    c = adam_constants(step=2, lr=0.5, beta1=0.5, beta2=0.5, eps=1e-8, weight_decay=0.0625,
                       adamw_mode=False, bias_correction=True, grad_scale=1.0)
    assert c.use_l2 is True
    assert c.l2 == 0.0625
    assert c.decay == 1.0
    assert c.step_size == 0.5 / 0.75
    assert c.inv_bc2_sqrt == 1.0 / math.sqrt(0.75)
    assert c.inv_scale == 1.0


def test_constants_without_weight_decay_or_bias_correction() -> None:
    """Adam mode with weight_decay 0 uses no l2 term; AdamW with 0 decays by exactly 1; without
    bias correction the step size is lr and the second-moment factor 1."""
    adam = adam_constants(step=5, lr=0.5, beta1=0.5, beta2=0.5, eps=1e-8, weight_decay=0.0,
                          adamw_mode=False, bias_correction=False, grad_scale=2.0)
    assert adam.use_l2 is False and adam.l2 == 0.0 and adam.decay == 1.0
    assert adam.step_size == 0.5 and adam.inv_bc2_sqrt == 1.0 and adam.inv_scale == 0.5
    adamw = adam_constants(step=5, lr=0.5, beta1=0.5, beta2=0.5, eps=1e-8, weight_decay=0.0,
                           adamw_mode=True, bias_correction=False, grad_scale=1.0)
    assert adamw.use_l2 is False and adamw.decay == 1.0 and adamw.step_size == 0.5


_reference_f64 = reference_adam_f64


CASES = [  # (adamw_mode, weight_decay, bias_correction, grad_scale, grad dtype, half dtype)
    (True, 0.1, True, 1.0, torch.float32, None),
    (False, 0.1, True, 1.0, torch.float32, torch.bfloat16),
    (False, 0.0, False, 64.0, torch.bfloat16, torch.float16),
    (True, 0.1, False, 64.0, torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize("adamw_mode,wd,bc,scale,gdt,hdt", CASES)
def test_step_follows_textbook_adam(adamw_mode, wd, bc, scale, gdt, hdt) -> None:
    """Ten steps of step_torch stay within 1e-4 of the movement of a float64 textbook Adam fed
    the same (rounded) gradients: moments and parameters, each mode, with and without bias
    correction and loss scale; the half copy is the parameter's cast."""
    torch.manual_seed(3)
    n = 257
    p0 = torch.randn(n)
    gs = [(torch.randn(n) * scale).to(gdt) for _ in range(10)]
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    half = None if hdt is None else torch.empty(n, dtype=hdt)
    hp = dict(HP, weight_decay=wd, adamw_mode=adamw_mode, bias_correction=bc, grad_scale=scale)
    for k, g in enumerate(gs, start=1):
        step_torch(p, g, m, v, half, adam_constants(step=k, **hp))
    rp, rm, rv = _reference_f64(p0, gs, **hp)
    tol = 1e-4 * float((rp - p0.double()).abs().max())
    assert float((p.double() - rp).abs().max()) <= tol
    assert float((m.double() - rm).abs().max()) <= 1e-5 * float(rm.abs().max())
    assert float((v.double() - rv).abs().max()) <= 1e-5 * float(rv.abs().max())
    if half is not None:
        assert torch.equal(_bits(half), _bits(p.to(hdt)))


@pytest.mark.parametrize("adamw_mode,wd,bc,scale,gdt,hdt", CASES)
def test_step_equals_the_native_scalar_kernel_bit_for_bit(adamw_mode, wd, bc, scale, gdt,
                                                          hdt) -> None:
    """The module's contract: the native kernel's numbers bit for bit (each op rounded once, sqrt
    via float64), parameters, moments and half copy, over several steps."""
    if "scalar" not in available_kernels():
        pytest.skip("the native library is not available")
    torch.manual_seed(4)
    n = 1031
    p0 = torch.randn(n)
    gs = [(torch.randn(n) * scale).to(gdt) for _ in range(4)]
    hp = dict(HP, weight_decay=wd, adamw_mode=adamw_mode, bias_correction=bc, grad_scale=scale)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    pn, mn, vn = p0.clone(), torch.zeros(n), torch.zeros(n)
    half = None if hdt is None else torch.empty(n, dtype=hdt)
    half_n = None if hdt is None else torch.empty(n, dtype=hdt)
    for k, g in enumerate(gs, start=1):
        step_torch(p, g, m, v, half, adam_constants(step=k, **hp))
        adam_step_flat(pn, g, mn, vn, step=k, half_out=half_n, impl="scalar", threads=1, **hp)
    for mine, theirs in ((p, pn), (m, mn), (v, vn), (half, half_n)):
        if mine is not None:
            assert torch.equal(_bits(mine), _bits(theirs))
