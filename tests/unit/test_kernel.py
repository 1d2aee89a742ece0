"""The Adam kernel of the partitioned optimizer (optim/kernel.py) at unit level, on a real Unit
(the engine's tests of it: tests/integration/test_step_faults.py): the hyperparameters it reads from
the param groups, the step runs it counts (with parameters that got no gradient), the roll-back
of that count, and the kernel calls over a range, flat or from held parts."""
from __future__ import annotations

import torch
from torch import nn

from infinity.optim.cpu_adam import adam_step_flat
from infinity.optim import kernel as kernel_module
from infinity.optim.kernel import AdamKernel
from infinity.optim.records import StepRun, UnitOptimState
from infinity.zero.unit import Unit

GROUPS = [{"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01},
          {"lr": 0.02, "betas": (0.7, 0.95), "eps": 1e-5, "weight_decay": 0.0,
           "bias_correction": False, "adamw_mode": False}]


def _unit() -> Unit:
    """a, b in group 0 (offsets 0, 16), c in group 1 (32), d frozen (1024)."""
    named = [("a", nn.Parameter(torch.zeros(10)), 0), ("b", nn.Parameter(torch.zeros(6)), 0),
             ("c", nn.Parameter(torch.zeros(5)), 1), ("d", nn.Parameter(torch.zeros(4)), -1)]
    return Unit(0, "u", nn.Module(), named, torch.float32, torch.device("cpu"))


def _state() -> UnitOptimState:
    return UnitOptimState(_unit(), None, None, None, None)


def _kernel(groups=None, adamw_mode: bool = True) -> AdamKernel:
    groups = GROUPS if groups is None else groups
    return AdamKernel(lambda: groups, adamw_mode=adamw_mode, threads=1)


def test_hyper_reads_each_group_with_its_defaults() -> None:
    """Every Adam setting of a group, by the kernel's names; a group without
    bias_correction/adamw_mode takes True and the optimizer's mode."""
    kernel = _kernel(adamw_mode=False)
    assert kernel.hyper(0) == {"lr": 0.1, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6,
                               "weight_decay": 0.01, "bias_correction": True,
                               "adamw_mode": False}
    assert kernel.hyper(1) == {"lr": 0.02, "beta1": 0.7, "beta2": 0.95, "eps": 1e-5,
                               "weight_decay": 0.0, "bias_correction": False,
                               "adamw_mode": False}
    assert _kernel(adamw_mode=True).hyper(0)["adamw_mode"] is True
    assert _kernel(adamw_mode=True).hyper(1)["adamw_mode"] is False   # the group's own mode
    lr = _kernel([dict(GROUPS[0], lr=torch.tensor(0.5))]).hyper(0)["lr"]
    assert type(lr) is float and lr == 0.5       # a tensor lr (a scheduler's) as a float


def test_hyperparameters_are_every_group_now() -> None:
    """One dict per group, read when asked (a deferred step keeps the lr of its request)."""
    groups = [dict(g) for g in GROUPS]
    kernel = AdamKernel(lambda: groups, adamw_mode=True, threads=None)
    first = kernel.hyperparameters()
    groups[0]["lr"] = 0.3
    assert [h["lr"] for h in first] == [0.1, 0.02]
    assert [h["lr"] for h in kernel.hyperparameters()] == [0.3, 0.02]
    assert kernel.hyperparameters() == [kernel.hyper(0), kernel.hyper(1)]
    assert kernel.threads is None and kernel.adamw_mode is True


def test_step_runs_join_parameters_of_one_group_and_step() -> None:
    """Every parameter stepped: one run per group, from the group's first parameter to the
    end of its last (the alignment gap inside), the frozen one left out; counts go up by 1."""
    kernel, state = _kernel(), _state()
    assert kernel.step_runs(state, None) == [StepRun(0, 0, 22, 1), StepRun(1, 32, 37, 1)]
    assert state.step == 1 and state.param_steps == {0: 1, 16: 1, 32: 1}
    assert kernel.step_runs(state, None) == [StepRun(0, 0, 22, 2), StepRun(1, 32, 37, 2)]
    assert state.step == 2 and state.param_steps == {0: 2, 16: 2, 32: 2}


def test_a_parameter_without_a_gradient_breaks_the_run_and_keeps_its_count() -> None:
    """[Note: parameters without a gradient]: a parameter not stepped is not in any run and
    its count stays; the next time, a parameter behind by one step is a run of its own."""
    kernel, state = _kernel(), _state()
    assert kernel.step_runs(state, frozenset({0, 32})) == [StepRun(0, 0, 10, 1),
                                                             StepRun(1, 32, 37, 1)]
    assert state.param_steps == {0: 1, 32: 1} and state.step == 1
    assert kernel.step_runs(state, None) == [StepRun(0, 0, 10, 2), StepRun(0, 16, 22, 1),
                                             StepRun(1, 32, 37, 2)]
    assert state.param_steps == {0: 2, 16: 1, 32: 2}
    # a gap between two stepped parameters of one group and step splits them too
    state = _state()
    state.param_steps = {0: 4, 16: 4}
    assert kernel.step_runs(state, frozenset({16})) == [StepRun(0, 16, 22, 5)]
    assert kernel.step_runs(state, frozenset()) == []
    assert state.step == 2 and state.param_steps == {0: 4, 16: 5}


def test_runs_of_the_same_step_in_two_groups_stay_apart() -> None:
    """Runs join only within one group: two groups at the same step count are two runs."""
    kernel, state = _kernel(), _state()
    state.param_steps = {0: 1, 16: 2, 32: 2}
    assert kernel.step_runs(state, None) == [StepRun(0, 0, 10, 2), StepRun(0, 16, 22, 3),
                                             StepRun(1, 32, 37, 3)]


def test_uncount_step_gives_back_what_step_runs_counted() -> None:
    """A speculated step rolled back: the unit's count and exactly the stepped parameters'."""
    kernel, state = _kernel(), _state()
    kernel.step_runs(state, None)
    kernel.step_runs(state, frozenset({16}))
    assert state.step == 2 and state.param_steps == {0: 1, 16: 2, 32: 1}
    kernel.uncount_step(state, frozenset({16}))
    assert state.step == 1 and state.param_steps == {0: 1, 16: 1, 32: 1}
    kernel.uncount_step(state, None)
    assert state.step == 0 and state.param_steps == {0: 0, 16: 0, 32: 0}


def _tensors(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.1
    return param, grad, m, v


def _expected(param, grad, m, v, pieces, hyper, grad_scale, half_out=None):
    """Each (x, y, step, group) piece stepped alone with adam_step_flat (tensors from 0)."""
    param, m, v = param.clone(), m.clone(), v.clone()
    half = None if half_out is None else half_out.clone()
    total = 0.0
    for x, y, step, group, g in pieces:
        total += adam_step_flat(param[x:y], grad[x:y] if g is None else g, m[x:y], v[x:y],
                                step=step, grad_scale=grad_scale,
                                half_out=None if half is None else half[x:y], threads=1,
                                grad_sq_sum=True, **hyper[group])
    return param, m, v, half, total


def test_run_steps_each_run_inside_the_range_with_its_group_and_step() -> None:
    """A sub-group [8, 40) of the unit, tensors indexed from 8: each run clipped to it, with its
    own group's settings and step count, the gradient unscaled, the half copy written, and the
    gradient's sum of squares returned only when asked."""
    kernel, state = _kernel(), _state()
    hyper = kernel.hyperparameters()
    runs = [StepRun(0, 0, 10, 3), StepRun(0, 16, 22, 1), StepRun(1, 32, 37, 2),
            StepRun(1, 45, 50, 1)]                   # the last lies past the range: skipped
    start, end = 8, 40
    param, grad, m, v = _tensors(end - start, 1)
    half = torch.zeros(end - start, dtype=torch.bfloat16)
    want = _expected(param, grad, m, v, [(0, 2, 3, 0, None), (8, 14, 1, 0, None),
                                         (24, 29, 2, 1, None)], hyper, 4.0, half)
    got = [t.clone() for t in (param, m, v, half)]
    total = kernel.run(state, start, end, got[0], grad, got[1], got[2], 4.0, got[3], hyper,
                       runs, grad_sq_sum=True)
    for a, b in zip(got, want[:4]):
        assert torch.equal(a, b)
    assert total == want[4] and total > 0
    assert torch.equal(got[0][2:8], param[2:8])      # the gap between runs is not stepped
    # without grad_sq_sum the same step returns 0
    again = [t.clone() for t in (param, m, v)]
    assert kernel.run(state, start, end, again[0], grad, again[1], again[2], 4.0, None, hyper,
                      runs) == 0.0
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])


