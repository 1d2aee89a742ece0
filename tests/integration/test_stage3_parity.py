"""Stage 3 (ZeRO-Infinity) equals plain PyTorch AdamW, for every placement of parameters and
optimizer states, on Llama, GPT-2 (tied weights, Conv1D) and Qwen2 models and a plain torch model.

Tolerance: fp32 losses within 1e-5 relative per step (the CPU Adam agrees with torch's to float32
rounding; the forward/backward is the same torch code on the same values).
"""
from __future__ import annotations

import itertools

import pytest

from parity import make_model, run_parity, state_bytes, zero_config

TIERS = ["none", "cpu", "nvme"]
FAMILIES = ["llama", "gpt2", "qwen2", "torch"]


def _budget(model, param: str, optimizer: str) -> dict:
    """With every state on NVMe: a host budget under a quarter of the model states (and the
    emulated device pool of a CPU-only machine its own budget, an eighth)."""
    if (param, optimizer) != ("nvme", "nvme"):
        return {}
    return {"host_memory_budget": state_bytes(model) // 4 - 1,
            "device_memory_budget": state_bytes(model) // 8}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("param,optimizer", list(itertools.product(TIERS, TIERS)))
def test_stage3_matches_torch(family: str, param: str, optimizer: str, disk_dir) -> None:
    model = make_model(family, layers=8, width=64)
    ds = zero_config(3, param, optimizer, str(disk_dir), **_budget(model, param, optimizer))
    result = run_parity(model, ds, steps=20)
    assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    assert result.losses[-1] < result.losses[0]


@pytest.mark.parametrize("clip,accumulation", [(0.5, 1), (0.0, 3), (1.0, 2)])
def test_stage3_nvme_deferred_step_matches_torch(clip: float, accumulation: int, disk_dir) -> None:
    """Clipping and accumulation force the deferred schedule (gradients kept on NVMe or host)."""
    model = make_model("llama", layers=4)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    result = run_parity(model, ds, steps=8, clip=clip, accumulation=accumulation)
    assert not result.engine.optimizer.early_step
    assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
