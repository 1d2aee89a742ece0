"""One rank of the host-collectives routing test (started by tests/integration/ranks.py
``launch``): the default group is made with the backend "cuda:gloo", a real group with no CPU
backend, as "nccl" is (a collective on a CPU tensor raises "No backend type associated with
device type cpu"), without needing CUDA. Then:

1. every operation of ``Collectives`` on host tensors, over that group (routed to the side
   group) and over a plain gloo group (no routing), by two ``Collectives`` each, one with
   unlimited buckets and one with 8-byte buckets (several calls per buffer), writing the
   results and the calls each group got;
2. a stage-3 engine on that group (the default group, as accelerate or a launcher makes it):
   a few steps with clipping and accumulation, and the loss mean over ranks of
   ``infinity train`` (``_mean_over_ranks``).

With a fourth argument "lost": the last rank reports a failure and exits instead of its next
host collective (the step's sequence check); the others write the error their collective (on
the side group) raised.

argv: out_dir nvme_dir steps [lost]
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import infinity
from infinity.comm.collectives import Collectives, LostRankError
from infinity.comm.routing import backends_of, group_timeout, side_group
from infinity.comm.watchdog import watch_ranks
from infinity.train.loop import _mean_over_ranks
from parity import make_model
from parity_ranks_worker import MICRO, case_config, global_batches

DEVICE_ONLY = "cuda:gloo"
CASE = {"name": "s3-cpu-cpu-deferred", "stage": 3, "opt": "cpu", "param": "cpu",
        "schedule": "deferred"}


def operations(comm: Collectives, rank: int, world: int) -> dict:
    """Every collective of ``comm`` on host tensors, with rank-dependent inputs; the results."""
    out: dict = {}
    shard = 6
    flat = torch.zeros(world * shard)
    flat[rank * shard:(rank + 1) * shard] = torch.arange(shard, dtype=torch.float32) + 10 * rank
    comm.all_gather(flat, tag=0)
    out["all_gather"] = flat.tolist()
    ahead = torch.zeros(world * shard)
    ahead[rank * shard:(rank + 1) * shard] = torch.arange(shard, dtype=torch.float32) - rank
    handle = comm.all_gather_async(ahead, tag=1)
    comm.compute_waits(handle)
    out["all_gather_ahead"] = ahead.tolist()
    gen = torch.Generator().manual_seed(100 + rank)
    source = torch.randn(world * shard, generator=gen)
    scattered = torch.empty(shard)
    comm.reduce_scatter_mean(scattered, source.clone(), tag=2)
    out["reduce_scatter_mean"] = scattered.tolist()
    averaged = torch.randn(5, generator=gen)
    comm.all_reduce_mean(averaged, tag=3)
    out["all_reduce_mean"] = averaged.tolist()
    # fp16 near its top: every rank's 40000 averages to 40000; summed first it overflows
    near = torch.full((world * shard,), 40000.0, dtype=torch.float16)
    near_shard = torch.empty(shard, dtype=torch.float16)
    comm.reduce_scatter_mean(near_shard, near, tag=4)
    out["fp16_reduce_scatter_mean"] = near_shard.float().tolist()
    near_all = torch.full((3,), 40000.0, dtype=torch.float16)
    comm.all_reduce_mean(near_all, tag=5)
    out["fp16_all_reduce_mean"] = near_all.float().tolist()
    out["sum_float"] = comm.sum_float(0.25 + rank)
    out["any_mask"] = comm.any_mask(torch.tensor([rank == 0, rank == 1, False])).tolist()
    out["objects"] = comm.all_gather_objects({"rank": rank})
    told = torch.full((4,), float(rank))
    comm.broadcast(told, world - 1)
    out["broadcast"] = told.tolist()
    comm.check_same_sequence("the routing test")
    comm.barrier()
    out["calls_by_group"] = dict(comm.calls_by_group)
    return out


def engine_steps(nvme_dir: str, steps: int, rank: int, world: int) -> dict:
    """Stage 3 on the default (device-only) group: the losses, and what the engine's
    collectives did."""
    model = make_model("torch", seed=0, layers=3, width=32)
    engine, *_ = infinity.initialize(model=model, config=case_config(CASE, nvme_dir, world))
    try:
        batches = global_batches(1, steps, engine.gradient_accumulation_steps(), world)
        losses, means = [], []
        for micros in batches:
            mine = []
            for x in micros:
                rows = x[rank * MICRO:(rank + 1) * MICRO]
                loss = engine(input_ids=rows, labels=rows)
                engine.backward(loss)
                engine.step()
                mine.append(loss.item())
            losses.append(sum(mine) / len(mine))
            means.append(_mean_over_ranks(mine, engine, world))
        side = engine.comm.side_group
        return {"losses": losses, "means": means, "calls_by_group": engine.comm.calls_by_group,
                "side_timeout_s": None if side is None else group_timeout(side).total_seconds(),
                "main_timeout_s": group_timeout(None).total_seconds()}
    finally:
        engine.close()


def lost(out: Path, rank: int, world: int) -> None:
    """The last rank stops before a host collective the others enter: theirs fails on the
    side group, naming it (the watch of [Note: lost rank] in infinity/comm/watchdog.py)."""
    comm = Collectives(None, world, rank, watch=watch_ranks(None, rank, world))
    comm.sum_float(1.0)
    if rank == world - 1:
        comm.report_failure(RuntimeError("injected failure before the norm"), "step")
        os._exit(3)
    try:
        comm.check_same_sequence("the lost-rank test")
        text = "no error"
    except LostRankError as exc:
        text = str(exc)
    (out / f"rank{rank}.txt").write_text(text + f"\ncalls: {comm.calls_by_group}")


def main() -> None:
    out, nvme_dir, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dist.init_process_group(backend=DEVICE_ONLY, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if sys.argv[4:] == ["lost"]:
        lost(out, rank, world)
        return
    results: dict = {"backends": backends_of(None)}
    try:
        try:
            dist.all_reduce(torch.ones(1))
            results["main_takes_cpu"] = True
        except RuntimeError as exc:
            results["main_takes_cpu"] = str(exc)
        routed = Collectives(None, world, rank)
        routed_small = Collectives(None, world, rank, gather_bucket_bytes=8,
                                   reduce_bucket_bytes=8)
        results["one_side_group"] = routed.side_group is routed_small.side_group
        plain_group = dist.new_group(backend="gloo")
        plain = Collectives(plain_group, world, rank)
        plain_small = Collectives(plain_group, world, rank, gather_bucket_bytes=8,
                                  reduce_bucket_bytes=8)
        results["plain_side_group"] = plain.side_group is not None
        # a group that numbers the ranks in reverse: the side group must number them alike
        order = list(reversed(range(world)))
        reverse = dist.new_group(ranks=order, backend=DEVICE_ONLY, sort_ranks=False)
        reverse_plain = dist.new_group(ranks=order, backend="gloo", sort_ranks=False)
        mine = dist.get_rank(reverse)
        results["reverse_rank"] = mine
        # a device-only group over some of the ranks: refused with the fix, never a side group
        # made by its members alone (see [Note: host collectives on a device-only group])
        alone = dist.new_group(ranks=[0], backend=DEVICE_ONLY)
        if rank == 0:
            try:
                side_group(alone)
                results["subgroup_refused"] = False
            except RuntimeError as exc:
                results["subgroup_refused"] = str(exc)
        for name, comm in (("routed", routed), ("routed_small", routed_small), ("plain", plain),
                           ("plain_small", plain_small)):
            results[name] = operations(comm, rank, world)
        results["routed_reverse"] = operations(Collectives(reverse, world, mine), mine, world)
        results["plain_reverse"] = operations(Collectives(reverse_plain, world, mine), mine,
                                              world)
        results["engine"] = engine_steps(nvme_dir, steps, rank, world)
    except Exception:  # noqa: BLE001 - written for the test, which shows it; the other rank fails too
        results["error"] = traceback.format_exc()
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
