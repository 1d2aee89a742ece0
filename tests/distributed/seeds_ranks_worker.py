"""One rank of test_zero_ranks.py's per-rank-seed test: each rank seeds its own generator (as
accelerate's set_seed(device_specific=True) does) and builds a model whose values are drawn
here -- under zero.Init ("init-<family>"), or a new head beside a checkpoint's weights
("head") -- then prints whether every rank holds the same model after initialize. argv: mode,
stage, a directory for the checkpoint."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import infinity
from parity import make_model


def main() -> None:
    mode, stage, where = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    info = infinity.init_distributed()
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "infinity": {"compute_dtype": "fp32", "collective_timeout": 60}}
    if mode == "head":
        import transformers

        if info.rank == 0:
            torch.manual_seed(0)
            make_model("llama", layers=2, width=32).save_pretrained(where / "src")
        dist.barrier()
        torch.manual_seed(100 + info.rank)
        engine, *_ = infinity.from_pretrained(
            where / "src", config=ds, model_class=transformers.LlamaForSequenceClassification,
            strict=False)       # score.weight is new: drawn by each rank's generator
    else:
        torch.manual_seed(100 + info.rank)
        with infinity.zero.Init():       # no config: on, whatever stage initialize takes
            model = make_model(mode.split("-")[1], layers=2, width=32)
        engine, *_ = infinity.initialize(model=model, config=ds)
    state = engine.module_state_dict()
    total = torch.stack([v.double().sum() for v in state.values()])
    everyone = [torch.empty_like(total) for _ in range(2)]
    dist.all_gather(everyone, total)
    engine.close()
    print("same" if torch.equal(*everyone) else "different", flush=True)


if __name__ == "__main__":
    main()
