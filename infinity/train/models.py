"""Model configurations for ``infinity train``: byte-level Llama presets, or any HF causal LM.

Why here and not in the planner: the planner's ``LLAMA_PRESETS`` describe the usual sizes with a
32000-token vocabulary; ``infinity train`` reads bytes, so every preset is built with the byte
vocabulary of ``infinity.train.data`` (260 ids). Two presets are defined for that vocabulary
directly (``tiny`` for tests and ``85M``, the demo), so their names are their real sizes; every
other name is taken from ``infinity.planner.inputs.LLAMA_PRESETS`` with the vocabulary replaced (the
embeddings shrink, so those models come out a little smaller than their names: the log and the
summary print the real count). ``--hf-config`` takes any ``transformers`` causal-LM config
(AutoConfig + AutoModelForCausalLM.from_config, random init), whose vocabulary must hold the
byte ids.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn

from infinity.train.data import VOCAB_SIZE
from infinity.train.defaults import DEFAULT_PRESET

# Byte-vocabulary Llama presets (LlamaConfig kwargs). 85M: the Llama "125M" shape (hidden 768,
# 12 layers) whose 32000-token embeddings become 260-token ones: 85.35M parameters.
BYTE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4),
    "85M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=12, num_key_value_heads=12),
}


def preset_names() -> list[str]:
    """Every name ``--model-size`` accepts."""
    return sorted(set(BYTE_PRESETS) | set(_planner_presets()), key=_size_key)


def _planner_presets() -> dict[str, dict[str, Any]]:
    from infinity.planner.inputs import LLAMA_PRESETS
    return LLAMA_PRESETS


def _size_key(name: str) -> tuple[float, str]:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}
    try:
        return float(name[:-1]) * scale[name[-1].upper()], name
    except (KeyError, ValueError, IndexError):
        return 0.0, name


def preset_config(name: str, seq_len: int) -> Any:
    """A ``LlamaConfig`` for preset ``name`` with the byte vocabulary, for ``seq_len`` tokens."""
    from transformers import LlamaConfig

    config = LlamaConfig(**preset_kwargs(name, seq_len))
    config._attn_implementation = "sdpa"
    return config


def preset_kwargs(name: str, seq_len: int) -> dict[str, Any]:
    """The ``LlamaConfig`` kwargs of preset ``name`` (byte vocabulary); ``infinity plan
    --model-size`` plans the same model from them."""
    if name in BYTE_PRESETS:
        kwargs = dict(BYTE_PRESETS[name])
    else:
        planner = _planner_presets()
        if name not in planner:
            raise ValueError(f"--model-size {name!r} is not a preset; choose one of "
                             f"{', '.join(preset_names())}, or pass --hf-config path/config.json")
        kwargs = dict(planner[name])
    kwargs.update(vocab_size=VOCAB_SIZE, tie_word_embeddings=False, use_cache=False,
                  max_position_embeddings=max(seq_len, int(kwargs.get("max_position_embeddings", 0))),
                  attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return kwargs


def read_hf_config(path: str | Path, flag: str = "--hf-config") -> tuple[Any, Path]:
    """The ``transformers`` config in ``path`` (a config.json or its directory) and the file read.

    Shared with ``infinity plan``: a missing path, a directory without config.json, a file that
    is not JSON or not a model config each raise one line naming the file (never the Hugging
    Face hub's lookup, which a missing local path would otherwise fall through to).
    """
    from transformers import AutoConfig

    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"{flag} {source} does not exist; pass a transformers "
                                "config.json (or the directory holding it)")
    file = source / "config.json" if source.is_dir() else source
    if not file.is_file():
        raise FileNotFoundError(f"{flag} {source}: no config.json there; pass a transformers "
                                "config.json (or the directory holding it)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} {file}: not valid JSON at line {exc.lineno} column "
                         f"{exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {file}: not a text file ({exc.reason} at byte "
                         f"{exc.start}); pass a transformers config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{flag} {file}: expected a transformers config with a "
                         "\"model_type\" key (e.g. \"llama\", \"gpt2\", \"qwen2\")")
    try:
        return AutoConfig.for_model(**data), file
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{flag} {file}: transformers cannot read it: {exc}") from None


def hf_config(path: str | Path, seq_len: int) -> Any:
    """The ``transformers`` config in ``path`` (a config.json or its directory), checked for bytes."""
    config, file = read_hf_config(path)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < VOCAB_SIZE:
        raise ValueError(f"--hf-config {file}: vocab_size = {vocab!r} cannot hold the byte ids "
                         f"of infinity train (0..{VOCAB_SIZE - 1}); set vocab_size >= {VOCAB_SIZE}")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(positions, int) and positions < seq_len:
        raise ValueError(f"--hf-config {file}: the model takes at most {positions} positions but "
                         f"--seq-len is {seq_len}; lower --seq-len")
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory holding any of these has a tokenizer ``AutoTokenizer`` can read."""


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer saved in ``directory`` (``--pretrained``), or None when it has none (the
    run then reads bytes)."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--pretrained {directory}: its tokenizer files cannot be read "
                         f"({exc}); remove them to train on bytes") from None


