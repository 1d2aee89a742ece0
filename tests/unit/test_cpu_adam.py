"""CPU Adam: numerics against torch.optim.AdamW/Adam, the 16-bit copy against torch's cast, every
SIMD kernel against the scalar reference, argument errors, and CPUAdam as a torch optimizer
(param groups, state_dict both ways with torch, LR schedulers, tensor lr, sparse grads); torch's
defaults and boundary hyperparameters, the lr argument's errors, how states from torch Adam (L2),
older states and hand-made ones are adopted, and the flat kernel API's edges."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from fakes import reference_adam_f64
from messages import raises_naming

import infinity
from infinity.optim import _adam_native as N
from infinity.optim import cpu_adam
from infinity.optim.cpu_adam import CPUAdam, adam_step_flat, adam_step_tensors, available_kernels


HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SIMD = ("avx2", "avx512", "neon")


def movement_tol(p_ref: torch.Tensor, p_init: torch.Tensor) -> float:
    """The bar: within 1e-3 of the parameters' total movement."""
    return 1e-3 * float((p_ref - p_init).abs().max())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit, two NaNs being equal whatever their payloads (IEEE leaves the payload of an
    operation on two NaNs open)."""
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    diff = (bits(a) != bits(b)) & ~nan
    assert not bool(diff.any()), (f"{what}: {int(diff.sum())} of {a.numel()} elements differ, "
                                  f"first at {int(diff.nonzero()[0])}")


def require_kernel(name: str) -> None:
    if name not in available_kernels():
        pytest.skip(f"Adam kernel {name!r} not supported by this CPU/build "
                    f"(available: {available_kernels()})")


# ---- the flat step against torch --------------------------------------------------------------

@pytest.mark.parametrize("adamw_mode", [True, False])
def test_flat_100_steps_match_torch(adamw_mode: bool) -> None:
    torch.manual_seed(0)
    n = 50_003
    p0 = torch.randn(n)
    grads = [torch.randn(n) for _ in range(100)]
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls([ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=HP["weight_decay"], foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for k, g in enumerate(grads, start=1):
        ref.grad = g.clone()
        opt.step()
        adam_step_flat(p, g, m, v, step=k, adamw_mode=adamw_mode, **HP)
    tol = movement_tol(ref.detach(), p0)
    assert float((p - ref.detach()).abs().max()) <= tol
    st = opt.state[ref]
    assert float((m - st["exp_avg"]).abs().max()) <= 1e-3 * float(st["exp_avg"].abs().max())
    assert float((v - st["exp_avg_sq"]).abs().max()) <= 1e-3 * float(st["exp_avg_sq"].abs().max())


def _reference_f64(p, gs, **hp):
    """The updated parameter of the textbook float64 Adam/AdamW (fakes.reference_adam_f64)."""
    return reference_adam_f64(p, gs, **hp)[0]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_scale_bias_correction_and_16bit_grads(bias_correction: bool,
                                                    grad_dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    n, scale = 10_007, 1024.0
    p0 = torch.randn(n)
    gs = [(torch.randn(n) * scale).to(grad_dtype) for _ in range(30)]
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for k, g in enumerate(gs, start=1):
        adam_step_flat(p, g, m, v, step=k, bias_correction=bias_correction, grad_scale=scale, **HP)
    ref = _reference_f64(p0, gs, adamw_mode=True, bias_correction=bias_correction,
                         grad_scale=scale, **HP)
    assert float((p.double() - ref).abs().max()) <= movement_tol(ref, p0.double())


@pytest.mark.parametrize("impl", ["scalar", *SIMD, "torch"])
@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_half_copy_equals_torch_cast(half_dtype: torch.dtype, impl: str) -> None:
    if impl != "torch":
        require_kernel(impl)
    torch.manual_seed(2)
    n = 100_003
    # values straddling rounding ties, overflow to inf, subnormals, NaNs
    p = torch.randn(n) * torch.tensor([1e-6, 1.0, 6e4, 3e38]).repeat(n // 4 + 1)[:n]
    p[::97] = float("nan")
    p[1::89] = float("inf")
    g, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    h = torch.empty(n, dtype=half_dtype)
    adam_step_flat(p, g, m, v, step=1, half_out=h, impl=impl, **HP)
    assert torch.equal(bits(h), bits(p.to(half_dtype)))


@pytest.mark.parametrize("kernel", SIMD)
def test_simd_kernel_equals_scalar_reference(kernel: str) -> None:
    require_kernel(kernel)
    torch.manual_seed(3)
    combos = [(n, gdt, hdt, adamw) for n in (0, 1, 7, 8, 15, 16, 17, 31, 4099)
              for gdt in (torch.float32, torch.bfloat16, torch.float16)
              for hdt in (None, torch.bfloat16, torch.float16) for adamw in (True, False)]
    combos += [(1_000_003, torch.float32, None, True),
               (1_000_003, torch.bfloat16, torch.bfloat16, False)]
    for n, gdt, hdt, adamw in combos:
        p0, g = torch.randn(n), (torch.randn(n) * 1e-2).to(gdt)
        m0, v0 = torch.randn(n) * 1e-3, torch.rand(n) * 1e-4
        out = {}
        for impl in ("scalar", kernel):
            p, m, v = p0.clone(), m0.clone(), v0.clone()
            h = None if hdt is None else torch.empty(n, dtype=hdt)
            adam_step_flat(p, g, m, v, step=5, adamw_mode=adamw, grad_scale=3.0, half_out=h,
                           impl=impl, **HP)
            out[impl] = (p, m, v, h)
        for a, b, name in zip(out["scalar"], out[kernel], ("p", "m", "v", "half")):
            if a is not None:
                assert_same_bits(a, b, f"{kernel} vs scalar, {name}, n={n}, grad {gdt}, "
                                       f"half {hdt}, adamw={adamw}")


def test_torch_impl_equals_native() -> None:
    torch.manual_seed(4)
    n = 300_001
    p0, g, m0, v0 = torch.randn(n), torch.randn(n).bfloat16(), torch.randn(n), torch.rand(n)
    outs = []
    for impl in ("native", "torch"):
        p, m, v, h = p0.clone(), m0.clone(), v0.clone(), torch.empty(n, dtype=torch.float16)
        adam_step_flat(p, g, m, v, step=9, adamw_mode=False, grad_scale=7.0, half_out=h,
                       impl=impl, **HP)
        outs.append((p, m, v, h))
    for a, b in zip(*outs):
        assert_same_bits(a, b, "torch path vs native")


def test_threads_do_not_change_results() -> None:
    torch.manual_seed(5)
    n = 2_000_003
    p0, g = torch.randn(n), torch.randn(n)
    results = []
    for threads in (1, 2, 5):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        adam_step_flat(p, g, m, v, step=1, threads=threads, **HP)
        results.append(p)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_the_threads_asked_for_are_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``threads`` (CPUAdam's and adam_step_tensors') is the thread count the native call gets:
    a caller sharing the CPU with other work limits the step to it."""
    monkeypatch.delenv(cpu_adam.KERNEL_ENV, raising=False)
    got: list[int] = []
    real = N.step

    def step(*args):
        got.append(args[-1])         # the native call's last argument: its thread count
        return real(*args)

    monkeypatch.setattr(N, "step", step)
    asked = cpu_adam._default_threads() + 1          # not what it would run on unasked
    ps = _model_params()
    opt = CPUAdam(ps, threads=asked)
    _run(opt, ps, 2)
    assert got == [asked, asked]
    got.clear()
    ts = [torch.randn(5) for _ in range(4)]
    adam_step_tensors([ts[0]], [ts[1]], [ts[2].zero_()], [ts[3].zero_()], step=1,
                      threads=asked + 1, **HP)
    assert got == [asked + 1]


