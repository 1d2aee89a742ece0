"""One rank of test_ranks_api.py: DeepSpeed API habits across ranks. GatheredParameters with
modifier_rank=0 (rank 0's change reaches every rank, whatever the others wrote), the
training_data loader (each rank its share), engine rank accessors, the values a model built
outside zero.Init starts from, and the process group ``init_distributed`` made destroyed at
exit.

argv: out_dir nvme_dir
"""
from __future__ import annotations

import atexit
import gc
import json
import sys
from pathlib import Path

import torch

import infinity
from parity import make_model


def _gloo_threads() -> list[str]:
    """The names of this process's threads that gloo started (Linux names them: a process
    group's transport loop and its backend's workers), sorted."""
    names = (path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm"))
    return sorted(name for name in names if "gloo" in name)


def _record_group_at_exit(out: Path, holder: dict) -> None:
    """Whether the process group still exists once infinity's own exit handler has run (this
    one was registered before it, and atexit runs the last registered first), and which of
    gloo's threads still run then: a group destroyed while something still referenced it kept
    its backend and threads alive into the interpreter's teardown (see [Note: a group kept
    alive by a default argument] in comm/group.py)."""
    gc.collect()
    (out / f"exit{holder['rank']}.json").write_text(json.dumps(
        {"initialized": torch.distributed.is_initialized(),
         "gloo_threads_before": holder["gloo_threads"], "gloo_threads": _gloo_threads()}))


def main() -> None:
    out, nvme = Path(sys.argv[1]), sys.argv[2]
    holder: dict = {}
    atexit.register(_record_group_at_exit, out, holder)
    info = infinity.init_distributed()
    rank = holder["rank"] = info.rank
    ds = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "infinity": {"collective_timeout": 60}}
    model = make_model("torch", seed=0, layers=2, width=32)
    data = torch.utils.data.TensorDataset(torch.arange(20))
    engine, _, loader, _ = infinity.initialize(model=model, config=ds, training_data=data)
    try:
        weight = model.blocks[0].up.weight
        with infinity.zero.GatheredParameters([weight], modifier_rank=0):
            weight.data.fill_(1.0 + rank)        # only rank 0's value may stay
        x = torch.randint(0, 256, (2, 8))
        loss = engine(input_ids=x, labels=x)       # a forward gathers the unit again
        with infinity.zero.GatheredParameters([weight]):
            seen = weight.detach().clone()
        # one call by two names (the model's and DeepSpeed's): the same call on every rank
        by_two_names = model.state_dict() if rank == 0 else engine.module_state_dict()
        samples = sorted(int(s) for (batch,) in loader for s in batch)
        result = {"values": sorted(set(seen.reshape(-1).tolist())), "samples": samples,
                  "swap_dir": engine.manager.swap.path.name,
                  "ranks": [engine.global_rank, engine.world_size, engine.dp_world_size],
                  "loss_finite": bool(torch.isfinite(loss)),
                  "by_two_names": {k: v.float().sum().item() for k, v in by_two_names.items()}}
    finally:
        engine.close()
    # a model built outside zero.Init with each rank's own values (a rank-seeded init, or only
    # rank 0 loading weights): every rank starts from rank 0's, at stage 0 and at stage 3
    result["started_from"], result["buffers_from"] = {}, {}
    for stage in (0, 3):
        model = make_model("torch", seed=rank, layers=2, width=32)
        # buffers of each rank's own too: an integer one and a non-persistent float one
        model.blocks[0].register_buffer("counts", torch.arange(5) + 10 * rank)
        model.register_buffer("table", torch.full((2, 3), 0.5 + rank), persistent=False)
        zero = {"stage": stage} if stage == 0 else ds["zero_optimization"]
        engine, *_ = infinity.initialize(model=model, config={
            **ds, "zero_optimization": zero,
            "infinity": {**ds["infinity"], "compute_dtype": "fp32"}})   # the values as built
        try:
            result["started_from"][stage] = {
                name: value.float().sum().item()
                for name, value in engine.module_state_dict().items() if "counts" not in name}
            result["buffers_from"][stage] = [model.blocks[0].counts.tolist(),
                                             model.table.tolist()]
        finally:
            engine.close()
    holder["gloo_threads"] = _gloo_threads()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
