"""Hugging Face directories in and out (issue 26): ``infinity.from_pretrained`` loads a
transformers checkpoint (sharded safetensors written by transformers' own ``save_pretrained``)
into the tiers with the logits of a plain ``from_pretrained``; after training,
``engine.save_pretrained`` / ``model.save_pretrained`` write the current weights as a directory
transformers loads; errors in the checkpoint are named before anything is built."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import infinity
from infinity.checkpoint.pretrained import PretrainedMismatchError
from infinity.checkpoint.tensor_file import CheckpointError
from hf_common import SHARD, hf_load, hf_moe, hf_saved, logits_of, quiet_transformers, weights_in
from parity import VOCAB, loss_of, make_model, zero_config

pytestmark = pytest.mark.slow


def _config(disk_dir: Path, stage: int = 3, tier: str = "nvme", **extra) -> dict:
    ds = zero_config(stage, tier, tier, str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["train_micro_batch_size_per_gpu"] = 2
    ds.update(extra)
    return ds


def _batches(steps: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_pretrained_loads_trains_and_saves_as_transformers_would(disk_dir, family) -> None:
    """Logits equal a plain from_pretrained (0 difference in fp32); 5 steps at stage 3 with
    parameters and optimizer on NVMe match torch AdamW on the plain model (1e-5 relative);
    save_pretrained reloads, with transformers and with infinity, to the engine's logits."""
    src = hf_saved(disk_dir, family)
    assert (src / "model.safetensors.index.json").is_file()
    plain = hf_load(src)
    reference = hf_load(src).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01,
                                foreach=False)
    engine, optimizer, _, _ = infinity.from_pretrained(src, config=_config(disk_dir))
    x = _batches(1, seed=9)[0]
    try:
        assert optimizer is engine.optimizer
        assert not engine.module.training              # as transformers returns it
        assert (logits_of(engine, x) - logits_of(plain, x)).abs().max().item() == 0.0
        engine.train()
        for batch in _batches(5):
            loss = loss_of(engine(input_ids=batch, labels=batch))
            engine.backward(loss)
            engine.step()
            ref_loss = loss_of(reference(input_ids=batch, labels=batch))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
        engine.eval()
        trained = logits_of(engine, x)
        out = disk_dir / "out"
        assert engine.save_pretrained(out, max_shard_size=SHARD) == out
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == [type(engine.module).__name__]
        if family == "gpt2":       # the tied head is saved once, under the embedding's name
            assert "transformer.wte.weight" in index["weight_map"]
            assert "lm_head.weight" not in index["weight_map"]
        assert (logits_of(hf_load(out), x) - trained).abs().max().item() == 0.0
        torch.testing.assert_close(trained, logits_of(reference.eval(), x), rtol=1e-4, atol=1e-5)
    finally:
        engine.close()
    again, *_ = infinity.from_pretrained(out, config=_config(disk_dir))
    try:
        assert (logits_of(again, x) - trained).abs().max().item() == 0.0
    finally:
        again.close()


@pytest.mark.parametrize("stage, tier", [(3, "nvme"), (2, "cpu")])
def test_model_save_pretrained_and_state_dict_are_current_after_a_clipped_step(
        disk_dir, stage, tier) -> None:
    """model.save_pretrained() and model.state_dict() of a held model, before and right after
    a step with clipping (whose update lands at the next fetch): the engine's current weights,
    equal to torch's after the same step, never empty or one step stale."""
    src = hf_saved(disk_dir, "llama")
    reference = hf_load(src).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01,
                                foreach=False)
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir, stage, tier,
                                                              gradient_clipping=0.05))
    model = engine.module
    try:
        model.save_pretrained(disk_dir / "before")
        before = weights_in(disk_dir / "before")
        expected = {n: p.detach() for n, p in reference.named_parameters()}
        assert set(before) == set(expected)
        for name, value in expected.items():
            assert torch.equal(before[name], value), name
        engine.train()
        x = _batches(1)[0]
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
        loss = loss_of(reference(input_ids=x, labels=x))
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05) > 0.05   # clipped
        ref_opt.step()
        model.save_pretrained(disk_dir / "after")
        after = weights_in(disk_dir / "after")
        state = model.state_dict()
        current = engine.module_state_dict()
        for name, value in reference.named_parameters():
            assert after[name].numel() == value.numel() > 0, name
            assert torch.equal(after[name], current[name]), name
            assert torch.equal(state[name], current[name]), name
            torch.testing.assert_close(after[name], value.detach(), rtol=1e-5, atol=1e-6,
                                       msg=name)
        moved = [n for n in before if not torch.equal(before[n], after[n])]
        assert len(moved) == len(before), "every parameter moves in a step"
    finally:
        engine.close()


