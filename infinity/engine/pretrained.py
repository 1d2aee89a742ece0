"""``infinity.from_pretrained`` and ``engine.save_pretrained``: Hugging Face directories in and out.

In: the model is built from the directory's ``config.json`` under ``zero.Init`` (on the meta
device: no memory, no init), the checkpoint is checked against it whole (files, names,
shapes: checkpoint/pretrained.py), then the engine places each unit with its values read
straight from the files into its home (``UnitValues``, zero/protocols.py): one unit in memory
at a time, each NVMe home written once, the fp32 master read in fp32, the Adam moments zero
without a write. The tuple returned is ``initialize``'s.

Out: the current weights as transformers writes them (checkpoint/pretrained_write.py), with
``config.json``, the generation config and, for a model loaded from a directory, its
tokenizer files.

[Note: the dtype of a saved model]
``dtype=None`` saves in the compute dtype, DeepSpeed's ``save_16bit_model``; except at stage 3
with ``stage3_gather_16bit_weights_on_model_save`` false, where DeepSpeed gathers no 16-bit
weights and its users take the fp32 weights (``zero_to_fp32``): there the save is fp32, read
from the fp32 masters. Streaming makes both cheap (a unit at a time), so the flag chooses the
precision, never whether the weights are written.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes
from infinity.checkpoint.pretrained import PretrainedWeights
from infinity.checkpoint.pretrained_write import (
    DEFAULT_MAX_SHARD_SIZE,
    out_dtype,
    save_pretrained as write_pretrained,
)
from infinity.engine.hf_conversions import hub_names
from infinity.engine.model_methods import is_peft_model, replace_buffers
from infinity.zero.init import Init
from infinity.zero.materialize import copied_from, valueless, values_kept_through_meta_moves

if TYPE_CHECKING:
    from infinity.engine.engine import Engine

log = get_logger("engine")

# from_pretrained's keyword arguments of transformers that mean something else here
_MODEL_KWARGS = ("attn_implementation", "trust_remote_code", "experts_implementation")
_HARMLESS = ("local_files_only", "low_cpu_mem_usage", "cache_dir", "force_download",
             "_fast_init", "output_loading_info")
_REFUSED = {
    "device_map": "the engine places every state itself (its tiers come from the config)",
    "max_memory": "the engine's budgets come from the config's \"infinity\" section",
    "offload_folder": "the engine offloads to zero_optimization.offload_*.nvme_path",
    "quantization_config": "quantized weights are not supported",
    "load_in_8bit": "quantized weights are not supported",
    "load_in_4bit": "quantized weights are not supported",
    "tp_plan": "tensor parallelism is not supported (ZeRO shards over data-parallel ranks)",
    "state_dict": "pass the directory; its files are streamed unit by unit",
    "variant": "pass the variant's file (or the directory of one) as the path",
    "gguf_file": "infinity reads safetensors only",
    "from_tf": "infinity reads safetensors only",
    "from_flax": "infinity reads safetensors only",
    "revision": "the path is a local directory (download the revision first)",
    "token": "the path is a local directory (download it first)",
}


def from_pretrained(pretrained_model_name_or_path: str | Path, config: Any = None, *,
                    model_class: Any = None, strict: bool = True,
                    ignore_mismatched_sizes: bool = False, optimizer: Any = None,
                    model_parameters: Iterable | None = None, lr_scheduler: Any = None,
                    training_data: Any = None, collate_fn: Callable | None = None,
                    auto_values: Mapping[str, Any] | None = None, process_group: Any = None,
                    args: Any = None, prepare_model: Callable[[nn.Module], nn.Module] | None = None,
                    **hf_kwargs: Any):
    """A transformers model from a local directory (``config.json`` + ``model.safetensors``,
    or shards with ``model.safetensors.index.json``) trained by an engine:
    ``(engine, optimizer, training_dataloader, lr_scheduler)`` as ``infinity.initialize``.

    ``config``: the ds_config (as ``initialize``'s; or ``args.deepspeed_config``).
    ``model_class``: the transformers class to build (default ``AutoModelForCausalLM``).
    ``strict``: parameters the checkpoint lacks or tensors the model lacks are an error listing
    them (False: they are logged, and the missing ones keep the model's init);
    ``ignore_mismatched_sizes``: parameters of another shape keep the model's init instead of
    an error. ``hf_kwargs``: ``attn_implementation``, ``trust_remote_code``, and config
    overrides (``use_cache=False``, ...), as transformers' ``from_pretrained`` takes them;
    ``dtype`` is the engine's compute dtype (the config's bf16 / fp16 sections), into which the
    weights are converted. The model is in eval mode, as transformers returns it: call
    ``engine.train()`` before training with dropout.

    ``prepare_model(model) -> model``: called on the model after the checkpoint was matched to
    it and before the engine takes it, outside ``zero.Init`` (the loaded parameters are still
    meta; modules it adds are built with their values: a PEFT LoRA wrapper, frozen layers).
    The model it returns is the one trained; the checkpoint's tensors follow their parameters
    under the new names.
    """
    from infinity.engine.engine import Engine
    from infinity.engine.entry import _config_source, check_training_data, training_loader

    source = Path(pretrained_model_name_or_path)
    directory = source if source.is_dir() else source.parent
    config_source = _config_source(args, config, None)
    check_training_data(training_data, process_group=process_group)
    weights = PretrainedWeights(source)          # the files are checked before anything else
    try:
        hf_config, model_kwargs = _hf_config(directory, hf_kwargs)
        model = _build(hf_config, model_class, model_kwargs)
        _load_generation_config(model, directory)
        conversions = hub_names(model)     # transformers' load-time renamings and fusions
        weights.match(model, strict=strict, ignore_mismatched_sizes=ignore_mismatched_sizes,
                      prefix=getattr(model, "base_model_prefix", "") or "",
                      ignore_unexpected=_patterns(model, "_keys_to_ignore_on_load_unexpected")
                      + _old_buffer_keys(model),
                      ignore_missing=_patterns(model, "_keys_to_ignore_on_load_missing"),
                      renamed=conversions.to_model if conversions else None,
                      fusions=conversions.fusions if conversions else None)
        weights.load_buffers(model)
        if prepare_model is not None:
            model = _prepared(model, prepare_model, weights)
        extra = {"optimizer": optimizer} if optimizer is not None else {}
        engine = Engine(model, model_parameters, config_source, lr_scheduler=lr_scheduler,
                        process_group=process_group, auto_values=auto_values, weights=weights,
                        **extra)
        log.info("loaded %s from %s (%s read by this rank)", type(model).__name__,
                 weights.directory, format_bytes(weights.bytes_read))
        _warn_fp32_modules_rounded(model, engine.compute_dtype)
        _buffers_as_transformers_loads(model, engine.compute_dtype)
    finally:
        weights.close()
    engine.pretrained_source = weights.directory
    model.eval()
    loader = None
    if training_data is not None:
        loader = training_loader(training_data, engine.config, collate_fn,
                                 rank=engine.ranks.rank, world_size=engine.ranks.world_size)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _prepared(model: nn.Module, prepare: Callable[[nn.Module], nn.Module],
              weights: PretrainedWeights) -> nn.Module:
    """``prepare(model)``, the checkpoint's tensors following their parameters' new names."""
    before = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    # what it builds (an adapter) keeps the values it gave them when moved to the meta device
    # of the layers it wraps; a copy of a loaded layer (modules_to_save) is loaded as it
    with values_kept_through_meta_moves():
        try:
            prepared = prepare(model)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            # an adapter computed from the base weights (PiSSA's and OLoRA's SVD, LoftQ, EVA)
            # meets meta tensors here, and torch's error says nothing of why
            raise ValueError(
                f"prepare_model raised {type(exc).__name__}: {exc}. It runs before the "
                "checkpoint's weights are read (they stream into the prepared model), so the "
                "model's parameters are on the meta device: if it initialises an adapter "
                "from the base weights (PiSSA, OLoRA, LoftQ, EVA, DoRA), that cannot be done "
                "here. Use one that does not read them (LoRA's default init), or load the base "
                "with transformers, prepare it, and pass it to infinity.initialize") from exc
    if not isinstance(prepared, nn.Module):
        raise TypeError(f"prepare_model returned {type(prepared).__name__}, not the nn.Module "
                        "to train")
    resized = []
    for p in prepared.parameters():
        name = before.get(id(copied_from(p)))
        held = weights.numel_of(name) if name is not None and weights.provides(name) else None
        if held is not None and held != p.numel():
            resized.append(f"{name} ({held:,} elements in the checkpoint, {list(p.shape)} now)")
    if resized:
        # its values stream from the checkpoint's tensor, which has no rows for the new shape:
        # they were read from the bytes after it in the file (the next tensor's), silently
        raise ValueError(
            f"prepare_model changed the shape of {len(resized)} loaded parameter(s): "
            f"{'; '.join(resized[:3])}{' ...' if len(resized) > 3 else ''} (a "
            "resize_token_embeddings?). Their values stream from the checkpoint, which has none "
            "for the new shape: load the model with transformers, resize it there, and pass it "
            "to infinity.initialize")
    lost = [name for name, p in prepared.named_parameters()
            if id(copied_from(p)) not in before and valueless(p)]
    if lost:
        # made on the meta device from the loaded layers' weights, which are not read yet: a
        # DoRA magnitude (the norm of the base weight) would come out as a random init
        raise ValueError(
            f"prepare_model made {len(lost)} parameter(s) on the meta device from weights that "
            f"are not loaded yet, so they have no value and would train from a random init: "
            f"{', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''} (a DoRA magnitude vector "
            "is the norm of the base weight). Use an adapter that does not read the base "
            "weights to initialise (LoRA without use_dora), or load the base with transformers "
            "and pass the prepared model to infinity.initialize")
    weights.rename({name: before[id(copied_from(p))] for name, p in
                    prepared.named_parameters(remove_duplicate=False)
                    if id(copied_from(p)) in before})
    return prepared


def _load_generation_config(model: nn.Module, directory: Path) -> None:
    """The directory's ``generation_config.json`` on the model, as transformers' own
    ``from_pretrained`` sets it (``generate`` and a later save use it)."""
    if not (directory / "generation_config.json").is_file() or \
            getattr(model, "generation_config", None) is None:
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError) as exc:
        log.warning("%s: generation_config.json not read (%s); the model's defaults stay",
                    directory, exc)


def _hf_config(directory: Path, hf_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The transformers config of ``directory`` with the overrides among ``hf_kwargs``, and
    the keyword arguments for building the model."""
    from transformers import AutoConfig

    kwargs = dict(hf_kwargs)
    refused = sorted(k for k in kwargs if k in _REFUSED)
    if refused:
        raise TypeError("infinity.from_pretrained: " + "; ".join(
            f"{k}: {_REFUSED[k]}" for k in refused))
    if kwargs.pop("use_safetensors", True) is False:
        raise ValueError("infinity.from_pretrained reads safetensors only (no pickle): "
                         "use_safetensors=False cannot be honoured")
    for name in _HARMLESS:
        kwargs.pop(name, None)
    for name in ("dtype", "torch_dtype"):
        asked = kwargs.pop(name, None)
        if asked not in (None, "auto"):
            log.info("from_pretrained(%s=%s): the engine computes in its compute dtype (the "
                     "config's bf16 / fp16 sections) and converts the weights to it", name, asked)
    model_kwargs = {k: kwargs.pop(k) for k in _MODEL_KWARGS if k in kwargs}
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} has no config.json: from_pretrained builds the "
                                "model from it (save_pretrained writes it)")
    trust = model_kwargs.get("trust_remote_code", False)
    hf_config, unused = AutoConfig.from_pretrained(str(directory), return_unused_kwargs=True,
                                                   trust_remote_code=trust, **kwargs)
    if unused:
        raise TypeError(f"infinity.from_pretrained got arguments that are neither options nor "
                        f"attributes of the model's config: {sorted(unused)}")
    return hf_config, model_kwargs