def test_grad_sq_sum_is_the_same_on_every_kernel_and_thread_count() -> None:
    """The sum of the gradient's squares returned with the step: float64-exact products,
    one summation order (the same bits for every kernel, thread count and call), within
    float64 rounding of torch's sum; the update itself is the step without it."""
    torch.manual_seed(6)
    impls = ["scalar", *[k for k in SIMD if k in available_kernels()]]
    for n in (1, 9, 65_537, 2_000_003):
        for gdt in (torch.float32, torch.bfloat16, torch.float16):
            g = torch.randn(n).to(gdt)
            want = float((g.double() ** 2).sum())
            sums, params = set(), []
            for impl in impls:
                for threads in (1, 3):
                    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
                    got = adam_step_flat(p, g, m, v, step=1, threads=threads, impl=impl,
                                         grad_sq_sum=True, **HP)
                    sums.add(got)
                    params.append(p)
            assert len(sums) == 1, f"n={n}, {gdt}: sums differ across kernels/threads: {sums}"
            assert sums.pop() == pytest.approx(want, rel=1e-12), (n, gdt)
            p = torch.ones(n)
            assert adam_step_flat(p, g, torch.zeros(n), torch.zeros(n), step=1, **HP) is None
            assert all(torch.equal(p, q) for q in params), f"n={n}, {gdt}: the update changed"
    torch_sum = adam_step_flat(torch.ones(5), torch.full((5,), 2.0), torch.zeros(5),
                               torch.zeros(5), step=1, impl="torch", grad_sq_sum=True, **HP)
    assert torch_sum == 20.0


@pytest.mark.parametrize("impl", ["scalar", *SIMD, "torch"])
def test_a_step_that_zeroes_its_gradient_is_the_same_step(impl: str) -> None:
    """``zero_grad`` (``inf_adam_step_zero``: each chunk's gradient zeroed right after its
    update, for a gradient home the next backward adds into again): the parameters, moments,
    16-bit copy and norm are the step's without it, bit for bit, and the gradient is left at
    zero, every element (sizes across the 64K-element chunks, a tail, an unaligned start,
    several threads)."""
    if impl != "torch":
        require_kernel(impl)
    torch.manual_seed(7)
    for n, offset in ((1, 0), (65_537, 0), (200_003, 1)):
        for gdt in (torch.float32, torch.bfloat16, torch.float16):
            g0 = torch.randn(n + offset).to(gdt)[offset:]
            runs = []
            for zero in (False, True):
                torch.manual_seed(8)
                p, m, v = torch.randn(n), torch.rand(n), torch.rand(n)
                h, g = torch.empty(n, dtype=torch.bfloat16), g0.clone()
                sq = adam_step_flat(p, g, m, v, step=3, impl=impl, threads=3, half_out=h,
                                    grad_sq_sum=True, zero_grad=zero, **HP)
                runs.append((p, m, v, h, g, sq))
            (p, m, v, h, g, sq), (pz, mz, vz, hz, gz, sqz) = runs
            for a, b, what in ((p, pz, "param"), (m, mz, "exp_avg"), (v, vz, "exp_avg_sq"),
                               (h, hz, "half_out")):
                assert_same_bits(a, b, f"{impl} n={n} {gdt} {what}")
            assert sq == sqz and torch.equal(g, g0), (impl, n, gdt)
            assert bool((bits(gz) == 0).all()), (impl, n, gdt)     # +0.0, every element