def test_state_dict_beyond_the_host_budget_names_the_streamed_save(disk_dir) -> None:
    src = hf_saved(disk_dir, "llama")
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    try:
        engine.manager.host_budget.limit = 1024       # a model larger than the budget
        with pytest.raises(RuntimeError, match=r"engine\.save_pretrained\(dir\)"):
            engine.module.state_dict()
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_files_load_into_fp32_compute(disk_dir, dtype) -> None:
    src = hf_saved(disk_dir, "qwen2", dtype=dtype)
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    x = _batches(1)[0]
    try:
        assert engine.compute_dtype == torch.float32
        plain = hf_load(src, dtype=torch.float32)
        assert (logits_of(engine, x) - logits_of(plain, x)).abs().max().item() == 0.0
    finally:
        engine.close()


def test_a_16bit_engine_keeps_the_fp32_file_in_its_masters(disk_dir) -> None:
    """bf16 compute from an fp32 file: the fp32 masters are read from the file (not from the
    bf16 copy), so an fp32 save right after the load gives the file back bit for bit; the
    default save dtype follows stage3_gather_16bit_weights_on_model_save."""
    src = hf_saved(disk_dir, "llama", layers=2)
    original = weights_in(src)
    for gather, expect in ((False, torch.float32), (True, torch.bfloat16)):
        ds = _config(disk_dir, 3, "cpu", bf16={"enabled": True},
                     infinity={"compute_dtype": "bf16"})
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
        engine, *_ = infinity.from_pretrained(src, config=ds)
        try:
            assert engine.compute_dtype == torch.bfloat16
            engine.save_pretrained(disk_dir / "out")
        finally:
            engine.close()
        saved = weights_in(disk_dir / "out")
        config = json.loads((disk_dir / "out" / "config.json").read_text())
        assert config["dtype"] == str(expect).replace("torch.", "")
        for name, value in original.items():
            assert saved[name].dtype == expect, name
            want = value if expect == torch.float32 else value.to(torch.bfloat16)
            assert torch.equal(saved[name], want), name


def test_tokenizer_and_generation_files_travel_with_the_model(disk_dir) -> None:
    src = hf_saved(disk_dir, "llama")
    generation = json.loads((src / "generation_config.json").read_text())
    generation["max_new_tokens"] = 17
    (src / "generation_config.json").write_text(json.dumps(generation))
    (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    try:
        engine.save_pretrained(disk_dir / "out")
        engine.save_checkpoint(disk_dir / "ckpt")
    finally:
        engine.close()
    out = disk_dir / "out"
    # and an export of its checkpoint (no --config): from the directory the manifest records
    from infinity.checkpoint.pretrained_write import export_pretrained
    exported = export_pretrained(disk_dir / "ckpt", disk_dir / "exported")
    for directory in (out, exported):
        for name in ("tokenizer_config.json", "tokenizer.json"):
            assert (directory / name).read_text() == (src / name).read_text(), directory
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 17
    assert (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors.index.json").exists()


def test_a_second_save_replaces_the_first_whole(disk_dir) -> None:
    """A sharded save over a single-file one (and back) leaves no file of the earlier save
    that transformers would read."""
    src = hf_saved(disk_dir, "llama")
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    out = disk_dir / "out"
    try:
        engine.save_pretrained(out)
        engine.save_pretrained(out, max_shard_size=SHARD)
        assert not (out / "model.safetensors").exists()
        shards = sorted(p.name for p in out.glob("model-*.safetensors"))
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == shards
        engine.save_pretrained(out)
        assert not list(out.glob("model-*.safetensors"))
        assert not (out / "model.safetensors.index.json").exists()
        assert not [p for p in out.iterdir() if p.name.startswith(".")]
    finally:
        engine.close()


def test_a_base_model_checkpoint_loads_under_a_head_and_kwargs_reach_the_config(disk_dir) -> None:
    """A checkpoint saved from the base model (no ``model.`` prefix, no head) loads into the
    causal LM with strict=False, as transformers maps base_model_prefix; keyword arguments
    override the config, and the ones that mean something else here are refused."""
    quiet_transformers()
    full = make_model("llama", layers=2, width=64)
    full.model.save_pretrained(disk_dir / "base")
    with pytest.raises(PretrainedMismatchError, match=r"not in it: lm_head\.weight"):
        infinity.from_pretrained(disk_dir / "base", config=_config(disk_dir))
    with pytest.raises(TypeError, match="device_map: the engine places every state itself"):
        infinity.from_pretrained(disk_dir / "base", config=_config(disk_dir), device_map="auto")
    with pytest.raises(TypeError, match="not_a_setting"):
        infinity.from_pretrained(disk_dir / "base", config=_config(disk_dir), strict=False,
                                 not_a_setting=1)
    engine, *_ = infinity.from_pretrained(disk_dir / "base", config=_config(disk_dir),
                                          strict=False, use_cache=False,
                                          attn_implementation="eager")
    try:
        assert engine.module.config.use_cache is False
        assert engine.module.config._attn_implementation == "eager"
        state = engine.module_state_dict()
        for name, value in full.model.state_dict().items():
            assert torch.equal(state["model." + name], value), name
    finally:
        engine.close()


class _Wrapped(torch.nn.Module):
    """A model wrapped as PEFT wraps one: new names, a small adapter with its own values."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.scale = torch.nn.Parameter(torch.full((64,), 0.5))

    def forward(self, input_ids, labels=None):
        out = self.inner(input_ids=input_ids, labels=labels)
        return out


def test_prepare_model_wraps_and_freezes_outside_zero_init(disk_dir) -> None:
    """prepare_model runs after the match, outside zero.Init: a wrapper's new parameter keeps
    the value it was built with, frozen parameters stay frozen, and the checkpoint's tensors
    follow their parameters under the wrapper's names."""
    src = hf_saved(disk_dir, "llama")

    def prepare(model):
        assert next(model.parameters()).device.type == "meta"
        model.model.embed_tokens.requires_grad_(False)
        return _Wrapped(model)

    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir), prepare_model=prepare)
    x = _batches(1)[0]
    try:
        assert isinstance(engine.module, _Wrapped)
        state = engine.module_state_dict()
        assert torch.equal(state["scale"], torch.full((64,), 0.5))
        assert not engine.module.inner.model.embed_tokens.weight.requires_grad
        assert (logits_of(engine, x) - logits_of(hf_load(src), x)).abs().max().item() == 0.0
    finally:
        engine.close()


