"""Property tests of the CPU Adam kernels (hypothesis): over sizes (0, 1, 7, 8, 15, 16, 1e6+3 and
random), tensor views at element offsets 0..15 (unaligned), every grad/half dtype and wide
hyperparameter ranges, every SIMD kernel equals the scalar reference bit for bit, the pure-torch
path equals it too, and the 16-bit copy equals torch's cast of the fp32 result."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.optim.cpu_adam import adam_step_flat, available_kernels

SIZES = st.one_of(st.sampled_from([0, 1, 7, 8, 15, 16, 1_000_003]), st.integers(0, 5000))
HALF = st.sampled_from([None, torch.bfloat16, torch.float16])
GRAD = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
HPARAMS = st.fixed_dictionaries({
    "lr": st.one_of(st.just(0.0), st.floats(1e-6, 1.0)),
    "beta1": st.one_of(st.just(0.0), st.floats(0.0, 0.999)),
    "beta2": st.one_of(st.just(0.0), st.floats(0.0, 0.99999)),
    "eps": st.one_of(st.just(0.0), st.floats(1e-12, 1e-2)),
    "weight_decay": st.one_of(st.just(0.0), st.floats(0.0, 0.5)),
    "adamw_mode": st.booleans(),
    "bias_correction": st.booleans(),
    "grad_scale": st.one_of(st.just(1.0), st.sampled_from([2.0 ** -8, 65536.0]),
                            st.floats(1e-3, 1e6)),
    "step": st.one_of(st.integers(1, 10), st.integers(1, 10 ** 7)),
})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return not bool(((_bits(a) != _bits(b)) & ~nan).any())


def _view(base: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    return base[offset:offset + n]


def _inputs(n: int, offset: int, gdt: torch.dtype, seed: int, specials: bool):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n + 16, generator=g) * 2
    grad = torch.randn(n + 16, generator=g) * 1e-2
    m = torch.randn(n + 16, generator=g) * 1e-3
    v = torch.rand(n + 16, generator=g) * 1e-4
    if specials and n:
        for t in (p, grad):
            idx = torch.randint(0, n + 16, (max(1, n // 50),), generator=g)
            vals = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                                 3e38, 65520.0])
            t[idx] = vals[torch.randint(0, len(vals), (len(idx),), generator=g)]
    return (_view(p, offset, n), _view(grad.to(gdt), offset, n), _view(m, offset, n),
            _view(v, offset, n))


def _run(impl: str, inputs, hdt, hoffset: int, hp: dict):
    p, g, m, v = (t.clone() if i != 1 else t for i, t in enumerate(inputs))
    n = p.numel()
    h = None if hdt is None else _view(torch.full((n + 16,), 7, dtype=hdt), hoffset, n)
    hp = dict(hp)
    adam_step_flat(p, g, m, v, step=hp.pop("step"), beta1=hp.pop("beta1"), beta2=hp.pop("beta2"),
                   half_out=h, impl=impl, **hp)
    return p, m, v, h


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=SIZES, offset=st.integers(0, 15), hoffset=st.integers(0, 15), gdt=GRAD, hdt=HALF,
       hp=HPARAMS, seed=st.integers(0, 2 ** 16), specials=st.booleans())
def test_every_path_equals_scalar_reference(n, offset, hoffset, gdt, hdt, hp, seed, specials):
    inputs = _inputs(n, offset, gdt, seed, specials)
    ref = _run("scalar", inputs, hdt, hoffset, hp)
    impls = [k for k in available_kernels() if k != "scalar"] + ["torch"]
    for impl in impls:
        got = _run(impl, inputs, hdt, hoffset, hp)
        for a, b, name in zip(ref, got, ("param", "exp_avg", "exp_avg_sq", "half_out")):
            if a is not None:
                assert _same(a, b), f"{impl} differs from scalar in {name} (n={n})"
    p, _, _, h = ref
    if h is not None:
        assert torch.equal(_bits(h), _bits(p.to(h.dtype))), "16-bit copy != torch cast"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3000), offset=st.integers(1, 15), hdt=HALF)
def test_views_leave_neighbours_untouched(n, offset, hdt):
    base = [torch.randn(n + 32) for _ in range(4)]
    before = [b.clone() for b in base]
    hbase = torch.zeros(n + 32, dtype=hdt) if hdt is not None else None
    views = [b[offset:offset + n] for b in base]
    adam_step_flat(views[0], views[1], views[2], views[3].abs_(), step=1, lr=1e-2, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.1,
                   half_out=None if hbase is None else hbase[offset:offset + n])
    for b, old in zip(base, before):
        assert torch.equal(b[:offset], old[:offset]) and torch.equal(b[offset + n:], old[offset + n:])
    if hbase is not None:
        assert not bool(hbase[:offset].any()) and not bool(hbase[offset + n:].any())
