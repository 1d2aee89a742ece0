"""The typed run configuration, parsed from a DeepSpeed-style ``ds_config.json`` in one place.

Users bring the JSON they already have for DeepSpeed; everything downstream (engine, storage,
optimizer, planner) reads these frozen, keyword-only dataclasses instead of dict lookups, so
every default lives in one place and every bad key or value is caught before any memory is
touched. Each section is a module of this package, their shared value checks are in
``config/values.py``; this module holds the whole configuration and the JSON parser.

Rules kept here:

* Unknown or misspelled keys are errors naming the key path and the closest valid key. An
  explicit list of DeepSpeed keys that infinity ignores on purpose is accepted with one log line,
  and so are DeepSpeed features infinity lacks while they are switched off (on, they are errors):
  the tables are config/deepspeed_keys.py's.
* ``"auto"`` (as written by the Hugging Face integration) for a *size* (sub-groups, buffers,
  buckets) means "derive it from the memory budgets" (``None`` here; ``infinity.planner.sizes`` fills
  it in), never DeepSpeed's literal defaults (a 1e9-element sub-group is 12 GB of host buffers).
  ``"auto"`` for any other value (lr, betas, batch sizes, ...) needs a resolved value from the
  caller: ``from_dict(d, auto_values={"optimizer.params.lr": 3e-4})``.
* Sizes accept ints, floats such as ``5e8`` and strings with units (``"3GiB"``, ``"100M"``).
  Sizes of tensors (``sub_group_size``, bucket sizes, ``buffer_size``) count *elements*, as in
  DeepSpeed; memory budgets and ``aio.block_size`` count bytes.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from infinity.config.aio import AioConfig
from infinity.config.deepspeed_keys import (
    IGNORED_KEYS,
    KEY_HINTS,
    OFF_ONLY_KEYS,
    schedule_of_key,
    scheduler_hint,
)
from infinity.config.file import check_nesting, decode_base64_config, read_config_file
from infinity.config.infinity_section import InfinitySection
from infinity.config.monitor import CsvMonitorConfig, TensorBoardConfig, WandbConfig
from infinity.config.optimizer import SCHEDULER_KEYS, OptimizerConfig, SchedulerConfig
from infinity.config.precision import Bf16Config, Fp16Config, check_communication_dtype
from infinity.config.values import (
    AUTO,
    AutoValueMissing,
    ConfigError,
    check_bool,
    check_float,
    check_int,
    is_whole,
    log,
    set_field,
)
from infinity.config.zero import OFFLOAD_KEYS, SIZE_KEYS, OffloadConfig, ZeroConfig

ACTIVATION_OFFLOAD_KEYS = ("partition_activations", "cpu_checkpointing")
"""DeepSpeed's activation_checkpointing keys that move activations off the GPU: ignored here,
where the model's checkpointing is its own (``gradient_checkpointing_enable()``) and the saved
activations go to NVMe by ``infinity.offload_activations``."""


def _warn_activation_checkpointing(section: Any) -> None:
    """A ds_config asking DeepSpeed to partition or offload checkpointed activations: said to
    do nothing here, naming what does (it was ignored with an INFO line among other keys)."""
    if not isinstance(section, Mapping):
        return
    asked = [k for k in ACTIVATION_OFFLOAD_KEYS if section.get(k)]
    if asked:
        log.warning("activation_checkpointing.%s is a DeepSpeed setting infinity does not use: "
                    "nothing moves activations because of it. Checkpoint blocks with the "
                    "model's own gradient_checkpointing_enable() (or torch.utils.checkpoint), and "
                    "send saved activations to the swap space with infinity.offload_activations "
                    "\"nvme\" (\"auto\" does when they exceed the host budget)",
                    " and .".join(asked))


_DTYPE_NAMES = {"float32": "fp32", "float": "fp32", "torch.float32": "fp32",
                "bfloat16": "bf16", "torch.bfloat16": "bf16",
                "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
"""The other spellings of a dtype DeepSpeed's DtypeEnum reads."""


