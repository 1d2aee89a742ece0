"""The ds_config parser: round trip, every error class with its message, "auto", batch sizes."""
from __future__ import annotations

import copy
import json
import logging
import re

import pytest

from infinity.config import (AioConfig, ConfigError, InfinityConfig, OffloadConfig,
                             OptimizerConfig, ZeroConfig)

# A realistic ZeRO-3 NVMe config as users write it for DeepSpeed (plus our "infinity" section).
ZERO3_NVME = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 50,
    "wall_clock_breakdown": True,
    "seed": 1234,
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100,
                             "total_num_steps": 1000, "warmup_type": "linear"}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "pipeline_read": True, "pipeline_write": True,
                              "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": "1G"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e8,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 2,
            "single_submit": False, "overlap_events": True, "use_gds": False},
    "infinity": {"host_memory_budget": "12GiB", "device_memory_budget": 4e9, "early_step": "off",
                 "unit_modules": ["LlamaDecoderLayer"], "compute_dtype": "auto"},
}

# What the Hugging Face Trainer writes (its ds_config_zero3.json), "auto" everywhere.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_VALUES = {
    "fp16.enabled": False, "bf16.enabled": True, "optimizer.params.lr": 2e-5,
    "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 2e-5, "scheduler.params.warmup_num_steps": 10,
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
}


def with_change(path: str, value: object, base: dict = ZERO3_NVME) -> dict:
    """A deep copy of ``base`` with the dotted ``path`` set (created if missing)."""
    d = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = d
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return d


def test_zero3_nvme_config_parses_and_round_trips() -> None:
    cfg = InfinityConfig.from_dict(ZERO3_NVME, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 2, 4)
    assert cfg.optimizer == OptimizerConfig(type="AdamW", lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                            weight_decay=0.1)
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.total_num_steps == 1000 and cfg.scheduler.warmup_type == "linear"
    assert cfg.bf16.enabled and not cfg.fp16.enabled and cfg.gradient_clipping == 1.0
    z = cfg.zero
    assert z.stage == 3 and z.sub_group_size == 100_000_000 and z.reduce_bucket_size is None
    assert z.offload_optimizer.device == "nvme" and z.offload_optimizer.nvme_path == "/local_nvme"
    assert z.offload_optimizer.pipeline_read and z.offload_optimizer.buffer_count == 4
    assert z.offload_param.buffer_size == 100_000_000 and z.offload_param.max_in_cpu == 10**9
    assert z.stage3_gather_16bit_weights_on_model_save
    assert cfg.aio == AioConfig(block_size=1 << 20, queue_depth=32, thread_count=2)
    assert cfg.infinity.host_memory_budget == 12 * 2**30 and cfg.infinity.device_memory_budget == 4 * 10**9
    assert cfg.infinity.unit_modules == ("LlamaDecoderLayer",)
    assert cfg.seed == 1234 and cfg.steps_per_print == 50 and cfg.wall_clock_breakdown

    out = cfg.to_dict()
    text = json.dumps(out)  # plain JSON: what a run prints as the ds_config it used
    again = InfinityConfig.from_dict(json.loads(text), world_size=2)
    assert again == cfg
    assert again.to_dict() == out
    assert out["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert out["aio"]["thread_count"] == 2 and out["infinity"]["unit_modules"] == ["LlamaDecoderLayer"]


def test_defaults_round_trip_and_are_not_deepspeed_literals() -> None:
    cfg = InfinityConfig.from_dict({})
    assert InfinityConfig.from_dict(cfg.to_dict()) == cfg == InfinityConfig()
    # unset sizes stay unresolved (the planner derives them), never DeepSpeed's 1e9 / 5e8
    assert cfg.zero.sub_group_size is None and cfg.zero.reduce_bucket_size is None
    assert cfg.zero.offload_optimizer.buffer_count is None
    assert cfg.optimizer is None and cfg.zero.stage == 0   # no section: initialize refuses


@pytest.mark.parametrize("path, suggestion", [
    ("zero_optimization.offload_optimizer.pin_memroy", "zero_optimization.offload_optimizer.pin_memory"),
    ("train_batch_sise", "train_batch_size"),
    ("zero_optimization.stage3_prefetch_bucket", "zero_optimization.stage3_prefetch_bucket_size"),
    ("aio.queue_dept", "aio.queue_depth"),
    ("optimizer.params.weight_decy", "optimizer.params.weight_decay"),
    ("infinity.host_budget", "infinity.host_memory_budget"),
])
def test_misspelled_key_names_path_and_closest(path: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as err:
        InfinityConfig.from_dict(with_change(path, True), world_size=2)
    assert repr(path) in str(err.value) and repr(suggestion) in str(err.value)


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'aio\.zzz'.*valid keys here: block_size"):
        InfinityConfig.from_dict({"aio": {"zzz": 1}})


def test_key_of_the_other_offload_section_is_unknown() -> None:
    with pytest.raises(ConfigError, match=r"'zero_optimization\.offload_param\.pipeline_read'"):
        InfinityConfig.from_dict({"zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu", "pipeline_read": True}}})