def _build(hf_config: Any, model_class: Any, model_kwargs: dict[str, Any]) -> nn.Module:
    """The model on the meta device (``zero.Init``: buffers real, no memory, no init)."""
    if model_class is None:
        from transformers import AutoModelForCausalLM

        if type(hf_config) not in AutoModelForCausalLM._model_mapping:
            raise ValueError(_not_causal_lm(hf_config))
        model_class = AutoModelForCausalLM
    build = getattr(model_class, "from_config", None) or getattr(model_class, "_from_config")
    with Init():
        # built in fp32 (buffers computed as in a plain load); the engine converts the
        # parameters to its compute dtype
        return build(hf_config, dtype=torch.float32, **model_kwargs)


# the Auto classes a model that is not a causal LM is likely built with, in the order tried
_OTHER_AUTO_CLASSES = ("AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                       "AutoModelForSequenceClassification", "AutoModelForImageTextToText",
                       "AutoModel")


def _not_causal_lm(hf_config: Any) -> str:
    """The error of a config AutoModelForCausalLM cannot build (T5, BERT...): the classes that
    can, for ``model_class=`` (transformers' own error lists every causal LM it knows)."""
    import transformers

    fits = [name for name in _OTHER_AUTO_CLASSES
            if type(hf_config) in getattr(transformers, name)._model_mapping]
    named = [a for a in (getattr(hf_config, "architectures", None) or [])
             if isinstance(a, str) and hasattr(transformers, a)]
    hints = [f"model_class=transformers.{name}" for name in named + fits[:2]]
    return (f"infinity.from_pretrained builds AutoModelForCausalLM by default, which has no "
            f"{hf_config.model_type!r} model ({type(hf_config).__name__}); pass "
            + (" or ".join(hints) if hints else "the model's class as model_class=")
            + " (the directory's config.json names its architecture"
            + (f": {', '.join(named)}" if named else "") + ")")


