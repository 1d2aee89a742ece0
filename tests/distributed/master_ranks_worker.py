"""One rank of test_master_ranks.py: changes by hand to a bf16 engine's weights at 2 ranks
reach every rank's fp32 master shard as the source rank made them. Each rank writes, into
out_dir, the masters of a checkpoint taken after each change (rank 0 reads them whole).

argv: out_dir
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import infinity
from infinity.checkpoint import consolidated_state_dict
from parity import make_model


def main() -> None:
    out = Path(sys.argv[1])
    info = infinity.init_distributed()
    rank = info.rank
    ds = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"},
                                "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "infinity": {"compute_dtype": "bf16", "collective_timeout": 60}}
    model = make_model("torch", seed=0, layers=2, width=32)
    engine, *_ = infinity.initialize(model=model, config=ds)
    name = "blocks.0.up.weight"
    weight = dict(model.named_parameters())[name]
    results: dict[str, object] = {}
    try:
        with infinity.zero.GatheredParameters([weight]):
            shape = tuple(weight.shape)             # released at stage 3 outside it
        gen = torch.Generator().manual_seed(7)
        target = torch.randn(shape, generator=gen) * 0.02 + 1e-4      # finer than bf16
        # rank 1 alone rebinds fp32 values (DeepSpeed's modifier_rank idiom)
        with infinity.zero.GatheredParameters([weight], modifier_rank=1):
            if rank == 1:
                weight.data = target.clone()
        engine.save_checkpoint(out / "ckpt", tag="rebound")
        # every rank loads a state dict; rank 1's differs below bf16's precision
        own = target * (1.0 + (1e-4 if rank == 1 else 0.0)) + 1e-3
        model.load_state_dict({name: own}, strict=False)
        engine.save_checkpoint(out / "ckpt", tag="loaded")
        if rank == 0:
            masters = {tag: consolidated_state_dict(out / "ckpt", tag=tag)[name]
                       for tag in ("rebound", "loaded")}
            results = {"rebound_equal": bool(torch.equal(masters["rebound"], target)),
                       "loaded_equal": bool(torch.equal(masters["loaded"], target + 1e-3)),
                       "loaded_diff": float((masters["loaded"] - (target + 1e-3)).abs().max())}
    finally:
        engine.close()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
