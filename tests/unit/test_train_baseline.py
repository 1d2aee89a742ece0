"""The torch baseline engine against a hand-written PyTorch loop (accumulation, clipping, schedule)."""
from __future__ import annotations

import copy

import pytest
import torch

from infinity.train import models
from infinity.train.baseline import TorchBaselineEngine
from infinity.train.data import VOCAB_SIZE
from infinity.train.run_config import Overrides, build_ds_config

DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
      "gradient_clipping": 0.5,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95],
                                                "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                   "warmup_num_steps": 3, "warmup_type": "linear"}}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build_model(models.preset_config("tiny", seq_len=16))


def test_baseline_matches_plain_pytorch() -> None:
    _, config = build_ds_config(DS, Overrides())
    model = _model()
    reference = copy.deepcopy(model)
    engine = TorchBaselineEngine(model, config)
    engine.train()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB_SIZE, (2, 16), generator=generator) for _ in range(8)]
    lrs = []
    for step in range(4):
        # linear warm-up from 0 over 3 steps, DeepSpeed's count starting at -1
        lr = min(1.0, max(0, step - 1) / 3) * 1e-2
        lrs.append(engine.get_lr()[0])
        for g in opt.param_groups:
            g["lr"] = lr
        for micro in range(2):
            x = batches[2 * step + micro]
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            (reference(input_ids=x, labels=x).loss / 2).backward()
            if micro == 1:  # accumulated gradients (Adam alone would hide a wrong loss scale)
                for p, q in zip(model.parameters(), reference.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
            engine.step()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        stats = engine.step_stats()
        assert stats["step_s"] >= stats["compute_s"] > 0 and stats["io_wait_s"] == 0.0
    assert lrs == pytest.approx([0.0, 0.0, 1e-2 / 3, 2e-2 / 3])
    assert engine.global_steps == 4 and engine.micro_steps == 8
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    moved = sum((p - q).abs().sum() for p, q in zip(model.parameters(), _model().parameters()))
    assert moved > 0  # the comparison is not between two untouched models


def test_held_bytes_count_params_grads_and_moments() -> None:
    _, config = build_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                                Overrides())
    model = _model()
    engine = TorchBaselineEngine(model, config)
    x = torch.randint(0, VOCAB_SIZE, (1, 16))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    n = sum(p.numel() for p in model.parameters())
    assert engine.step_stats()["device_bytes"] == 16 * n  # fp32 param, grad, exp_avg, exp_avg_sq
    engine.close()