def _train_three_steps(engine) -> None:
    """Three training steps on seeded batches, the engine left in eval mode."""
    engine.train()
    for batch in _batches(3, seed=5):
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    engine.eval()


def _peft(model, **lora):
    """``model`` wrapped by PEFT, its adapter drawn from seed 7."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            **lora))


def test_an_older_checkpoints_per_layer_rotary_buffers_are_ignored_as_transformers(disk_dir):
    """Llama conversions written before transformers 4.31 hold each layer's rotary inv_freq:
    transformers ignores them, the load here refused them as not in the model (strict=False,
    which hides real mismatches, was the only way through)."""
    from safetensors.torch import load_file, save_file

    src = hf_saved(disk_dir, "llama", shard="1GB")
    path = src / "model.safetensors"
    state = load_file(str(path))
    for i in range(3):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(state, str(path), metadata={"format": "pt"})
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    try:
        got = engine.module_state_dict()
        assert all(torch.equal(got[k], v) for k, v in state.items() if k in got)
    finally:
        engine.close()


def test_prepare_model_that_resizes_a_loaded_parameter_is_refused(disk_dir) -> None:
    """resize_token_embeddings in prepare_model keeps the Parameter and gives it a new shape:
    its values were streamed from the checkpoint's tensor, and the rows past it were the bytes
    of the next tensor in the file (a norm's ones, then other weights), silently."""
    src = hf_saved(disk_dir, "llama")

    def prepare(model):
        model.resize_token_embeddings(model.config.vocab_size + 12, mean_resizing=False)
        return model

    with pytest.raises(ValueError, match=r"prepare_model changed the shape of .*embed_tokens"
                                         r".*resize it there"):
        infinity.from_pretrained(src, config=_config(disk_dir), prepare_model=prepare)
    # and after loading: refused saying when to resize (transformers failed on the released
    # weight at stage 3, "not enough values to unpack")
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    try:
        with pytest.raises(RuntimeError, match=r"resize_token_embeddings\(140\) after "
                                               r"infinity\.initialize.*Resize before"):
            engine.module.resize_token_embeddings(140)
        # a call that changes nothing (the getter form, the current size) is transformers'
        embeddings = engine.module.get_input_embeddings()
        assert engine.module.resize_token_embeddings() is embeddings
        assert engine.module.resize_token_embeddings(embeddings.num_embeddings) is embeddings
    finally:
        engine.close()


@pytest.mark.parametrize("lora", [{}, {"modules_to_save": ["lm_head"]}], ids=["lora", "head"])
def test_a_peft_adapter_from_prepare_model_starts_from_the_base(disk_dir, lora) -> None:
    """PEFT builds the adapter with its values (lora_B zero), then moves it to the meta device
    of the layers it wraps: the adapter keeps those values (before, the model's _init_weights
    re-initialised lora_B to std 0.02 and step 0 was not the base model), and a
    modules_to_save copy of the head is loaded as the head. Step-0 logits equal the base
    model's; every adapter tensor equals PEFT's on a plain model from the same seed."""
    pytest.importorskip("peft")
    src = hf_saved(disk_dir, "llama", layers=2)
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir),
                                          prepare_model=lambda m: _peft(m, **lora))
    x = _batches(1)[0]
    try:
        base = hf_load(src)
        assert (logits_of(engine, x) - logits_of(base, x)).abs().max().item() == 0.0
        reference = _peft(hf_load(src), **lora).state_dict()
        state = engine.module_state_dict()
        added = [k for k in reference if "lora_" in k or "modules_to_save" in k]
        assert added and all(torch.equal(state[k], reference[k]) for k in added), added
    finally:
        engine.close()