def test_ignored_deepspeed_keys_are_accepted_with_one_log_line() -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("infinity.config")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        cfg = InfinityConfig.from_dict({
            "zero_allow_untested_optimizer": True, "comet": {"enabled": False},
            # asked on, partition_activations warns (see the test below): here it is off
            "activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4},
            "zero_optimization": {"stage": 2, "allgather_partitions": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        })
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert cfg.zero.stage == 2 and cfg.optimizer.lr == 1e-4
    assert len(records) == 1
    message = records[0].getMessage()
    for key in ("zero_allow_untested_optimizer", "comet", "activation_checkpointing",
                "zero_optimization.allgather_partitions", "optimizer.params.torch_adam"):
        assert key in message


# the zero3 config Hugging Face / axolotl users copy, with DeepSpeed 0.19's other keys at their
# off values
COPIED_ZERO3 = {
    "fp16": {"enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 32,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
             "min_loss_scale": 1, "fp16_master_weights_and_grads": False},
    "bf16": {"enabled": True, "immediate_grad_update": False, "check_grad_overflow": True,
             "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
    "amp": {"enabled": False}, "torch_autocast": {"enabled": False}, "sparse_gradients": False,
    "compile": {"disable": False}, "dataloader_drop_last": False, "gradient_allreduce_op": "mean",
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
        "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
        "stage3_gather_16bit_weights_on_model_save": True, "elastic_checkpoint": False,
        "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False, "zero_hpz_partition_size": 1, "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False, "memory_efficient_linear": True,
        "stage3_model_persistence_threshold": 1e9, "stage3_module_granularity_threshold": 0,
        "stage3_use_all_reduce_for_fetch_params": False, "legacy_stage1": False,
        "cpu_offload": False, "log_trace_cache_warnings": False, "zenflow": None},
    "wall_clock_breakdown": False,
}


def test_deepspeeds_activation_offload_asked_is_said_to_do_nothing(infinity_log) -> None:
    """cpu_checkpointing true was ignored among other keys in one INFO line: no offload, and
    no word of what does it here."""
    InfinityConfig.from_dict({"activation_checkpointing": {"cpu_checkpointing": False}})
    assert "infinity does not use: nothing moves" not in infinity_log.text
    InfinityConfig.from_dict({"activation_checkpointing": {"cpu_checkpointing": True}})
    assert "activation_checkpointing.cpu_checkpointing is a DeepSpeed setting infinity does " \
           "not use" in infinity_log.text
    assert "infinity.offload_activations" in infinity_log.text


def test_amsgrad_off_is_accepted_and_on_is_refused_naming_it() -> None:
    """A config written for torch's Adam lists amsgrad false: it was an unknown key."""
    def config(amsgrad: bool) -> InfinityConfig:
        return InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {
            "lr": 1e-3, "amsgrad": amsgrad}}})
    assert config(False).optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match=r"optimizer\.params\.amsgrad = true.*no AMSGrad"):
        config(True)


@pytest.mark.parametrize("section, key, off, on", [
    ("", "progressive_layer_drop", {"enabled": False}, {"enabled": True}),
    ("", "curriculum_learning", {"enabled": False}, {"enabled": True}),
    ("", "data_efficiency", {"enabled": False}, {"enabled": True}),
    ("", "eigenvalue", {"enabled": False}, {"enabled": True}),
    ("", "compression_training", {}, {"weight_quantization": {"shared_parameters": {}}}),
    ("", "graph_harvesting", False, True),
    ("", "managed_gradient_accumulation", True, False),
    ("", "gradient_allreduce_op", "Mean", "sum"),    # ignored: averaged where "sum" was asked
    ("", "checkpoint", {"tag_validation": "Warn", "use_node_local_storage": False},
     {"use_node_local_storage": True}),      # ignored whole, it failed at the first save
    ("optimizer.params", "fp32_optimizer_states", True, False),
])
def test_deepspeed_features_left_at_their_off_value_are_accepted(section, key, off, on) -> None:
    """DeepSpeed keys a copied config carries at their defaults (docs/configuration.md: features
    infinity lacks are accepted while switched off) were unknown keys; switched on, refused
    naming the key."""
    def config(value) -> dict:
        if section:
            return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, key: value}}}
        return {key: value}
    InfinityConfig.from_dict(config(off))
    with pytest.raises(ConfigError, match=f"{key} = .*does not have this DeepSpeed feature"):
        InfinityConfig.from_dict(config(on))