@pytest.mark.parametrize("impl", ["scalar", *SIMD, "torch"])
def test_a_step_with_folded_addends_is_the_step_of_the_adds_made_first(impl: str) -> None:
    """``addends`` (``inf_adam_step_fold``: the last micro-batch's gradient parts added into
    the home chunk by chunk, in cache): the bits of the adds made first (storage/host_adds.py
    ``add_widened``, in the order given, two overlapping) and then the zeroing step; the norm is
    of the completed gradient; the staged parts are left as they were."""
    from infinity.storage.host_adds import add_widened
    if impl != "torch":
        require_kernel(impl)
    n = 200_003
    for adt in (torch.float32, torch.bfloat16, torch.float16):
        torch.manual_seed(9)
        home = torch.randn(n)
        addends = [(5, torch.randn(70_000).to(adt)), (65_000, torch.randn(135_003).to(adt)),
                   (7, torch.randn(9).to(adt))]
        kept = [a.clone() for _, a in addends]
        runs = []
        for fold in (False, True):
            torch.manual_seed(10)
            p, m, v = torch.randn(n), torch.rand(n), torch.rand(n)
            h, g = torch.empty(n, dtype=torch.bfloat16), home.clone()
            if not fold:
                for at, values in addends:
                    add_widened(g[at:at + values.numel()], values)
            sq = adam_step_flat(p, g, m, v, step=2, impl=impl, threads=3, half_out=h,
                                grad_sq_sum=True, zero_grad=True,
                                addends=addends if fold else (), **HP)
            runs.append((p, m, v, h, g, sq))
        (p, m, v, h, g, sq), (pf, mf, vf, hf, gf, sqf) = runs
        for a, b, what in ((p, pf, "param"), (m, mf, "exp_avg"), (v, vf, "exp_avg_sq"),
                           (h, hf, "half_out")):
            assert_same_bits(a, b, f"{impl} {adt} {what}")
        assert sq == sqf and not bool(gf.any()), (impl, adt)
        assert all(torch.equal(a, b) for (_, a), b in zip(addends, kept))


def test_folded_addends_are_refused_where_they_cannot_be_right() -> None:
    """Addends need the home left at zero (they are folded, not kept), an fp32 gradient, and
    parts inside the range; each refusal names what is wrong before anything is stepped."""
    p, m, v, g = torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8)
    part = [(0, torch.ones(4))]
    with pytest.raises(ValueError, match="zero_grad=True"):
        adam_step_flat(p, g, m, v, step=1, addends=part, **HP)
    with pytest.raises(ValueError, match="float32 grad"):
        adam_step_flat(p, g.bfloat16(), m, v, step=1, addends=part, zero_grad=True, **HP)
    with pytest.raises(ValueError, match=r"addends\[0\]: elements \[6, 10\)"):
        adam_step_flat(p, g, m, v, step=1, addends=[(6, torch.ones(4))], zero_grad=True, **HP)
    with pytest.raises(ValueError, match=r"addends\[0\]: expected a contiguous 1-D"):
        adam_step_flat(p, g, m, v, step=1, addends=[(0, torch.ones(2, 2))], zero_grad=True,
                       **HP)
    assert not bool(p.any()) and not bool(m.any())


def test_many_tensors_in_one_call_equal_flat_calls() -> None:
    torch.manual_seed(6)
    sizes = [1, 7, 100_000, 3, 65_537, 250_000]
    ps = [torch.randn(s) for s in sizes]
    gs = [torch.randn(s) for s in sizes]
    flat_p = torch.cat(ps)
    ms = [torch.zeros(s) for s in sizes]
    vs = [torch.zeros(s) for s in sizes]
    hs = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    fm, fv, fh = torch.zeros(sum(sizes)), torch.zeros(sum(sizes)), torch.empty(sum(sizes), dtype=torch.bfloat16)
    adam_step_tensors(ps, gs, ms, vs, step=2, half_outs=hs, **HP)
    adam_step_flat(flat_p, torch.cat(gs), fm, fv, step=2, half_out=fh, **HP)
    assert torch.equal(torch.cat(ps), flat_p)
    assert torch.equal(torch.cat(hs), fh) and torch.equal(torch.cat(vs), fv)


# ---- argument errors ---------------------------------------------------------------------------

def _args(n: int = 8) -> dict:
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize("name,bad,match", [
    ("param", torch.zeros(8, dtype=torch.float64), "param must be float32"),
    ("grad", torch.zeros(8, dtype=torch.int32), "grad must be float32, bfloat16 or float16"),
    ("exp_avg", torch.zeros(9), "exp_avg has 9 elements but param has 8"),
    ("exp_avg_sq", torch.zeros(4, 2), "exp_avg_sq must be 1-D"),
    ("grad", torch.zeros(16)[::2], "grad must be contiguous"),
    ("exp_avg", torch.zeros(8, dtype=torch.bfloat16), "exp_avg must be float32"),
])
def test_flat_argument_errors_name_the_argument(name: str, bad: torch.Tensor, match: str) -> None:
    args = _args()
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        adam_step_flat(**args, step=1, **HP)


def test_flat_half_out_and_overlap_errors() -> None:
    with pytest.raises(ValueError, match="half_out must be bfloat16 or float16"):
        adam_step_flat(**_args(), step=1, half_out=torch.zeros(8), **HP)
    with pytest.raises(ValueError, match="half_out has 7 elements"):
        adam_step_flat(**_args(), step=1, half_out=torch.zeros(7, dtype=torch.bfloat16), **HP)
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        adam_step_flat(torch.zeros(8), torch.zeros(8), buf[:8], buf[4:12], step=1, **HP)