def test_save_pretrained_of_a_peft_model_is_its_adapter(disk_dir, tmp_path) -> None:
    """engine.save_pretrained (and model.save_pretrained) of a PeftModel write what
    PeftModel.save_pretrained writes -- adapter_config.json and adapter_model.safetensors under
    PEFT's names, no config.json or model.safetensors of the wrapper's internal names (which
    transformers loaded with the base's weights missing, silently) -- and PeftModel.from_pretrained
    over the plain base gives the engine's logits after training; a README of the user's stays."""
    pytest.importorskip("peft")
    from peft import PeftModel

    src = hf_saved(disk_dir, "llama", layers=2)
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir),
                                          prepare_model=lambda m: _peft(m))
    x = _batches(1)[0]
    try:
        _train_three_steps(engine)
        out = tmp_path / "adapter"
        out.mkdir()
        (out / "README.md").write_text("mine\n")
        engine.save_pretrained(out)
        assert sorted(p.name for p in out.iterdir()) == [
            "README.md", "adapter_config.json", "adapter_model.safetensors"]
        assert (out / "README.md").read_text() == "mine\n"
        again = tmp_path / "again"
        engine.module.save_pretrained(again)
        assert (again / "adapter_model.safetensors").is_file()
        merged = tmp_path / "merged"
        engine.save_pretrained(merged, merged=True)
        ours = logits_of(engine, x)
    finally:
        engine.close()
    for directory in (out, again):
        reloaded = PeftModel.from_pretrained(hf_load(src), directory).eval()
        assert (logits_of(reloaded, x) - ours).abs().max().item() <= 1e-6
        assert (logits_of(reloaded, x) - logits_of(hf_load(src), x)).abs().max().item() > 1e-4
    # merged=True: the base with the adapter merged, under the base's names, as PEFT's
    # merge_and_unload gives it (fp32; the merge's products rounded alike: <= 1e-6)
    want = PeftModel.from_pretrained(hf_load(src), out).merge_and_unload().state_dict()
    got = weights_in(merged)
    assert sorted(got) == sorted(weights_in(src)), sorted(set(got) ^ set(weights_in(src)))
    for name, value in got.items():
        assert (value - want[name]).abs().max().item() <= 1e-6, name
    assert (logits_of(hf_load(merged), x) - ours).abs().max().item() <= 1e-5


def test_a_merged_save_of_a_lora_over_a_tied_head_is_refused(disk_dir, tmp_path) -> None:
    """LoRA on GPT-2's lm_head, tied to its input embedding: a merged save cannot be what
    training computed (one saved tensor serves both uses; merged, the input embedding would
    change too), and before it was written without the adapter, silently. Refused before
    anything is written; the adapter's own save still works."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    src = hf_saved(disk_dir, "gpt2", layers=2)
    engine, *_ = infinity.from_pretrained(
        src, config=_config(disk_dir),
        prepare_model=lambda m: get_peft_model(m, LoraConfig(r=4, target_modules=["lm_head"])))
    try:
        batch = _batches(1)[0]
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
        with pytest.raises(ValueError, match="lm_head adapts a weight tied to .*wte.weight"):
            engine.save_pretrained(tmp_path / "merged", merged=True)
        assert not (tmp_path / "merged").exists()
        engine.save_pretrained(tmp_path / "adapter")
        assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    finally:
        engine.close()


def _lora_variant(model, case: str):
    """``model`` under a LoRA adapter of ``case`` (seeded): "embedding" (LoRA on the input
    embedding, whose factors are lora_embedding_A/B), "lora_bias" (a trained bias on lora_B),
    "second_adapter" (two adapters, each with its own copy of the head; the second active),
    "copy_of_another" (the active adapter has no copy of the head; the other has one: the
    original head is the layer)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    if case == "embedding":
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    if case == "lora_bias":
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    if case == "copy_of_another":     # only the inactive adapter copies the head
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
        model.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"],
                                               modules_to_save=["lm_head"]))
        model.set_adapter("default")
        return model
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"],
                                             modules_to_save=["lm_head"]))
    model.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"],
                                           modules_to_save=["lm_head"]))
    model.set_adapter("second")
    return model


@pytest.mark.parametrize("case", ["embedding", "lora_bias", "second_adapter",
                                  "copy_of_another"])
def test_a_merged_save_is_the_trained_model_for_every_lora_layer_kind(disk_dir, tmp_path,
                                                                      case) -> None:
    """A merged save holds the base's tensors, no more, no fewer, and gives the engine's logits
    (fp32: 1e-5). Before: an embedding's factors and a lora_B bias were written as extra
    tensors beside the unmerged base (logits 0.58 and 1.7e-3 off), and with two adapters the
    untrained one's head copy was written as the head (0.84 off), each loaded by transformers
    with only an "unexpected keys" note."""
    pytest.importorskip("peft")
    src = hf_saved(disk_dir, "qwen2" if case == "lora_bias" else "llama", layers=2)
    engine, *_ = infinity.initialize(model=_lora_variant(hf_load(src), case),
                                     config=_config(disk_dir, optimizer={
                                         "type": "AdamW", "params": {"lr": 1e-2}}))
    x = _batches(1)[0]
    try:
        _train_three_steps(engine)
        ours = logits_of(engine, x)
        engine.save_pretrained(tmp_path / "merged", merged=True)
    finally:
        engine.close()
    assert sorted(weights_in(tmp_path / "merged")) == sorted(weights_in(src))
    assert (logits_of(hf_load(tmp_path / "merged"), x) - ours).abs().max().item() <= 1e-5
    assert (logits_of(hf_load(src), x) - ours).abs().max().item() > 1e-4    # it trained