def test_a_copied_deepspeed_zero3_config_is_accepted() -> None:
    cfg = InfinityConfig.from_dict(COPIED_ZERO3)
    assert cfg.zero.stage == 3 and cfg.bf16.enabled
    assert cfg.zero.sub_group_size is None          # DeepSpeed's 0 (a sub-group per parameter)


@pytest.mark.parametrize("path, value, expected", [
    ("zero_quantized_weights", True, r"zero_optimization\.zero_quantized_weights = true: infinity "
                                     r"does not have this DeepSpeed feature; remove the key or set "
                                     r"it to false"),
    ("zero_hpz_partition_size", 8, r"zero_hpz_partition_size = 8.*set it to 1"),
    ("mics_shard_size", 4, r"mics_shard_size = 4.*set it to -1"),
    ("cpu_offload", True, r"cpu_offload = true.*offload_optimizer.*cpu"),
])
def test_deepspeed_features_infinity_lacks_are_refused_when_on(path, value, expected) -> None:
    data = copy.deepcopy(COPIED_ZERO3)
    data["zero_optimization"][path] = value
    with pytest.raises(ConfigError, match=expected):
        InfinityConfig.from_dict(data)


@pytest.mark.parametrize("section, value", [("amp", {"enabled": True}),
                                            ("torch_autocast", {"enabled": True, "dtype": "bf16"}),
                                            ("sparse_gradients", True),
                                            ("elasticity", {"enabled": True,
                                                            "max_train_batch_size": 64})])
def test_top_level_features_infinity_lacks_are_refused_when_on(section, value) -> None:
    data = copy.deepcopy(COPIED_ZERO3)
    data[section] = value
    with pytest.raises(ConfigError, match=rf"{section} = .*remove the key or set it to"):
        InfinityConfig.from_dict(data)


def test_master_weights_in_16_bits_are_refused() -> None:
    data = copy.deepcopy(COPIED_ZERO3)
    data["bf16"]["bf16_master_weights_and_grads"] = True
    with pytest.raises(ConfigError, match=r"bf16\.bf16_master_weights_and_grads = true.*fp32"):
        InfinityConfig.from_dict(data)


@pytest.mark.parametrize("path, value, expected", [
    ("zero_optimization.stage", 4, r"zero_optimization\.stage = 4 is out of range.*\[0, 3\]"),
    ("zero_optimization.offload_optimizer.device", "ssd",
     r"offload_optimizer\.device = 'ssd'.*'none', 'cpu', 'nvme'"),
    ("optimizer.params.lr", -1.0, r"optimizer\.params\.lr = -1\.0 is out of range.*>= 0"),
    ("optimizer.params.betas", [0.9], r"optimizer\.params\.betas = \[0\.9\].*two numbers"),
    ("optimizer.params.betas", [0.9, 1.5], r"optimizer\.params\.betas = 1\.5 is out of range"),
    ("optimizer.params.eps", 0, r"optimizer\.params\.eps = 0\.0 is out of range.*> 0"),
    ("optimizer.type", "Lamb", r"optimizer\.type = 'Lamb'.*only 'Adam' and 'AdamW'"),
    ("bf16.enabled", "yes", r"bf16\.enabled = 'yes': expected true or false"),
    ("aio.block_size", 1000, r"aio\.block_size = 1000 is out of range: expected at least 4096"),
    ("aio.block_size", 6000, r"aio\.block_size = 6000: expected a multiple of 4096"),
    ("aio.queue_depth", 0, r"aio\.queue_depth = 0 is out of range"),
    ("aio.backend", "spdk", r"aio\.backend = 'spdk'.*'io_uring'"),
    ("aio.use_gds", True, r"GPUDirect Storage is not supported"),
    ("zero_optimization.sub_group_size", "lots", r"zero_optimization\.sub_group_size.*'lots'"),
    ("zero_optimization.sub_group_size", -1, r"sub_group_size = -1: must not be negative"),
    ("zero_optimization.offload_optimizer.ratio", 0.5, r"ratio = 0\.5: partial offload is not supported"),
    ("infinity.early_step", "maybe", r"infinity\.early_step = 'maybe'.*'auto', 'on', 'off'"),
    ("infinity.unit_modules", "LlamaDecoderLayer", r"unit_modules = 'LlamaDecoderLayer'.*list"),
    ("infinity.host_memory_budget", "3 parsecs", r"infinity\.host_memory_budget.*3 parsecs"),
    ("fp16.initial_scale_power", 64, r"fp16\.initial_scale_power = 64 is out of range.*\[0, 63\]"),
    ("gradient_clipping", -1, r"gradient_clipping = -1\.0 is out of range"),
    ("scheduler.type", "Cyclic", r"scheduler\.type = 'Cyclic'.*'WarmupLR'"),
    ("zero_optimization.offload_optimizer", [], r"offload_optimizer: expected a JSON object"),
])
def test_bad_value_names_key_value_and_allowed(path: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        InfinityConfig.from_dict(with_change(path, value), world_size=2)


def test_offload_param_below_stage_3_says_use_stage_3() -> None:
    d = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match=r"offload_param\.device = 'cpu' needs ZeRO stage 3.*stage = 2.*\"stage\": 3"):
        InfinityConfig.from_dict(d)
    # device "none" is fine at any stage
    InfinityConfig.from_dict({"zero_optimization": {"stage": 1, "offload_param": {"device": "none"}}})


