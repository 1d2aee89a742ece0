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
* A shape from a parameter count alone (``estimated_shape``) follows published models: see
  [Note: shapes from a parameter count].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "shape_from_llama_kwargs", "shape_from_hf_config", "estimated_shape",
           "llama_param_count", "PUBLISHED_SHAPES", "activation_bytes", "flops_per_token"]

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
    source: str = ""
    """Where an estimated shape's depth and width came from (the published shapes between which
    they were interpolated, or the depth given); empty for a shape read from a config."""

    def llama_params(self) -> int:
        """Elements of the Llama of this shape (full multi-head attention, no biases): what
        ``inputs.shape_stats`` counts parameter by parameter."""
        return llama_param_count(self.hidden, self.intermediate, self.layers, self.vocab, self.tied)


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


def llama_param_count(hidden: int, intermediate: int, layers: int, vocab: int,
                      tied: bool = False) -> int:
    """Elements of a Llama block stack: per block q, k, v, o (``h^2`` each), gate, up, down
    (``h i`` each) and two RMSNorms (``h``); the embedding (``V h``), the final norm and, untied,
    the head (``V h``)."""
    block = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return layers * block + vocab * hidden * (1 if tied else 2) + hidden


# [Note: shapes from a parameter count]
# A bare count (``infinity plan --params 1T``) is planned as a Llama whose depth and width
# follow the models people trained, not a fixed depth: with 32 layers, 1T was one block of
# 29.4B elements of width 51031 that no 80 GB GPU can fetch, where the ZeRO-Infinity paper's 1T
# is 128 layers of width 25600 and fits. Depth and width are interpolated linearly in the
# logarithm of the count between the two published shapes around it (PUBLISHED_SHAPES, each
# row's count taken as this module's Llama count of its depth and width, MLP 8h/3, vocabulary
# 32000, so the table is monotonic in one measure). Since log L and log h are both linear in
# log N, 12 L h^2 is too, and it is exact at the rows: between them it stays within a few %.
# The depth is rounded to an integer, the width to a multiple of 128 (head dim 128), and the
# MLP width -- the free term, near the Llama rule 8h/3 -- takes up what is left of the count,
# rounded to 256 as Llama's multiple_of does (64 below an MLP of 8192): the Llama of the shape
# counts within half a rounding step, 3 h 128 L / N, of N (0.7% at 7B, 0.1% at 1T; under 1%
# from 1e8 to 1e14 parameters). Outside the table the end row's aspect ratio
# h / L is kept and both scale as N^(1/3). A given depth (``--layers``) wins; the width is then
# solved from 12 L h^2 + 2 V h = N. Below ~85M parameters a 32000-word vocabulary alone would
# exceed half the count: the vocabulary is cut so the embeddings take half (a toy model, not
# a published one).

@dataclass(frozen=True, kw_only=True)
class PublishedShape:
    """A trained model's depth and width, one row of the table shapes are estimated from."""

    name: str
    layers: int
    hidden: int
    source: str
    """The paper and table it is read from."""

    @property
    def count(self) -> int:
        """This row's parameter count in one measure (a Llama, MLP 8h/3, vocabulary 32000)."""
        return self.layers * (12 * self.hidden * self.hidden + 2 * self.hidden) \
            + 2 * DEFAULT_VOCAB * self.hidden + self.hidden