def _check_data_types(section: Any) -> None:
    """DeepSpeed's ``data_types.grad_accum_dtype``: gradients accumulate in fp32 here whatever
    it says; a 16-bit one asked for is said to be fp32 (more precise than asked, and another
    training than DeepSpeed's), a value DeepSpeed would refuse is refused."""
    if section is None:
        return
    if not isinstance(section, Mapping):
        raise ConfigError(f"data_types: expected a JSON object, got {section!r}")
    asked = section.get("grad_accum_dtype")
    if asked is None:
        return
    asked = _DTYPE_NAMES.get(asked, asked) if isinstance(asked, str) else asked
    if asked not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"data_types.grad_accum_dtype = {asked!r}: expected \"fp32\", "
                          "\"bf16\" or \"fp16\" (gradients accumulate in fp32 here)")
    if asked != "fp32":
        log.warning("data_types.grad_accum_dtype = %r: gradients accumulate in fp32 here (more "
                    "precise than asked; DeepSpeed would round each micro-batch's sum to %s)",
                    asked, asked)


MAX_BATCH_SIZE = 2**31 - 1
"""Batch sizes above this (samples per step) are refused as a typo (1e30), not a plan."""


# ----------------------------------------------------------------------------------------------
# The whole configuration.

@dataclass(frozen=True, kw_only=True)
class InfinityConfig:
    """A whole run's configuration. Build it with ``from_dict`` / ``load``, print it with ``to_dict``.

    Batch sizes follow DeepSpeed: ``train_batch_size = micro * gradient_accumulation_steps *
    world_size``; any two determine the third (none given: micro 1, accumulation 1).
    """

    train_batch_size: int | None = None
    """Samples per optimizer step over all ranks."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches accumulated per optimizer step."""
    world_size: int = 1
    """Ranks in the run (not part of the JSON; from torch.distributed)."""
    optimizer: OptimizerConfig | None = None
    """The optimizer; None when the config has no ``"optimizer"`` section (then
    ``initialize`` needs ``optimizer=torch.optim.AdamW(...)``, whose settings it takes over)."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule; None = constant lr."""
    fp16: Fp16Config = field(default_factory=Fp16Config)
    """fp16 compute and loss scaling."""
    bf16: Bf16Config = field(default_factory=Bf16Config)
    """bf16 compute."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this value; 0 = off."""
    communication_data_type: str | None = None
    """The dtype gradients are reduced in over the ranks on a GPU ("fp32", "bf16", "fp16"; None
    = the gradients' own dtype, as DeepSpeed): the device buffer, the collective and the copy
    of the shard to the host. A CPU device reduces in fp32 on the host whatever it says."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage, home tiers, sizes (JSON key "zero_optimization")."""
    aio: AioConfig = field(default_factory=AioConfig)
    """Async I/O engine settings."""
    infinity: InfinitySection = field(default_factory=InfinitySection)
    """Budgets and compute choices."""
    wall_clock_breakdown: bool = False
    """Log the time of forward, backward and step phases."""
    steps_per_print: int = 10
    """Log progress every this many optimizer steps."""
    seed: int | None = None
    """Seed for torch's generators at engine start; None = leave them alone."""
    dataloader_drop_last: bool = False
    """The loader ``initialize(training_data=...)`` returns drops a last, short batch."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard events of each step (DeepSpeed's tags, engine/monitor.py)."""
    csv_monitor: CsvMonitorConfig = field(default_factory=CsvMonitorConfig)
    """CSV files of the same events."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging of the same events."""

    def __post_init__(self) -> None:
        set_field(self, "world_size", check_int("world_size", self.world_size, 1))
        self._resolve_batch_sizes()
        for name, cls in (("fp16", Fp16Config), ("bf16", Bf16Config),
                          ("zero", ZeroConfig), ("aio", AioConfig), ("infinity", InfinitySection),
                          ("tensorboard", TensorBoardConfig), ("csv_monitor", CsvMonitorConfig),
                          ("wandb", WandbConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: expected {cls.__name__}, got {getattr(self, name)!r}")
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError(f"optimizer: expected OptimizerConfig or None, got {self.optimizer!r}")
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler: expected SchedulerConfig or None, got {self.scheduler!r}")
        set_field(self, "gradient_clipping", check_float("gradient_clipping", self.gradient_clipping, 0.0))
        check_bool("wall_clock_breakdown", self.wall_clock_breakdown)
        set_field(self, "steps_per_print", check_int("steps_per_print", self.steps_per_print, 1))
        check_bool("dataloader_drop_last", self.dataloader_drop_last)
        if self.seed is not None:
            set_field(self, "seed", check_int("seed", self.seed, 0, 2**64 - 1))   # torch.manual_seed's range
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled are both true: enable at most one")
        dtype = self.infinity.compute_dtype
        if dtype == "fp16" and not self.fp16.enabled:
            raise ConfigError("infinity.compute_dtype = 'fp16' needs loss scaling: set fp16.enabled true")
        if (dtype == "bf16" and self.fp16.enabled) or (dtype == "fp16" and self.bf16.enabled):
            other = "fp16" if dtype == "bf16" else "bf16"
            raise ConfigError(f"infinity.compute_dtype = {dtype!r} contradicts {other}.enabled = true")
        if dtype == "auto":    # as a GPU resolves it (the planner checks the resolved one too)
            dtype = "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32"
        set_field(self, "communication_data_type",
                  check_communication_dtype(self.communication_data_type, dtype))
        if self.infinity.offload_activations == "nvme" and self.zero.swap_path is None:
            raise ConfigError("infinity.offload_activations is \"nvme\" but no swap directory is "
                              "configured: set zero_optimization.offload_param.nvme_path or "
                              "offload_optimizer.nvme_path")
        if self.infinity.early_step == "on":
            blockers = []
            if self.gradient_clipping > 0:
                blockers.append(f"gradient_clipping = {self.gradient_clipping} (needs the global norm first)")
            if self.fp16.enabled:
                blockers.append("fp16.enabled = true (needs the overflow check first)")
            # with gradient_accumulation_steps > 1 "on" steps each unit in the last
            # micro-batch's backward (see optim/boundary_steps.py)
            if blockers:
                raise ConfigError("infinity.early_step = 'on' cannot be used with "
                                  + "; ".join(blockers) + ": set early_step 'auto' or 'off'")

    def _resolve_batch_sizes(self) -> None:
        ws = self.world_size
        train, micro, accum = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                               self.gradient_accumulation_steps)
        names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        train, micro, accum = (None if v is None else check_int(name, v, 1, MAX_BATCH_SIZE)
                               for name, v in zip(names, (train, micro, accum)))

        def inconsistent(why: str) -> ConfigError:
            return ConfigError(
                f"batch sizes are inconsistent ({why}): train_batch_size = {train}, "
                f"train_micro_batch_size_per_gpu = {micro}, gradient_accumulation_steps = {accum}, "
                f"world_size = {ws}; DeepSpeed's rule is train_batch_size = micro * "
                "gradient_accumulation_steps * world_size (give any two)")

        if train is not None and micro is not None:
            if accum is None:
                if train % (micro * ws):
                    raise inconsistent("train_batch_size is not a multiple of micro * world_size")
                accum = train // (micro * ws)
        elif train is not None and accum is not None:
            if train % (accum * ws):
                raise inconsistent("train_batch_size is not a multiple of accumulation * world_size")
            micro = train // (accum * ws)
        elif train is not None:
            if train % ws:
                raise inconsistent("train_batch_size is not a multiple of world_size")
            micro, accum = train // ws, 1
        else:
            micro = 1 if micro is None else micro
            accum = 1 if accum is None else accum
        train = micro * accum * ws if train is None else train
        if train != micro * accum * ws:
            raise inconsistent(f"{micro} * {accum} * {ws} = {micro * accum * ws}")
        set_field(self, "train_batch_size", train)
        set_field(self, "train_micro_batch_size_per_gpu", micro)
        set_field(self, "gradient_accumulation_steps", accum)

    # -- reading and writing ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, world_size: int = 1,
                  auto_values: Mapping[str, Any] | None = None,
                  auto_defaults: bool = False) -> "InfinityConfig":
        """Parse a ds_config dict.

        ``auto_values`` maps key paths (``"optimizer.params.lr"``, ``"train_batch_size"``) to the
        values that replace ``"auto"``. ``auto_defaults=True`` lets any other ``"auto"`` take the
        default instead of raising; only for tools that read a config for its memory layout
        (``infinity plan``), never for a training run.
        """
        check_nesting(d, "the config")
        return _Parser(dict(auto_values or {}), auto_defaults).config(d, world_size)

    @classmethod
    def load(cls, source: "str | Path | Mapping[str, Any] | InfinityConfig", *, world_size: int = 1,
             auto_values: Mapping[str, Any] | None = None,
             auto_defaults: bool = False) -> "InfinityConfig":
        """Read a ``.json`` file, a dict, or pass an InfinityConfig through unchanged."""
        if isinstance(source, InfinityConfig):
            return source
        if isinstance(source, Mapping):
            data = source
        else:
            path = Path(source)
            encoded = decode_base64_config(source) if isinstance(source, str) and \
                not path.exists() else None
            if encoded is not None:
                data = encoded
            else:
                # the one reader of a config path (the CLI's too): FileNotFoundError names the
                # path, a FIFO or device is refused before opening, comments and trailing
                # commas are read as DeepSpeed's hjson reads them, a duplicate key is refused
                data = read_config_file(path)
        return cls.from_dict(data, world_size=world_size, auto_values=auto_values,
                             auto_defaults=auto_defaults)

    def to_dict(self) -> dict[str, Any]:
        """The ds_config this run uses, with every default and resolved value written out.

        ``InfinityConfig.from_dict(cfg.to_dict(), world_size=cfg.world_size) == cfg``; sizes still
        derived from budgets appear as ``"auto"``.
        """
        out: dict[str, Any] = {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.to_dict()
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.to_dict()
        out.update({
            "fp16": self.fp16.to_dict(), "bf16": self.bf16.to_dict(),
            "gradient_clipping": self.gradient_clipping,
            **({} if self.communication_data_type is None else
               {"communication_data_type": self.communication_data_type}),
            "zero_optimization": self.zero.to_dict(), "aio": self.aio.to_dict(),
            "infinity": self.infinity.to_dict(),
            "wall_clock_breakdown": self.wall_clock_breakdown,
            "steps_per_print": self.steps_per_print,
            "dataloader_drop_last": self.dataloader_drop_last,
        })
        for name in _MONITORS:
            section = getattr(self, name)
            if section != type(section)():
                out[name] = section.to_dict()
        if self.seed is not None:
            out["seed"] = self.seed
        return out


# ----------------------------------------------------------------------------------------------
# JSON -> dataclasses. Only key handling lives here; values are checked in __post_init__.

_TOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "optimizer", "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization",
             "communication_data_type", "aio", "infinity", "wall_clock_breakdown",
             "steps_per_print", "seed",
             "dataloader_drop_last", "tensorboard", "csv_monitor", "wandb")
