"""DeepSpeed's keys as infinity reads them where it does not simply take them: those accepted
and ignored (tools it lacks, layouts that change no result here), those accepted only while
switched off (features it lacks: on, they would train something else than asked), and what an
unknown key or type a DeepSpeed user writes means here. Why apart from the parser: these are
tables of another project's vocabulary, which grow as DeepSpeed does; the parser
(config/infinity_config.py) only consults them."""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from infinity.config.optimizer import SCHEDULER_KEYS
from infinity.config.values import is_whole

# DeepSpeed keys we accept and ignore on purpose: they configure tools infinity does not have
# (profilers, compilers), collectives of a world size of 1, or memory layouts that change
# no result here. Anything else unknown is an error.
IGNORED_KEYS: dict[str, tuple[str, ...]] = {
    "": ("zero_allow_untested_optimizer", "activation_checkpointing",
         "flops_profiler", "comms_logger",
         "autotuning",
         "memory_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor",
         "zero_force_ds_cpu_optimizer", "data_types", "compile",
         "disable_allgather",
         "seq_parallel_communication_data_type", "log_level", "disable_python_gc",
         "use_data_before_expert_parallelism", "timers"),
    "zero_optimization": ("allgather_partitions", "ignore_unused_parameters",
                          "load_from_fp32_weights", "elastic_checkpoint",
                          "use_multi_rank_bucket_allreduce", "model_persistence_threshold",
                          "stage3_model_persistence_threshold", "module_granularity_threshold",
                          "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
                          "stage3_use_all_reduce_for_fetch_params", "allgather_sequential",
                          "stage3_allgather_sequential", "memory_efficient_linear",
                          "pipeline_loading_checkpoint", "override_module_apply",
                          "log_trace_cache_warnings", "enable_sanity_checks", "compute_grad_norm",
                          "parameter_alignment", "cpu_offload_use_pin_memory", "leaf_module",
                          "save_muon_momentum_buffer_in_memory"),
    # bf16 steps here accumulate gradients in fp32 and step as they come; DeepSpeed checks
    # bf16 gradients for overflow at stages 1-2 only (check_grad_overflow), not at stage 3; a
    # non-finite gradient here is said by the step (optim/grad_norm.py), not skipped
    "bf16": ("immediate_grad_update", "check_grad_overflow"),
    "optimizer.params": ("torch_adam", "fused"),
}


def _is_off(value: Any) -> bool:
    return value is False or value is None


def _section_off(value: Any) -> bool:
    return value is None or value == {} or (isinstance(value, Mapping) and value.get("enabled") is False)


