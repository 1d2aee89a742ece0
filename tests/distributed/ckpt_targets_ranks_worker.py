"""One rank of test_checkpoint_ranks.py's target tests: each rank names its own checkpoint (its
node's directory), for a save, then for a load of a save made where every rank sees it. Prints
one line per call: "<call>: <error type>: <message>" or "<call>: ok". argv: root directory."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import infinity


def attempt(call: str, fn) -> None:
    try:
        fn()
        print(f"{call}: ok", flush=True)
    except Exception as exc:    # the test reads what each rank was told
        print(f"{call}: {type(exc).__name__}: {exc}", flush=True)


def main() -> None:
    root = Path(sys.argv[1])
    info = infinity.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "infinity": {"compute_dtype": "fp32", "collective_timeout": 60}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    engine.backward(engine(torch.randn(1, 8)).sum())
    engine.step()
    own = root / f"node{info.rank}"
    attempt("save", lambda: engine.save_checkpoint(own))
    attempt("save shared", lambda: engine.save_checkpoint(root / "shared"))
    attempt("load", lambda: engine.load_checkpoint(root / "shared" if info.rank == 0 else own))
    engine.close()


if __name__ == "__main__":
    main()
