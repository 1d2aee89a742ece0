"""infinity.train.run_config: the demo ds_config, --config files, and the flags that override them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from infinity.config import ConfigError
from infinity.base.sizes import parse_bytes
from infinity.train.run_config import (DEFAULT_HOST_BUDGET, DEFAULT_NVME_PATH, Overrides,
                                       build_ds_config, demo_config, nvme_paths, read_config_file)


def test_demo_is_stage3_with_params_and_optimizer_on_nvme() -> None:
    ds, config = build_ds_config(demo_config(), Overrides(steps=80))
    assert config.zero.stage == 3
    assert config.zero.offload_param.device == "nvme" == config.zero.offload_optimizer.device
    assert nvme_paths(ds) == [DEFAULT_NVME_PATH]
    assert config.infinity.host_memory_budget == parse_bytes(DEFAULT_HOST_BUDGET)
    assert config.scheduler is not None and config.scheduler.type == "WarmupCosineLR"
    assert config.scheduler.total_num_steps == 80  # the run's length
    assert config.gradient_clipping == 1.0


def test_demo_host_budget_is_under_half_the_demo_model_states() -> None:
    n_params = 85_353_216  # the 85M preset (checked in test_train_models)
    assert 16 * n_params >= 2 * parse_bytes(DEFAULT_HOST_BUDGET)


def test_flags_override_the_config(tmp_path: Path) -> None:
    base = demo_config()
    base["train_batch_size"] = 8
    base["gradient_accumulation_steps"] = 4
    ds, config = build_ds_config(base, Overrides(micro_batch=3, lr=5e-4, nvme_path=str(tmp_path),
                                                 host_budget="1GiB"))
    assert config.train_micro_batch_size_per_gpu == 3
    assert config.gradient_accumulation_steps == 4 and config.train_batch_size == 12
    assert config.optimizer.lr == 5e-4
    assert config.infinity.host_memory_budget == 1 << 30
    assert config.zero.offload_param.nvme_path == str(tmp_path)
    assert config.zero.offload_optimizer.nvme_path == str(tmp_path)
    assert base["train_micro_batch_size_per_gpu"] == 2  # the input is not changed


def test_micro_batch_keeps_an_accumulation_the_config_left_implicit() -> None:
    """train_batch_size 8 with micro-batches of 2 means 4 micro-steps (DeepSpeed's rule);
    --micro-batch 4 keeps the 4 (train_batch_size 16), where it silently became 1."""
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    _, config = build_ds_config(base, Overrides(micro_batch=4))
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.train_batch_size) == (4, 4, 16)
    _, config = build_ds_config({"train_batch_size": 8}, Overrides(micro_batch=2))
    assert (config.gradient_accumulation_steps, config.train_batch_size) == (1, 2)


def test_batch_sizes_are_read_for_the_world_size() -> None:
    """Under torchrun the config is read for its ranks: train_batch_size = micro x accumulation
    x world size (the issue's seed config: 32 = 4 x 2 x 4), and --micro-batch keeps the
    accumulation that train_batch_size implied at that world size."""
    base = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2}
    _, config = build_ds_config(base, Overrides(), world_size=4)
    assert (config.world_size, config.gradient_accumulation_steps) == (4, 2)
    with pytest.raises(ValueError, match="train_batch_size"):
        build_ds_config(base, Overrides(), world_size=1)
    implicit = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}
    _, config = build_ds_config(implicit, Overrides(micro_batch=4), world_size=2)
    assert (config.gradient_accumulation_steps, config.train_batch_size) == (4, 32)


def test_lr_a_schedule_sets_itself_is_warned(infinity_log) -> None:
    """--lr moves a warm-up's maximum; a schedule whose rate comes from its own keys ignores it,
    which used to pass silently."""
    import logging
    ds = {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                       "cycle_first_step_size": 10}}}
    with infinity_log.at_level(logging.WARNING):
        build_ds_config(ds, Overrides(lr=0.5))
    assert "--lr 0.5 has no effect on the learning rate" in infinity_log.text
    assert "cycle_min_lr / cycle_max_lr" in infinity_log.text


def test_user_config_keeps_its_nvme_path_and_gets_a_default_where_missing(tmp_path: Path) -> None:
    ds = {"zero_optimization": {"stage": 3,
                                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                "offload_optimizer": {"device": "nvme"}}}
    out, config = build_ds_config(ds, Overrides())
    assert config.zero.offload_param.nvme_path == str(tmp_path)
    assert config.zero.offload_optimizer.nvme_path == DEFAULT_NVME_PATH
    assert nvme_paths(out) == [str(tmp_path), DEFAULT_NVME_PATH]


def test_nothing_on_nvme_means_no_swap_path() -> None:
    ds, config = build_ds_config({"zero_optimization": {"stage": 0}}, Overrides(nvme_path="/x"))
    assert nvme_paths(ds) == [] and config.zero.stage == 0


def test_hf_style_auto_values_take_the_flags() -> None:
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5,
                                                              "total_num_steps": "auto"}}}
    _, config = build_ds_config(ds, Overrides(micro_batch=2, lr=1e-3, steps=40))
    assert config.train_micro_batch_size_per_gpu == 2 and config.optimizer.lr == 1e-3
    assert config.scheduler.total_num_steps == 40
    # another "auto" (a Trainer's config): the CLI says to write it, not to pass auto_values=
    ds["optimizer"]["params"]["weight_decay"] = "auto"
    with pytest.raises(ConfigError, match=r"optimizer.params.weight_decay is \"auto\" in the "
                                          r"config .* write a value for") as info:
        build_ds_config(ds, Overrides(micro_batch=2, lr=1e-3, steps=40))
    assert "auto_values" not in str(info.value)
    # every "auto" the flags fill: the batch's total, the schedule's peak from --lr (it was
    # "fills the batch sizes" and then "write a value for train_batch_size")
    ds["optimizer"]["params"]["weight_decay"] = 0.0
    ds["train_batch_size"] = "auto"
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                      "warmup_max_lr": "auto",
                                                      "warmup_num_steps": 5}}
    _, config = build_ds_config(ds, Overrides(micro_batch=2, lr=3e-4), world_size=2)
    assert config.train_batch_size == 4 and config.gradient_accumulation_steps == 1
    assert config.scheduler.warmup_max_lr == 3e-4 and config.scheduler.warmup_min_lr == 0.0


@pytest.mark.parametrize("overrides, match", [
    (Overrides(host_budget="lots"), "--host-budget"),
    (Overrides(micro_batch=0), "--micro-batch must be at least 1"),
    (Overrides(lr=-1.0), "--lr must be positive"),
])
def test_bad_flags_name_the_flag(overrides: Overrides, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_ds_config(demo_config(), overrides)


def test_config_errors_are_value_errors_with_the_key() -> None:
    with pytest.raises(ConfigError, match="zero_optimisation"):
        build_ds_config({"zero_optimisation": {"stage": 3}}, Overrides())
    assert issubclass(ConfigError, ValueError)  # the CLI prints it as one line, exit code 2


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        read_config_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"stage\": }")
    with pytest.raises(ConfigError, match="not valid JSON at line 1"):
        read_config_file(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        read_config_file(bad)
    good = tmp_path / "ds.json"
    good.write_text(json.dumps(demo_config()))
    assert read_config_file(good) == demo_config()


def test_lr_flag_also_sets_a_warmup_peak() -> None:
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 5}}}
    _, config = build_ds_config(ds, Overrides(lr=5e-4))
    assert config.optimizer.lr == 5e-4 and config.scheduler.warmup_max_lr == 5e-4


@pytest.mark.parametrize("flag", ["", "  "])
def test_an_empty_nvme_path_flag_is_named_as_the_flag(flag: str) -> None:
    """It was refused as "zero_optimization.offload_optimizer.nvme_path = ''", a key the user
    never wrote."""
    with pytest.raises(ValueError, match=r"--nvme-path '\s*': expected a directory path"):
        build_ds_config(demo_config(), Overrides(nvme_path=flag))


@pytest.mark.parametrize("flag", ["--local_rank=1", "--local-rank=1"])
def test_the_local_rank_flag_launchers_append_is_taken(monkeypatch, flag) -> None:
    """The deepspeed launcher and torch.distributed.launch append --local_rank=N: it was
    "unrecognized arguments"; it sets LOCAL_RANK where the launcher did not."""
    import os

    from infinity.cli import main
    from infinity.train import loop

    seen = []
    monkeypatch.setenv("LOCAL_RANK", "0")    # so that undoing restores what was there
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(loop, "run_training", lambda opts: seen.append(os.environ["LOCAL_RANK"]))
    assert main(["train", "--model-size", "tiny", flag]) == 0
    assert seen == ["1"]