def test_run_that_zeroes_the_gradient_leaves_the_whole_range_at_zero_and_steps_the_same() -> None:
    """``zero_grad`` (a gradient home the next backward adds into; [Note: the step gives the
    home back at zero]): the same step, and every element of the range at zero afterwards,
    the runs' (zeroed by the kernel as it goes) and the rest: the gap between parameters, a
    parameter not stepped, the range's ends outside every run."""
    kernel, state = _kernel(), _state()
    hyper = kernel.hyperparameters()
    runs = [StepRun(0, 0, 10, 3), StepRun(1, 32, 37, 2)]     # b (16..22) not stepped
    start, end = 8, 40
    param, grad, m, v = _tensors(end - start, 5)
    want = [t.clone() for t in (param, m, v)]
    want_sq = kernel.run(state, start, end, want[0], grad, want[1], want[2], 2.0, None, hyper,
                         runs, grad_sq_sum=True)
    got, home = [t.clone() for t in (param, m, v)], grad.clone()
    sq = kernel.run(state, start, end, got[0], home, got[1], got[2], 2.0, None, hyper, runs,
                    grad_sq_sum=True, zero_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and sq == want_sq
    assert not bool(home.any()), home
    held = {0: torch.ones(10)}
    try:
        kernel.run(state, 0, 10, param[:10], held, m[:10], v[:10], 1.0, None, hyper,
                   [StepRun(0, 0, 10, 1)], zero_grad=True)
    except TypeError as exc:
        assert "one flat gradient tensor" in str(exc)
    else:
        raise AssertionError("held parts cannot be zeroed in place: refused")


def test_run_skips_runs_before_the_range_and_steps_those_after() -> None:
    """A sub-group [30, 40) past the first run's end (and one ending exactly at its start):
    those runs are skipped and the runs inside are still stepped."""
    kernel, state = _kernel(), _state()
    hyper = kernel.hyperparameters()
    runs = [StepRun(0, 0, 22, 1), StepRun(0, 22, 30, 1), StepRun(1, 32, 37, 2)]
    param, grad, m, v = _tensors(10, 4)
    want = _expected(param, grad, m, v, [(2, 7, 2, 1, None)], hyper, 1.0)
    got = [t.clone() for t in (param, m, v)]
    total = kernel.run(state, 30, 40, got[0], grad, got[1], got[2], 1.0, None, hyper, runs,
                       grad_sq_sum=True)
    for a, b in zip(got, want[:3]):
        assert torch.equal(a, b)
    assert total == want[4] and total > 0


def test_run_passes_the_kernel_its_threads_and_settings(monkeypatch) -> None:
    """Each kernel call gets the kernel's thread count (the engine's setting), the run's step
    and its group's settings, and the unscale factor, as given."""
    calls = []

    def recording(*args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "half_out"})
        return adam_step_flat(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "adam_step_flat", recording)
    kernel = AdamKernel(lambda: GROUPS, adamw_mode=True, threads=3)
    hyper = kernel.hyperparameters()
    param, grad, m, v = _tensors(40, 3)
    kernel.run(_state(), 0, 40, param, grad, m, v, 2.0, None, hyper,
               [StepRun(0, 0, 10, 4), StepRun(1, 32, 37, 1)])
    assert calls == [dict(step=4, grad_scale=2.0, threads=3, grad_sq_sum=False, zero_grad=False,
                          addends=[], **hyper[0]),
                     dict(step=1, grad_scale=2.0, threads=3, grad_sq_sum=False, zero_grad=False,
                          addends=[], **hyper[1])]


def test_run_from_held_parts_steps_each_parameter_from_its_own_part() -> None:
    """Held gradients (a dict by entry offset): each parameter's piece of the range from its
    part, a parameter without a part with zeros; the sum is over the parts stepped."""
    kernel, state = _kernel(), _state()
    hyper = kernel.hyperparameters()
    runs = [StepRun(0, 0, 22, 1), StepRun(1, 32, 37, 1)]
    start, end = 4, 37
    param, _, m, v = _tensors(end - start, 2)
    parts = {0: torch.randn(10), 32: torch.randn(5)}          # b (16) got no part
    want = _expected(param, None, m, v, [
        (0, 6, 1, 0, parts[0][4:10]), (12, 18, 1, 0, torch.zeros(6)),
        (28, 33, 1, 1, parts[32])], hyper, 1.0)
    got = [t.clone() for t in (param, m, v)]
    total = kernel.run(state, start, end, got[0], parts, got[1], got[2], 1.0, None, hyper,
                       runs, grad_sq_sum=True)
    for a, b in zip(got, want[:3]):
        assert torch.equal(a, b)
    assert total == want[4]