def test_fp16_and_bf16_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        InfinityConfig.from_dict({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_nvme_without_path_is_an_error() -> None:
    d = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    with pytest.raises(ConfigError, match=r"offload_optimizer\.device is \"nvme\" but .*nvme_path is not set"):
        InfinityConfig.from_dict(d)


def test_early_step_on_with_clipping_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"early_step = 'on'.*gradient_clipping = 1\.0"):
        InfinityConfig.from_dict({"gradient_clipping": 1.0, "infinity": {"early_step": "on"}})


def test_compute_dtype_contradicting_16bit_flag_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"compute_dtype = 'bf16' contradicts fp16\.enabled"):
        InfinityConfig.from_dict({"fp16": {"enabled": True}, "infinity": {"compute_dtype": "bf16"}})


def test_adamw_without_w_mode_is_contradictory_and_type_is_case_insensitive() -> None:
    with pytest.raises(ConfigError, match="adam_w_mode false is contradictory"):
        InfinityConfig.from_dict({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    cfg = InfinityConfig.from_dict({"optimizer": {"type": "adam", "params": {"adam_w_mode": False}}})
    assert cfg.optimizer.type == "Adam" and not cfg.optimizer.adam_w_mode


def test_alias_given_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match="'thread_count' is given twice"):
        InfinityConfig.from_dict({"aio": {"thread_count": 1, "intra_op_parallelism": 2}})
    assert InfinityConfig.from_dict({"bfloat16": {"enabled": True}}).bf16.enabled


@pytest.mark.parametrize("given, world_size, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ({"train_batch_size": 8}, 2, (8, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 4, (12, 3, 1)),
    ({"gradient_accumulation_steps": 5}, 1, (5, 1, 5)),
    ({}, 3, (3, 1, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2, (24, 3, 4)),
    ({"train_batch_size": 6e0, "train_micro_batch_size_per_gpu": 3.0}, 1, (6, 3, 2)),
])
def test_batch_size_arithmetic(given: dict, world_size: int, expected: tuple[int, int, int]) -> None:
    cfg = InfinityConfig.from_dict(given, world_size=world_size)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected
    assert all(type(v) is int for v in got)


@pytest.mark.parametrize("given, world_size", [
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 1),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2),
    ({"train_batch_size": 7}, 2),
])
def test_inconsistent_batch_sizes_list_all_three_and_world_size(given: dict, world_size: int) -> None:
    with pytest.raises(ConfigError) as err:
        InfinityConfig.from_dict(given, world_size=world_size)
    msg = str(err.value)
    for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert name in msg
    assert f"world_size = {world_size}" in msg and f"train_batch_size = {given['train_batch_size']}" in msg


def test_auto_needs_values_and_names_every_key(infinity_log) -> None:
    """Every "auto" without a value is named in one error (it was the first alone: the HF zero3
    config took a dozen rounds); an auto_values path that replaced nothing is warned about (a
    misspelt path was dropped without a word, the config's own value used)."""
    from infinity.config import AutoValueMissing

    with pytest.raises(AutoValueMissing) as err:
        InfinityConfig.from_dict(HF_ZERO3)
    written = {path for path, value in _flatten(HF_ZERO3) if value == "auto"}
    sizes = {p for p in written if p.startswith("zero_optimization.")}   # derived later
    assert set(err.value.keys) == written - sizes, err.value.keys
    assert "are \"auto\" but no value was given" in str(err.value)
    assert "auto_values={" in str(err.value)
    InfinityConfig.from_dict(HF_ZERO3, world_size=2,
                             auto_values={**HF_VALUES, "optimizer.params.l": 1e-3})
    assert any("auto_values ['optimizer.params.l'] replaced nothing" in r.getMessage()
               for r in infinity_log.records)
    partial = {k: v for k, v in HF_VALUES.items() if k != "optimizer.params.eps"}
    with pytest.raises(ConfigError, match=r"optimizer\.params\.eps is \"auto\""):
        InfinityConfig.from_dict(HF_ZERO3, auto_values=partial)


