"""One rank of the NCCL runs of tests/gpu/test_cuda_ranks.py (started by
tests/integration/ranks.py ``launch``, one GPU per rank, ``LOCAL_RANK``): a stage-3 engine on
CUDA with parameters and optimizer states on the host, clipping and accumulation (the deferred
step: the global gradient norm, the gradient reduction into host buffers), where the process
group is

- "nccl": made by the script before the engine, as ``deepspeed.init_distributed("nccl")`` or
  accelerate make it: CUDA only, so the engine's collectives on host tensors run on its gloo
  side group;
- "engine": made by the engine itself from the launcher's environment ("cpu:gloo,cuda:nccl").

Writes the losses, the loss mean over ranks of ``infinity train`` and the calls each group got.

argv: mode out_dir nvme_dir steps
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import infinity
from infinity.comm.routing import backends_of
from infinity.train.loop import _mean_over_ranks
from parity import make_model
from parity_ranks_worker import MICRO, case_config, global_batches

CASE = {"name": "s3-cpu-cpu-deferred", "stage": 3, "opt": "cpu", "param": "cpu",
        "schedule": "deferred"}


def main() -> None:
    mode, out, nvme_dir, steps = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    # fp32 matmuls without TF32: the test compares with torch at fp32 bounds
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if mode == "nccl":
        dist.init_process_group(backend="nccl")
    rank = int(os.environ["RANK"])
    results: dict = {}
    try:
        model = make_model("torch", seed=0, layers=3, width=32).cuda()
        world = int(os.environ["WORLD_SIZE"])
        engine, *_ = infinity.initialize(model=model, config=case_config(CASE, nvme_dir, world))
        try:
            batches = global_batches(1, steps, engine.gradient_accumulation_steps(), world)
            losses, means = [], []
            for micros in batches:
                mine = []
                for x in micros:
                    rows = x[rank * MICRO:(rank + 1) * MICRO].cuda()
                    loss = engine(input_ids=rows, labels=rows)
                    engine.backward(loss)
                    engine.step()
                    mine.append(loss.item())
                losses.append(sum(mine) / len(mine))
                means.append(_mean_over_ranks(mine, engine, world))
            results.update(losses=losses, means=means, backends=backends_of(None),
                           backend=str(dist.get_backend()),
                           side_group=engine.comm.side_group is not None,
                           calls_by_group=engine.comm.calls_by_group)
        finally:
            engine.close()
    except Exception:  # noqa: BLE001 - written for the test, which shows it
        results["error"] = traceback.format_exc()
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
