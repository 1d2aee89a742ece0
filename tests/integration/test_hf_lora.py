"""PEFT LoRA on an infinity engine, through infinity's Trainer: the frozen base lives on NVMe
(stage 3) and only the adapter is in the optimizer; the adapter trains, save_model writes the
adapter (adapter_model.safetensors), which peft loads back onto a fresh base to the engine's
logits. The same run with transformers' plain Trainer gives the same losses."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hf_common import hf_args, hf_data, hf_ds, logged
from parity import make_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
hf = pytest.importorskip("infinity.integrations.hf")


def _lora(seed: int = 0):
    base = make_model("llama", layers=2, width=32, seed=seed)
    config = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"],
                             lora_dropout=0.0, task_type="CAUSAL_LM")
    torch.manual_seed(1)
    return peft.get_peft_model(base, config)


def test_a_lora_adapter_trains_offloaded_saves_and_reloads(disk_dir, tmp_path) -> None:
    from infinity.storage.tiers import Tier

    warnings.filterwarnings("ignore")
    data, evals = hf_data(), hf_data(8, seed=1)
    model = _lora()
    plain = transformers.Trainer(model=copy.deepcopy(model), train_dataset=data,
                                 eval_dataset=evals,
                                 args=transformers.TrainingArguments(tmp_path / "plain",
                                                                     **hf_args(learning_rate=3e-2)))
    plain.train()
    adapter_before = {n: p.detach().clone() for n, p in model.named_parameters()
                      if p.requires_grad}
    trainer = hf.Trainer(model=model, train_dataset=data, eval_dataset=evals,
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                                   **hf_args(learning_rate=3e-2)))
    try:
        trainer.train()
        engine = trainer.engine
        # the frozen base is at home on NVMe; the optimizer holds the adapter alone
        assert engine.param_tier is Tier.NVME
        in_optimizer = [p for g in engine.optimizer.param_groups for p in g["params"]]
        assert len(in_optimizer) == len(adapter_before) == 18
        trainable = {e.name: e.numel for u in engine.units for e in u.params if e.trainable}
        assert trainable == {n: p.numel() for n, p in adapter_before.items()}
        _close(logged(trainer, "loss"), logged(plain, "loss"), 1e-5)
        _close(logged(trainer, "grad_norm"), logged(plain, "grad_norm"), 1e-5)
        losses = logged(trainer, "loss")
        assert sum(losses[-4:]) < sum(losses[:4]) - 0.05, str(losses)

        trainer.save_model(tmp_path / "adapter")
        saved = sorted(p.name for p in (tmp_path / "adapter").iterdir())
        assert "adapter_model.safetensors" in saved and "adapter_config.json" in saved
        assert "model.safetensors" not in saved
        x = torch.stack([d["input_ids"] for d in evals])
        engine.eval()
        with torch.no_grad():
            ours = engine(input_ids=x).logits
        current = engine.module_state_dict()
        assert any(not torch.equal(current[n], adapter_before[n]) for n in adapter_before)
    finally:
        trainer.close()
    base = make_model("llama", layers=2, width=32, seed=0)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = reloaded(input_ids=x).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def _close(ours: list[float], theirs: list[float], rel: float) -> None:
    assert len(ours) == len(theirs) and ours, (ours, theirs)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= rel * abs(b), (ours, theirs)