@pytest.mark.parametrize("key,value,match", [
    ("step", 0, "step must be >= 1"), ("beta1", 1.0, r"beta1 must be in \[0, 1\)"),
    ("beta2", -0.1, "beta2 must be"), ("lr", float("nan"), "lr must be"),
    ("eps", -1.0, "eps must be"), ("weight_decay", -0.1, "weight_decay must be"),
    ("grad_scale", 0.0, "grad_scale must be"), ("threads", 0, "threads must be >= 1"),
    ("impl", "cuda", "impl must be one of"),
])
def test_flat_hyperparameter_errors(key: str, value, match: str) -> None:
    kw = dict(HP, step=1)
    kw[key] = value
    with pytest.raises(ValueError, match=match):
        adam_step_flat(**_args(), **kw)


def test_kernel_forcing_and_native_info(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args()
    adam_step_flat(**args, step=1, **HP)
    assert infinity.native_info()["in_use"]["adam_kernel"] == N.best_kernel()
    monkeypatch.setenv(cpu_adam.KERNEL_ENV, "scalar")
    adam_step_flat(**args, step=2, **HP)
    assert infinity.native_info()["in_use"]["adam_kernel"] == "scalar"
    monkeypatch.setenv(cpu_adam.KERNEL_ENV, "sse9")
    with raises_naming(ValueError, "INFINITY_ADAM_KERNEL='sse9' is not a kernel",
                       "use one of scalar, avx2, avx512, neon (or unset it)", ends=True):
        adam_step_flat(**args, step=3, **HP)
    missing = [k for k in SIMD if k not in available_kernels()]
    if missing:
        monkeypatch.setenv(cpu_adam.KERNEL_ENV, missing[0])
        with pytest.raises(RuntimeError, match="cannot run on this CPU"):
            adam_step_flat(**args, step=3, **HP)


def test_fallback_to_torch_warns_once_when_library_missing(monkeypatch: pytest.MonkeyPatch,
                                                           infinity_log) -> None:
    """The warning (and its line in the log) says why, what runs instead and the fix."""
    def missing():
        raise infinity.base.native_library.NativeLibraryError("libinfinity_native.so is not built")

    monkeypatch.setattr(N, "lib", missing)
    monkeypatch.setattr(cpu_adam, "_fallback_warned", False)
    monkeypatch.delenv(cpu_adam.KERNEL_ENV, raising=False)
    p0 = torch.randn(100)
    p, g = p0.clone(), torch.randn(100)
    with pytest.warns(RuntimeWarning) as caught:
        adam_step_flat(p, g, torch.zeros(100), torch.zeros(100), step=1, **HP)
    (said,) = [str(w.message) for w in caught]
    for phrase in ("native library unavailable (libinfinity_native.so is not built)",
                   "using the pure-torch path (same numbers, several times slower)",
                   "Build the package to fix this."):
        assert phrase in said, (phrase, said)
    assert said in [rec.getMessage() for rec in infinity_log.records]
    assert not torch.equal(p, p0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adam_step_flat(p, g, torch.zeros(100), torch.zeros(100), step=2, **HP)
    assert infinity.native_info()["in_use"]["adam_kernel"] == "torch"
    with pytest.raises(infinity.base.native_library.NativeLibraryError):
        adam_step_flat(p, g, torch.zeros(100), torch.zeros(100), step=3, impl="scalar", **HP)


# ---- CPUAdam as a torch optimizer ----------------------------------------------------------------

def _model_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 33), (33,), (1,), (7, 5, 3), (1000,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _set_grads(params, k: int) -> None:
    g = torch.Generator().manual_seed(1000 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _run(opt, params, steps: int, start: int = 0, sched=None) -> None:
    for k in range(start, start + steps):
        _set_grads(params, k)
        opt.step()
        if sched is not None:
            sched.step()


def _assert_close(ours, ref, init) -> None:
    for a, b, c in zip(ours, ref, init):
        assert float((a.detach() - b.detach()).abs().max()) <= movement_tol(b.detach(), c) + 1e-12


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_param_groups_match_torch(adamw_mode: bool) -> None:
    init = [p.detach().clone() for p in _model_params()]
    ours, ref = _model_params(), _model_params()
    groups = lambda ps: [{"params": ps[:2], "lr": 2e-3, "weight_decay": 0.1},  # noqa: E731
                         {"params": ps[2:], "betas": (0.8, 0.99)}]
    opt = CPUAdam(groups(ours), lr=1e-3, weight_decay=0.01, adamw_mode=adamw_mode)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    topt = cls(groups(ref), lr=1e-3, weight_decay=0.01, foreach=False)
    _run(opt, ours, 100)
    _run(topt, ref, 100)
    _assert_close(ours, ref, init)


def test_state_dict_loads_into_torch_adamw_and_back() -> None:
    init = [p.detach().clone() for p in _model_params()]
    a, b = _model_params(), _model_params()
    torch_opt = torch.optim.AdamW(a, lr=1e-3, weight_decay=0.01, foreach=False)
    _run(torch_opt, a, 5)
    # torch -> ours
    for pa, pb in zip(a, b):
        pb.data.copy_(pa.data)
    ours = CPUAdam(b, lr=5.0, weight_decay=0.5)  # hyperparameters come from the state_dict
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert ours.param_groups[0]["lr"] == 1e-3 and ours.param_groups[0]["adamw_mode"] is True
    _run(torch_opt, a, 5, start=5)
    _run(ours, b, 5, start=5)
    _assert_close(b, a, init)
    sd = ours.state_dict()
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and torch.is_tensor(st["step"])
    assert float(st["step"]) == 10.0
    # ours -> torch
    c = _model_params()
    for pb, pc in zip(b, c):
        pc.data.copy_(pb.data)
    torch2 = torch.optim.AdamW(c, lr=1.0, foreach=False)
    torch2.load_state_dict(copy.deepcopy(sd))
    assert torch2.param_groups[0]["decoupled_weight_decay"] is True
    _run(ours, b, 5, start=10)
    _run(torch2, c, 5, start=10)
    _assert_close(b, c, init)


@pytest.mark.parametrize("as_number", [int, float])
def test_a_state_dict_with_a_plain_number_step_goes_on_where_it_stopped(as_number) -> None:
    """A state_dict whose ``step`` is a plain number (older torch, hand-made or JSON-loaded
    states) loads with its count: the bias correction goes on from step 5, not from 1. Against
    torch AdamW run 10 steps straight, within 1e-3 of the parameters' total movement (a restart
    at step 1 makes the 6th update ~1.9 times as large: far outside)."""
    init = [p.detach().clone() for p in _model_params()]
    first, ref = _model_params(), _model_params()
    before = CPUAdam(first, lr=1e-2, weight_decay=0.01)
    _run(before, first, 5)
    sd = copy.deepcopy(before.state_dict())
    for st in sd["state"].values():
        st["step"] = as_number(st["step"].item())
    assert all(type(st["step"]) is as_number and st["step"] == 5 for st in sd["state"].values())
    resumed = _model_params()
    for p_resumed, p_first in zip(resumed, first):
        p_resumed.data.copy_(p_first.data)
    after = CPUAdam(resumed, lr=1.0)      # the hyperparameters come from the state_dict
    after.load_state_dict(sd)
    _run(after, resumed, 5, start=5)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    _run(torch_opt, ref, 10)
    _assert_close(resumed, ref, init)
    assert all(float(st["step"]) == 10.0 for st in after.state_dict()["state"].values())


def test_adam_mode_state_dict_keeps_l2_in_torch() -> None:
    ps = _model_params()
    ours = CPUAdam(ps, weight_decay=0.1, adamw_mode=False)
    _run(ours, ps, 2)
    t = torch.optim.Adam(_model_params(), foreach=False)
    t.load_state_dict(ours.state_dict())
    assert t.param_groups[0]["decoupled_weight_decay"] is False
    assert t.param_groups[0]["weight_decay"] == 0.1


def test_lr_scheduler_and_tensor_lr() -> None:
    init = [p.detach().clone() for p in _model_params()]
    ours, ref = _model_params(), _model_params()
    opt = CPUAdam(ours, lr=torch.tensor(1e-2), weight_decay=0.01)
    topt = torch.optim.AdamW(ref, lr=torch.tensor(1e-2), weight_decay=0.01, foreach=False)
    s1 = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(topt, step_size=3, gamma=0.5)
    _run(opt, ours, 10, sched=s1)
    _run(topt, ref, 10, sched=s2)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.5 ** 3)
    _assert_close(ours, ref, init)
    sched = torch.optim.lr_scheduler.OneCycleLR(CPUAdam(_model_params(), lr=1e-3), max_lr=1e-2,
                                                total_steps=10)
    sched.optimizer.step()
    sched.step()


def test_sparse_grads_are_rejected() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with raises_naming(RuntimeError, "CPUAdam does not support sparse gradients",
                       "(got a torch.sparse_coo grad for a parameter of shape (10, 4))",
                       "use torch.optim.SparseAdam for embeddings with sparse=True",
                       starts=True, ends=True):
        CPUAdam(emb.parameters()).step()


def test_params_without_grad_non_contiguous_and_wrong_dtype() -> None:
    base = torch.randn(6, 4)
    p_t = torch.nn.Parameter(base.t())  # non-contiguous parameter
    p_none = torch.nn.Parameter(torch.randn(3))
    ref = torch.nn.Parameter(base.t().clone())
    opt = CPUAdam([p_t, p_none], lr=1e-2)
    topt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    for k in range(3):
        g = torch.randn(4, 6)
        p_t.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
    assert p_none not in opt.state
    assert not p_t.is_contiguous()
    assert float((p_t - ref).detach().abs().max()) <= 1e-6
    bad = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    bad.grad = torch.randn(3, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32 CPU parameters"):
        CPUAdam([bad]).step()


def test_closure_and_constructor_errors() -> None:
    ps = _model_params()
    opt = CPUAdam(ps)

    def closure():
        _set_grads(ps, 0)
        return 3.0

    assert opt.step(closure) == 3.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        CPUAdam(ps, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid betas"):
        CPUAdam(ps, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="impl must be one of"):
        CPUAdam(ps, impl="gpu")
    with pytest.raises(ValueError, match="amsgrad"):
        t = torch.optim.Adam(_model_params(), amsgrad=True)
        CPUAdam(ps).load_state_dict(t.state_dict())


def test_cpu_adam_is_exported() -> None:
    assert infinity.CPUAdam is CPUAdam
    import infinity.optim as optim

    assert optim.CPUAdam is CPUAdam and optim.adam_step_flat is adam_step_flat


# -- CPUAdam's defaults, boundary hyperparameters and adopted states -----------------------------

def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((8, 5), (5,))]


def _steps(opt, params, n: int, start: int = 0) -> None:
    for k in range(start, start + n):
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def _close(a, b, atol: float = 1e-6) -> None:
    for x, y in zip(a, b):
        assert torch.allclose(x.detach(), y.detach(), rtol=0, atol=atol)


def test_defaults_are_torch_adams() -> None:
    ours, ref = CPUAdam(_params()), torch.optim.Adam(_params())
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert ours.defaults[key] == ref.defaults[key], key


def test_a_zero_lr_is_allowed_and_moves_nothing() -> None:
    ps = _params()
    before = [p.detach().clone() for p in ps]
    opt = CPUAdam(ps, lr=0.0)
    _steps(opt, ps, 3)
    _close(ps, before, atol=0.0)


@pytest.mark.parametrize("betas", [(0.0, 0.999), (0.9, 0.0)], ids=["beta1", "beta2"])
def test_a_zero_beta_is_allowed_and_matches_torch(betas: tuple[float, float]) -> None:
    """beta1 = 0 (no momentum) and beta2 = 0 (the second moment is the last squared gradient)
    are in torch's [0, 1)."""
    ours, ref = _params(), _params()
    opt = CPUAdam(ours, lr=1e-2, betas=betas)
    topt = torch.optim.AdamW(ref, lr=1e-2, betas=betas, weight_decay=0.0, foreach=False)
    _steps(opt, ours, 4)
    _steps(topt, ref, 4)
    _close(ours, ref)


def test_an_lr_tensor_of_several_elements_is_refused_naming_lr() -> None:
    with pytest.raises(ValueError, match=r"lr must be a number or a 1-element tensor, got shape \(2,\)"):
        CPUAdam(_params(), lr=torch.tensor([1e-3, 2e-3]))


def test_a_torch_adam_state_loads_as_l2_mode_and_goes_on_like_torch() -> None:
    """torch.optim.Adam's state (decoupled_weight_decay False) into a CPUAdam built in AdamW mode:
    the state decides, and the steps after it match torch Adam's."""
    init = _params()
    a, b = _params(), _params()
    topt = torch.optim.Adam(a, lr=1e-2, weight_decay=0.1, foreach=False)
    _steps(topt, a, 3)
    for pa, pb in zip(a, b):
        pb.data.copy_(pa.data)
    ours = CPUAdam(b, lr=1.0)          # adamw_mode=True by default
    ours.load_state_dict(copy.deepcopy(topt.state_dict()))
    group = ours.param_groups[0]
    assert group["adamw_mode"] is False and group["decoupled_weight_decay"] is False
    _steps(topt, a, 3, start=3)
    _steps(ours, b, 3, start=3)
    _close(b, a)
    assert not torch.allclose(b[0], init[0])
    again = torch.optim.Adam(_params(), foreach=False)
    again.load_state_dict(ours.state_dict())
    assert again.param_groups[0]["decoupled_weight_decay"] is False


def test_an_older_state_without_decoupled_weight_decay_keeps_its_mode() -> None:
    """A CPUAdam state saved before groups carried decoupled_weight_decay: its adamw_mode holds,
    whatever the loading optimizer was built with."""
    ps = _params()
    old = CPUAdam(ps, adamw_mode=False, weight_decay=0.1)
    _steps(old, ps, 1)
    sd = copy.deepcopy(old.state_dict())
    for group in sd["param_groups"]:
        del group["decoupled_weight_decay"]
    new = CPUAdam(_params(), adamw_mode=True)
    new.load_state_dict(sd)
    assert new.param_groups[0]["adamw_mode"] is False
    assert new.param_groups[0]["decoupled_weight_decay"] is False


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_a_state_naming_no_mode_takes_the_loading_optimizers(adamw_mode: bool) -> None:
    """A torch Adam/AdamW state saved before groups carried decoupled_weight_decay (and never
    adamw_mode) says nothing of the mode: the loading CPUAdam keeps its own, and goes on as
    torch's optimizer of that mode would."""
    ours, ref = _params(), _params()
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    topt = cls(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    _steps(topt, ref, 2)
    sd = copy.deepcopy(topt.state_dict())
    for group in sd["param_groups"]:
        del group["decoupled_weight_decay"]
    for a, b in zip(ours, ref):
        a.data.copy_(b.data)
    opt = CPUAdam(ours, adamw_mode=adamw_mode)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["adamw_mode"] is adamw_mode
    _steps(opt, ours, 2, start=2)
    _steps(topt, ref, 2, start=2)
    _close(ours, ref)


def test_a_maximize_state_is_refused() -> None:
    t = torch.optim.Adam(_params(), maximize=True)
    with pytest.raises(ValueError, match="CPUAdam does not support maximize=True"):
        CPUAdam(_params()).load_state_dict(t.state_dict())


def test_a_minimal_state_gets_torchs_group_keys() -> None:
    """A hand-made state with only the hyperparameters CPUAdam steps with: the groups get the
    keys torch's Adam expects (amsgrad and maximize off, the weight-decay form), so the state
    loads into torch too."""
    ps = _params()
    opt = CPUAdam(ps)
    _steps(opt, ps, 1)
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        for key in ("amsgrad", "maximize", "decoupled_weight_decay", "bias_correction"):
            group.pop(key)
    fresh = CPUAdam(_params())
    fresh.load_state_dict(sd)
    group = fresh.param_groups[0]
    assert group["amsgrad"] is False and group["maximize"] is False
    assert group["bias_correction"] is True and group["decoupled_weight_decay"] is True
    t = torch.optim.AdamW(_params(), foreach=False)
    t.load_state_dict(fresh.state_dict())
    assert t.param_groups[0]["amsgrad"] is False and t.param_groups[0]["maximize"] is False


def test_parameters_after_one_without_a_gradient_are_still_stepped() -> None:
    frozen, ours, ref = (torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.ones(4)),
                         torch.nn.Parameter(torch.ones(4)))
    opt = CPUAdam([frozen, ours], lr=1e-2)
    topt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    for _ in range(2):
        ours.grad = torch.arange(4.0)
        ref.grad = torch.arange(4.0)
        opt.step()
        topt.step()
    assert frozen not in opt.state
    _close([ours], [ref])


def test_a_non_contiguous_gradient_of_a_contiguous_parameter_is_stepped() -> None:
    ours, ref = torch.nn.Parameter(torch.ones(4, 6)), torch.nn.Parameter(torch.ones(4, 6))
    opt = CPUAdam([ours], lr=1e-2)
    topt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    g = torch.randn(6, 4).t()
    assert not g.is_contiguous()
    ours.grad, ref.grad = g, g.clone()
    opt.step()
    topt.step()
    _close([ours], [ref])


def _rows(n: int = 2):
    ps = [torch.zeros(4) for _ in range(n)]
    return ps, [torch.ones(4) for _ in range(n)], [torch.zeros(4) for _ in range(n)], \
        [torch.zeros(4) for _ in range(n)]


ROW_HP = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def test_adam_step_tensors_length_errors_give_every_length() -> None:
    ps, gs, ms, vs = _rows()
    with pytest.raises(ValueError, match="must have equal lengths, got 2, 1, 2, 2"):
        adam_step_tensors(ps, gs[:1], ms, vs, **ROW_HP)
    with pytest.raises(ValueError, match="half_outs has 1 entries but params has 2"):
        adam_step_tensors(ps, gs, ms, vs, half_outs=[None], **ROW_HP)


@pytest.mark.parametrize("which,label", [(0, "params[1]"), (1, "grads[1]"), (2, "exp_avgs[1]"),
                                         (3, "exp_avg_sqs[1]"), (4, "half_outs[1]")])
def test_adam_step_tensors_errors_name_the_argument_and_index(which: int, label: str) -> None:
    cols = list(_rows())
    halves = [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)]
    if which < 4:
        cols[which][1] = torch.zeros(5)                       # a wrong size in row 1
        match = f"{label} has 5 elements"
    else:
        halves[1] = torch.zeros(4, dtype=torch.float64)       # a wrong half dtype in row 1
        match = f"{label} must be bfloat16 or float16"
    if which == 0:
        match = "grads\\[1\\] has 4 elements but params\\[1\\] has 5"
    else:
        match = match.replace("[", "\\[").replace("]", "\\]")
    with pytest.raises(ValueError, match=match):
        adam_step_tensors(*cols, half_outs=halves, **ROW_HP)


def test_constructor_bounds_and_messages() -> None:
    ps = _params()
    with pytest.raises(ValueError, match="Invalid betas"):
        CPUAdam(ps, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"Invalid epsilon value: -1e-08 \(must be >= 0\)"):
        CPUAdam(ps, eps=-1e-8)
    with pytest.raises(ValueError, match=r"Invalid weight_decay value: -0.1 \(must be >= 0\)"):
        CPUAdam(ps, weight_decay=-0.1)
    with pytest.raises(ValueError, match="threads must be >= 1 or None, got 0"):
        CPUAdam(ps, threads=0)
    CPUAdam(ps, eps=0.0, threads=1)           # the bounds themselves are allowed


def test_two_non_contiguous_parameters_in_one_group_are_both_stepped() -> None:
    base = [torch.randn(6, 4), torch.randn(5, 3)]
    ours = [torch.nn.Parameter(b.t()) for b in base]
    ref = [torch.nn.Parameter(b.t().clone()) for b in base]
    opt = CPUAdam(ours, lr=1e-2)
    topt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, foreach=False)
    for k in range(2):
        for p, r in zip(ours, ref):
            g = torch.randn(p.shape)
            p.grad, r.grad = g, g.clone()
        opt.step()
        topt.step()
    _close(ours, ref)


def test_impl_torch_never_calls_the_native_kernel(monkeypatch) -> None:
    from infinity.optim import _adam_native as N

    def no_native(*a, **kw):
        raise AssertionError("the native kernel ran for impl='torch'")

    monkeypatch.setattr(N, "step", no_native)
    monkeypatch.setattr(N, "step_norm", no_native)
    ours, ref = _params(), _params()
    opt = CPUAdam(ours, lr=1e-2, impl="torch")
    topt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, foreach=False)
    _steps(opt, ours, 2)
    _steps(topt, ref, 2)
    _close(ours, ref)


