"""CPUAdam: behaviours that mutation testing (tools/mutation.py, issue 23) found unchecked by
test_cpu_adam.py -- torch's defaults and boundary hyperparameters, the lr argument's errors, and
how states from torch Adam (L2), older states and hand-made ones are adopted."""
from __future__ import annotations

import copy

import pytest
import torch

from infinity.optim.cpu_adam import CPUAdam


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


def test_beta1_zero_is_allowed_and_matches_torch() -> None:
    ours, ref = _params(), _params()
    opt = CPUAdam(ours, lr=1e-2, betas=(0.0, 0.999))
    topt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.0, 0.999), weight_decay=0.0, foreach=False)
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


HP = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def test_adam_step_tensors_length_errors_give_every_length() -> None:
    from infinity.optim.cpu_adam import adam_step_tensors

    ps, gs, ms, vs = _rows()
    with pytest.raises(ValueError, match="must have equal lengths, got 2, 1, 2, 2"):
        adam_step_tensors(ps, gs[:1], ms, vs, **HP)
    with pytest.raises(ValueError, match="half_outs has 1 entries but params has 2"):
        adam_step_tensors(ps, gs, ms, vs, half_outs=[None], **HP)


@pytest.mark.parametrize("which,label", [(0, "params[1]"), (1, "grads[1]"), (2, "exp_avgs[1]"),
                                         (3, "exp_avg_sqs[1]"), (4, "half_outs[1]")])
def test_adam_step_tensors_errors_name_the_argument_and_index(which: int, label: str) -> None:
    from infinity.optim.cpu_adam import adam_step_tensors

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
        adam_step_tensors(*cols, half_outs=halves, **HP)


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


# -- the flat kernel API (adam_step_flat): the rest of cpu_adam.py's mutants ----------------------

import math

import infinity
from infinity.optim import _adam_native as N
from infinity.optim import cpu_adam
from infinity.optim.cpu_adam import adam_step_flat

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
    assert str(info.value) == "exp_avg must be a CPU tensor, got device meta"
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
