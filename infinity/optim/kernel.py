"""The Adam kernel over a unit's flat ranges: the hyperparameters of each param group, the step
runs of a job (see [Note: parameters without a gradient] in optim/partitioned.py) and the CPU
Adam call on a sub-group. The step stream sees it through its ``StepKernel`` Protocol
(optim/step_kernel.py); the optimizer and the speculation own the same object.

[Note: the step gives the home back at zero]
A gradient accumulated in its resident host home (the deferred schedule, and the last
micro-batch stepping early from it: optim/boundary_steps.py) must be at zero before the next
cycle's first add. Zeroed after the step, that was a pass of its own over 4 bytes a parameter,
by then out of cache: a read for ownership and a write-back. On the fourth H200 pass each
layer's (50M elements) took ~6 ms of the step stream, beside ~13.5 ms of Adam, in the tail
where the GPU waited for the last units' steps (docs/gpu.md). The native kernel zeroes each
64K-element chunk of the gradient right after its update instead (``inf_adam_step_zero``),
while the chunk is in cache: a store to lines just read. The rest of the range (the gaps
between parameters, a parameter not stepped this cycle) is zeroed beside it; a step that fails
midway leaves its ranges not stepped to the gradient's ``give_back``
(``CompleteGradient.zeroed``). The bits of the step are the same with and without it (tested
per kernel)."""
from __future__ import annotations

from typing import Callable

import torch

from infinity.optim.cpu_adam import adam_step_flat, check_hyperparameters
from infinity.optim.formatted_step import MomentScales, step_formatted
from infinity.optim.records import (StepRun, UnitOptimState, add_addends, clipped_addends,
                                    run_pieces)


