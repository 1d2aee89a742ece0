"""The planner's prediction of the bytes a training forward saves for backward
(``infinity.planner.activations``) against what autograd really saves, and the "auto" choice.

Tolerance: the prediction is within 0.1% of the measured bytes (distinct storages the forward
hands to ``saved_tensors_hooks``, parameters left out) for Llama, Qwen2 and Mistral (sdpa and
eager attention) and GPT-2 (sdpa, each kind of dropout on and off), in bf16 and fp32, with and
without labels: the count follows each op (see [Note: saved bytes of a Llama-family block] and
[Note: saved bytes of a GPT-2 block]); only the int64 targets' storage of a single sequence
(8 bytes more, a view of the padded labels) is not modelled.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from infinity.planner.activations import (
    activation_shape_from_hf_config,
    choose_activation_offload,
    recomputed_block_bytes,
    saved_activation_bytes,
    step_working_bytes,
)

transformers = pytest.importorskip("transformers")
TOLERANCE = 1e-3


def _model(family: str, attention: str):
    warnings.filterwarnings("ignore")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    cfg = config_cls(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=352, vocab_size=1000,
                     tie_word_embeddings=False, use_cache=False, max_position_embeddings=256)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    return model_cls(cfg).train(), cfg


def _gpt2(attn: float = 0.0, resid: float = 0.0, embd: float = 0.0):
    warnings.filterwarnings("ignore")
    cfg = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000,
                                  n_positions=256, attn_pdrop=attn, resid_pdrop=resid,
                                  embd_pdrop=embd, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train(), cfg


def measured_saved_bytes(model, ids: torch.Tensor, labels: bool) -> int:
    """Bytes of the distinct storages a forward saves for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids if labels else None)
    assert out.logits.requires_grad
    return sum(seen.values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_prediction_matches_saved_bytes(family: str, attention: str) -> None:
    model, cfg = _model(family, attention)
    shape = activation_shape_from_hf_config(cfg)
    assert shape is not None and shape.family == "llama" and shape.attention == attention
    _assert_prediction_matches(model, cfg, shape, (family, attention))


def _assert_prediction_matches(model, cfg, shape, case) -> None:
    """Prediction against the measured saved bytes in bf16 and fp32, two batch shapes, with
    and without labels."""
    for dtype in (torch.bfloat16, torch.float32):
        model.to(dtype)
        for batch, seq in ((2, 64), (1, 100)):
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            for labels in (True, False):
                got = measured_saved_bytes(model, ids, labels)
                predicted = saved_activation_bytes(shape, batch, seq, dtype.itemsize, labels)
                assert abs(predicted - got) <= TOLERANCE * got, \
                    (case, dtype, batch, seq, labels, predicted, got)


@pytest.mark.parametrize("dropout", [(0.0, 0.0, 0.0), (0.1, 0.0, 0.0), (0.0, 0.1, 0.1),
                                     (0.1, 0.1, 0.1)])
def test_gpt2_prediction_matches_saved_bytes(dropout: tuple[float, float, float]) -> None:
    """GPT-2 is another family: LayerNorm, a fused q/k/v projection, GELU "new", dropout (sdpa
    leaves its fused kernel for the fp32 math path with attention dropout)."""
    model, cfg = _gpt2(*dropout)
    shape = activation_shape_from_hf_config(cfg)
    assert shape is not None and shape.family == "gpt2", shape
    _assert_prediction_matches(model, cfg, shape, dropout)


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("qwen2", "eager"),
                                              ("gpt2", "sdpa")])