_MONITORS = ("tensorboard", "csv_monitor", "wandb")
_ALIASES: dict[str, dict[str, str]] = {
    "": {"bfloat16": "bf16"},
    "aio": {"intra_op_parallelism": "thread_count"},
    "zero_optimization": {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    },
}
# Keys whose own choices include "auto" (resolved later by the planner and engine, not here).
_AUTO_IS_A_CHOICE = frozenset({"aio.backend", "infinity.early_step", "infinity.speculative_step",
                               "infinity.compute_dtype", "infinity.offload_activations",
                               "infinity.host_memory_budget", "infinity.device_memory_budget"})
_ZERO_SCALARS = tuple(f.name for f in dataclasses.fields(ZeroConfig)
                      if f.name not in ("offload_optimizer", "offload_param"))



def _other_home(key: str, path: str, value: Any) -> str:
    """Where ``key`` belongs when it is a key of one other section (``compute_dtype`` written
    at the top level belongs in "infinity"): the closest name here misled ("did you mean
    'communication_data_type'?")."""
    sections = {"infinity": InfinitySection, "aio": AioConfig, "fp16": Fp16Config,
                "bf16": Bf16Config}
    homes = [name for name, cls in sections.items()
             if name != path and key in {f.name for f in dataclasses.fields(cls)}]
    if path != "zero_optimization" and key in _ZERO_SCALARS + ("offload_optimizer",
                                                               "offload_param"):
        homes.append("zero_optimization")
    if len(homes) != 1:
        return ""
    if path == "bf16" and homes == ["fp16"]:    # an fp16 template's key: no loss scale here
        return (f"{key!r} is fp16's loss scaling, which bf16 does not need (its range is "
                "fp32's): remove it")
    return (f"{key!r} is a key of the {homes[0]!r} section, not of "
            f"{repr(path) if path else 'the top level'}: write "
            f"{{\"{homes[0]}\": {{\"{key}\": {json.dumps(value, default=str)}}}}}")


