"""A parameter that gets no gradient in a step is not stepped, as torch skips a parameter whose
``.grad`` is None, even when the rest of its unit is (see [Note: parameters without a gradient]
in optim/partitioned.py): no decay, no momentum, and its own step count for bias correction."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from parity import VOCAB, engine_and_reference, zero_config


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
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.body = Body(width)
        self.head = nn.Linear(width, VOCAB)
        self.calls = 0

    def forward(self, input_ids, labels):
        self.calls += 1
        h = self.body(self.embed(input_ids), use_sometimes=self.calls % 2 == 0)
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