def _old_buffer_keys(model: nn.Module) -> list[str]:
    """The keys of buffers older checkpoints saved and transformers ignores wherever the model
    has such buffers (its ``_adjust_missing_and_unexpected_keys``): each layer's rotary
    ``inv_freq`` (Llama conversions before transformers 4.31), ``position_ids``. They were
    refused as not in the model, with strict=False, which hides real mismatches, as the only
    way through."""
    names = [name for name, _ in model.named_buffers()]
    return [pattern for suffix, pattern in OLD_BUFFER_KEYS.items()
            if any(n.endswith(suffix) for n in names)]


OLD_BUFFER_KEYS = {"rotary_emb.inv_freq": r"rotary_emb\.inv_freq",
                   "position_ids": r"(^|\.)position_ids$"}
"""A buffer's name ending -> the pattern of its keys ignored (``_old_buffer_keys``)."""


def _patterns(model: nn.Module, attribute: str) -> list[str]:
    """A transformers model class's list of name patterns (``_keys_to_ignore_on_load_*``)."""
    found = getattr(model, attribute, None) or []
    return [p for p in found if isinstance(p, str)]


def tie_targets(model: nn.Module) -> set[str]:
    """The names a transformers model ties to another parameter (``lm_head.weight``), which
    its own save leaves out: ``all_tied_weights_keys`` (transformers 5, whole model) or the
    class's ``_tied_weights_keys``."""
    ties = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(ties, Mapping):
        ties = getattr(model, "_tied_weights_keys", None)
    if isinstance(ties, Mapping):
        return {t for t in ties if isinstance(t, str)}
    if isinstance(ties, (list, tuple, set)):
        return {t for t in ties if isinstance(t, str)}
    return set()


