"""The torch baseline engine against a hand-written PyTorch loop (accumulation, clipping, schedule),
in fp32 and in the engine's bf16 recipe (the baseline follows the engine's compute dtype rule)."""
from __future__ import annotations

import copy

import pytest
import torch

from infinity.base.cpu_bf16 import ENV
from infinity.train import models
from infinity.train.baseline import TorchBaselineEngine
from infinity.train.data import VOCAB_SIZE
from infinity.train.run_config import Overrides, build_ds_config

DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
      "gradient_clipping": 0.5,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95],
                                                "weight_decay": 0.1}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                   "warmup_num_steps": 3, "warmup_type": "linear"}},
      # fp32 parity: "auto" is bf16 on a CPU with native bf16
      "infinity": {"compute_dtype": "fp32"}}


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
    _, config = build_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                 "infinity": {"compute_dtype": "fp32"}}, Overrides())
    model = _model()
    engine = TorchBaselineEngine(model, config)
    x = torch.randint(0, VOCAB_SIZE, (1, 16))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    n = sum(p.numel() for p in model.parameters())
    assert engine.step_stats()["device_bytes"] == 16 * n  # fp32 param, grad, exp_avg, exp_avg_sq
    engine.close()


@pytest.mark.parametrize("native", ["1", "0"])
def test_auto_follows_the_engines_compute_dtype(native: str, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path) -> None:
    """"auto" on a CPU with native bf16 (the probe's answer forced both ways): the baseline runs
    the engine's bf16 recipe (bf16 parameters, fp32 masters stepped by AdamW, clipped over the
    masters, parameters rounded from them) step for step like a hand-written one; without
    native bf16 it stays fp32."""
    monkeypatch.setenv(ENV, native)
    ds = {k: v for k, v in DS.items() if k not in ("infinity", "scheduler")}
    ds["gradient_accumulation_steps"] = 1
    _, config = build_ds_config(ds, Overrides())
    model = _model()
    reference = copy.deepcopy(model)
    engine = TorchBaselineEngine(model, config)
    want = torch.bfloat16 if native == "1" else torch.float32
    assert engine.compute_dtype == want
    assert all(p.dtype == want for p in model.parameters())
    masters = [p.detach().clone() for p in reference.parameters()]
    for p in reference.parameters():
        p.data = p.data.to(want)
    opt = torch.optim.AdamW(masters, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, VOCAB_SIZE, (2, 16), generator=generator)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        ref_loss = reference(input_ids=x, labels=x).loss
        ref_loss.backward()
        for master, p in zip(masters, reference.parameters()):
            master.grad, p.grad = p.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, 0.5)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, reference.parameters()):
                p.copy_(master)
        assert loss.item() == ref_loss.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    n = sum(p.numel() for p in model.parameters())
    # parameters in the compute dtype, fp32 masters and moments (bf16), or fp32 param, grad and
    # moments (gradients of the last step are counted before they go)
    held = engine.step_stats()["device_bytes"]
    assert held == (n * (2 + 4 + 4 + 8) if native == "1" else 16 * n)
    # --export: fp32, from the masters (as the engine exports at stage 3); the model computes on
    engine.save_pretrained(str(tmp_path))
    exported = type(model).from_pretrained(tmp_path)
    for (name, p), master in zip(exported.named_parameters(), masters):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master), name
    assert all(p.dtype == want for p in model.parameters())
    engine.close()


def test_a_setting_torch_cannot_reproduce_is_refused() -> None:
    """bias_correction false: torch's Adam always corrects, and the "same run in plain
    PyTorch" differed from its second step without a word."""
    ds = copy.deepcopy(DS)
    ds["optimizer"]["params"]["bias_correction"] = False
    _, config = build_ds_config(ds, Overrides())
    with pytest.raises(ValueError, match="bias_correction = false: torch's Adam/AdamW always"):
        TorchBaselineEngine(_model(), config)