def test_a_peft_adapter_over_a_zero_init_base_is_refused_not_reinitialised(disk_dir) -> None:
    """get_peft_model over a base built under zero.Init moves the adapter PEFT initialised to
    the base's meta device (its values gone); initialize refuses it, naming the route that
    keeps them, instead of training from a random lora_B."""
    pytest.importorskip("peft")
    with infinity.zero.Init(config=_config(disk_dir)):
        base = make_model("llama", layers=2, width=64)
    with pytest.raises(ValueError) as info:
        infinity.initialize(model=_peft(base), config=_config(disk_dir))
    message = str(info.value)
    assert "lora_B" in message and "prepare_model" in message, message


def test_a_dora_adapter_passed_to_initialize_starts_from_the_base(disk_dir) -> None:
    """DoRA (refused through prepare_model, whose base is not loaded yet) through
    initialize(peft_model) over a base transformers loaded: its magnitude is the base weight's
    norm, so step-0 logits equal the base model's, on stage 3 NVMe."""
    pytest.importorskip("peft")
    src = hf_saved(disk_dir, "llama", layers=2)
    engine, *_ = infinity.initialize(model=_peft(hf_load(src), use_dora=True),
                                     config=_config(disk_dir))
    x = _batches(1)[0]
    try:
        assert (logits_of(engine, x) - logits_of(hf_load(src), x)).abs().max().item() <= 1e-6
    finally:
        engine.close()


def test_an_adapter_computed_from_unloaded_weights_is_refused(disk_dir) -> None:
    """DoRA computes its magnitude from the base weight, still on the meta device inside
    prepare_model: refused before any work, naming the parameters and what to do (it would
    otherwise train from a random init)."""
    pytest.importorskip("peft")
    src = hf_saved(disk_dir, "llama", layers=2)
    with pytest.raises(ValueError) as info:
        infinity.from_pretrained(src, config=_config(disk_dir),
                                 prepare_model=lambda m: _peft(m, use_dora=True))
    message = str(info.value)
    assert "lora_magnitude_vector" in message and "use_dora" in message, message
    assert "infinity.initialize" in message, message


def test_an_adapter_initialised_by_an_svd_of_unloaded_weights_is_named(disk_dir) -> None:
    """PiSSA's SVD of the base weight on the meta device failed inside PEFT with torch's
    "incompatible tensor type" and no word of why; the error now says what prepare_model
    runs on and the two routes that work."""
    pytest.importorskip("peft")
    src = hf_saved(disk_dir, "llama", layers=2)
    with pytest.raises(ValueError, match=r"prepare_model raised .*meta device.*PiSSA.*"
                                         r"infinity\.initialize"):
        infinity.from_pretrained(src, config=_config(disk_dir),
                                 prepare_model=lambda m: _peft(m, init_lora_weights="pissa"))


def _neox(directory: Path) -> Path:
    """A small random GPT-NeoX saved by transformers: the Hub layout, with embed_out, which
    transformers renames to lm_head while it loads."""
    transformers = quiet_transformers()
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     tie_word_embeddings=False)
    src = directory / "neox"
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(src, max_shard_size=SHARD)
    return src