def test_checkpointed_prediction_matches_saved_bytes(family: str, attention: str) -> None:
    """transformers' gradient checkpointing (reentrant: the outer graph saves each block's
    input): the forward keeps a block's input instead of its saved set (see [Note: saved bytes
    under activation checkpointing]); the block backward recomputes at a time is the difference
    between the plain and the checkpointed forward, per block, plus that input."""
    model, cfg = _gpt2() if family == "gpt2" else _model(family, attention)
    shape = activation_shape_from_hf_config(cfg)
    for dtype in (torch.bfloat16, torch.float32):
        model.to(dtype)
        c = dtype.itemsize
        for batch, seq in ((2, 64), (1, 100)):
            ids = torch.randint(0, cfg.vocab_size, (batch, seq))
            model.gradient_checkpointing_disable()
            plain = measured_saved_bytes(model, ids, False)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True})
            for labels in (True, False):
                got = measured_saved_bytes(model, ids, labels)
                predicted = saved_activation_bytes(shape, batch, seq, c, labels,
                                                   checkpointed=True)
                assert abs(predicted - got) <= TOLERANCE * got, \
                    (family, dtype, batch, seq, labels, predicted, got)
            checkpointed = measured_saved_bytes(model, ids, False)
            assert checkpointed < plain / 2, (plain, checkpointed)   # what checkpointing is for
            rotary = 2 * seq * (shape.hidden // shape.heads) * c if family != "gpt2" else 0
            per_block = (plain - checkpointed - rotary) / shape.layers + c * shape.hidden * batch * seq
            assert recomputed_block_bytes(shape, batch, seq, c) == pytest.approx(
                per_block, rel=TOLERANCE), (family, dtype, batch, seq)
            model.gradient_checkpointing_disable()


def test_auto_policy_sees_gradient_checkpointing_turned_on() -> None:
    """A budget the plain forward's activations overflow but the checkpointed one's fit: "auto"
    offloads, then keeps them in memory once the model checkpoints its blocks (decided again)."""
    from infinity.engine.activation_policy import AutoActivationOffload

    model, cfg = _model("llama", "sdpa")
    shape = activation_shape_from_hf_config(cfg)
    batch, seq = 2, 64
    needed = {ck: saved_activation_bytes(shape, batch, seq, 4, True, checkpointed=ck) +
              step_working_bytes(shape, batch, seq, 4, 0, checkpointed=ck) for ck in (False, True)}
    assert needed[True] < needed[False]
    swapper = _StubSwapper()
    policy = AutoActivationOffload(model, swapper, (needed[True] + needed[False]) // 2, 4)  # type: ignore[arg-type]
    try:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        model(input_ids=ids, labels=ids)
        assert policy.choice.decision == "nvme", policy.choice
        model.gradient_checkpointing_enable()
        model(input_ids=ids, labels=ids)
        assert policy.choice.decision == "none", policy.choice
        assert policy.choice.predicted_bytes == saved_activation_bytes(shape, batch, seq, 4, True,
                                                                       checkpointed=True)
    finally:
        policy._handle.remove()


def test_prediction_follows_the_compute_dtype() -> None:
    """bf16 saves less than fp32, but not half: the norms' fp32 upcasts and the loss's fp32
    log-softmax stay fp32 (a count scaled by the item size alone would be 2x off)."""
    _, cfg = _model("qwen2", "sdpa")
    shape = activation_shape_from_hf_config(cfg)
    bf16, fp32 = (saved_activation_bytes(shape, 2, 64, c, True) for c in (2, 4))
    assert 0.5 * fp32 < bf16 < 0.7 * fp32, (bf16, fp32)


def test_other_configs_are_estimated_and_none_is_unknown() -> None:
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500)
    gpt2._attn_implementation = "eager"        # counted for sdpa only
    shape = activation_shape_from_hf_config(gpt2)
    assert shape is not None and shape.family == "estimated" and shape.intermediate == 256
    assert saved_activation_bytes(shape, 1, 16, 2, True) > 0
    assert activation_shape_from_hf_config(None) is None
    assert activation_shape_from_hf_config(object()) is None


def test_auto_offloads_what_does_not_fit_and_only_that() -> None:
    mib = 1 << 20
    small = choose_activation_offload(100 * mib, room=120 * mib, has_swap=True, working=30 * mib)
    assert small.decision == "nvme", small        # 100 MiB > 120 - 30
    assert small.overshoot_bytes == 0
    large = choose_activation_offload(100 * mib, room=140 * mib, has_swap=True, working=30 * mib)
    assert large.decision == "none" and large.overshoot_bytes == 0, large
    # no swap space: kept in memory, the overshoot named (a warning, never an error)
    stuck = choose_activation_offload(100 * mib, room=120 * mib, has_swap=False, working=30 * mib,
                                      no_swap="no swap directory")
    assert stuck.decision == "none" and stuck.overshoot_bytes == 10 * mib, stuck
    assert "10.00 MiB more" in stuck.reason and "no swap directory" in stuck.reason, stuck.reason
    assert "about 10.00 MiB with the step's gradients" in stuck.reason, stuck.reason
    # offloaded, but the step's gradients and logits alone exceed the room: the overshoot is
    # theirs, named in a warning (it was 0: an info line, the budget overshot silently)
    crowded = choose_activation_offload(100 * mib, room=20 * mib, has_swap=True,
                                        working=30 * mib)
    assert crowded.decision == "nvme" and crowded.overshoot_bytes == 10 * mib, crowded
    assert "alone exceed the room by 10.00 MiB" in crowded.reason, crowded.reason
    unknown = choose_activation_offload(None, room=0, has_swap=True)
    assert unknown.decision == "none" and "cannot be predicted" in unknown.reason


def test_step_working_bytes_counts_the_largest_unit_and_the_logits() -> None:
    _, cfg = _model("llama", "sdpa")
    shape = activation_shape_from_hf_config(cfg)
    assert step_working_bytes(shape, 2, 8, 2, 1000) == 1000 * 2 + 12 * 1000 * 16
    assert step_working_bytes(None, 2, 8, 4, 1000) == 4000
    with pytest.raises(ValueError, match="batch 0"):
        saved_activation_bytes(shape, 0, 8, 2, True)


class _StubSwapper:
    """Stands in for the engine's ActivationSwapper: only whether its hooks are entered matters."""

    def __init__(self) -> None:
        self.entered = 0

    def hooks(self, observe=None):
        import contextlib

        self.entered += 1
        return contextlib.nullcontext()


def test_auto_policy_decides_before_each_training_forward_by_its_batch() -> None:
    from infinity.engine.activation_policy import AutoActivationOffload, batch_of

    model, cfg = _model("llama", "sdpa")
    shape = activation_shape_from_hf_config(cfg)
    room = saved_activation_bytes(shape, 2, 32, 4, True) + step_working_bytes(shape, 2, 32, 4, 0)
    swapper = _StubSwapper()
    policy = AutoActivationOffload(model, swapper, room, 4)     # type: ignore[arg-type]
    try:
        small = torch.randint(0, cfg.vocab_size, (2, 32))
        model(input_ids=small, labels=small)
        assert policy.choice.decision == "none" and not policy.active, policy.choice
        large = torch.randint(0, cfg.vocab_size, (2, 33))          # one token per row more
        model(input_ids=large, labels=large)
        assert policy.choice.decision == "nvme" and policy.active, policy.choice
        with policy.hooks():
            pass
        assert swapper.entered == 1
        with torch.no_grad():
            model(input_ids=small)                                 # no training: no decision
        assert policy.choice.decision == "nvme"
    finally:
        policy._handle.remove()
    assert batch_of((), {"inputs_embeds": torch.zeros(3, 7, 4)}) == (3, 7)
    assert batch_of((torch.zeros(5, dtype=torch.long),), {}) == (1, 5)
    assert batch_of((), {"labels": None}) is None


def test_auto_policy_reads_a_dict_batch_passed_whole() -> None:
    """``model(batch)`` with the tokenizer's dict: its input_ids give the batch's shape (before,
    only keywords and bare tensors were read, and a batch over the room stayed in memory with a
    reason blaming the model's config); arguments with no batch in them say so."""
    from collections import UserDict

    from infinity.engine.activation_policy import AutoActivationOffload, batch_of

    ids = torch.zeros(3, 7, dtype=torch.long)
    assert batch_of(({"input_ids": ids, "labels": ids},), {}) == (3, 7)
    assert batch_of((UserDict(inputs_embeds=torch.zeros(2, 5, 4)),), {}) == (2, 5)
    assert batch_of(({"labels": None}, torch.zeros(4, 6)), {}) == (4, 6)

    inner, cfg = _model("llama", "sdpa")

    class TakesADict(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm, self.config = inner, inner.config

        def forward(self, batch):
            return self.lm(**batch)

    model = TakesADict().train()
    shape = activation_shape_from_hf_config(cfg)
    policy = AutoActivationOffload(model, _StubSwapper(), 1, 4)   # type: ignore[arg-type]
    try:
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        model({"input_ids": x, "labels": x})
        assert policy.choice.decision == "nvme", policy.choice
        assert policy.choice.predicted_bytes == saved_activation_bytes(shape, 2, 16, 4, True)
        policy._before_forward(model, ({"labels": None},), {})     # no batch to read
    finally:
        policy._handle.remove()
    assert policy.choice.predicted_bytes is None and policy.choice.decision == "none"
    assert "no input_ids, inputs_embeds or tensor" in policy.choice.reason, policy.choice.reason
    # an empty batch: nothing saved (the planner's count refused a 0, before torch's own error)
    assert policy.decide(0, 16).reason == "an empty batch (0 x 16): nothing saved"
    assert policy.decide(2, 0).predicted_bytes == 0


def test_auto_policy_reads_checkpointing_without_a_deprecation_warning() -> None:
    """transformers 5 deprecated ``is_gradient_checkpointing`` (a FutureWarning at every read,
    the attribute gone in 6): the policy reads ``is_activation_checkpointing`` where it exists,
    so a training forward warns nothing (before: the main job's output carried the warning) and
    checkpointing is still seen."""
    import warnings as warnings_module

    from infinity.engine.activation_policy import AutoActivationOffload

    model, cfg = _model("llama", "sdpa")
    policy = AutoActivationOffload(model, _StubSwapper(), 1 << 40, 4)   # type: ignore[arg-type]
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    try:
        with warnings_module.catch_warnings(record=True) as caught:
            warnings_module.simplefilter("always")
            model(input_ids=ids, labels=ids)
            model.gradient_checkpointing_enable()
            model(input_ids=ids, labels=ids)
    finally:
        policy._handle.remove()
    deprecated = [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert not deprecated, deprecated
    from infinity.engine.activation_policy import blocks_checkpointed

    assert blocks_checkpointed(model) and policy.choice.predicted_bytes == saved_activation_bytes(
        activation_shape_from_hf_config(cfg), 1, 8, 4, True, checkpointed=True), policy.choice

    class OldStyle(torch.nn.Module):      # transformers 4: only is_gradient_checkpointing
        is_gradient_checkpointing = True
    assert blocks_checkpointed(OldStyle()) and not blocks_checkpointed(torch.nn.Linear(1, 1))


def test_auto_policy_leaves_a_deep_copy_of_the_model_alone() -> None:
    """copy.deepcopy(model) (an EMA or reference copy) shares the hook function: the copy's
    training forwards are no pass of the engine, so they decide nothing (before: each new
    shape of the copy's batches was decided, logged and recorded as the engine's choice)."""
    import copy

    from infinity.engine.activation_policy import AutoActivationOffload

    model, cfg = _model("llama", "sdpa")
    policy = AutoActivationOffload(model, _StubSwapper(), 1, 4)    # type: ignore[arg-type]
    twin = copy.deepcopy(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    try:
        twin(input_ids=ids, labels=ids)
        assert policy.choice is None and not policy._decided, policy.choice
        model(input_ids=ids, labels=ids)
        assert policy.choice.decision == "nvme" and policy.active, policy.choice
    finally:
        policy._handle.remove()


def test_native_info_names_the_choice_of_the_last_training_forward() -> None:
    """native_info()["in_use"]["offload_activations"] follows the forward that ran, also when
    its shape was decided before (before: it kept the last new decision, so a long batch
    after a short one read "none" while it was offloaded)."""
    import infinity
    from infinity.engine.activation_policy import AutoActivationOffload

    model, cfg = _model("llama", "sdpa")
    shape = activation_shape_from_hf_config(cfg)
    room = saved_activation_bytes(shape, 2, 16, 4, True) + step_working_bytes(shape, 2, 16, 4, 0)
    policy = AutoActivationOffload(model, _StubSwapper(), room, 4)    # type: ignore[arg-type]
    seen = []
    try:
        for seq in (32, 16, 32):
            ids = torch.randint(0, cfg.vocab_size, (2, seq))
            model(input_ids=ids, labels=ids)
            seen.append((policy.choice.decision,
                         infinity.native_info()["in_use"]["offload_activations"].split()[0]))
    finally:
        policy._handle.remove()
    assert seen == [("nvme", "nvme"), ("none", "none"), ("nvme", "nvme")], seen


def test_auto_policy_lowers_the_malloc_threshold_only_while_offloading() -> None:
    """The offloaded mmap threshold (activation_min_bytes) is for forwards that offload; a batch
    kept in memory after one that offloaded gets the configured threshold back (before: one
    long batch left every later step at the low threshold, each allocation above it mapped
    and faulted in afresh)."""
    from infinity.base import malloc_tuning
    from infinity.engine.activation_policy import AutoActivationOffload

    if malloc_tuning._glibc() is None:
        pytest.skip("not glibc: malloc is left alone")
    model, cfg = _model("llama", "sdpa")
    shape = activation_shape_from_hf_config(cfg)
    room = saved_activation_bytes(shape, 2, 16, 4, True) + step_working_bytes(shape, 2, 16, 4, 0)
    before = malloc_tuning._applied
    policy = AutoActivationOffload(model, _StubSwapper(), room, 4,    # type: ignore[arg-type]
                                   offloaded_mmap_threshold=256 << 10,
                                   kept_mmap_threshold=4 << 20)
    seen = []
    try:
        for seq in (16, 32, 16):
            ids = torch.randint(0, cfg.vocab_size, (2, seq))
            model(input_ids=ids, labels=ids)
            seen.append((policy.choice.decision, malloc_tuning._applied))
    finally:
        policy._handle.remove()
        if before is not None:
            malloc_tuning.set_mmap_threshold(before)
    assert seen == [("none", 4 << 20), ("nvme", 256 << 10), ("none", 4 << 20)], seen


def test_dynamic_padding_warns_once_per_larger_overshoot(infinity_info_log) -> None:
    """No swap space and a batch length that changes every step (dynamic padding): each new
    shape is decided and logged, but a warning only when the overshoot grows by over a quarter
    beyond the largest warned; the rest go to info."""
    import logging

    from infinity.engine.activation_policy import AutoActivationOffload

    model, cfg = _model("llama", "sdpa")
    policy = AutoActivationOffload(model, None, 0, 4)     # type: ignore[arg-type]
    try:
        for seq in (32, 33, 34, 35, 36, 80, 81, 30):
            ids = torch.randint(0, cfg.vocab_size, (2, seq))
            model(input_ids=ids, labels=ids)
    finally:
        policy._handle.remove()
    decided = [r for r in infinity_info_log.records if "offload_activations auto, batch 2 x" in r.message]
    assert len(decided) == 8, [r.message for r in decided]
    warned = [r.message.split(":")[0] for r in decided if r.levelno == logging.WARNING]
    assert warned == ["offload_activations auto, batch 2 x 32",
                      "offload_activations auto, batch 2 x 80"], warned


def test_activations_are_kept_where_offloading_would_hold_more() -> None:
    """[Note: keeping activations within the host budget]: a batch whose saved activations take
    no more than the swapper's staging and two windows is kept (the reserve: the activations and
    the step's working bytes); a larger one is left to "auto" offload (None), unless the
    budget cannot offload at all."""
    from infinity.planner.activations import reserve_to_keep
    from infinity.planner.engine_sizes import ACTIVATION_STAGING_BYTES

    shape = activation_shape_from_hf_config(_model("llama", "sdpa")[1])
    window = 64 << 20
    small, large = (1, 64), (8, 4096)
    saved_small = saved_activation_bytes(shape, *small, 2, with_loss=True)
    saved_large = saved_activation_bytes(shape, *large, 2, with_loss=True)
    assert saved_small <= ACTIVATION_STAGING_BYTES + 2 * window < saved_large
    assert reserve_to_keep(shape, *small, 2, 1000, window, True) == \
        saved_small + step_working_bytes(shape, *small, 2, 1000)
    assert reserve_to_keep(shape, *large, 2, 1000, window, True) is None
    assert reserve_to_keep(shape, *large, 2, 1000, window, False) == \
        saved_large + step_working_bytes(shape, *large, 2, 1000)