class AdamKernel:
    """Adam/AdamW on flat fp32 ranges, per the param groups ``param_groups()`` returns now."""

    def __init__(self, param_groups: Callable[[], list[dict]], adamw_mode: bool,
                 threads: int | None) -> None:
        self._param_groups = param_groups
        self.adamw_mode = adamw_mode
        self.threads = threads

    def hyper(self, group_index: int) -> dict:
        """One param group's Adam hyperparameters now."""
        g = self._param_groups()[group_index]
        return {"lr": float(g["lr"]), "beta1": g["betas"][0], "beta2": g["betas"][1],
                "eps": g["eps"], "weight_decay": g["weight_decay"],
                "bias_correction": g.get("bias_correction", True),
                "adamw_mode": g.get("adamw_mode", self.adamw_mode)}

    def hyperparameters(self) -> list[dict]:
        """Each param group's Adam hyperparameters now, for a step that runs later (a deferred
        step runs after the scheduler has moved the learning rate on)."""
        return [self.hyper(i) for i in range(len(self._param_groups()))]

    def checked_hyperparameters(self) -> list[dict]:
        """``hyperparameters()``, each group's values checked as the kernel checks them at a
        step: a value it refuses (beta1 >= 1 from OneCycle's momentum decay, a NaN lr a
        schedule or the user's code wrote into the groups) is refused before any unit steps
        with it -- refused by the kernel in the middle of a step, some units were stepped and
        the engine was unusable after it, not even able to save."""
        hyper = self.hyperparameters()
        for index, h in enumerate(hyper):
            try:
                check_hyperparameters(h)
            except ValueError as exc:
                raise ValueError(f"param group {index}: {exc}, for the next optimizer step "
                                 "(set by the schedule, or written into "
                                 "optimizer.param_groups); nothing was stepped with it: "
                                 "correct it and call again") from None
        return hyper

    def step_runs(self, state: UnitOptimState, stepped: frozenset[int] | None) -> list[StepRun]:
        """Count one step for the parameters in ``stepped`` (entry offsets; None: all) and
        return the runs the kernel steps: contiguous ranges of one param group whose
        parameters all take the same step (see [Note: parameters without a gradient]). With
        every parameter stepped every time there is one run per param group."""
        state.step += 1
        runs: list[StepRun | None] = []
        entries = sorted(state.unit.trainable_entries(), key=lambda e: e.offset)
        for entry in entries:
            if stepped is not None and entry.offset not in stepped:
                runs.append(None)             # a break: this parameter is not stepped
                continue
            count = state.param_steps.get(entry.offset, 0) + 1
            state.param_steps[entry.offset] = count
            last = runs[-1] if runs else None
            if last is not None and (last.group_index, last.step) == (entry.group_index, count):
                runs[-1] = StepRun(last.group_index, last.start, entry.offset + entry.numel, count)
            else:
                runs.append(StepRun(entry.group_index, entry.offset, entry.offset + entry.numel,
                                    count))
        return [r for r in runs if r is not None]

    def uncount_step(self, state: UnitOptimState, stepped: frozenset[int] | None) -> None:
        """Undo ``step_runs``' counting (a speculated step rolled back)."""
        state.step -= 1
        for entry in state.unit.trainable_entries():
            if stepped is None or entry.offset in stepped:
                state.param_steps[entry.offset] -= 1

    def run(self, state: UnitOptimState, start: int, end: int, param: torch.Tensor,
            grad: torch.Tensor | dict[int, torch.Tensor], m: torch.Tensor, v: torch.Tensor,
            grad_scale: float, half_out: torch.Tensor | None, hyper: list[dict],
            runs: list[StepRun], grad_sq_sum: bool = False,
            scales: MomentScales | None = None, zero_grad: bool = False,
            addends: list[tuple[int, torch.Tensor]] | None = None) -> float:
        """Run Adam on elements [start, end) of the unit; tensors are indexed from ``start``;
        ``hyper`` per param group (``hyperparameters()`` when the step was asked for), ``runs``
        from ``step_runs``; m and v (and a bf16 master) in the state's format, ``scales`` the
        int8 scales of the range's blocks. Returns the stepped gradient's sum of squares (as
        given) when ``grad_sq_sum``, else 0. ``zero_grad``: ``grad`` (one flat tensor, a
        gradient home the next backward accumulates into again) is left at zero over [start,
        end): the native kernel zeroes what it steps chunk by chunk, in cache, and the rest (the
        gaps between parameters, a parameter not stepped) is zeroed here; no pass of its own
        over the whole range (see [Note: the step gives the home back at zero]).
        ``addends``: parts of the gradient still apart from it, (unit element, values), in the
        order they add (the last micro-batch's, copied off the device: [Note: the last adds
        fold into the step] in optim/boundary_steps.py); folded into the kernel chunk by chunk,
        the bits of the adds made first; only with ``zero_grad``."""
        if zero_grad and not isinstance(grad, torch.Tensor):
            raise TypeError(f"{state.unit.name}: zero_grad needs one flat gradient tensor, got "
                            f"held parts {sorted(grad)[:4]}")
        addends = [(at, v) for at, v in addends or () if at < end and at + v.numel() > start]
        if addends and not zero_grad:
            raise ValueError(f"{state.unit.name}: addends fold into a gradient the step leaves "
                             "at zero (zero_grad)")
        if not state.fmt.is_default:
            if addends:               # made first, then the formats' step
                add_addends(grad, start, addends)
            total = step_formatted(state, start, end, param, grad, m, v, scales, grad_scale,
                                   half_out, hyper, runs, self.threads, grad_sq_sum)
            if zero_grad:
                grad.zero_()
            return total
        total = 0.0
        zeroed = start          # [start, zeroed) is at zero (zero_grad)
        for run, x, y, g in run_pieces(state.unit, runs, grad, start, end):
            s = slice(x - start, y - start)
            if zero_grad and x > zeroed:     # no run steps it: an addend there is dropped too
                grad[zeroed - start:x - start].zero_()
            total += adam_step_flat(
                param[s], g, m[s], v[s], step=run.step, grad_scale=grad_scale,
                half_out=None if half_out is None else half_out[s], threads=self.threads,
                grad_sq_sum=grad_sq_sum, zero_grad=zero_grad,
                addends=clipped_addends(addends, x, y), **hyper[run.group_index]) or 0.0
            zeroed = max(zeroed, y)
        if zero_grad and zeroed < end:
            grad[zeroed - start:end - start].zero_()
        return total