def test_a_checkpoint_transformers_renames_at_load_loads_and_saves_back(disk_dir,
                                                                        tmp_path) -> None:
    """GPT-NeoX's embed_out is the model's lm_head after transformers' load-time renaming
    (its conversion_mapping, read from transformers): the logits equal transformers' (fp32, 0
    difference; before, the load was refused, and the strict=False it suggested left the head
    random), and save_pretrained writes the Hub's names back, as transformers does."""
    src = _neox(disk_dir)
    assert "embed_out.weight" in weights_in(src)
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    x = _batches(1)[0]
    try:
        assert (logits_of(engine, x) - logits_of(hf_load(src), x)).abs().max().item() == 0.0
        engine.save_pretrained(tmp_path / "out")
    finally:
        engine.close()
    assert sorted(weights_in(tmp_path / "out")) == sorted(weights_in(src))
    assert (logits_of(hf_load(tmp_path / "out"), x) - logits_of(hf_load(src), x)).abs().max() == 0.0


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "phimoe"])
def test_a_checkpoint_transformers_fuses_at_load_loads_as_transformers_loads_it(
        disk_dir, tmp_path, family) -> None:
    """The per-expert tensors of a Hub MoE checkpoint are fused into the model's
    experts.gate_up_proj / down_proj with transformers' own operations (its conversion_mapping)
    as each unit is placed: the logits equal transformers' (fp32: 0 difference; before, the
    load was refused and the strict=False it suggested left the experts random: 1.22 off for
    Mixtral); 5 steps at stage 3 on NVMe, the router's auxiliary loss in the loss, match torch
    AdamW on transformers' model (1e-5 relative, as the dense families); the save is the Hub
    layout again (its names equal the source's) and reloads in transformers to the engine's
    logits."""
    src = hf_moe(disk_dir, family)
    assert any(".experts.1." in k for k in weights_in(src))
    assert len(list(src.glob("*.safetensors"))) > 2
    reference = hf_load(src).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01,
                                foreach=False)
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    x = _batches(1)[0]
    try:
        assert (logits_of(engine, x) - logits_of(hf_load(src), x)).abs().max().item() == 0.0
        engine.train()
        for batch in _batches(5):
            out = engine(input_ids=batch, labels=batch)
            assert out.aux_loss is not None and out.aux_loss.item() > 0
            engine.backward(out.loss)
            engine.step()
            ref_loss = reference(input_ids=batch, labels=batch).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            # the engine's update and torch's agree to about an ulp, as for the dense families;
            # the router could only pick another expert where two of its logits tie to ~1e-7;
            # on these seeded weights and batches the closest call between the 2nd and 3rd
            # expert is 9e-5 (Qwen2-MoE; Mixtral 5e-4, PhiMoE 1e-3), ~1000x that drift
            assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
        engine.eval()
        ours = logits_of(engine, x)
        engine.save_pretrained(tmp_path / "out")
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    assert (logits_of(hf_load(tmp_path / "out"), x) - ours).abs().max().item() == 0.0
    assert sorted(weights_in(tmp_path / "out")) == sorted(weights_in(src))   # the Hub layout
    # and `infinity export` of its checkpoint, from the config.json the checkpoint holds
    from infinity.checkpoint.pretrained_write import export_pretrained
    from infinity.engine.hf_conversions import hub_names_of_config
    exported = export_pretrained(tmp_path / "ckpt", tmp_path / "exported",
                                 hub_names_of=hub_names_of_config)
    assert sorted(weights_in(exported)) == sorted(weights_in(src))
    assert (logits_of(hf_load(exported), x) - ours).abs().max().item() <= 1e-6


def test_a_model_that_is_not_a_causal_lm_names_the_class_to_pass(disk_dir) -> None:
    """T5 under the default AutoModelForCausalLM: the error names the classes that build it
    (its config's architecture first), not transformers' list of every causal LM."""
    transformers = quiet_transformers()
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                num_heads=2)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(disk_dir / "t5")
    with pytest.raises(ValueError) as info:
        infinity.from_pretrained(disk_dir / "t5", config=_config(disk_dir))
    message = str(info.value)
    assert "model_class=transformers.T5ForConditionalGeneration" in message, message
    assert "AutoModelForSeq2SeqLM" in message and "GPT2Config" not in message, message


@pytest.mark.parametrize("kept_fp32", [False, True], ids=["cast", "kept-fp32"])
def test_a_16_bit_engine_holds_the_checkpoints_buffers_as_transformers_does(
        disk_dir, monkeypatch, kept_fp32) -> None:
    """BART's ``final_logits_bias`` (a persistent buffer) stayed fp32 under a bf16 engine, so
    its logits and loss were fp32 where transformers' bf16 load gives bf16; computed buffers
    (a rotary inv_freq) stay fp32, as transformers keeps them, and so does a buffer the model
    lists in ``_keep_in_fp32_modules_strict`` (a MoE router's correction bias)."""
    transformers = quiet_transformers()
    if kept_fp32:
        monkeypatch.setattr(transformers.BartForConditionalGeneration,
                            "_keep_in_fp32_modules_strict", ["final_logits_bias"], raising=False)
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1,
                                  decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32)
    model = transformers.BartForConditionalGeneration(cfg)
    with torch.no_grad():
        model.final_logits_bias.normal_()
    model.save_pretrained(disk_dir / "bart")
    reference = transformers.BartForConditionalGeneration.from_pretrained(
        disk_dir / "bart", dtype=torch.bfloat16)
    engine, *_ = infinity.from_pretrained(
        disk_dir / "bart", config=_config(disk_dir, infinity={"compute_dtype": "bf16"}),
        model_class=transformers.BartForConditionalGeneration)
    try:
        want = torch.float32 if kept_fp32 else torch.bfloat16
        assert engine.module.final_logits_bias.dtype == reference.final_logits_bias.dtype == want
        x = torch.randint(3, VOCAB, (1, 6))
        engine.eval()
        with torch.no_grad():
            ours = engine(input_ids=x, decoder_input_ids=x).logits
            theirs = reference(input_ids=x, decoder_input_ids=x).logits
        assert ours.dtype == theirs.dtype == want
        torch.testing.assert_close(ours, theirs)
    finally:
        engine.close()


# -- errors in the checkpoint ------------------------------------------------------------
def _single_file(disk_dir: Path, change) -> Path:
    """A llama checkpoint as one file, its state dict changed by ``change(sd)``."""
    from safetensors.torch import save_file

    model = make_model("llama", layers=2, width=64)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    change(sd)
    src = disk_dir / "src"
    model.config.save_pretrained(src)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


