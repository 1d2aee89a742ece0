"""Trains a model whose blocks read a weight ``.detach()``ed (saved for backward without its
gradient) under infinity and under plain torch in lock step, and prints the losses as JSON
(run by test_detached_reads.py in a process of its own: before the fix, the backward read a
released buffer and the process died of a segmentation fault).

argv: case_json swap_dir
"""
from __future__ import annotations

import json
import sys

import torch
from torch import nn

from parity import TinyLM, run_parity, zero_config


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


def main() -> None:
    case, swap = json.loads(sys.argv[1]), sys.argv[2]
    ds = zero_config(case["stage"], case["tier"], case["tier"], swap,
                     **case.get("infinity", {}))
    # every unit of its own, released after each use: the product's read finds it released
    ds["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                   stage3_max_reuse_distance=0)
    result = run_parity(model(case.get("checkpointed")), ds, steps=4, accumulation=case["accumulation"], lr=0.02)
    print(json.dumps({"losses": result.losses, "reference": result.ref_losses}))


if __name__ == "__main__":
    main()