def pretrained_config(directory: str | Path, seq_len: int, tokenizer: Any) -> Any:
    """The config of the model saved in ``directory`` (``--pretrained``), checked for the run:
    its vocabulary holds the tokenizer's ids (or the byte ids without one), its positions
    ``seq_len``."""
    source = Path(directory)
    if not source.is_dir():
        raise FileNotFoundError(f"--pretrained {source}: not a directory; pass the directory "
                                "of a transformers model (config.json and model.safetensors)")
    config, file = read_hf_config(source, flag="--pretrained")
    vocab = getattr(config, "vocab_size", None)
    need = len(tokenizer) if tokenizer is not None else VOCAB_SIZE
    if not isinstance(vocab, int) or vocab < need:
        what = (f"the {need} ids of its tokenizer" if tokenizer is not None else
                f"the byte ids of infinity train (0..{VOCAB_SIZE - 1}; the directory has no "
                "tokenizer)")
        raise ValueError(f"--pretrained {file}: vocab_size = {vocab!r} cannot hold {what}")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(positions, int) and positions < seq_len:
        raise ValueError(f"--pretrained {file}: the model takes at most {positions} positions "
                         f"but --seq-len is {seq_len}; lower --seq-len")
    return config


def model_config(model_size: str | None, hf_config_path: str | Path | None, seq_len: int) -> Any:
    """The config of the model to train: ``--hf-config`` if given, else preset ``model_size``."""
    if hf_config_path is not None:
        if model_size is not None:
            raise ValueError("--model-size and --hf-config both given; pass one of them")
        return hf_config(hf_config_path, seq_len)
    return preset_config(model_size or DEFAULT_PRESET, seq_len)


def causal_lm_from_config(config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` (in the caller's device or init context),
    with a config that has no causal-LM class named as such: transformers' error lists its ~400
    config classes and says nothing of what to do."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ValueError(
            f"the model config (model_type {getattr(config, 'model_type', None)!r}) has no "
            "causal language model class in transformers (AutoModelForCausalLM): infinity "
            "train and infinity plan build decoder-only models from a config. Train an "
            "encoder-decoder (T5, BART) or encoder (BERT) model through infinity.initialize "
            "with its own class, and plan it with --params") from None


def count_parameters(config: Any) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = causal_lm_from_config(config)
    return sum(p.numel() for p in model.parameters())


def model_stats(config: Any, unit_modules: tuple[str, ...] | None = None) -> Any:
    """The planner's ``ModelStats`` (counts, units) of the model ``config`` describes, on meta."""
    from infinity.planner.inputs import ModelStats

    with torch.device("meta"):
        model = causal_lm_from_config(config)
    return ModelStats.from_module(model, unit_modules)


def build_model(config: Any, init_context: ContextManager[Any] | None = None) -> nn.Module:
    """Build a randomly initialised causal LM from ``config`` inside ``init_context``.

    ``init_context`` is ``infinity.zero.Init(config=...)`` for the engine (parameters stay meta
    until the engine places each unit in its home tier), or nothing for the torch baseline.
    """
    with init_context if init_context is not None else contextlib.nullcontext():
        model = causal_lm_from_config(config)
    return model


def describe(config: Any, n_params: int) -> str:
    """One line naming the architecture and its size, e.g. ``llama, 12 layers, 85.35M params``."""
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    parts = [str(getattr(config, "model_type", "model"))]
    if layers:
        parts.append(f"{layers} layers")
    if hidden:
        parts.append(f"hidden {hidden}")
    parts.append(f"vocab {getattr(config, 'vocab_size', '?')}")
    parts.append(f"{n_params / 1e6:.2f}M params")
    return ", ".join(parts)