def _no_swap_left(disk_dir: Path) -> bool:
    return not list(disk_dir.glob("infinity-swap-*"))


def test_a_missing_parameter_is_named_and_strict_false_loads_the_rest(disk_dir) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    src = _single_file(disk_dir, lambda sd: sd.pop(name))
    with pytest.raises(PretrainedMismatchError, match=f"not in it: {name}.*strict=False"):
        infinity.from_pretrained(src, config=_config(disk_dir))
    assert _no_swap_left(disk_dir)
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir), strict=False)
    try:
        current = engine.module_state_dict()
        full = make_model("llama", layers=2, width=64).state_dict()
        for key, value in full.items():
            if key != name:
                assert torch.equal(current[key], value), key
        assert current[name].std() > 0          # the model's init, not zeros
    finally:
        engine.close()


def test_an_unexpected_tensor_is_named_with_its_file(disk_dir) -> None:
    src = _single_file(disk_dir, lambda sd: sd.update({"model.layers.0.extra.weight":
                                                        torch.zeros(3)}))
    with pytest.raises(PretrainedMismatchError,
                       match=r"not in the model: model\.layers\.0\.extra\.weight "
                             r"\(model\.safetensors\)"):
        infinity.from_pretrained(src, config=_config(disk_dir))
    assert _no_swap_left(disk_dir)


def test_a_shape_mismatch_names_the_tensor_and_the_file(disk_dir) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    src = _single_file(disk_dir, lambda sd: sd.update({name: torch.zeros(64, 100)}))
    with pytest.raises(PretrainedMismatchError,
                       match=rf"{name}: checkpoint \[64, 100\] in model\.safetensors, model "
                             r"\[64, 128\].*ignore_mismatched_sizes=True"):
        infinity.from_pretrained(src, config=_config(disk_dir))
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir),
                                          ignore_mismatched_sizes=True)
    engine.close()


def test_a_missing_shard_is_named_with_a_tensor_it_holds(disk_dir) -> None:
    src = hf_saved(disk_dir, "llama")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    lost = sorted(set(index.values()))[1]
    held = sorted(k for k, v in index.items() if v == lost)[0]
    (src / lost).unlink()
    with pytest.raises(CheckpointError, match=rf"missing: {lost} \(holds \d+ tensors, e\.g\. "
                                              rf"{held}\)"):
        infinity.from_pretrained(src, config=_config(disk_dir))
    assert _no_swap_left(disk_dir)


def test_a_directory_without_safetensors_is_refused_plainly(disk_dir) -> None:
    src = _single_file(disk_dir, lambda sd: None)
    shutil.move(src / "model.safetensors", src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        infinity.from_pretrained(src, config=_config(disk_dir))


# -- infinity export ---------------------------------------------------------------------
def test_infinity_export_writes_a_directory_transformers_loads(disk_dir, capsys) -> None:
    from infinity.cli import main

    src = hf_saved(disk_dir, "gpt2")
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    x = _batches(1, seed=5)[0]
    try:
        engine.train()
        for batch in _batches(2):
            engine.backward(loss_of(engine(input_ids=batch, labels=batch)))
            engine.step()
        engine.save_checkpoint(disk_dir / "ckpt")
        engine.eval()
        trained = logits_of(engine, x)
    finally:
        engine.close()
    out = disk_dir / "exported"
    out.mkdir()
    (out / "adapter.safetensors").write_bytes(b"the user's")     # not counted as written
    assert main(["export", str(disk_dir / "ckpt"), str(out), "--max-shard-size", SHARD]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = len(set(index["weight_map"].values()))
    assert f": {written} weight file(s), " in capsys.readouterr().out
    # into the checkpoint (a tag's directory or the save directory): refused, nothing written
    tag = next(p for p in (disk_dir / "ckpt").iterdir() if p.is_dir())
    for into in (tag, disk_dir / "ckpt"):
        assert main(["export", str(disk_dir / "ckpt"), str(into)]) == 2
        assert "is a checkpoint or inside one" in capsys.readouterr().err
        assert not (into / "model.safetensors").exists()
    assert (out / "model.safetensors.index.json").is_file()
    assert (logits_of(hf_load(out), x) - trained).abs().max().item() == 0.0
    assert main(["export", str(disk_dir / "ckpt"), str(disk_dir / "half"), "--dtype", "bf16"]) == 0
    assert json.loads((disk_dir / "half" / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in weights_in(disk_dir / "half").values()
               if v.is_floating_point())


def test_an_export_as_stored_says_the_dtype_it_wrote(disk_dir) -> None:
    """`infinity export --dtype stored` of a bf16 run writes its fp32 masters: config.json said
    bfloat16 (the run's compute dtype), so transformers' default load threw the precision the
    user exported for away."""
    from infinity.cli import main

    src = hf_saved(disk_dir, "llama", shard="1GB")
    ds = _config(disk_dir)
    ds["infinity"]["compute_dtype"] = "bf16"
    engine, *_ = infinity.from_pretrained(src, config=ds)
    try:
        engine.save_checkpoint(disk_dir / "ckpt")
    finally:
        engine.close()
    assert main(["export", str(disk_dir / "ckpt"), str(disk_dir / "out"), "--dtype", "stored"]) == 0
    written = {v.dtype for v in weights_in(disk_dir / "out").values() if v.is_floating_point()}
    assert written == {torch.float32}, written
    assert json.loads((disk_dir / "out" / "config.json").read_text())["dtype"] == "float32"


def test_a_tied_head_stored_with_other_values_is_refused_and_loads_untied(disk_dir) -> None:
    """GPT-2 ties its head to the embedding; a checkpoint holding both with different values
    (a fine-tune saved untied) loaded the embedding for both, silently: logits 30 away from
    transformers', which unties them then. Refused, naming the override that loads it as
    transformers does; the same values stored twice load as one."""
    from safetensors.torch import load_file, save_file

    src = hf_saved(disk_dir, "gpt2", shard="1GB")
    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["transformer.wte.weight"].clone()   # the same: fine
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    x = torch.randint(1, VOCAB, (2, 8))
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    try:
        assert torch.equal(logits_of(engine.eval(), x), logits_of(hf_load(src), x))
    finally:
        engine.close()
    weights["lm_head.weight"] = torch.randn_like(weights["lm_head.weight"])
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PretrainedMismatchError, match="ties transformer.wte.weight and "
                                                      "lm_head.weight .* different values"):
        infinity.from_pretrained(src, config=_config(disk_dir))
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir), tie_word_embeddings=False)
    try:
        theirs = hf_load(src)
        assert torch.equal(theirs.lm_head.weight, weights["lm_head.weight"])   # untied there
        assert torch.equal(logits_of(engine.eval(), x), logits_of(theirs, x))
    finally:
        engine.close()


