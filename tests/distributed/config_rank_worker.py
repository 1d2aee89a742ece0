"""One rank of test_rank_faults.py's config test: rank 1 alone is given a config it refuses
(offload_param "cpu" at stage 2). Prints "<rank> <error type>: <message>"."""
from __future__ import annotations

import torch

import infinity


def main() -> None:
    info = infinity.init_distributed()
    ds = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3 if info.rank == 0 else 2,
                                "offload_param": {"device": "cpu"}},
          "infinity": {"compute_dtype": "fp32", "collective_timeout": 60}}
    try:
        infinity.initialize(model=torch.nn.Linear(4, 4), config=ds)
    except Exception as exc:    # the test reads what each rank was told
        print(f"{info.rank} {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
