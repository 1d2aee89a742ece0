"""The bytes autograd saves for backward in one training forward, predicted from the model's
shape and the batch's, and whether they fit in what the host budget leaves
(``infinity.offload_activations`` "auto").

Pure: the engine hands in the model's config (read by attribute name, as ``shape.py`` does), the
batch's size and length, the compute dtype's item size and the room its own sizes leave.

[Note: saved bytes of a Llama-family block]
Counted from what torch 2.x saves for each op of transformers' Llama / Qwen2 / Mistral decoder
layer (RMSNorm, rotary embedding, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP), per token, with ``c`` the compute dtype's bytes,
``d`` = hidden / heads:

* each RMSNorm (two a block, one at the end): its input upcast to fp32 (``4 h``, the input
  itself when ``c`` is 4), the fp32 reciprocal RMS (4), the normalized value in the compute
  dtype (``c h``, for the weight's product) and the weighted output (``c h``, for the next
  projections, which share it);
* attention (sdpa): q after the rotary embedding (``c h``), k and v with their KV heads
  (``2 c kv d``: no repeat, sdpa takes the groups), the output (``c h``, shared with o's input)
  and the fp32 log-sum-exp (``4 heads``); the eager path instead keeps k and v repeated to
  every head and the fp32 probabilities and their 16-bit cast (``(4 + c) heads s``);
* the MLP: gate and up outputs, SiLU's output and down's input (``4 c i``);
* per sequence the rotary cos and sin (``2 s d c``), per token the int64 ids (8); with labels
  (the loss inside the forward) the fp32 log-softmax of the logits (``4 V``) and the int64
  targets (8).

[Note: saved bytes of a GPT-2 block]
transformers' GPT-2 (LayerNorm, one fused q/k/v projection, sdpa, GELU "new"), per token:

* each LayerNorm (two a block, one at the end): its input and its output (``2 c h``), the mean
  and the reciprocal deviation (``2 c``);
* attention without attention dropout (sdpa's fused kernel): the q/k/v projection's output,
  whose views q, k and v are (``3 c h``), the output (``c h``) and the fp32 log-sum-exp
  (``4 heads``); with attention dropout sdpa takes its math path in fp32: q, k and v upcast
  (``12 h``; in fp32 with one sequence v stays a view of the whole q/k/v output: ``8 h``
  more), the probabilities, the dropout mask and the dropped probabilities (``12 heads s``), and
  the output (``c h``);
* the MLP: the fc output, the tanh, the inner sum and product of GELU "new", and the
  projection's input (``5 c i``);
* dropout masks (``c h``): two a block with residual dropout, one with embedding dropout;
* per sequence the int64 positions (``8 s``); the ids and the loss as for Llama.

Measured by ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters left
out) on small random Llama, Qwen2, Mistral and GPT-2 models in bf16 and fp32, the counts are
exact (tests/unit/test_activation_prediction.py). Other models with a transformers-style config
get ``shape.activation_bytes``' estimate (16-bit ``8 h + 4 i`` a block, logits ``(c + 4) V``),
marked as estimated; a model without one is not predicted.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from infinity.base.sizes import format_bytes
from infinity.planner.engine_sizes import ACTIVATION_STAGING_BYTES
from infinity.planner.shape import config_int, shape_from_hf_config

__all__ = ["ActivationShape", "activation_shape_from_hf_config", "saved_activation_bytes",
           "OffloadChoice", "choose_activation_offload", "step_working_bytes", "LLAMA_FAMILY",
           "reserve_to_keep",
           "recomputed_block_bytes"]

LLAMA_FAMILY = frozenset({"llama", "qwen2", "mistral"})
"""``model_type``s whose blocks are counted op by op (see the note above)."""


@dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """What the saved bytes of a forward depend on, besides the batch and the dtype."""

    family: Literal["llama", "gpt2", "estimated"]
    """"llama", "gpt2": counted op by op; "estimated": the generic per-block estimate."""
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    attention: Literal["sdpa", "eager"] = "sdpa"
    """transformers' attention implementation: sdpa keeps no s x s scores, eager does."""
    dropout: tuple[bool, bool, bool] = (False, False, False)
    """GPT-2: whether attention, residual and embedding dropout are on (they save masks)."""


