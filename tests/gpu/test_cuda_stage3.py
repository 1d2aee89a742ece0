"""Stage 3 and checkpoints on a CUDA device (skipped visibly without one; tools/gpu_check.sh runs
them where a GPU is lent): the device is the GPU, parameters are fetched from host or NVMe into
device memory, and the results equal plain PyTorch AdamW on the same GPU (fp32, TF32 off)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import infinity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from parity import VOCAB, loss_of, make_model, reference_step, zero_config  # noqa: E402

# fp32 matmuls without TF32 (tests/gpu/conftest.py): parity with torch at fp32 bounds
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]


def _config(disk_dir, stage: int, param: str, optimizer: str, **extra) -> dict:
    ds = zero_config(stage, param, optimizer, str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds.update(extra)
    return ds


def _batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen).cuda() for _ in range(count)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("tiers", [(3, "nvme", "nvme"), (3, "cpu", "cpu"), (3, "none", "cpu"),
                                   (2, "none", "nvme")])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_training_on_cuda_equals_torch(disk_dir, family, tiers, clip) -> None:
    model = make_model(family, layers=2, width=64).cuda()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    engine, *_ = infinity.initialize(model=model,
                                     config=_config(disk_dir, *tiers, gradient_clipping=clip))
    try:
        for x in _batches(6):
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            ref_loss = reference_step(reference, ref_opt, x, clip)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_a_cuda_checkpoint_resumes_on_the_cpu_and_back(disk_dir) -> None:
    """Saved by a CUDA engine, loaded by a CPU one and by a CUDA one: the same next losses."""
    batches = _batches(6)
    a, *_ = infinity.initialize(model=make_model("llama", layers=2).cuda(),
                                config=_config(disk_dir, 3, "nvme", "nvme"))
    try:
        for x in batches[:3]:
            a.backward(loss_of(a(input_ids=x, labels=x)))
            a.step()
        a.save_checkpoint(disk_dir / "ckpt")
        expected = []
        for x in batches[3:]:
            loss = loss_of(a(input_ids=x, labels=x))
            a.backward(loss)
            a.step()
            expected.append(loss.item())
    finally:
        a.close()
    for device in ("cpu", "cuda"):
        b, *_ = infinity.initialize(model=make_model("llama", seed=4, layers=2).to(device),
                                    config=_config(disk_dir, 3, "cpu", "cpu"))
        try:
            b.load_checkpoint(disk_dir / "ckpt")
            got = []
            for x in batches[3:]:
                x = x.to(device)
                loss = loss_of(b(input_ids=x, labels=x))
                b.backward(loss)
                b.step()
                got.append(loss.item())
        finally:
            b.close()
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
