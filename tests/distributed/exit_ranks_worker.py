"""One rank of test_exit_ranks.py: a group the script made itself (``init_process_group``, as
transformers does), an engine trained on it and closed, a torch module imported after the group
that holds it in a default argument (torch.distributed.optim), and the script's own
``destroy_process_group`` at its end; at exit, after infinity's handler, the rank records which
of gloo's threads still run (none may: see [Note: a group kept alive by a default argument] in
comm/group.py).

argv: out_dir
"""
from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import infinity
from parity import make_model, with_adamw


def gloo_threads() -> list[str]:
    """This process's threads gloo started (Linux names them), sorted."""
    names = (path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm"))
    return sorted(name for name in names if "gloo" in name)


def record_at_exit(out: Path, rank: int, before: list[str]) -> None:
    """Registered before infinity's handler, so it runs after it (atexit: last in, first out)."""
    gc.collect()
    (out / f"exit{rank}.json").write_text(json.dumps(
        {"initialized": dist.is_initialized(), "gloo_threads_before": before,
         "gloo_threads": gloo_threads()}))


def main() -> None:
    out = Path(sys.argv[1])
    held: list[str] = []
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    atexit.register(record_at_exit, out, rank, held)
    importlib.import_module("torch.distributed.optim")     # its defaults take the group
    engine, *_ = infinity.initialize(
        model=make_model("torch", seed=0, layers=2, width=32),
        config=with_adamw({"train_micro_batch_size_per_gpu": 2,
                           "zero_optimization": {"stage": 2},
                           "infinity": {"compute_dtype": "fp32"}}))
    x = torch.randint(0, 256, (2, 8))
    engine.backward(engine(input_ids=x, labels=x))
    engine.step()
    engine.close()
    held.extend(gloo_threads())
    dist.destroy_process_group()       # the script's group: the script destroys it


if __name__ == "__main__":
    main()
