"""Ranks on GPUs with NCCL (skipped visibly without enough CUDA devices; tools/gpu_check.sh
runs them where a GPU is lent): a stage-3 engine with host offload, clipping and accumulation
trains as plain torch AdamW on the whole batch on one GPU (losses within 1e-5 relative, fp32
without TF32), whether the process group is a plain "nccl" one made by the script (the host
tensors' collectives then run on the engine's gloo side group, [Note: host collectives on a
device-only group] in infinity/comm/routing.py) or the engine's own ("cpu:gloo,cuda:nccl", no
side group). One rank on an NCCL group (what a single-GPU `torchrun` or accelerate launch
makes) runs on any GPU machine; two need two GPUs. The worker is
tests/distributed/cuda_ranks_worker.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from parity import make_model  # noqa: E402
from parity_ranks_worker import LR, WEIGHT_DECAY, global_batches  # noqa: E402
from ranks import check_ranks, launch, read_results, reference_run  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("exact_fp32_matmuls"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 3


# one rank: the engine makes no group of one ("engine" would be the single-process case)
@pytest.mark.parametrize("world, mode", [(1, "nccl"), (2, "nccl"), (2, "engine")])
def test_nccl_ranks_train_a_stage3_step_as_torch(tmp_path, world, mode):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices (one per rank), has {torch.cuda.device_count()}")
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    out.mkdir()
    nvme.mkdir()
    results = launch(world, "cuda_ranks_worker.py", [mode, str(out), str(nvme), str(STEPS)],
                     timeout=600)
    check_ranks(results)
    ranks = read_results(out, world)
    batches = [[x.cuda() for x in micros] for micros in global_batches(1, STEPS, 2, world)]
    ref_losses, _ = reference_run(make_model("torch", seed=0, layers=3, width=32).cuda(),
                                  batches, lr=LR, weight_decay=WEIGHT_DECAY, clip=0.05)
    losses = [sum(r["losses"][s] for r in ranks) / world for s in range(STEPS)]
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (mode, s, losses, ref_losses)
    for r in ranks:
        assert r["means"] == pytest.approx(losses, rel=1e-6), r
        calls = r["calls_by_group"]
        if mode == "nccl":
            assert r["backends"] == {"cuda": "nccl"}, r
            if world > 1:     # one rank has nothing to exchange: no collective, no side group
                assert r["side_group"] and calls["main"] > 0 and calls["side"] > 0, r
        else:
            assert r["backends"] == {"cpu": "gloo", "cuda": "nccl"}, r
            assert not r["side_group"] and calls["side"] == 0, r