def test_an_adamw_mode_state_keeps_decoupled_decay_in_torch_adam() -> None:
    ps = _params()
    ours = CPUAdam(ps, weight_decay=0.1)       # AdamW mode
    _steps(ours, ps, 1)
    t = torch.optim.Adam(_params(), foreach=False)
    t.load_state_dict(ours.state_dict())
    assert t.param_groups[0]["decoupled_weight_decay"] is True


def test_group_lr_and_betas_errors_name_them() -> None:
    ps = _params()
    opt = CPUAdam(ps)
    _steps(opt, ps, 1)
    opt.param_groups[0]["lr"] = torch.tensor([1e-3, 1e-3])
    with pytest.raises(ValueError, match=r"lr must be a number or a 1-element tensor"):
        _steps(opt, ps, 1)
    opt.param_groups[0]["lr"] = 1e-3
    opt.param_groups[0]["betas"] = (torch.tensor([0.9, 0.9]), 0.999)
    with pytest.raises(ValueError, match=r"betas must be a number or a 1-element tensor"):
        _steps(opt, ps, 1)


# -- the flat kernel API (adam_step_flat): its lr, empty steps and impl choice ---------------------

_HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def _flat(n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g), torch.zeros(n),
            torch.zeros(n))


@pytest.mark.parametrize("lr", [-1e-3, -math.inf, math.inf])
def test_a_negative_or_infinite_lr_is_refused(lr) -> None:
    with pytest.raises(ValueError, match=f"lr must be a finite number >= 0, got {lr}"):
        adam_step_flat(*_flat(), step=1, **dict(_HP, lr=lr))