def test_auto_resolution_with_values() -> None:
    cfg = InfinityConfig.from_dict(HF_ZERO3, world_size=2, auto_values=HF_VALUES)
    assert cfg.optimizer.lr == 2e-5 and cfg.optimizer.betas == (0.9, 0.999)
    assert cfg.bf16.enabled and not cfg.fp16.enabled and cfg.gradient_clipping == 1.0
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.scheduler is not None and cfg.scheduler.warmup_num_steps == 10
    # "auto" sizes are derived from budgets later, not filled with DeepSpeed's literals
    assert cfg.zero.reduce_bucket_size is None and cfg.zero.stage3_prefetch_bucket_size is None
    assert cfg.zero.stage3_param_persistence_threshold is None
    assert cfg.zero.sub_group_size == 10**9  # written as a number: the user's choice is kept
    # a size may also be given through auto_values (HF computes some from hidden_size)
    sized = InfinityConfig.from_dict(HF_ZERO3, world_size=2,
                                     auto_values={**HF_VALUES, "zero_optimization.reduce_bucket_size": 4096 * 4096})
    assert sized.zero.reduce_bucket_size == 4096 * 4096
    assert InfinityConfig.from_dict(cfg.to_dict(), world_size=2) == cfg


def test_auto_defaults_for_layout_only_readers() -> None:
    cfg = InfinityConfig.from_dict(HF_ZERO3, auto_defaults=True)
    assert cfg.optimizer.lr == OptimizerConfig().lr and cfg.gradient_clipping == 0.0
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (1, 1)
    assert cfg.zero.stage == 3 and cfg.zero.offload_param.device == "cpu"


def test_sizes_accept_ints_floats_and_units() -> None:
    cfg = InfinityConfig.from_dict({"zero_optimization": {
        "stage": 3, "sub_group_size": "100M", "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 12345, "offload_param": {"buffer_size": "1Mi"}},
        "infinity": {"host_memory_budget": "3GiB", "device_memory_budget": "512MB"}})
    z = cfg.zero
    assert (z.sub_group_size, z.reduce_bucket_size, z.stage3_prefetch_bucket_size) == (10**8, 5 * 10**8, 12345)
    assert z.offload_param.buffer_size == 2**20
    assert cfg.infinity.host_memory_budget == 3 * 2**30 and cfg.infinity.device_memory_budget == 512 * 10**6


def test_a_fractional_count_is_refused_not_cut() -> None:
    """sub_group_size 1.5 became 1 silently (DeepSpeed's int field refuses it); a fractional
    size with a unit is bytes, rounded down."""
    with pytest.raises(ConfigError, match=r"sub_group_size = 1\.5: .*not a whole number"):
        InfinityConfig.from_dict({"zero_optimization": {"stage": 3, "sub_group_size": 1.5}})
    cfg = InfinityConfig.from_dict({"infinity": {"host_memory_budget": "1.5KiB"}})
    assert cfg.infinity.host_memory_budget == 1536


def test_dataclasses_validate_when_built_directly() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.max_in_cpu = -1"):
        OffloadConfig(kind="param", max_in_cpu=-1)
    with pytest.raises(ConfigError, match=r"needs ZeRO stage 3"):
        ZeroConfig(stage=1, offload_param=OffloadConfig(kind="param", device="cpu"))
    assert OffloadConfig(kind="optimizer", buffer_size="4Mi").buffer_size == 4 * 2**20
    with pytest.raises(dataclasses_frozen_error()):
        InfinityConfig().seed = 3  # type: ignore[misc]


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_load_reads_a_json_file(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3_NVME))
    assert InfinityConfig.load(path, world_size=2) == InfinityConfig.from_dict(ZERO3_NVME, world_size=2)
    assert InfinityConfig.load(str(path), world_size=2).zero.stage == 3
    cfg = InfinityConfig()
    assert InfinityConfig.load(cfg) is cfg
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3,, }}')
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON at line 1 column"):
        InfinityConfig.load(bad)
    with pytest.raises(FileNotFoundError):
        InfinityConfig.load(tmp_path / "missing.json")


def test_malloc_mmap_threshold_defaults_to_4mib_and_accepts_null_and_sizes() -> None:
    assert InfinityConfig.from_dict({}).infinity.malloc_mmap_threshold == 4 << 20
    assert InfinityConfig.from_dict(
        {"infinity": {"malloc_mmap_threshold": None}}).infinity.malloc_mmap_threshold is None
    assert InfinityConfig.from_dict(
        {"infinity": {"malloc_mmap_threshold": "8MiB"}}).infinity.malloc_mmap_threshold == 8 << 20


