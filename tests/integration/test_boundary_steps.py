"""The last micro-batch of an accumulating step steps each unit as its backward completes
(optim/boundary_steps.py): with early_step "auto" or "on", gradient accumulation, no clipping
and an offloaded optimizer, the deferred schedule steps the units whose gradients are in
host memory during the last micro-batch's backward. Training equals torch AdamW over the
accumulated gradient (fp32, within 1e-5: the same sums in the same order, only when the step
runs differs); a unit that the last micro-batch does not use is stepped at ``step()`` as
before; what cannot be undone is refused; early_step "off" keeps every step deferred."""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.optim.boundary_steps import BoundarySteps
from parity import VOCAB, make_model, run_parity, zero_config
from test_step_overlap import AlternatingHeadModel


def _count_started(monkeypatch) -> dict[str, int]:
    """Count the units the last micro-batches stepped (every engine of the test)."""
    count = {"jobs": 0}
    started = BoundarySteps.started

    def counting(self, job) -> None:
        count["jobs"] += 1
        started(self, job)
    monkeypatch.setattr(BoundarySteps, "started", counting)
    return count


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("param, accumulation", [("cpu", 2), ("none", 3)])
def test_the_last_micro_batch_steps_every_unit_as_torch(disk_dir, monkeypatch, family, param,
                                                       accumulation) -> None:
    count = _count_started(monkeypatch)
    ds = zero_config(3, param, "cpu", str(disk_dir))
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    result = run_parity(make_model(family, layers=2, width=32), ds, steps=4,
                        accumulation=accumulation, close=False)
    try:
        engine = result.engine
        assert engine.optimizer.boundary.enabled and not engine.optimizer.early_step
        assert count["jobs"] == 4 * len(engine.optimizer.states)    # every unit, every step
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    finally:
        result.engine.close()


def _heads_engine(disk_dir, **infinity_section):
    torch.manual_seed(0)
    model = AlternatingHeadModel(width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01,
                                foreach=False)
    ds = zero_config(3, "cpu", "cpu", str(disk_dir), **infinity_section)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["gradient_accumulation_steps"] = 2
    engine, *_ = infinity.initialize(model=model, config=ds)
    return model, reference, ref_opt, engine


def test_a_unit_the_last_micro_batch_does_not_use_is_stepped_at_step(disk_dir,
                                                                      monkeypatch) -> None:
    """Each micro-batch ends in the other head: the head of the first micro-batch has its whole
    gradient at home before the last backward, which does not reach it, so ``step()`` steps it
    (the deferred way); the other units are stepped in the last backward. Both equal torch."""
    count = _count_started(monkeypatch)
    model, reference, ref_opt, engine = _heads_engine(disk_dir)
    try:
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            for _ in range(2):
                x = torch.randint(0, VOCAB, (2, 8), generator=gen)
                loss = engine(input_ids=x, labels=x)
                engine.backward(loss)
                engine.step()
                ref_loss = reference(input_ids=x, labels=x)
                (ref_loss / 2).backward()
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        engine.flush()
        for name, param in reference.named_parameters():
            mine = dict(model.named_parameters())[name]
            with infinity.zero.GatheredParameters([mine]):
                torch.testing.assert_close(mine, param, rtol=1e-5, atol=1e-5)
        units = len(engine.optimizer.states)
        assert count["jobs"] == 3 * (units - 1)      # all but the first micro-batch's head
    finally:
        engine.close()


def _a_cycle_and_a_micro_step(engine) -> None:
    """One whole cycle (two micro-batches, the optimizer stepped at the second), then the first
    micro-batch of the next, each followed by ``engine.step()`` (which counts micro-steps)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2, 8), generator=gen)
        engine.backward(engine(input_ids=x, labels=x))
        engine.step()


@pytest.mark.parametrize("call", ["engine.backward", "loss.backward", "zero_grad"])
def test_what_would_undo_a_step_of_the_last_backward_is_refused(disk_dir, call) -> None:
    """After the last micro-batch's backward stepped its units, another backward (it would
    step them again) or zero_grad (their gradients are already applied) is refused with what
    to do; step() then goes on as usual."""
    _, _, _, engine = _heads_engine(disk_dir)
    try:
        _a_cycle_and_a_micro_step(engine)          # micro-step 1 of the second cycle
        x = torch.randint(0, VOCAB, (2, 8))
        engine.backward(engine(input_ids=x, labels=x))   # the boundary: units stepped
        assert engine.optimizer.boundary.pending
        with pytest.raises(RuntimeError, match="step them again|cannot be discarded"):
            if call == "zero_grad":
                engine.zero_grad()
            else:
                loss = engine(input_ids=x, labels=x)
                engine.backward(loss) if call == "engine.backward" else loss.backward()
        engine.step()
        assert not engine.optimizer.boundary.pending
        engine.backward(engine(input_ids=x, labels=x))   # the next cycle
        engine.zero_grad()
    finally:
        engine.close()


def test_early_step_off_keeps_every_step_until_step(disk_dir, monkeypatch) -> None:
    count = _count_started(monkeypatch)
    _, _, _, engine = _heads_engine(disk_dir, early_step="off")
    try:
        assert not engine.optimizer.boundary.enabled
        _a_cycle_and_a_micro_step(engine)
        assert count["jobs"] == 0
    finally:
        engine.close()
