"""One rank of the data-parallel parity matrix (started by tests/integration/ranks.py ``launch``):
for each case, trains TinyLM (seed 0) on this rank's rows of each global micro-batch, then
writes its losses, final parameters (gathered), skipped steps and communication counters.

argv: out_dir nvme_dir cases_json steps
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

import infinity
from parity import VOCAB, ArmedBackwardHook, make_model

MICRO = 2      # rows per rank per micro-batch
SEQ = 16
LR, WEIGHT_DECAY = 1e-3, 0.01


def global_batches(seed: int, steps: int, accumulation: int, world: int) -> list[list[torch.Tensor]]:
    """The global micro-batches (all ranks' rows) of a run, the same on every rank and in the
    reference."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=gen)
             for _ in range(accumulation)] for _ in range(steps)]


def case_config(case: dict, nvme_dir: str, world: int) -> dict:
    z = {"stage": case["stage"], "offload_optimizer": {"device": case["opt"]}}
    if case["opt"] == "nvme":
        z["offload_optimizer"]["nvme_path"] = nvme_dir
    if case["stage"] == 3:
        z["offload_param"] = {"device": case["param"]}
        if case["param"] == "nvme":
            z["offload_param"]["nvme_path"] = nvme_dir
    z.update(case.get("zero_extra", {}))
    # "boundary": 2 micro-batches, no clipping, early_step "auto": the last micro-batch's
    # backward steps the units (optim/boundary_steps.py)
    deferred, boundary = case["schedule"] == "deferred", case["schedule"] == "boundary"
    ds = {"zero_optimization": z, "train_micro_batch_size_per_gpu": MICRO,
          "gradient_accumulation_steps": 2 if deferred or boundary else 1,
          "gradient_clipping": 0.05 if deferred else 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
          "infinity": {"collective_timeout": 120, "compute_dtype": case.get("compute", "fp32"),
                       "early_step": "off" if deferred else "auto" if boundary else "on"}}
    if case.get("compute") == "bf16":
        ds["bf16"] = {"enabled": True}
    if case.get("comm") is not None:        # DeepSpeed's key; unset: the gradients' dtype
        ds["communication_data_type"] = case["comm"]
    if case.get("fp16"):
        ds["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return ds


def run_case(case: dict, nvme_dir: str, steps: int, out: Path, rank: int, world: int) -> dict:
    from infinity.storage.device_cache import DeviceMemoryCache

    # "slots": the path of devices without the memory cache (CUDA): NVMe reads of the own
    # shard into host fetch slots, then a copy into the device buffer and the gather
    from infinity.optim import device_gradients

    supported = DeviceMemoryCache.supported
    DeviceMemoryCache.supported = staticmethod(
        (lambda device: False) if case.get("slots") else supported)
    # "device_reduce": a GPU's gradient path on the CPU device (see [Note: gradients reduced
    # on the device] in optim/device_gradients.py)
    on_device = device_gradients.reduces_on_device
    if case.get("device_reduce"):
        device_gradients.reduces_on_device = lambda device: True
    try:
        return _run_case(case, nvme_dir, steps, out, rank, world)
    finally:
        DeviceMemoryCache.supported = supported
        device_gradients.reduces_on_device = on_device


def _run_case(case: dict, nvme_dir: str, steps: int, out: Path, rank: int, world: int) -> dict:
    model = make_model("torch", seed=0, layers=3, width=case.get("width", 32))
    overflow = ArmedBackwardHook(factor=float("inf"))
    model.blocks[0].register_full_backward_pre_hook(overflow)
    engine, *_ = infinity.initialize(model=model, config=case_config(case, nvme_dir, world))
    accumulation = engine.gradient_accumulation_steps()
    batches = global_batches(case.get("seed", 1), steps, accumulation, world)
    losses, sent = [], []
    try:
        for step, micros in enumerate(batches):
            total = 0.0
            for x in micros:
                mine = x[rank * MICRO:(rank + 1) * MICRO]
                # an overflow on one rank only: every rank must skip the step
                overflow.armed = bool(case.get("fp16")) and step == 2 and rank == world - 1
                loss = engine(input_ids=mine, labels=mine)
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / len(micros))
            sent.append(engine.step_stats()["comm_sent_bytes"])
        engine.flush()
        with infinity.zero.GatheredParameters(list(model.parameters())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(params, out / f"{case['name']}.rank{rank}.pt")
        if case.get("slots"):
            assert engine.fetch_pool is not None and not engine.direct_fetch
            assert engine.fetch_pool.slot_bytes < max(u.nbytes for u in engine.units)
        return {"losses": losses, "skipped": engine.skipped_steps, "sent": sent,
                "early": engine.optimizer.early_step, "grad_norm": engine.get_global_grad_norm(),
                "copies": _late_counts(engine.manager.copies),
                "device_reduce": engine.optimizer.gradients.device_pool is not None,
                "reduce_dtype": _reduce_dtype(engine)}
    finally:
        engine.close()


def _reduce_dtype(engine) -> str | None:
    """The device buffers' dtype (the communication dtype), None on the host path."""
    pool = engine.optimizer.gradients.device_pool
    return None if pool is None else str(pool.dtype).removeprefix("torch.")


def _late_counts(copies) -> dict | None:
    """The late copies' counters (INFINITY_LATE_TRANSFERS set), else None."""
    from infinity.storage.transfers import LateCopies

    if not isinstance(copies, LateCopies):
        return None
    copies.drain()
    return {"copies": copies.copies, "to_host": copies.to_host_copies,
            "poisoned": copies.poisoned, "lost": copies.lost}


def main() -> None:
    out, nvme_dir, cases, steps = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), \
        int(sys.argv[4])
    import torch.distributed as dist

    infinity.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case, nvme_dir, steps, out, rank, world)
        except Exception:  # noqa: BLE001 - reported per case, the other ranks fail too
            results[case["name"]] = {"error": traceback.format_exc()}
            (out / f"rank{rank}.json").write_text(json.dumps(results))
            raise
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
