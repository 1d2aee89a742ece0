"""A parameter that gets no gradient in a step is not stepped, as torch skips a parameter whose
``.grad`` is None, even when the rest of its unit is (see [Note: parameters without a gradient]
in optim/partitioned.py): no decay, no momentum, and its own step count for bias correction;
and with accumulation its gradient home is at zero again after each step it takes part in."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from parity import (VOCAB, accumulating_micro_steps, assert_same_parameters,
                    engine_and_reference, zero_config)


class Body(nn.Module):
    """One unit: ``always`` is used every step, ``sometimes`` only on even ones."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.always = nn.Linear(width, width)
        self.sometimes = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        h = torch.tanh(self.always(h))
        return h + torch.tanh(self.sometimes(h)) if use_sometimes else h


class SometimesUsedModel(nn.Module):
    def __init__(self, width: int = 64, calls_a_step: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.body = Body(width)
        self.head = nn.Linear(width, VOCAB)
        self.calls = 0
        self.calls_a_step = calls_a_step     # micro-batches a step: all of a step use it or none

    def forward(self, input_ids, labels):
        self.calls += 1
        step = (self.calls - 1) // self.calls_a_step + 1
        h = self.body(self.embed(input_ids), use_sometimes=step % 2 == 0)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("tiers,early_step,speculative_step", [
    ("nvme", "on", "auto"), ("cpu", "on", "auto"),       # early step
    ("nvme", "off", "off"), ("cpu", "off", "off"),       # deferred
    ("nvme", "off", "on"),                              # deferred, speculated
])
def test_a_parameter_without_a_gradient_is_not_stepped(disk_dir, tiers: str, early_step: str,
                                                      speculative_step: str) -> None:
    torch.manual_seed(0)
    model = SometimesUsedModel()
    ds = zero_config(3, tiers, tiers, str(disk_dir), early_step=early_step,
                     speculative_step=speculative_step)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0   # body is streamed
    engine, reference, ref_opt = engine_and_reference(model, ds)
    gen = torch.Generator().manual_seed(7)
    try:
        for _ in range(5):
            x = torch.randint(0, VOCAB, (2, 8), generator=gen)
            loss = engine(input_ids=x, labels=x)
            engine.backward(loss)
            engine.step()
            ref_loss = reference(input_ids=x, labels=x)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        engine.flush()
        ours = dict(model.named_parameters())
        with infinity.zero.GatheredParameters(list(ours.values())):
            for name, expected in reference.named_parameters():
                torch.testing.assert_close(ours[name], expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, name=name: f"{name}: {m}")
        body = next(s for s in engine.optimizer.states if s.unit.name == "body")
        offsets = {e.name: e.offset for e in body.unit.params}
        assert body.param_steps[offsets["body.always.weight"]] == 5
        assert body.param_steps[offsets["body.sometimes.weight"]] == 2
    finally:
        engine.close()


@pytest.mark.parametrize("early_step", ["auto", "off"])
def test_a_gradient_home_stepped_from_is_at_zero_for_the_next_cycle(disk_dir,
                                                                   early_step: str) -> None:
    """2 micro-batches a step, the optimizer in host memory: gradients accumulate in a resident
    home, which the step leaves at zero for the next cycle (the kernel as it steps, the rest
    beside it: [Note: the step gives the home back at zero] in optim/kernel.py), in the last
    micro-batch's backward ("auto") or after it ("off"). ``sometimes`` gets gradients in every
    other step only: a home not left at zero after it is stepped would add that step's gradient
    into the next one it gets, and a parameter not stepped keeps its home at zero. torch AdamW
    with the same micro-batches is the reference."""
    torch.manual_seed(0)
    model = SometimesUsedModel(calls_a_step=2)
    ds = zero_config(3, "cpu", "cpu", str(disk_dir), early_step=early_step)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0   # body is streamed
    ds["gradient_accumulation_steps"] = 2
    engine, reference, ref_opt = engine_and_reference(model, ds)
    gen = torch.Generator().manual_seed(7)
    try:
        for _ in range(5):
            accumulating_micro_steps(engine, reference,
                                     [torch.randint(0, VOCAB, (2, 8), generator=gen)
                                      for _ in range(2)])
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        engine.flush()
        assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)
        body = next(s for s in engine.optimizer.states if s.unit.name == "body")
        offsets = {e.name: e.offset for e in body.unit.params}
        assert body.param_steps[offsets["body.always.weight"]] == 5
        assert body.param_steps[offsets["body.sometimes.weight"]] == 2
        assert body.grad_store is not None and body.grad_store.resident
        assert not bool(body.grad_store.tensor.any())    # every home at zero after the step
        stepped_early = engine.optimizer.boundary.enabled
        assert stepped_early == (early_step == "auto")
    finally:
        engine.close()
