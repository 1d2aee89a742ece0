"""Frozen parameters (LoRA-style fine-tuning) under stage 3: they never move, whichever schedule
steps their unit's trainable range, and training equals torch AdamW with weight decay."""
from __future__ import annotations

import copy

import pytest
import torch
from parity import VOCAB, run_parity, zero_config
from torch import nn

from infinity.engine import sizing as engine_sizing


class LoRABlock(nn.Module):
    """A frozen base linear and a trainable low-rank update: the unit's trainable range (320
    elements) is not a multiple of 1024, so its padding would reach into the frozen weight if
    the layout let it."""

    def __init__(self, width: int = 32, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.base(x) + self.up(self.down(x)))


class LoRAModel(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(LoRABlock(width) for _ in range(2))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("param,optimizer,early_step,held", [
    ("none", "none", "off", True),
    ("nvme", "nvme", "off", True),
    ("cpu", "cpu", "on", False),       # the early step through a flat gradient (CUDA's path)
    ("nvme", "nvme", "on", True),
])
def test_frozen_parameters_never_move(disk_dir, monkeypatch, param, optimizer, early_step,
                                      held) -> None:
    # the run plan asks the engine's device whether the early step may hold autograd's gradients
    monkeypatch.setattr(engine_sizing, "gradients_held", lambda device: held)
    torch.manual_seed(0)
    model = LoRAModel()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ds = zero_config(3, param, optimizer, str(disk_dir), early_step=early_step)
    result = run_parity(copy.deepcopy(model), ds, steps=5, weight_decay=0.1, close=False)
    engine = result.engine
    try:
        if not held or early_step == "on":   # (the deferred step holds them when it speculates)
            assert engine.optimizer.holds_grads is held
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
        import infinity
        engine.flush()
        trained = dict(engine.module.named_parameters())
        for name, before in frozen.items():
            with infinity.zero.GatheredParameters([trained[name]]):
                assert torch.equal(trained[name], before), f"frozen {name} moved"
    finally:
        engine.close()


def test_a_parameter_frozen_at_initialize_and_unfrozen_later_is_refused(disk_dir) -> None:
    """The engine trains what required a gradient at initialize: a parameter unfrozen later
    was never updated (0 movement where torch moved it 0.05), silently. The next training
    forward refuses, naming it; frozen again, training goes on; an eval forward is not
    refused. (Freezing a trainable one later is fine: it gets no gradient, as in torch.)"""
    import infinity

    torch.manual_seed(0)
    model = LoRAModel()
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    try:
        engine.backward(engine(x, labels=x))
        engine.step()
        model.blocks[0].base.weight.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"1 parameter\(s\) frozen when the engine was "
                                               r"built now require a gradient "
                                               r"\(blocks\.0\.base\.weight\)"):
            engine(x, labels=x)
        engine.eval()
        with torch.no_grad():
            engine(x, labels=x)
        engine.train()
        model.blocks[0].base.weight.requires_grad_(False)
        engine.backward(engine(x, labels=x))
        engine.step()
    finally:
        engine.close()
