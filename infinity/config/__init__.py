"""The run configuration, parsed from a DeepSpeed-style ``ds_config.json`` in one place.

``InfinityConfig`` is the whole configuration (config/infinity_config.py: the JSON parser, unknown
keys, aliases, "auto"); each section is a frozen, keyword-only dataclass in a module of its own,
validating its values in ``__post_init__`` with the checks in config/values.py, which name the
key path in every error. Pure: imports nothing above config/ but the base helpers (log, sizes).
"""
from infinity.config.aio import AioConfig
from infinity.config.infinity_config import IGNORED_KEYS, OFF_ONLY_KEYS, InfinityConfig
from infinity.config.infinity_section import InfinitySection
from infinity.config.optimizer import SCHEDULER_KEYS, OptimizerConfig, SchedulerConfig
from infinity.config.precision import Bf16Config, Fp16Config
from infinity.config.values import AutoValueMissing, ConfigError
from infinity.config.zero import OffloadConfig, ZeroConfig

__all__ = [
    "AutoValueMissing", "ConfigError", "InfinityConfig", "OptimizerConfig", "SchedulerConfig", "Fp16Config",
    "Bf16Config", "OffloadConfig", "ZeroConfig", "AioConfig", "InfinitySection",
    "IGNORED_KEYS", "OFF_ONLY_KEYS", "SCHEDULER_KEYS",
]