@pytest.mark.parametrize("value", ["auto", " Auto ", ""])
def test_the_kernel_variable_set_to_auto_is_the_default_choice(monkeypatch, value) -> None:
    monkeypatch.setenv(cpu_adam.KERNEL_ENV, value)
    adam_step_flat(*_flat(), step=1, **_HP)
    assert infinity.native_info()["in_use"]["adam_kernel"] == N.best_kernel()


def test_the_torch_path_is_reported_as_torch() -> None:
    adam_step_flat(*_flat(), step=1, impl="torch", **_HP)
    assert infinity.native_info()["in_use"]["adam_kernel"] == "torch"


def test_empty_tensors_take_no_part_in_a_call() -> None:
    """A zero-element parameter (an empty bias, say) is skipped, its grad's dtype included."""
    from infinity.optim.cpu_adam import adam_step_tensors
    p, g, m, v = _flat()
    ref = [t.clone() for t in (p, g, m, v)]
    empty = (torch.zeros(0), torch.zeros(0, dtype=torch.bfloat16), torch.zeros(0), torch.zeros(0))
    adam_step_tensors([p, empty[0]], [g, empty[1]], [m, empty[2]], [v, empty[3]], step=1, **_HP)
    adam_step_flat(*ref, step=1, **_HP)
    assert torch.equal(p, ref[0]) and torch.equal(m, ref[2]) and torch.equal(v, ref[3])
    assert adam_step_flat(*empty[:1], torch.zeros(0), *empty[2:], step=1, grad_sq_sum=True,
                          **_HP) == 0.0


