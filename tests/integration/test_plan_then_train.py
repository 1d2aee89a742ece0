"""The config ``infinity plan`` recommends starts and trains: the planner and the engine agree on
where each state lives (the planner once put the deferred schedule's gradients in the device
pool at stage 0 while the engine keeps them in host memory, so its "fits" plan failed at
initialize)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import infinity
from infinity.cli import main


def test_the_recommended_config_initialises_and_steps(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path, disk_dir: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=4096, max_position_embeddings=128)
    config.save_pretrained(tmp_path)
    assert main(["plan", "--hf-config", str(tmp_path / "config.json"), "--host-budget", "76MiB",
                 "--nvme-path", str(disk_dir), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"], plan["warnings"]
    ds = plan["ds_config"] | {"train_micro_batch_size_per_gpu": 1,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(model=transformers.LlamaForCausalLM(config), config=ds)
    try:
        x = torch.randint(0, 4096, (1, 16))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        assert engine.global_steps == 1
    finally:
        engine.close()
