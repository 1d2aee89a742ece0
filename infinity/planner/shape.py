"""A transformer's shape (width, MLP width, depth, vocabulary), and what follows from it per
token: the activations autograd saves on the device, and the FLOPs of a training step.

Pure. Counts, with their sources:

* FLOPs per token of a step (forward + backward): ``6 N + 12 L h s`` (N parameters that
  multiply, L layers, width h, sequence s) -- the model FLOPs of PaLM (Chowdhery et al. 2022,
  appendix B), the attention term counted for a full (non-causal) score matrix as there. The
  input embedding of an untied model is a lookup, not a product, so its V h parameters are not
  in N (a tied one is the head's weight, which multiplies): at 0.49B (7 Llama layers of width
  2048, vocabulary 32000) that is 13% of the parameters, and the compute time of the 0.49B and
  1.04B benches grows as 6 N without them (BENCHMARKS.md, "Plan calibration"). Activation
  checkpointing recomputes the forward once more: ``8 N + 16 L h s`` of hardware FLOPs.
* Activations a Llama block saves for backward, in the 16-bit compute type, per token: the
  inputs of both RMSNorms, of q/k/v, of o (the attention output) and of gate/up, the three MLP
  products and the input of down: ``2 (8 h + 4 i)`` bytes (flash attention: no s x s scores).
  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
  count ``34 h`` bytes for a GPT block with a 4h MLP and dropout, the same order.
  With checkpointing a block keeps only its input (``2 h`` per token) and one block at a time
  holds the full set while it is recomputed. The head's logits add ``6 V`` per token (16-bit
  logits and their fp32 upcast for the loss).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "shape_from_llama_kwargs", "shape_from_hf_config", "estimated_shape",
           "activation_bytes", "flops_per_token"]

DEFAULT_VOCAB = 32000
"""Vocabulary assumed when only a parameter count is known (Llama 1/2)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Widths and depth of a decoder-only transformer."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    tied: bool = False
    """The head's weight is the input embedding's (``tie_word_embeddings``)."""
    estimated: bool = False
    """True when guessed from a parameter count (``estimated_shape``), not read from a config."""


def shape_from_llama_kwargs(kwargs: dict[str, Any]) -> ModelShape:
    """The shape of a LlamaConfig's keyword arguments (the presets of ``inputs.LLAMA_PRESETS``)."""
    return ModelShape(hidden=int(kwargs["hidden_size"]), intermediate=int(kwargs["intermediate_size"]),
                      layers=int(kwargs["num_hidden_layers"]), vocab=int(kwargs["vocab_size"]),
                      tied=bool(kwargs.get("tie_word_embeddings", False)))


def config_int(config: Any, *names: str) -> int | None:
    """The first of ``names`` that ``config`` (a transformers config, read by attribute) has as
    a positive integer (a bool is not one), else None: the one reader of a model's sizes."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def shape_from_hf_config(config: Any) -> ModelShape | None:
    """The shape of a transformers config (Llama-style names, or GPT-2's), None when unknown."""
    def first(*names: str) -> int | None:
        return config_int(config, *names)
    hidden = first("hidden_size", "n_embd", "d_model")
    layers = first("num_hidden_layers", "n_layer", "num_layers")
    vocab = first("vocab_size")
    if hidden is None or layers is None or vocab is None:
        return None
    intermediate = first("intermediate_size", "n_inner", "ffn_dim", "d_ff") or 4 * hidden
    return ModelShape(hidden=hidden, intermediate=intermediate, layers=layers, vocab=vocab,
                      tied=bool(getattr(config, "tie_word_embeddings", False)))


def estimated_shape(params: int, layers: int) -> ModelShape:
    """A Llama-like shape for ``params`` in ``layers`` blocks: 12 h^2 per block (attention 4 h^2,
    a SwiGLU MLP of width 8h/3), the vocabulary of DEFAULT_VOCAB, untied."""
    layers = max(1, layers)
    hidden = max(64, int(math.sqrt(max(params, 1) / (12 * layers))))
    return ModelShape(hidden=hidden, intermediate=8 * hidden // 3, layers=layers,
                      vocab=DEFAULT_VOCAB, estimated=True)


def activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, checkpointing: bool,
                     itemsize: int = 2) -> int:
    """Device bytes of the activations one micro-step keeps at its peak (start of backward)."""
    tokens = seq_len * micro_batch
    per_block = itemsize * (8 * shape.hidden + 4 * shape.intermediate) * tokens
    logits = (itemsize + 4) * shape.vocab * tokens
    if checkpointing:
        return shape.layers * itemsize * shape.hidden * tokens + per_block + logits
    return shape.layers * per_block + logits


def flops_per_token(params: int, shape: ModelShape, seq_len: int, checkpointing: bool = False) -> float:
    """FLOPs of one token's forward and backward: model FLOPs, or with ``checkpointing`` the
    hardware FLOPs (one more forward). ``params``: all of the model's; an untied input
    embedding is taken out (a lookup)."""
    if not shape.tied:
        params = max(0, params - shape.vocab * shape.hidden)
    attention = shape.layers * shape.hidden * seq_len
    if checkpointing:
        return 8.0 * params + 16.0 * attention
    return 6.0 * params + 12.0 * attention