def activation_shape_from_hf_config(config: Any) -> ActivationShape | None:
    """The shape of a transformers config (Llama-style or GPT-2 names), None when it has no
    width, depth or vocabulary to read."""
    sizes = shape_from_hf_config(config)
    if sizes is None:
        return None
    hidden, layers, vocab = sizes.hidden, sizes.layers, sizes.vocab

    def first(*names: str) -> int | None:
        return config_int(config, *names)
    heads = first("num_attention_heads", "n_head") or 1
    impl = getattr(config, "_attn_implementation", None)
    attention = "eager" if impl == "eager" else "sdpa"
    model_type = getattr(config, "model_type", None)
    family = "estimated"
    if model_type in LLAMA_FAMILY and hidden % heads == 0:
        family = "llama"
    elif model_type == "gpt2" and attention == "sdpa" and hidden % heads == 0:
        family = "gpt2"
    dropout = tuple(bool(getattr(config, name, 0.0) or 0.0)
                    for name in ("attn_pdrop", "resid_pdrop", "embd_pdrop"))
    return ActivationShape(
        family=family, hidden=hidden, layers=layers, vocab=vocab, heads=heads,
        intermediate=sizes.intermediate,
        kv_heads=first("num_key_value_heads") or heads, attention=attention,
        dropout=dropout)  # type: ignore[arg-type]


def saved_activation_bytes(shape: ActivationShape, batch: int, seq: int, itemsize: int,
                           with_loss: bool, checkpointed: bool = False) -> int:
    """Bytes autograd saves in one training forward of ``batch`` sequences of ``seq`` tokens in
    a compute dtype of ``itemsize`` bytes (``with_loss``: labels given, the loss computed inside
    the forward; ``checkpointed``: the blocks run under activation checkpointing, as
    transformers' ``gradient_checkpointing_enable()`` runs them); see [Note: saved bytes of a
    Llama-family block] and [Note: saved bytes under activation checkpointing]."""
    if batch < 1 or seq < 1 or itemsize not in (2, 4):
        raise ValueError(f"saved_activation_bytes: batch {batch}, seq {seq}, itemsize "
                         f"{itemsize}: expected a batch and a length >= 1, an item size 2 or 4")
    if checkpointed:
        return _checkpointed_bytes(shape, batch, seq, itemsize, with_loss)
    c, h, i, v = itemsize, shape.hidden, shape.intermediate, shape.vocab
    tokens = batch * seq
    loss = (4 * v + 8) * tokens + 4 if with_loss else 0
    if shape.family == "estimated":
        per_block = c * (8 * h + 4 * i)
        return shape.layers * per_block * tokens + (c + 4) * v * tokens + loss
    if shape.family == "gpt2":
        return _gpt2_bytes(shape, batch, seq, c) + loss
    d = h // shape.heads
    norm = 4 * h + 4 + 2 * c * h
    if shape.attention == "eager":
        # the fp32 probabilities, and their cast to the compute dtype (none when that is fp32)
        attention = c * (4 * h) + (4 + (c if c < 4 else 0)) * shape.heads * seq
    else:
        attention = c * (2 * h + 2 * shape.kv_heads * d) + 4 * shape.heads
    block = 2 * norm + attention + 4 * c * i
    per_token = shape.layers * block + norm + 8
    return per_token * tokens + 2 * seq * d * c + loss


