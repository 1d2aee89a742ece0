"""ZeRO-Offload (stages 0-2, world size 1): parameters stay on the device, the optimizer state
lives on the device, host or NVMe, and training equals plain PyTorch AdamW.

fp32 tolerance: 1e-5 relative loss per step (float32 rounding of the same Adam formula).
16-bit tolerance: 3e-2 relative per step, against an fp32 torch run: bf16 keeps 8 significant
bits (relative rounding 2^-9 = 2e-3 per value) and a forward pass of a few layers compounds a few
such roundings, while the fp32 master keeps the update itself exact.
"""
from __future__ import annotations

import pytest
import torch

from parity import make_model, run_parity, zero_config


@pytest.mark.parametrize("family", ["torch", "llama"])
@pytest.mark.parametrize("stage,optimizer", [(0, "none"), (1, "cpu"), (2, "cpu"), (1, "nvme"),
                                             (2, "nvme"), (2, "none")])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_offload_matches_torch(family: str, stage: int, optimizer: str, accumulation: int,
                               disk_dir) -> None:
    model = make_model(family, layers=4, width=64)
    result = run_parity(model, zero_config(stage, "none", optimizer, str(disk_dir)), steps=20,
                        accumulation=accumulation)
    assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    assert result.losses[-1] < result.losses[0]


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_bf16_compute_with_fp32_master(optimizer: str, disk_dir) -> None:
    model = make_model("llama", layers=2, width=64)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    ds = zero_config(1, "none", optimizer, str(disk_dir), compute_dtype="bf16")
    ds["bf16"] = {"enabled": True}
    result = run_parity(model, ds, steps=20)
    assert result.engine.compute_dtype == torch.bfloat16
    assert result.worst_relative <= 3e-2, (result.losses, result.ref_losses)
    assert result.losses[-1] < 0.9 * result.losses[0]


def test_param_groups_keep_their_hyperparameters(disk_dir) -> None:
    """No weight decay on norms and biases, as a user's param groups say, equals torch's."""
    import copy

    import infinity
    from parity import VOCAB

    model = make_model("torch", layers=2)
    reference = copy.deepcopy(model)

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    ref_opt = torch.optim.AdamW(groups(reference), lr=1e-2, foreach=False)
    engine, _, _, _ = infinity.initialize(
        model=model, model_parameters=groups(model),
        config=zero_config(2, "none", "nvme", str(disk_dir)) | {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        engine.backward(engine(input_ids=x, labels=x))
        engine.step()
        reference(input_ids=x, labels=x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    engine.close()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-6, msg=name)