@pytest.mark.parametrize("value", ["64MiB", 0, "lots"])
def test_malloc_mmap_threshold_out_of_glibc_range_is_refused(value) -> None:
    with pytest.raises(ConfigError, match="malloc_mmap_threshold"):
        InfinityConfig.from_dict({"infinity": {"malloc_mmap_threshold": value}})


_SIZES = ("zero_optimization.sub_group_size", "zero_optimization.reduce_bucket_size",
          "zero_optimization.offload_optimizer.buffer_size", "aio.block_size",
          "infinity.host_memory_budget", "infinity.activation_window")
_NUMBERS = ("zero_optimization.stage", "aio.queue_depth", "scheduler.params.warmup_num_steps",
            "optimizer.params.lr", "gradient_clipping", "fp16.loss_scale")


@pytest.mark.parametrize("path, value", [
    *[(p, v) for p in _SIZES for v in (float("inf"), float("nan"), "1e400", "1e300TiB")],
    *[(p, v) for p in _NUMBERS for v in (float("inf"), float("-inf"), float("nan"))],
])
def test_non_finite_numbers_are_config_errors_naming_the_key(path: str, value: object) -> None:
    """Python's json reads Infinity and NaN; int(inf) of a size raised a bare OverflowError."""
    leaf = path.rsplit(".", 1)[-1]
    with pytest.raises(ConfigError, match=rf"{leaf} = .*(finite|integer)"):
        InfinityConfig.from_dict(with_change(path, value), world_size=2)
    text = json.dumps(with_change(path, value))   # as read from a file: bare Infinity / NaN
    assert "Infinity" in text or "NaN" in text or isinstance(value, str)
    with pytest.raises(ConfigError, match=leaf):
        InfinityConfig.from_dict(json.loads(text), world_size=2)


def test_deepspeed_tool_sections_are_ignored() -> None:
    cfg = InfinityConfig.from_dict({"comet": {"enabled": False}, "autotuning": {"enabled": False},
                                    "csv_monitor": {"enabled": True}})
    assert cfg.zero.stage == 0


def test_config_files_are_read_as_deepspeed_reads_them(tmp_path) -> None:
    """DeepSpeed reads ds_config files with hjson: comments and trailing commas are taken (they
    were refused as invalid JSON); a key given twice is refused (the last one silently won:
    a second zero_optimization section replaced the first); a base64 config string works."""
    import base64
    import json as json_module
    path = tmp_path / "ds_config.json"
    path.write_text('''{
      // ZeRO-3 with both offloads
      "train_micro_batch_size_per_gpu": 2,  # per rank
      /* the optimizer section
         as DeepSpeed documents it */
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], },},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},},
    }''')
    cfg = InfinityConfig.load(path)
    assert (cfg.zero.stage, cfg.optimizer.lr, tuple(cfg.optimizer.betas)) == (3, 3e-4, (0.9, 0.95))
    path.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,\n'
                    ' "zero_optimization": {"stage": 1}}')
    with pytest.raises(ConfigError, match=r"ds_config\.json: key 'zero_optimization' is given twice"):
        InfinityConfig.load(path)
    for not_trailing in ('{,}', '{"gradient_clipping": [1.0,,]}'):    # a comma after no value
        path.write_text(not_trailing)
        with pytest.raises(ConfigError, match="not valid JSON"):
            InfinityConfig.load(path)
    path.write_text('{"zero_optimization": {"stage": 3 "offload_param": {}}}')
    with pytest.raises(ConfigError, match=r"not valid JSON at line 1 column 35"):
        InfinityConfig.load(path)
    encoded = base64.b64encode(json_module.dumps({"train_micro_batch_size_per_gpu": 3}).encode())
    assert InfinityConfig.load(encoded.decode()).train_micro_batch_size_per_gpu == 3
    with pytest.raises(FileNotFoundError):
        InfinityConfig.load(str(tmp_path / "missing.json"))


def _integer_keys() -> list[tuple[str, dict]]:
    """Every integer key of the config (fields typed int), with a base config where it counts:
    (key path, config dict holding the key as the placeholder ``"VALUE"``)."""
    import dataclasses

    from infinity.config import (SCHEDULER_KEYS, AioConfig, Fp16Config, InfinitySection,
                                 SchedulerConfig)

    def ints(cls) -> list[str]:
        # the type names int as a word ("int8", a format's name, is no integer)
        return [f.name for f in dataclasses.fields(cls) if re.search(r"\bint\b", str(f.type))]

    keys = [(name, {name: "VALUE"}) for name in ints(InfinityConfig) if name != "world_size"]
    for cls, section in ((ZeroConfig, "zero_optimization"), (Fp16Config, "fp16"),
                         (AioConfig, "aio"), (InfinitySection, "infinity")):
        keys += [(f"{section}.{name}", {section: {name: "VALUE"}}) for name in ints(cls)]
    for kind in ("optimizer", "param"):
        for name in ints(OffloadConfig):
            if name in ("buffer_count", "buffer_size", "max_in_cpu") and \
                    (kind == "param" or name == "buffer_count"):
                keys.append((f"zero_optimization.offload_{kind}.{name}", {"zero_optimization": {
                    "stage": 3, f"offload_{kind}": {"device": "cpu", name: "VALUE"}}}))
    for name in ints(SchedulerConfig):
        kind = next(k for k, allowed in SCHEDULER_KEYS.items() if name in allowed)
        needed = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3} if kind == "OneCycle" else {}
        keys.append((f"scheduler.params.{name}",
                     {"scheduler": {"type": kind, "params": {name: "VALUE", **needed}}}))
    keys.append(("zero_optimization.zero_hpz_partition_size",
                 {"zero_optimization": {"zero_hpz_partition_size": "VALUE"}}))
    return keys