def test_one_call_refuses_mixed_grad_or_half_out_dtypes() -> None:
    from infinity.optim.cpu_adam import adam_step_tensors
    a, b = _flat(seed=1), _flat(seed=2)
    with pytest.raises(ValueError) as info:
        adam_step_tensors([a[0], b[0]], [a[1], b[1].bfloat16()], [a[2], b[2]], [a[3], b[3]],
                          step=1, **_HP)
    assert str(info.value) == ("all grads of one call must share a dtype, got "
                               "['torch.bfloat16', 'torch.float32']")
    with pytest.raises(ValueError) as info:
        adam_step_tensors([a[0], b[0]], [a[1], b[1]], [a[2], b[2]], [a[3], b[3]], step=1,
                          half_outs=[None, torch.zeros(8, dtype=torch.float16)], **_HP)
    assert str(info.value) == ("all half_outs of one call must share a dtype (or all be None), "
                               "got ['None', 'torch.float16']")


def test_a_flat_step_of_nothing_returns_none_or_a_zero_sum() -> None:
    empty = (torch.zeros(0),) * 4
    assert adam_step_flat(*[t.clone() for t in empty], step=1, **_HP) is None
    assert adam_step_flat(*[t.clone() for t in empty], step=1, grad_sq_sum=True, **_HP) == 0.0