# -- saving ---------------------------------------------------------------------------------
def default_save_dtype(engine: "Engine") -> torch.dtype:
    """See [Note: the dtype of a saved model]."""
    if engine.stage == 3 and not engine.config.zero.stage3_gather_16bit_weights_on_model_save:
        return torch.float32
    return engine.compute_dtype


def model_texts(model: nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """``config.json`` (with ``dtype`` and the model's class as its architecture, as
    transformers writes it) and ``generation_config.json`` of a transformers model; nothing
    for another module."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return {}
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    try:
        config.dtype = dtype
    except AttributeError:      # an older config class
        config.torch_dtype = dtype
    texts = {"config.json": config.to_json_string(use_diff=True)}
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        texts["generation_config.json"] = generation.to_json_string(use_diff=True)
    return texts


def _buffers_as_transformers_loads(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """transformers' 16-bit load holds the checkpoint's floating buffers (BART's
    ``final_logits_bias``, a BatchNorm's statistics) in that dtype and keeps those its modules
    compute at build in fp32 (a rotary ``inv_freq``, not persistent): the same here. The model
    is built in fp32, so BART's logits and loss came out fp32 under a bf16 engine (twice the
    memory of the largest activation, and not the 16-bit recipe transformers and DeepSpeed
    run). A buffer two modules share stays one tensor."""
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return
    kept = _fp32_pattern(model, compute_dtype)    # a MoE router's correction bias stays fp32
    computed = {f"{m}.{n}" if m else n for m, module in model.named_modules()
                for n in module._non_persistent_buffers_set}

    def cast(name: str, buf: torch.Tensor) -> torch.Tensor | None:
        if not buf.is_floating_point() or buf.dtype == compute_dtype or buf.is_meta or \
                name in computed or (kept is not None and kept.search(name)):
            return None
        return buf.to(compute_dtype)

    replace_buffers(model, cast)


def _fp32_modules(model: nn.Module, compute_dtype: torch.dtype) -> list[str]:
    """The modules transformers keeps in fp32 when it loads ``model`` in ``compute_dtype``
    (``_keep_in_fp32_modules_strict`` in bf16 and fp16, ``_keep_in_fp32_modules`` in fp16
    too)."""
    if compute_dtype not in (torch.bfloat16, torch.float16):
        return []
    kept = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if compute_dtype == torch.float16:
        kept += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return sorted(set(kept))


def _fp32_pattern(model: nn.Module, compute_dtype: torch.dtype) -> re.Pattern | None:
    """``_fp32_modules`` as a pattern over parameter and buffer names; None for none."""
    kept = _fp32_modules(model, compute_dtype)
    if not kept:
        return None
    return re.compile(r"(^|\.)(" + "|".join(re.escape(k) for k in kept) + r")(\.|$)")


def _warn_fp32_modules_rounded(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """transformers keeps some modules in fp32 when it loads a model in 16 bits
    (``_keep_in_fp32_modules_strict`` in bf16 and fp16: MoE routers' gates, DeepSeek's and
    GLM's; ``_keep_in_fp32_modules`` in fp16); the engine computes every parameter in its one
    compute dtype, so those are rounded: outputs a little further from transformers' than 16-bit
    rounding alone (0.03 in a GLM4-MoE's logits where bf16 alone moves them 0.004). Said, not
    refused: a 16-bit run is a choice; fp32 compute gives transformers' numbers."""
    pattern = _fp32_pattern(model, compute_dtype)
    if pattern is None:
        return
    rounded = [n for n, _ in model.named_parameters() if pattern.search(n)]
    name = "bf16" if compute_dtype == torch.bfloat16 else "fp16"
    if rounded:
        log.warning("%s keeps %s in fp32 when transformers loads it in %s; this engine computes "
                    "every parameter in %s, so %d parameter(s) (e.g. %s) are rounded and its "
                    "outputs differ from transformers' a little more than %s alone makes them "
                    "(compute_dtype \"fp32\" gives transformers' numbers)", type(model).__name__,
                    _fp32_modules(model, compute_dtype), name, name, len(rounded), rounded[0],
                    name)


def save_pretrained(engine: "Engine", save_directory: str | Path,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, dtype: Any = None,
                    what: str = "save_pretrained", merged: bool = False) -> Path:
    """``engine.save_pretrained`` (see there)."""
    from infinity.engine.checkpointing import training_state

    engine._check_open(what)
    if merged:
        if not is_peft_model(engine.module):
            raise ValueError(f"{what}(merged=True) merges a PEFT adapter into its base; this "
                             f"model is a {type(engine.module).__name__}: leave merged unset")
        return _save_merged(engine, Path(save_directory), max_shard_size, dtype, what)
    if is_peft_model(engine.module):
        if dtype is not None:
            raise ValueError(f"{what}(dtype={dtype!r}) on a PEFT model: its adapter is saved "
                             "as PeftModel.save_pretrained saves it (trained weights in fp32, "
                             "from their masters under 16-bit compute; others in their dtype); "
                             "leave dtype unset")
        from infinity.engine.peft_save import save_adapter
        return save_adapter(engine, Path(save_directory))
    dtype = out_dtype(dtype, default_save_dtype(engine))
    conversions = hub_names(engine.module)   # saved under the Hub's names, as transformers does
    return write_pretrained(training_state(engine), save_directory,
                            max_shard_size=max_shard_size, dtype=dtype,
                            texts=model_texts(engine.module, dtype),
                            carry_from=engine.__dict__.get("pretrained_source"),
                            tie_targets=tie_targets(engine.module), what=what,
                            hub_name=conversions.to_hub if conversions else None,
                            hub_split=conversions.split if conversions else None)


def _save_merged(engine: "Engine", directory: Path, max_shard_size: int | str, dtype: Any,
                 what: str) -> Path:
    """A PEFT LoRA model saved as its base with the adapter merged (engine/peft_merge.py),
    streamed as any save, under the base's names (and its Hub layout)."""
    from infinity.engine.checkpointing import training_state
    from infinity.engine.peft_merge import PREFIX, MergedNames

    merge = MergedNames(engine.module)
    base = engine.module.get_base_model()
    dtype = out_dtype(dtype, default_save_dtype(engine))
    conversions = hub_names(base)

    def hub_name(name: str) -> str:
        return hub_name_of(merge.rename(name))

    def hub_name_of(name: str) -> str:
        return conversions.to_hub(name) if conversions else name

    texts, ties = model_texts(base, dtype), tie_targets(base)
    broken = _ties_a_copy_breaks(base, merge.own_copy, PREFIX)
    # the original of a copied tie source (the embedding the head is tied to): the head's
    # weight, written under the head's name (dropped with the original, the head was missing)
    tied = getattr(base, "all_tied_weights_keys", None) or {}
    heads = {PREFIX + _original(tied[t]): t for t in broken if isinstance(tied.get(t), str)}

    def hub_split(name: str, value: torch.Tensor):
        if name in heads:
            return [(hub_name_of(heads[name]), value)]
        parts = merge.split(name, value)
        if parts is None and conversions is not None:
            parts = conversions.split(merge.rename(name), value)
        return parts

    if broken and "config.json" in texts:
        # a modules_to_save copy of a tied weight (the embedding) trained apart from its tie:
        # both are written, untied, as PEFT's merge_and_unload saves them (tied, transformers
        # made the head the trained embedding copy: logits 0.67 off)
        config = json.loads(texts["config.json"])
        config["tie_word_embeddings"] = False
        texts["config.json"] = json.dumps(config, indent=2, sort_keys=True) + "\n"
        ties = ties - broken
    return write_pretrained(training_state(engine), directory, max_shard_size=max_shard_size,
                            dtype=dtype, texts=texts,
                            carry_from=engine.__dict__.get("pretrained_source"),
                            tie_targets={PREFIX + t for t in ties}, what=what,
                            hub_name=hub_name, hub_split=hub_split)


def _original(name: str) -> str:
    """A wrapped layer's parameter name inside a PEFT modules_to_save wrapper's original."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.original_module.{leaf}"


def _ties_a_copy_breaks(base: nn.Module, own_copy: set[str], prefix: str) -> set[str]:
    """The tie targets (``lm_head.weight``) whose tie a PEFT modules_to_save copy of either
    side broke (the copy trained, the other side not)."""
    tied = getattr(base, "all_tied_weights_keys", None)
    if not isinstance(tied, Mapping):
        return set()
    copied = {name[len(prefix):] for name in own_copy if name.startswith(prefix)}
    return {target for target, source in tied.items()
            if isinstance(target, str) and isinstance(source, str) and
            {target.rsplit(".", 1)[0], source.rsplit(".", 1)[0]} & copied}