# DeepSpeed features infinity does not have. A copied config often lists them switched off, so
# that is accepted (logged with the ignored keys); switched on, ignoring them would train something
# else than the config asks for, so it is an error. key -> (is it off?, the off value, what to do)
OFF_ONLY_KEYS: dict[str, dict[str, tuple[Any, str, str]]] = {
    "": {"amp": (_section_off, '{"enabled": false}', "use fp16 or bf16"),
         "comet": (_section_off, '{"enabled": false}', "use tensorboard, csv_monitor or wandb"),
         "torch_autocast": (_section_off, '{"enabled": false}', "use bf16 or fp16"),
         "sparse_gradients": (_is_off, "false", ""),
         "progressive_layer_drop": (_section_off, '{"enabled": false}', ""),
         "curriculum_learning": (_section_off, '{"enabled": false}', ""),
         "data_efficiency": (_section_off, '{"enabled": false}', ""),
         "eigenvalue": (_section_off, '{"enabled": false}', ""),
         "compression_training": (_section_off, "{}", ""),
         "graph_harvesting": (_is_off, "false", ""),
         # its other keys (tag_validation, load_universal, writers) change nothing here; node-
         # local storage would fail at the first save, hours in: every rank writes its part
         # into one directory that rank 0 commits
         "checkpoint": (lambda v: v is None or (isinstance(v, Mapping) and not
                                                v.get("use_node_local_storage")),
                        '{"use_node_local_storage": false}',
                        "checkpoints are written by every rank into one directory on a file "
                        "system every rank mounts"),
         # ranks' gradients are averaged here; DeepSpeed's "sum" adds them (stages 0-2)
         "gradient_allreduce_op": (lambda v: v is None or (isinstance(v, str) and
                                                           v.lower() == "mean"), '"mean"',
                                   "gradients are averaged over ranks here; for a sum, multiply "
                                   "the loss by the world size"),
         # DeepSpeed's default (since 0.19.4): step() counts the micro-batches, as here always
         "managed_gradient_accumulation": (lambda v: v is None or v is True, "true",
                                           "engine.step() counts micro-batches here always"),
         # DeepSpeed's elasticity picks the batch sizes: ignored, the run would take another
         "elasticity": (lambda v: v is None or (isinstance(v, Mapping) and v.get("enabled") in
                                               (None, False)), '{"enabled": false}',
                        "set train_batch_size, train_micro_batch_size_per_gpu and "
                        "gradient_accumulation_steps to the sizes wanted")},
    "fp16": {"fp16_master_weights_and_grads": (_is_off, "false", "master weights stay fp32")},
    "bf16": {"bf16_master_weights_and_grads": (_is_off, "false", "master weights stay fp32"),
             "bf16_optimizer_states": (_is_off, "false",
                                       'for bf16 Adam moments set infinity.optimizer_moments '
                                       '"bf16"')},
    # a config written for torch's Adam lists it off; infinity's CPU Adam has none
    "optimizer.params": {"amsgrad": (_is_off, "false", "infinity's CPU Adam has no AMSGrad"),
                         # DeepSpeedCPUAdam's and FusedAdam's own switches, at their defaults
                         "fp32_optimizer_states": (lambda v: v is None or v is True, "true",
                                                   'for 16-bit Adam moments set '
                                                   'infinity.optimizer_moments "bf16"'),
                         "set_grad_none": (lambda v: v is None or isinstance(v, bool), "true",
                                           "")},
    "zero_optimization": {
        "zero_quantized_weights": (_is_off, "false", ""),
        "zero_quantized_nontrainable_weights": (_is_off, "false", ""),
        "zero_quantized_gradients": (_is_off, "false", ""),
        "zero_hpz_partition_size": (lambda v: is_whole(v) and v in (0, 1), "1", ""),
        "mics_shard_size": (lambda v: is_whole(v) and v <= 0, "-1", ""),
        "mics_hierarchical_params_gather": (_is_off, "false", ""),
        "legacy_stage1": (_is_off, "false", ""),
        "cpu_offload": (_is_off, "false",
                        'DeepSpeed\'s old spelling: use "offload_optimizer": {"device": "cpu"}'),
        "cpu_offload_param": (_is_off, "false",
                              'DeepSpeed\'s old spelling: use "offload_param": {"device": "cpu"}'),
        "zenflow": (_section_off, "null", ""),
        "zeropp_loco_param": (_is_off, "null", ""),
    },
}


KEY_HINTS = {
    "optimizer.params.max_grad_norm": "gradient clipping is the top-level "
                                      "\"gradient_clipping\" (as in DeepSpeed)",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not part of infinity; remove "
                        "the section (the model's own attention runs)",
}
"""Unknown keys a DeepSpeed user writes whose closest valid name would mislead."""

TORCH_SCHEDULERS = ("LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR",
                    "LinearLR", "ExponentialLR", "PolynomialLR", "CosineAnnealingLR",
                    "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR", "SequentialLR",
                    "ChainedScheduler", "ReduceLROnPlateau")
"""``torch.optim.lr_scheduler``'s classes, which DeepSpeed builds from a config's type."""


def scheduler_hint(kind: Any) -> str:
    """What to do about a scheduler type infinity does not build: a torch class (DeepSpeed
    builds those), or a misspelling of one of DeepSpeed's."""
    if kind in TORCH_SCHEDULERS:
        return (f"; torch's {kind} is built in the script here: pass infinity.initialize("
                f"..., lr_scheduler=lambda opt: torch.optim.lr_scheduler.{kind}(opt, ...)) and "
                "leave the \"scheduler\" section out")
    names = {name.lower(): name for name in SCHEDULER_KEYS}
    close = names.get(str(kind).lower()) or next(iter(difflib.get_close_matches(
        str(kind), list(SCHEDULER_KEYS), n=1, cutoff=0.6)), None)
    return f" (did you mean {close!r}?)" if close else ""


def schedule_of_key(key: str, kind: str) -> str:
    """For a scheduler.params key of another schedule: which schedules take it."""
    takers = [name for name, keys in SCHEDULER_KEYS.items() if key in keys]
    return (f"{key} is a key of {', '.join(takers)}, not of {kind}" if takers else "")
