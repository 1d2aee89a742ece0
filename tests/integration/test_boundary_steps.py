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
from parity import (VOCAB, accumulating_micro_steps, assert_same_parameters, make_model,
                    run_parity, zero_config)
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
            accumulating_micro_steps(engine, reference, [
                torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(2)])
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        engine.flush()
        assert_same_parameters(model, reference)
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
        # what to do: step() after every backward (the DeepSpeed loop), not a schedule flag,
        # which would keep two backwards a micro-batch (each update twice the batches)
        said = "step them again.*Call engine.step\\(\\) after every backward" \
            if call != "zero_grad" else "cannot be discarded"
        with pytest.raises(RuntimeError, match=said):
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


def test_a_refused_direct_backward_keeps_the_gradients_for_step(disk_dir) -> None:
    """``loss.backward()`` after the last micro-batch's backward is refused before any of its
    gradients is taken; the unit that backward did not reach (the first micro-batch's head)
    still has its gradient at home, and ``step()`` steps it: the run equals torch's."""
    model, reference, ref_opt, engine = _heads_engine(disk_dir)
    try:
        gen = torch.Generator().manual_seed(5)
        for micro in range(2):
            x = torch.randint(0, VOCAB, (2, 8), generator=gen)
            engine.backward(engine(input_ids=x, labels=x))
            (reference(input_ids=x, labels=x) / 2).backward()
            if micro == 1:
                with pytest.raises(RuntimeError, match="step them again"):
                    engine(input_ids=x, labels=x).backward()
            engine.step()
        ref_opt.step()
        engine.flush()
        assert_same_parameters(model, reference, atol=1e-6)
    finally:
        engine.close()


def test_another_engines_backward_into_the_last_micro_batch_is_refused(disk_dir) -> None:
    """A GAN's generator loss goes through the discriminator where the discriminator's next
    backward is its last micro-batch: that backward would step the discriminator, so it is
    refused, nothing stepped and nothing dropped; the discriminator's zero_grad still works."""
    from test_engine_guards import Net

    def cfg(accumulation: int) -> dict:
        return {"train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": accumulation,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                      "offload_optimizer": {"device": "cpu"}},
                "infinity": {"compute_dtype": "fp32"}}
    torch.manual_seed(0)
    gen, *_ = infinity.initialize(model=Net(4, 8), config=cfg(1))
    disc, *_ = infinity.initialize(model=Net(8, 1), config=cfg(2))
    try:
        data = torch.Generator().manual_seed(1)
        z, real = torch.randn(8, 4, generator=data), torch.randn(8, 8, generator=data)
        disc.backward(disc(real).mean() - disc(gen(z).detach()).mean())   # 1 of 2
        disc.step()
        params = list(disc.module.parameters())
        with infinity.zero.GatheredParameters(params):
            before = [p.detach().clone() for p in params]
        with pytest.raises(RuntimeError, match="another engine.*nothing was stepped"):
            gen.backward(disc(gen(z)).mean())
        with infinity.zero.GatheredParameters(params):
            assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert not disc.optimizer.boundary.pending
        disc.zero_grad()
    finally:
        gen.close()
        disc.close()


class _SharedBlock(torch.nn.Module):
    """One block applied twice, each under reentrant checkpointing (ALBERT's sharing)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.block = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
        self.other = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, VOCAB)

    def _apply_block(self, h):
        return h + torch.tanh(self.block(h))

    def forward(self, input_ids, labels):
        from torch.utils.checkpoint import checkpoint
        h = self.embed(input_ids)
        h = self.other(checkpoint(self._apply_block, h, use_reentrant=True))
        h = checkpoint(self._apply_block, h, use_reentrant=True)
        logits = self.head(h).reshape(-1, VOCAB)
        return torch.nn.functional.cross_entropy(logits, labels.reshape(-1))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_gradient_after_the_units_step_started_is_refused_not_lost(disk_dir,
                                                                     accumulation) -> None:
    """Reentrant checkpointing of a block applied twice: the block's hooks fire at the first
    inner backward, so the unit looks complete and its step starts (the early step, or the last
    micro-batch's); the second use's gradient would be missing from it. That gradient is
    refused, naming the unit and what to do."""
    torch.manual_seed(0)
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["gradient_accumulation_steps"] = accumulation
    engine, *_ = infinity.initialize(model=_SharedBlock(), config=ds)
    try:
        assert engine.optimizer.early_step == (accumulation == 1)
        _train_into_the_refusal(engine, accumulation, "block: a gradient arrived after "
                                                      ".*use_reentrant")
    finally:
        engine.close()


def _train_into_the_refusal(engine, accumulation: int, refusal: str) -> None:
    """One optimizer step of ``accumulation`` micro-batches, which must raise ``refusal``."""
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match=refusal):
        for _ in range(accumulation):
            x = torch.randint(0, VOCAB, (2, 8), generator=gen)
            engine.backward(engine(input_ids=x, labels=x))
            engine.step()


@pytest.mark.parametrize("clip, accumulation", [(0.5, 1), (0.0, 2)])
def test_a_late_gradient_is_refused_under_the_speculative_step_too(disk_dir, clip,
                                                                   accumulation) -> None:
    """Stage 3 on NVMe with clipping or accumulation steps each unit speculatively as its
    gradients complete: the second use's gradient was left out of the step kept or redone
    (weights 0.06-0.08 from torch, silently). Refused as under the early step, and the message
    names both settings that avoid it."""
    torch.manual_seed(0)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["gradient_accumulation_steps"] = accumulation
    ds["gradient_clipping"] = clip
    engine, *_ = infinity.initialize(model=_SharedBlock(), config=ds)
    try:
        assert engine.speculative
        _train_into_the_refusal(engine, accumulation, r"block: a gradient arrived after .*"
                                                      r"use_reentrant=False.*speculative_step")
    finally:
        engine.close()


def test_training_goes_on_after_the_last_backward_raised(disk_dir) -> None:
    """The last micro-batch's backward raises after some units were stepped: they keep their
    update (as under the early step), the cycle's other gradients are dropped, and the loop
    goes on with the next batch without a step() in between."""
    _, _, _, engine = _heads_engine(disk_dir)
    try:
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, VOCAB, (2, 8), generator=gen)
        engine.backward(engine(input_ids=x, labels=x))
        engine.step()
        loss = engine(input_ids=x, labels=x)

        def fail(grad):
            raise ValueError("injected backward failure")
        engine.module.embed.weight.register_hook(fail)
        with pytest.raises(ValueError, match="injected"):
            engine.backward(loss)
        assert not engine.optimizer.boundary.pending
        engine.module.embed.weight._backward_hooks.clear()
        for _ in range(2):
            engine.backward(engine(input_ids=x, labels=x))
            engine.step()
    finally:
        engine.close()