def _put(config: dict, value: object) -> dict:
    return json.loads(json.dumps(config), object_hook=lambda d: {
        k: (value if v == "VALUE" else v) for k, v in d.items()})


GOOD_INTS = {"zero_optimization.stage": 3, "fp16.initial_scale_power": 16, "aio.thread_count": 4,
             "aio.queue_depth": 8, "zero_optimization.zero_hpz_partition_size": 1}


@pytest.mark.parametrize("path, config", _integer_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_integer_key_refuses_true_and_false(path: str, config: dict) -> None:
    """``true`` was taken where a count is expected (Python's True == 1): every integer key of
    the config refuses true and false with the key's name, while a real integer there is read."""
    InfinityConfig.from_dict(_put(config, GOOD_INTS.get(path, 4096)))   # the base is valid
    for flag in (True, False):
        with pytest.raises(ConfigError, match=re.escape(path)):
            InfinityConfig.from_dict(_put(config, flag))


def test_world_size_refuses_a_bool() -> None:
    with pytest.raises(ConfigError, match="world_size = True: expected an integer >= 1"):
        InfinityConfig(world_size=True)


@pytest.mark.parametrize("value, expected", [
    (1e30, r"train_micro_batch_size_per_gpu = 1e\+30 is out of range: expected an integer in \[1, 2147483647\]"),
    (2**40, r"train_micro_batch_size_per_gpu = 1099511627776 is out of range"),
    (2.5, r"train_micro_batch_size_per_gpu = 2\.5: expected an integer"),
    (float("nan"), r"train_micro_batch_size_per_gpu = nan: expected an integer"),
])
def test_a_batch_size_that_is_no_count_is_refused(value: object, expected: str) -> None:
    """1e30 was taken (a whole float, then int(1e30) samples per step)."""
    with pytest.raises(ConfigError, match=expected):
        InfinityConfig.from_dict({"train_micro_batch_size_per_gpu": value})
    assert InfinityConfig.from_dict({"train_micro_batch_size_per_gpu": 4.0}).train_micro_batch_size_per_gpu == 4


def test_integers_of_other_integral_types_are_read_as_ints() -> None:
    """A config built in Python with numpy values: stage np.int64(3) was refused as "expected an
    integer"; numpy and torch integers are integers (their bools are not)."""
    np = pytest.importorskip("numpy")
    import torch
    cfg = InfinityConfig.from_dict({"train_micro_batch_size_per_gpu": np.int32(2),
                                    "gradient_accumulation_steps": torch.tensor(3).item(),
                                    "steps_per_print": np.uint8(5),
                                    "zero_optimization": {"stage": np.int64(3)},
                                    "aio": {"queue_depth": np.int16(16)},
                                    "scheduler": {"type": "WarmupLR",
                                                  "params": {"warmup_num_steps": np.int64(10)}}})
    assert (cfg.zero.stage, cfg.train_micro_batch_size_per_gpu, cfg.aio.queue_depth) == (3, 2, 16)
    assert type(cfg.zero.stage) is int and type(cfg.train_micro_batch_size_per_gpu) is int
    assert type(cfg.aio.queue_depth) is int and type(cfg.steps_per_print) is int
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage = .*True.*not true or false"):
        InfinityConfig.from_dict({"zero_optimization": {"stage": np.bool_(True)}})
    with pytest.raises(ConfigError, match=r"seed = 18446744073709551616 is out of range"):
        InfinityConfig.from_dict({"seed": 2**64})
    with pytest.raises(ConfigError, match=r"steps_per_print = 9223372036854775808 is out of range"):
        InfinityConfig.from_dict({"steps_per_print": 2**63})


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``(key path, value)`` of every leaf of a ds_config."""
    out = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        out += _flatten(value, path) if isinstance(value, dict) else [(path, value)]
    return out


@pytest.mark.parametrize("config, match", [
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
     r"max_grad_norm.*top-level \"gradient_clipping\""),       # was: did you mean set_grad_none
    ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 100}}},
     r"total_num_steps is a key of WarmupDecayLR, WarmupCosineLR, not of WarmupLR"),
    ({"scheduler": {"type": "CosineAnnealingLR", "params": {"T_max": 100}}},
     r"lr_scheduler=lambda opt: torch\.optim\.lr_scheduler\.CosineAnnealingLR\(opt"),
    ({"scheduler": {"type": "WarmupCosineLr"}}, r"did you mean 'WarmupCosineLR'\?"),
    ({"optimizer": {"type": "AdamWW"}}, r"did you mean 'AdamW'\?"),
    ({"sparse_attention": {"mode": "fixed"}}, r"sparse attention kernels are not part"),
    ({"zero_optimization": True}, r"DeepSpeed's old boolean form"),
    # a key of another section: the closest name here misled (communication_data_type)
    ({"compute_dtype": "fp32"}, r'key of the \'infinity\' section.*\{"infinity": \{"compute_dtype"'),
    ({"zero_optimization": {"stage": 3, "early_step": "auto"}},
     r"'early_step' is a key of the 'infinity' section, not of 'zero_optimization'"),
    ({"stage": 3}, r'\{"zero_optimization": \{"stage": 3\}\}'),
    ({"bf16": {"enabled": True, "loss_scale": 0}},       # an fp16 template's: not "write fp16"
     r"'loss_scale' is fp16's loss scaling, which bf16 does not need.*remove it"),
])
def test_what_a_deepspeed_user_writes_wrong_is_named_for_what_it_is(config, match) -> None:
    """Unknown keys and types a DeepSpeed user writes: the closest valid name misled
    (max_grad_norm -> set_grad_none, a WarmupDecayLR key on WarmupLR -> warmup_num_steps), a
    torch scheduler (DeepSpeed builds those) or a misspelt type got a bare list."""
    with pytest.raises(ConfigError, match=match):
        InfinityConfig.from_dict(config)


def test_communication_data_type_is_read_in_any_case() -> None:
    """DeepSpeed lower-cases it ("BF16" was refused here)."""
    assert InfinityConfig.from_dict({"communication_data_type": "BF16"}).communication_data_type \
        == "bf16"


def test_a_16_bit_gradient_accumulation_asked_for_is_said_to_be_fp32(infinity_log) -> None:
    """data_types.grad_accum_dtype was ignored whatever it said ("int7" too)."""
    InfinityConfig.from_dict({"data_types": {"grad_accum_dtype": "fp32"}})
    assert not [r for r in infinity_log.records if r.levelname == "WARNING"]
    InfinityConfig.from_dict({"data_types": {"grad_accum_dtype": "bf16"}})
    assert any("gradients accumulate in fp32 here" in r.getMessage() for r in infinity_log.records)
    with pytest.raises(ConfigError, match=r"data_types\.grad_accum_dtype = 'int7'"):
        InfinityConfig.from_dict({"data_types": {"grad_accum_dtype": "int7"}})
    for name in ("float32", "torch.float32", "float"):     # DeepSpeed's other spellings
        InfinityConfig.from_dict({"data_types": {"grad_accum_dtype": name}})


def test_an_optimizer_section_without_a_type_names_no_optimizer(infinity_log) -> None:
    """DeepSpeed names no optimizer from it (the one passed to initialize, or none): it became
    AdamW here, of settings nobody chose; a refusal then told a user who passed an optimizer
    to write a type."""
    config = InfinityConfig.from_dict({"optimizer": {"params": {"lr": 0.1}}})
    assert config.optimizer is None
    assert any("has no \"type\": it names no optimizer" in r.getMessage()
               for r in infinity_log.records)


def test_deepspeeds_leaf_module_is_said_to_change_nothing(infinity_log) -> None:
    """DeepSpeed's ZeRO-3 fix for MoE blocks was dropped with an INFO line among the ignored."""
    InfinityConfig.from_dict({"zero_optimization": {
        "stage": 3, "leaf_module": {"classes": ["MixtralSparseMoeBlock"]}}})
    assert any("leaf_module is DeepSpeed's way" in r.getMessage() and r.levelname == "WARNING"
               for r in infinity_log.records)


def test_an_nvme_path_under_home_is_the_users_home(monkeypatch) -> None:
    """"~/nvme" was a directory named "~" under the working directory (and the error for a
    missing one suggested `mkdir -p` of that literal path)."""
    monkeypatch.setenv("HOME", "/home/someone")
    z = InfinityConfig.from_dict({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "~/nvme"}}}).zero
    assert z.offload_param.nvme_path == "/home/someone/nvme"