def _checkpointed_bytes(shape: ActivationShape, batch: int, seq: int, c: int,
                        with_loss: bool) -> int:
    """[Note: saved bytes under activation checkpointing]
    With each block checkpointed, the forward keeps of a block only its input hidden state
    (``c h`` a token); what runs outside the blocks (embedding, final norm, logits, loss) saves
    what it saves without checkpointing, the rotary cos and sin excepted (only the blocks'
    attention saved them). Backward then recomputes one block at a time, holding that block's
    saved set while it runs: ``recomputed_block_bytes``, which the step's working bytes count.
    Measured like the plain count (saved_tensors_hooks, reentrant checkpointing, where the
    block's input is what the outer graph saves): exact for Llama, Qwen2 and GPT-2. The
    non-reentrant kind keeps the same inputs alive through its recomputation closure instead
    of saving them, the same bytes."""
    outside = saved_activation_bytes(replace(shape, layers=0), batch, seq, c, with_loss)
    if shape.family == "llama":
        outside -= 2 * seq * (shape.hidden // shape.heads) * c
    return outside + shape.layers * c * shape.hidden * batch * seq


def recomputed_block_bytes(shape: ActivationShape, batch: int, seq: int, itemsize: int) -> int:
    """One block's saved bytes: what backward holds while it recomputes a checkpointed block."""
    one = saved_activation_bytes(replace(shape, layers=1), batch, seq, itemsize, False)
    return one - saved_activation_bytes(replace(shape, layers=0), batch, seq, itemsize, False)


def _gpt2_bytes(shape: ActivationShape, batch: int, seq: int, c: int) -> int:
    """Saved bytes of GPT-2's forward without the loss: [Note: saved bytes of a GPT-2 block]."""
    h, i, heads = shape.hidden, shape.intermediate, shape.heads
    attn_dropout, resid_dropout, embd_dropout = shape.dropout
    norm = 2 * c * h + 2 * c
    if attn_dropout:
        attention = 12 * h + 12 * heads * seq + c * h
        if c == 4 and batch == 1:
            attention += 8 * h     # v is a view of the whole q/k/v output (no upcast, no copy)
    else:
        attention = 3 * c * h + c * h + 4 * heads
    block = 2 * norm + attention + 5 * c * i + (2 * c * h if resid_dropout else 0)
    per_token = shape.layers * block + norm + 8 + (c * h if embd_dropout else 0)
    return per_token * batch * seq + 8 * seq


def step_working_bytes(shape: ActivationShape | None, batch: int, seq: int, itemsize: int,
                       largest_unit_numel: int, checkpointed: bool = False) -> int:
    """Bytes a training step holds beside its saved activations and outside the engine's pools,
    at the turn from forward to backward: autograd's gradient of the largest unit in the compute
    dtype (before the engine takes it into its budgeted buffers; see HELD_GRADIENT_UNITS in
    ``calibration.py``) and the logits' working set (the output, its fp32 upcast, the fp32
    gradient and its cast back), and with ``checkpointed`` blocks the one block backward
    recomputes at a time. Staying in memory either way, they count against the room before the
    activations do."""
    logits = (2 * itemsize + 8) * shape.vocab * batch * seq if shape is not None else 0
    recompute = recomputed_block_bytes(shape, batch, seq, itemsize) \
        if checkpointed and shape is not None else 0
    return logits + largest_unit_numel * itemsize + recompute


@dataclass(frozen=True, kw_only=True)
class OffloadChoice:
    """What "auto" chose for a batch's saved activations, and why."""

    decision: Literal["nvme", "none"]
    predicted_bytes: int | None
    """The saved bytes predicted (None: the model's shape is unknown)."""
    room_bytes: int
    """What the host budget leaves beside the engine's own pools."""
    reason: str
    working_bytes: int = 0
    """What the step holds besides (``step_working_bytes``), counted against the room first."""

    @property
    def overshoot_bytes(self) -> int:
        """Bytes what the step keeps in memory exceeds the room by (0 when it fits): the
        activations kept there, and the step's gradients and logits, which stay in memory when
        the activations are offloaded too."""
        if self.predicted_bytes is None:
            return 0
        kept = 0 if self.decision == "nvme" else self.predicted_bytes
        return max(0, kept + self.working_bytes - self.room_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "predicted_bytes": self.predicted_bytes,
                "room_bytes": self.room_bytes, "working_bytes": self.working_bytes,
                "overshoot_bytes": self.overshoot_bytes,
                "reason": self.reason}


def _mib(nbytes: int) -> str:
    return format_bytes(nbytes)


def choose_activation_offload(predicted: int | None, room: int, has_swap: bool,
                              working: int = 0, no_swap: str = "no nvme_path is set",
                              unknown: str | None = None) -> OffloadChoice:
    """"nvme" when the ``predicted`` saved bytes do not fit in the ``room`` the host budget
    leaves after the step's other ``working`` bytes and there is a swap space to send them to;
    "none" otherwise (the reason says which case; ``no_swap``: why there is no swap space;
    ``unknown``: why nothing was predicted, when not for want of the model's config)."""
    room, working = max(0, room), max(0, working)
    left = max(0, room - working)
    if predicted is None:
        why = unknown or ("no transformers-style config with a width, depth and "
                          "vocabulary")
        return OffloadChoice(decision="none", predicted_bytes=None, room_bytes=room, reason=(
            f"the model's saved activations cannot be predicted ({why}): kept in memory; set "
            "infinity.offload_activations \"nvme\" to send them to the swap space"),
            working_bytes=working)
    beside = f"the {_mib(left)} the host budget leaves ({_mib(room)} beside the engine's " \
             f"pools, less {_mib(working)} of the step's gradients and logits)"
    if predicted <= left:
        return OffloadChoice(decision="none", predicted_bytes=predicted, room_bytes=room,
                             working_bytes=working,
                             reason=f"{_mib(predicted)} predicted fit in {beside}: kept in memory")
    if not has_swap:
        over = predicted + working - room
        return OffloadChoice(decision="none", predicted_bytes=predicted, room_bytes=room,
                             working_bytes=working, reason=(
            f"{_mib(predicted)} predicted, {_mib(predicted - left)} more than {beside}, but "
            f"they cannot be offloaded ({no_swap}): they stay in memory and peak memory "
            f"exceeds infinity.host_memory_budget by about {_mib(over)} with the step's "
            "gradients and logits (raise the budget, or give the swap space room)"))
    over = working - room
    return OffloadChoice(decision="nvme", predicted_bytes=predicted, room_bytes=room,
                         working_bytes=working,
                         reason=f"{_mib(predicted)} predicted exceed {beside}: offloaded to the "
                                "swap space" + ("" if over <= 0 else
                                f"; the step's gradients and logits alone exceed the room by "
                                f"{_mib(over)}, so peak memory exceeds "
                                "infinity.host_memory_budget by about that much (raise the "
                                "budget, or take a smaller batch)"))


def forced_offload(predicted: int | None, room: int, working: int) -> OffloadChoice:
    """``offload_activations: "nvme"``: every training forward's saved activations go to the
    swap space, whatever fits; the step's ``working`` bytes (``step_working_bytes``: the
    logits' fp32 copies and gradients, a unit's gradient) stay in memory all the same, and what
    they take past the ``room`` the host budget leaves is named (a 124M Llama, vocabulary
    32000, 1 x 1024 tokens: ~400 MiB of logits work past a 512 MiB budget, unwarned before)."""
    room, working = max(0, room), max(0, working)
    over = working - room
    reason = 'offloaded to the swap space (offload_activations "nvme")' + (
        "" if over <= 0 or predicted is None else
        f"; the step's gradients and logits ({_mib(working)}) stay in memory and exceed the "
        f"{_mib(room)} the host budget leaves beside the engine's pools by {_mib(over)}, so "
        "peak memory exceeds infinity.host_memory_budget by about that much (raise the "
        "budget, or take a smaller batch or shorter sequences)")
    return OffloadChoice(decision="nvme", predicted_bytes=predicted, room_bytes=room,
                         working_bytes=working, reason=reason)


def reserve_to_keep(shape: ActivationShape, batch: int, seq: int, itemsize: int,
                    largest_unit_numel: int, window: int, can_offload: bool,
                    checkpointed: bool = False) -> int | None:
    """[Note: keeping activations within the host budget]
    The optimizer's slots take what the engine's other pools leave of the host budget (the
    bigger the sub-group, the fewer NVMe requests and kernel calls a step), so the activations
    "auto" keeps in memory have no room, and a run that keeps them goes over its budget (the
    85M demo of ``infinity train``: 104 MiB in bf16 over 512 MiB, with a warning every run).
    Offloading them is no cure for a small batch: the swapper's staging and its two windows
    hold more than the activations themselves, and the room rule gives them up where they
    would halve the sub-group. Where the batch is known before the engine is built (``infinity
    train`` knows its model, micro-batch and length), ``infinity.activation_reserve`` keeps
    room for what the step holds in memory: the saved activations and the step's working bytes
    (``step_working_bytes``). Keeping beats offloading when the activations take no more than
    the swapper would hold (``ACTIVATION_STAGING_BYTES`` and two windows), or when the budget
    cannot offload at all (``can_offload`` False: no staging in the plan); else None (no
    reserve: "auto" offloads as before). A smaller sub-group costs little at this size: the
    demo with 118 MiB kept (1.5M elements instead of 3.7M) stepped within the run-to-run noise
    of the unreserved run on this project's 2-core VM."""
    saved = saved_activation_bytes(shape, batch, seq, itemsize, with_loss=True,
                                   checkpointed=checkpointed)
    if can_offload and saved > ACTIVATION_STAGING_BYTES + 2 * window:
        return None
    return saved + step_working_bytes(shape, batch, seq, itemsize, largest_unit_numel,
                                      checkpointed)
