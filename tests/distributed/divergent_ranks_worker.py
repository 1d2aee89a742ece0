"""One rank of test_rank_paths.py: TinyLM whose forward skips a block that depends on the rank
(rank 0 skips block 2, rank 1 skips block 1): the same number of gathers of the same sizes, so
nothing but the units' identities tells the ranks' collectives apart. argv: mode (diverge|same)"""
from __future__ import annotations

import sys

import torch

import infinity
from parity import VOCAB, make_model


def main() -> None:
    info = infinity.init_distributed()
    model = make_model("torch", seed=0, layers=3, width=32)
    skipped = (2 - info.rank) if sys.argv[1] == "diverge" else 2

    def forward(input_ids, labels):
        h = model.embed(input_ids)
        for i, block in enumerate(model.blocks):
            if i != skipped:
                h = block(h)
        logits = model.head(h)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 labels[:, 1:].reshape(-1))

    model.forward = forward
    ds = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "infinity": {"collective_timeout": 30}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(info.rank))
    for _ in range(2):
        loss = engine(input_ids=x, labels=x)
        engine.backward(loss)
        engine.step()
    engine.close()
    print("trained")


if __name__ == "__main__":
    main()