class _Parser:
    """Walks the JSON: checks keys (unknown, aliases, ignored), resolves "auto", builds sections."""

    def __init__(self, auto_values: dict[str, Any], auto_defaults: bool) -> None:
        self.auto_values = auto_values
        self.auto_defaults = auto_defaults
        self.ignored: list[str] = []
        self.missing: list[str] = []        # "auto" keys with no value
        self.filled: set[str] = set()      # the auto_values taken

    def keys(self, data: Any, path: str, allowed: tuple[str, ...],
             hint: Callable[[str], str] | None = None) -> dict[str, Any]:
        """``data`` with aliases renamed and ignored keys dropped; unknown keys raise (``hint``:
        what an unknown key means here, where a close name would mislead)."""
        where = path or "the top level"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a JSON object, got {data!r}")
        if not path and ("model_type" in data or "architectures" in data):
            raise ConfigError(
                f"this is a transformers model config (model_type "
                f"{data.get('model_type')!r}), not a ds_config: it describes the model, not "
                "its training. Pass it where a model config is asked for (--hf-config of "
                "infinity plan and infinity train), and a DeepSpeed-format ds_config here")
        aliases = _ALIASES.get(path, {})
        ignored = IGNORED_KEYS.get(path, ())
        off_only = OFF_ONLY_KEYS.get(path, {})
        out: dict[str, Any] = {}
        for key, value in data.items():
            full = f"{path}.{key}" if path else str(key)
            name = aliases.get(key, key)
            if name in allowed:
                if name in out:
                    raise ConfigError(f"{full}: {name!r} is given twice (once through an alias)")
                out[name] = value
            elif key in ignored:
                self.ignored.append(full)
            elif key in off_only:
                is_off, off_value, advice = off_only[key]
                if not is_off(value):
                    raise ConfigError(
                        f"{full} = {json.dumps(value)}: infinity does not have this DeepSpeed "
                        f"feature; remove the key or set it to {off_value}"
                        + (f" ({advice})" if advice else ""))
                self.ignored.append(full)
            else:
                known = (KEY_HINTS.get(full) or (hint(str(key)) if hint is not None else "")
                         or _other_home(str(key), path, value))
                valid = sorted(set(allowed) | set(aliases) | set(ignored) | set(off_only))
                close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
                advice = known or (f"did you mean {(f'{path}.' if path else '') + close[0]!r}?"
                                   if close else f"valid keys here: {', '.join(allowed)}")
                raise ConfigError(f"unknown key {full!r} in the config: {advice}")
        return out

    def resolve(self, values: dict[str, Any], path: str,
                sizes: frozenset[str] = SIZE_KEYS) -> dict[str, Any]:
        """Replace "auto": sizes -> None (derived later); anything else -> auto_values[path]."""
        out = {}
        for key, value in values.items():
            full = f"{path}.{key}" if path else key
            if isinstance(value, str) and value == AUTO and full not in _AUTO_IS_A_CHOICE:
                if full in self.auto_values:
                    value = self.auto_values[full]
                    self.filled.add(full)
                elif key in sizes:
                    value = None
                elif self.auto_defaults:
                    continue  # the dataclass default (batch sizes: derived by the batch rule)
                else:
                    self.missing.append(full)   # all of them named at the end (config())
                    continue
            out[key] = value
        return out

    def config(self, data: Any, world_size: int) -> InfinityConfig:
        """The config of ``data``; every "auto" left without a value named in one error (a
        section's own check failing on a default that stood in for one is not the error)."""
        try:
            config = self._config(data, world_size)
        except (ValueError, TypeError):
            if self.missing:
                raise AutoValueMissing(self.missing) from None
            raise
        if self.missing:
            raise AutoValueMissing(self.missing)
        unused = sorted(set(self.auto_values) - self.filled)
        if unused:    # a misspelt path, or a value the config writes itself: never taken
            log.warning("auto_values %s replaced nothing: the config has no \"auto\" at %s "
                        "(a misspelt key path, or a value the config writes itself, which is "
                        "the one used)", unused, "that path" if len(unused) == 1 else "those paths")
        return config

    def _config(self, data: Any, world_size: int) -> InfinityConfig:
        top = self.keys(data, "", _TOP_KEYS)
        kwargs: dict[str, Any] = {"world_size": world_size}
        scalars = {k: v for k, v in top.items() if k not in
                   ("optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "aio", "infinity",
                    *_MONITORS)}
        kwargs.update(self.resolve(scalars, "", sizes=frozenset()))
        if isinstance(top.get("optimizer"), Mapping) and "type" not in top["optimizer"]:
            # DeepSpeed names no optimizer from such a section (the one passed to initialize,
            # or none); it became AdamW here, of settings nobody chose
            log.warning("the config's \"optimizer\" section has no \"type\": it names no "
                        "optimizer and is not used (write \"type\": \"AdamW\" or \"Adam\" "
                        "to train with its params)")
        elif "optimizer" in top:
            kwargs["optimizer"] = self.optimizer(top["optimizer"])
        if top.get("scheduler") is not None:
            kwargs["scheduler"] = self.scheduler(top["scheduler"])
        for name, cls in (("fp16", Fp16Config), ("bf16", Bf16Config), ("aio", AioConfig),
                          ("infinity", InfinitySection), ("tensorboard", TensorBoardConfig),
                          ("csv_monitor", CsvMonitorConfig), ("wandb", WandbConfig)):
            if name in top:
                allowed = tuple(f.name for f in dataclasses.fields(cls))
                kwargs[name] = cls(**self.resolve(self.keys(top[name], name, allowed), name))
        if "zero_optimization" in top:
            kwargs["zero"] = self.zero(top["zero_optimization"])
        config = InfinityConfig(**kwargs)
        _warn_activation_checkpointing(data.get("activation_checkpointing"))
        _check_data_types(data.get("data_types"))
        zero = data.get("zero_optimization")
        if isinstance(zero, Mapping) and zero.get("leaf_module"):
            log.warning("zero_optimization.leaf_module is DeepSpeed's way to fetch a module (a "
                        "mixture-of-experts block) whole at stage 3; infinity fetches each unit "
                        "whole (decoder layers by default; infinity.unit_modules names the "
                        "classes), and experts hit on one rank only train as they are: the key "
                        "changes nothing here")
        if self.ignored:
            log.info("ignoring DeepSpeed keys that infinity does not use: %s", ", ".join(self.ignored))
        return config

    def optimizer(self, data: Any) -> OptimizerConfig:
        section = self.keys(data, "optimizer", ("type", "params"))
        kwargs = self.resolve({k: v for k, v in section.items() if k != "params"}, "optimizer")
        params = self.keys(section.get("params", {}), "optimizer.params",
                           ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"))
        kwargs.update(self.resolve(params, "optimizer.params"))
        return OptimizerConfig(**kwargs)

    def scheduler(self, data: Any) -> SchedulerConfig:
        section = self.keys(data, "scheduler", ("type", "params"))
        kind = section.get("type")
        if kind not in SCHEDULER_KEYS:
            raise ConfigError(f"scheduler.type = {kind!r}: expected one of "
                              f"{', '.join(map(repr, SCHEDULER_KEYS))}{scheduler_hint(kind)}")
        params = self.keys(section.get("params", {}), "scheduler.params", SCHEDULER_KEYS[kind],
                           hint=lambda key: schedule_of_key(key, kind))
        return SchedulerConfig(type=kind, **self.resolve(params, "scheduler.params"))

    def zero(self, data: Any) -> ZeroConfig:
        path = "zero_optimization"
        if isinstance(data, bool):      # DeepSpeed's old form
            raise ConfigError(f"zero_optimization = {json.dumps(data)}: DeepSpeed's old "
                              "boolean form; write the section, e.g. {\"stage\": 1}"
                              if data else "zero_optimization = false: write {\"stage\": 0}")
        section = self.keys(data, path, _ZERO_SCALARS + ("offload_optimizer", "offload_param"))
        kwargs = self.resolve({k: v for k, v in section.items()
                               if k not in ("offload_optimizer", "offload_param")}, path)
        for kind in ("optimizer", "param"):
            raw = section.get(f"offload_{kind}")
            if raw is None:
                continue
            sub = f"{path}.offload_{kind}"
            values = self.resolve(self.keys(raw, sub, OFFLOAD_KEYS[kind]), sub)
            kwargs[f"offload_{kind}"] = OffloadConfig(kind=kind, **values)
        return ZeroConfig(**kwargs)