def test_model_save_pretrained_says_which_options_it_does_not_honour(disk_dir, infinity_log):
    """Options the engine's save does not take (transformers 5's save_original_format, say)
    were dropped without a word."""
    src = hf_saved(disk_dir, "llama", shard="1GB")
    engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir))
    try:
        engine.module.save_pretrained(disk_dir / "out", save_original_format=True)
        assert not any("not honoured" in r.getMessage() for r in infinity_log.records)  # its own
        engine.module.save_pretrained(disk_dir / "out", save_original_format=False)
    finally:
        engine.close()
    assert any("save_original_format=False not honoured" in r.getMessage()
               for r in infinity_log.records)
    assert (disk_dir / "out" / "model.safetensors").is_file()


def test_a_saved_adapter_loaded_in_prepare_model_keeps_its_values(disk_dir) -> None:
    """PeftModel.from_pretrained(model, adapter_dir) in prepare_model: PEFT's load copied the
    saved adapter into meta parameters (a no-op) and the engine trained a fresh LoRA init,
    silently. The saved values are the engine's, as when the loaded PeftModel is passed to
    initialize."""
    from peft import PeftModel
    from safetensors.torch import load_file

    src = hf_saved(disk_dir, "llama", layers=2)
    trained = _peft(hf_load(src))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_" in name:
                p.normal_()           # a trained adapter: lora_B away from its zero init
    trained.save_pretrained(disk_dir / "adapter")
    saved = load_file(str(disk_dir / "adapter" / "adapter_model.safetensors"))
    engine, *_ = infinity.from_pretrained(
        src, config=_config(disk_dir), prepare_model=lambda m: PeftModel.from_pretrained(
            m, str(disk_dir / "adapter"), is_trainable=True))
    try:
        state = engine.module_state_dict()
        for key, value in saved.items():
            assert torch.equal(state[key.replace(".weight", ".default.weight")], value), key
    finally:
        engine.close()


def test_adapters_peft_moves_entry_by_entry_keep_peft_s_init(disk_dir) -> None:
    """IA3's vectors and LoRA's embedding factors live in ParameterDicts, which PEFT moves to
    the base layer's (meta) device entry by entry: their init was taken for one computed from
    the base weights and prepare_model was refused. IA3 starts at ones, an embedding LoRA's A
    at zeros, as PEFT makes them."""
    from peft import IA3Config, LoraConfig, get_peft_model

    src = hf_saved(disk_dir, "llama", layers=2)
    for config, check in (
            (IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                       feedforward_modules=["down_proj"]),
             lambda k, v: "ia3_l" not in k or torch.equal(v, torch.ones_like(v))),
            (LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]),
             lambda k, v: "lora_embedding_A" not in k or not v.any())):
        engine, *_ = infinity.from_pretrained(src, config=_config(disk_dir),
                                              prepare_model=lambda m: get_peft_model(m, config))
        try:
            state = engine.module_state_dict()
            assert any("ia3_l" in k or "lora_embedding_A" in k for k in state)
            assert all(check(k, v) for k, v in state.items()), type(config).__name__
        finally:
            engine.close()
