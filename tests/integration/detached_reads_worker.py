"""Trains a model whose blocks read a weight ``.detach()``ed (saved for backward without its
gradient) under infinity and under plain torch in lock step, and prints the losses as JSON
(run by test_detached_reads.py in a process of its own: before the fix, the backward read a
released buffer and the process died of a segmentation fault).

argv: case_json swap_dir
"""
from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn

import infinity
from parity import VOCAB, TinyLM, run_parity, zero_config


class DetachedReadBlock(nn.Module):
    """``x * diag(W)`` with W detached, then the block's own layers: autograd runs the product's
    backward (which reads W) after every gradient of the block is whole."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.up.weight.detach().diagonal()
        return x + torch.tanh(self.up(self.norm(y)))


class CheckpointedLM(TinyLM):
    """Each block under activation checkpointing, recomputed in the backward through its module
    call as transformers does it: reentrant, or not (transformers' default)."""

    reentrant = True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           labels[:, 1:].reshape(-1))


def model(checkpointed: str | None) -> nn.Module:
    """``checkpointed``: None, "reentrant" or "non-reentrant"."""
    torch.manual_seed(0)
    lm = (CheckpointedLM if checkpointed else TinyLM)(width=32, depth=3)
    lm.reentrant = checkpointed == "reentrant"
    lm.blocks = nn.ModuleList(DetachedReadBlock(32) for _ in range(3))
    return lm


def interleaved(ds: dict, steps: int) -> tuple[list[float], list[float]]:
    """Both micro-batches' forwards first, then their backwards (the first backward's end must
    not forget what the second forward noted), against torch on the whole batch."""
    ds = copy.deepcopy(ds)
    ds.update(optimizer={"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
              train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    lm = model(None)
    reference = copy.deepcopy(lm)
    engine, *_ = infinity.initialize(model=lm, config=ds)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.02, weight_decay=0.01,
                                foreach=False)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    try:
        for _ in range(steps):
            a, b = (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2))
            la, lb = engine(input_ids=a, labels=a), engine(input_ids=b, labels=b)
            engine.backward(la)
            engine.step()
            engine.backward(lb)
            engine.step()
            ra, rb = reference(input_ids=a, labels=a), reference(input_ids=b, labels=b)
            ((ra + rb) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append((la.item() + lb.item()) / 2)
            ref_losses.append((ra.item() + rb.item()) / 2)
    finally:
        engine.close()
    return losses, ref_losses


def main() -> None:
    case, swap = json.loads(sys.argv[1]), sys.argv[2]
    ds = zero_config(case["stage"], case["tier"], case["tier"], swap,
                     **case.get("infinity", {}))
    # every unit of its own, released after each use: the product's read finds it released
    ds["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                   stage3_max_reuse_distance=0)
    # five steps: the losses of steps 2-5 check the gradients of steps 1-4
    if case.get("interleaved"):
        losses, reference = interleaved(ds, steps=5)
    else:
        result = run_parity(model(case.get("checkpointed")), ds, steps=5,
                            accumulation=case["accumulation"], lr=0.02)
        losses, reference = result.losses, result.ref_losses
    print(json.dumps({"losses": losses, "reference": reference}))


if __name__ == "__main__":
    main()