_GPT3 = "GPT-3, Brown et al. 2020, table 2.1"
_LLAMA = "Llama, Touvron et al. 2023"
_ZERO_INF = "ZeRO-Infinity, Rajbhandari et al. 2021, table 1"
PUBLISHED_SHAPES: tuple[PublishedShape, ...] = (
    PublishedShape(name="GPT-3 Small 125M", layers=12, hidden=768, source=_GPT3),
    PublishedShape(name="GPT-3 Medium 350M", layers=24, hidden=1024, source=_GPT3),
    PublishedShape(name="GPT-3 Large 760M", layers=24, hidden=1536, source=_GPT3),
    PublishedShape(name="GPT-3 XL 1.3B", layers=24, hidden=2048, source=_GPT3),
    PublishedShape(name="GPT-3 2.7B", layers=32, hidden=2560, source=_GPT3),
    PublishedShape(name="Llama 7B", layers=32, hidden=4096, source=_LLAMA),       # = GPT-3 6.7B
    PublishedShape(name="Llama 13B", layers=40, hidden=5120, source=_LLAMA),      # GPT-3 13B: 5140
    PublishedShape(name="Llama 33B", layers=60, hidden=6656, source=_LLAMA),
    PublishedShape(name="Llama 65B / Llama 2 70B", layers=80, hidden=8192, source=_LLAMA),
    PublishedShape(name="GPT-3 175B", layers=96, hidden=12288, source=_GPT3),
    PublishedShape(name="Llama 3.1 405B", layers=126, hidden=16384,
                   source="Llama 3, Grattafiori et al. 2024, table 3"),
    PublishedShape(name="ZeRO-Infinity 0.5T", layers=124, hidden=18432, source=_ZERO_INF),
    PublishedShape(name="ZeRO-Infinity 1T", layers=128, hidden=25600, source=_ZERO_INF),
    PublishedShape(name="ZeRO-Infinity 5T", layers=174, hidden=49152, source=_ZERO_INF),
    PublishedShape(name="ZeRO-Infinity 10T", layers=200, hidden=65536, source=_ZERO_INF),
    PublishedShape(name="ZeRO-Infinity 20T", layers=205, hidden=90112, source=_ZERO_INF),
)
"""Published decoder shapes, smallest first (GPT-3's and Llama's trained models, the
ZeRO-Infinity paper's evaluated ones up to 20T); see [Note: shapes from a parameter count]."""

WIDTH_MULTIPLE = 128
"""An estimated width is a multiple of the head dimension of Llama and GPT-3 (128)."""
MLP_MULTIPLE = 256
"""An estimated MLP width is a multiple of Llama's ``multiple_of`` from 8192 up (models of ~3B
and more); below, of 64, where steps of 256 would move a small count by up to 2%."""


def _rows(*rows: PublishedShape) -> str:
    named = " and ".join(f"{row.name} ({row.layers} x {row.hidden})" for row in rows)
    return f"{named} ({'; '.join(dict.fromkeys(row.source for row in rows))})"


def _depth_and_width(params: int) -> tuple[float, float, str]:
    """Depth and width for ``params`` from PUBLISHED_SHAPES, unrounded, and where they came from."""
    rows = PUBLISHED_SHAPES
    if params <= rows[0].count or params >= rows[-1].count:
        end = rows[0] if params <= rows[0].count else rows[-1]
        scale = (params / end.count) ** (1 / 3)
        return (end.layers * scale, end.hidden * scale,
                f"the aspect ratio of {_rows(end)}, scaled as N^(1/3)")
    hi = next(i for i, row in enumerate(rows) if row.count >= params)
    lo, up = rows[hi - 1], rows[hi]
    t = math.log(params / lo.count) / math.log(up.count / lo.count)
    return (lo.layers * (up.layers / lo.layers) ** t, lo.hidden * (up.hidden / lo.hidden) ** t,
            f"log-interpolated between {_rows(lo, up)}")


def _multiple(value: float, step: int) -> int:
    return max(step, step * round(value / step))


def estimated_shape(params: int, layers: int | None = None) -> ModelShape:
    """A Llama shape (untied, full multi-head attention) whose count is ``params``: depth and
    width from published models, or ``layers`` deep when given; see [Note: shapes from a
    parameter count]. ``source`` says where they came from."""
    n = max(1, int(params))
    if layers is None:
        depth, width, source = _depth_and_width(n)
        layers = max(1, round(depth))
    else:
        layers = max(1, layers)
        v = DEFAULT_VOCAB
        width = (-2 * v + math.sqrt(4 * v * v + 48 * layers * n)) / (24 * layers)
        source = f"depth {layers} given, width solved from 12 L h^2 + 2 V h = N"
    hidden = _multiple(width, WIDTH_MULTIPLE)
    vocab = DEFAULT_VOCAB
    if 2 * vocab * hidden > n // 2:       # a toy count: the embeddings take half of it
        vocab = max(1, n // (4 * hidden))
    rest = n - 2 * vocab * hidden - hidden - layers * (4 * hidden * hidden + 2 * hidden)
    mlp = rest / (3 * hidden * layers)
    intermediate = _multiple(mlp, MLP_MULTIPLE if mlp >= 32 * MLP_MULTIPLE else 64)
    return ModelShape(hidden=hidden, intermediate=intermediate, layers=layers, vocab=vocab,
                      estimated=True, source=source)


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
