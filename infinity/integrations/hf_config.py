"""A ds_config filled from ``transformers.TrainingArguments``, as Hugging Face's DeepSpeed
integration fills it (``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``_finalize``).

Why a module: the rule is data in, data out (a dict and the arguments' values), testable without
a Trainer. Each key the Trainer also decides is filled where the config says ``"auto"``, and a
value written that disagrees with the argument is an error listing every disagreement (HF's
rule, so a run never trains with two answers to one question). Two differences from HF, both so
that swapping the Trainer's import changes nothing else: the batch sizes, accumulation and
``gradient_clipping`` are also filled when absent (the plain Trainer clips at ``max_grad_norm``
1.0 by default; HF+DeepSpeed silently did not), and sizes (bucket sizes, persistence threshold)
are left to infinity's budgets rather than derived from ``hidden_size``. And
``infinity.compute_dtype`` left "auto" (or absent) takes the Trainer's training precision:
bf16 with ``bf16=True`` (or ``bf16.enabled``), fp32 without, "auto" where the config's fp16 is
enabled (its rule): "auto" alone, with no bf16 section, picks bf16 on a CPU with native bf16.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping

from infinity.config.file import decode_base64_config, read_config_file

AUTO = "auto"


def read_ds_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The ds_config dict of ``source``: a dict (copied), a JSON path or a base64 string."""
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, str) and not Path(source).exists():
        decoded = decode_base64_config(source)
        if decoded is not None:
            return decoded
    return read_config_file(Path(source))


def fill_from_training_args(ds: Mapping[str, Any], args: Any, *, world_size: int,
                            max_steps: int) -> dict[str, Any]:
    """``ds`` with the Trainer's values in place of ``"auto"`` (and of the absent keys named in
    the module docstring); raises ValueError listing each explicit value that disagrees."""
    out = copy.deepcopy(dict(ds))
    filler = _Filler(out)
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    filler.match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size",
                 absent=True)
    filler.match("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps",
                 absent=True)
    filler.match("train_batch_size", world_size * micro * accumulation,
                 "train_batch_size (world size x per_device_train_batch_size x "
                 "gradient_accumulation_steps)", absent=True)
    filler.match("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm",
                 absent=True)
    if isinstance(out.get("optimizer"), Mapping):
        filler.match("optimizer.params.lr", args.learning_rate, "learning_rate")
        filler.match("optimizer.params.betas", [args.adam_beta1, args.adam_beta2],
                     "adam_beta1+adam_beta2")
        filler.match("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        filler.match("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    if isinstance(out.get("scheduler"), Mapping):
        filler.fill_only("scheduler.params.warmup_min_lr", 0.0)
        filler.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
        filler.match("scheduler.params.total_num_steps", max_steps,
                     "num_training_steps (calculated)")
        filler.match("scheduler.params.warmup_num_steps",
                     max(1, args.get_warmup_steps(max_steps)), "warmup_steps")
    filler.match("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    filler.match("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    section = out.setdefault("infinity", {})
    if isinstance(section, dict) and section.get("compute_dtype", AUTO) == AUTO:
        # the Trainer's training precision, as transformers' own computes (the *_full_eval
        # flags are evaluation's): "auto" alone, with no bf16 section, picks bf16 on a CPU that
        # multiplies it natively, and TrainingArguments' bf16=False (its default) then trained
        # in bf16 beside a plain Trainer in fp32
        def enabled(key: str) -> bool:
            part = out.get(key)
            return isinstance(part, dict) and part.get("enabled") is True
        if not enabled("fp16"):        # fp16's loss scaling keeps "auto" (the engine's rule)
            section["compute_dtype"] = "bf16" if args.bf16 or enabled("bf16") else "fp32"
    if filler.mismatches:
        raise ValueError(
            "the ds_config and the TrainingArguments disagree (write \"auto\" in the config to "
            "take the Trainer's value, or make them equal):\n- " + "\n- ".join(filler.mismatches))
    return out


class _Filler:
    """Fills ``"auto"`` entries of one config dict and collects the disagreements."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def _parent(self, path: str) -> tuple[dict | None, str]:
        *parents, key = path.split(".")
        node: Any = self.config
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        return (node if isinstance(node, dict) else None), key

    def match(self, path: str, value: Any, arg: str, absent: bool = False) -> None:
        """``path`` = ``value`` when "auto" (or absent, with ``absent``); else it must equal."""
        parent, key = self._parent(path)
        if parent is None:
            return
        if key not in parent:
            if absent:
                parent[key] = value
            return
        current = parent[key]
        if current == AUTO:
            parent[key] = value
        elif not _same(current, value):
            self.mismatches.append(f"{path} = {current!r} but TrainingArguments' {arg} = "
                                   f"{value!r}")

    def fill_only(self, path: str, value: Any) -> None:
        """``path`` = ``value`` when "auto"; any written value is kept (not a Trainer setting)."""
        parent, key = self._parent(path)
        if parent is not None and parent.get(key) == AUTO:
            parent[key] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b