def test_argument_errors_name_the_argument_and_what_it_got() -> None:
    p, g, m, v = _flat()
    with pytest.raises(ValueError) as info:
        adam_step_flat(p, [0.0] * 8, m, v, step=1, **_HP)
    assert str(info.value) == "grad must be a torch.Tensor, got list"
    with pytest.raises(ValueError) as info:
        adam_step_flat(p, g, torch.zeros(8, device="meta"), v, step=1, **_HP)
    assert str(info.value) == "exp_avg is on meta but param on cpu: all must be on one device"
    with pytest.raises(ValueError) as info:
        adam_step_flat(p, g.to(torch.int32), m, v, step=1, **_HP)
    assert str(info.value) == "grad must be float32, bfloat16 or float16, got torch.int32"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_layouts_are_refused_csr_included() -> None:
    from infinity.optim.cpu_adam import adam_step_tensors
    p = torch.zeros(2, 4)
    for grad in (torch.eye(2, 4).to_sparse(), torch.eye(2, 4).to_sparse_csr()):
        with pytest.raises(ValueError) as info:
            adam_step_tensors([p], [grad], [torch.zeros(2, 4)], [torch.zeros(2, 4)], step=1,
                              **_HP)
        assert str(info.value) == (f"grads[0] must be a dense strided tensor, got layout "
                                   f"{grad.layout}")


def test_overlap_is_refused_for_one_element_and_adjacent_buffers_are_not() -> None:
    one = torch.zeros(1)
    with pytest.raises(ValueError, match="param and grad overlap in memory"):
        adam_step_flat(one, one, torch.zeros(1), torch.zeros(1), step=1, **_HP)
    buf = torch.zeros(32)
    adam_step_flat(buf[0:8], buf[8:16], buf[16:24], buf[24:32], step=1, **_HP)   # adjacent
    adam_step_flat(buf[24:32], buf[16:24], buf[8:16], buf[0:8], step=1, **_HP)   # reversed


def test_the_torch_path_returns_none_without_the_sum() -> None:
    assert adam_step_flat(*_flat(), step=1, impl="torch", **_HP) is None
    total = adam_step_flat(*_flat(), step=1, impl="torch", grad_sq_sum=True, **_HP)
    assert total == pytest.approx(float((_flat()[1].double() ** 2).sum()))


def test_cpu_adam_without_bias_correction_steps_without_it() -> None:
    p, g, m, v = _flat()
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    CPUAdam([param], lr=1e-2, bias_correction=False).step()
    ref_off, ref_on = p.clone(), p.clone()
    adam_step_flat(ref_off, g.clone(), m.clone(), v.clone(), step=1, bias_correction=False, **_HP)
    adam_step_flat(ref_on, g.clone(), m.clone(), v.clone(), step=1, **_HP)
    assert torch.equal(param.detach(), ref_off) and not torch.equal(ref_off, ref_on)
