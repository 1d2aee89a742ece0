"""PEFT LoRA on an infinity engine, through infinity's Trainer: the frozen base lives on NVMe
(stage 3) and only the adapter is in the optimizer; the adapter trains, save_model writes the
adapter (adapter_model.safetensors), which peft loads back onto a fresh base to the engine's
logits. The same run with transformers' plain Trainer gives the same losses.

[Note: why 1e-5 holds on any CPU, and why lr 1e-2]
The engine and the plain Trainer take the same steps up to rounding: infinity's AdamW update is
torch's to at most ~10 ulps (of the update) on ~3% of the elements (an equally rounded but different
formula: sqrt(v) * (1/sqrt(bc2)) against sqrt(v) / sqrt(bc2), beta1*m + (1-beta1)*g against lerp),
its gradient norm is a fixed-order float64 sum against torch's float32 reductions, and those
reductions and the GEMMs round differently on each CPU (ATen's AVX2 or AVX-512 kernels, MKL's
AVX2, AVX-512 or AMX code paths). What the bound must cover is that per-step rounding after the
training dynamics have amplified it over the 20 steps. The amplification is a property of the
trajectory (the Jacobians along it), the same on every CPU, since the trajectories agree to far
below the bound; only the injected rounding differs, and that is a few ulps on any IEEE CPU.
Measured by nudging the plain Trainer's own adapter by 16 float32 ulps, random sign, on every
element after every step (more than the engine's difference): at lr 1e-2 the losses move by
<= 2e-7 and the grad norms by <= 2e-6 over the 20 steps, so 1e-5 is 5x that and ~170 float32 ulps
(2**-24 ~ 6e-8). At lr 3e-2 (this test's old value) the run is unstable (the loss oscillates
between 5.1 and 5.7 and learns a quarter as much) and a single 1-ulp nudge became 1e-5 to 5e-5 in
the grad norms of steps 16-18: the old bound held or failed by the luck of the CPU's rounding
(it failed on Intel Sapphire Rapids, grad norm 3.021740 vs 3.021692 at step 16). The engine's
actual drift on an AVX2 AMD EPYC: losses 9e-8 (one ulp), grad norms 2e-7, also with ATen forced to
its unvectorized kernels and MKL to its compatible (CBWR) code path. A wrong update is first
order at lr 1e-2: an update 1.0001x too large moves the grad norms by 1e-4 (10x the bound), 1.001x
by 1e-3 (losses 9e-5), a wrong weight decay by 1.5e-2, one adapter tensor not stepped by 0.6."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import infinity
from hf_common import close_rel, hf_args, hf_data, hf_ds, logged
from parity import make_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
hf = pytest.importorskip("infinity.integrations.hf")


LR = 1e-2        # stable: rounding is not amplified (see the note above); 3e-2 was not
REL = 1e-5       # losses and grad norms against the plain Trainer's (see the note above)


def _lora(seed: int = 0):
    base = make_model("llama", layers=2, width=32, seed=seed)
    config = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"],
                             lora_dropout=0.0, task_type="CAUSAL_LM")
    torch.manual_seed(1)
    return peft.get_peft_model(base, config)


def test_a_lora_adapter_trains_offloaded_saves_and_reloads(disk_dir, tmp_path) -> None:
    from infinity.storage.tiers import Tier

    warnings.filterwarnings("ignore")
    data, evals = hf_data(), hf_data(8, seed=1)
    model = _lora()
    plain = transformers.Trainer(model=copy.deepcopy(model), train_dataset=data,
                                 eval_dataset=evals,
                                 args=transformers.TrainingArguments(tmp_path / "plain",
                                                                     **hf_args(learning_rate=LR)))
    plain.train()
    adapter_before = {n: p.detach().clone() for n, p in model.named_parameters()
                      if p.requires_grad}
    trainer = hf.Trainer(model=model, train_dataset=data, eval_dataset=evals,
                         args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                                   **hf_args(learning_rate=LR)))
    try:
        trainer.train()
        engine = trainer.engine
        # the frozen base is at home on NVMe; the optimizer holds the adapter alone
        assert engine.param_tier is Tier.NVME
        in_optimizer = [p for g in engine.optimizer.param_groups for p in g["params"]]
        assert len(in_optimizer) == len(adapter_before) == 18
        trainable = {e.name: e.numel for u in engine.units for e in u.params if e.trainable}
        assert trainable == {n: p.numel() for n, p in adapter_before.items()}
        close_rel(logged(trainer, "loss"), logged(plain, "loss"), REL)
        close_rel(logged(trainer, "grad_norm"), logged(plain, "grad_norm"), REL)
        losses = logged(trainer, "loss")
        assert sum(losses[-4:]) < sum(losses[:4]) - 0.05, str(losses)

        trainer.save_model(tmp_path / "adapter")
        saved = sorted(p.name for p in (tmp_path / "adapter").iterdir())
        assert "adapter_model.safetensors" in saved and "adapter_config.json" in saved
        assert "model.safetensors" not in saved
        x = torch.stack([d["input_ids"] for d in evals])
        engine.eval()
        with torch.no_grad():
            ours = engine(input_ids=x).logits
        current = engine.module_state_dict()
        assert any(not torch.equal(current[n], adapter_before[n]) for n in adapter_before)
    finally:
        trainer.close()
    base = make_model("llama", layers=2, width=32, seed=0)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = reloaded(input_ids=x).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)




def test_a_model_with_two_adapters_saves_each_where_peft_puts_it(disk_dir, tmp_path) -> None:
    """The trained "default" adapter at the top and an added one in its own directory, as
    ``PeftModel.save_pretrained`` lays them out, each with its own config and weights (the
    added one is frozen: saved all the same). Before, the files were taken by name from every
    directory PEFT wrote, and the added adapter's config and weights replaced the trained
    one's. A killed save's staging directory is removed where it holds only adapter files;
    one holding anything else is left alone."""
    from safetensors.torch import load_file

    import infinity

    warnings.filterwarnings("ignore")
    model = _lora()
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["up_proj"],
                                                task_type="CAUSAL_LM"))
    model.set_adapter("default")
    out = tmp_path / "adapters"
    (out / ".infinity-adapter-killed" / "second").mkdir(parents=True)
    (out / ".infinity-adapter-killed" / "second" / "adapter_config.json").write_text("{}")
    (out / ".infinity-adapter-mine").mkdir()
    (out / ".infinity-adapter-mine" / "notes.txt").write_text("the user's\n")
    ds = {**hf_ds(disk_dir), "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
          "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        engine.save_pretrained(out)
        trained = engine.module_state_dict()
    finally:
        engine.close()
    reference = copy.deepcopy(_lora())
    reference.add_adapter("second", peft.LoraConfig(r=2, target_modules=["up_proj"],
                                                    task_type="CAUSAL_LM"))
    reference.load_state_dict(trained)
    reference.save_pretrained(tmp_path / "peft")
    for relative in ("adapter_model.safetensors", "second/adapter_model.safetensors"):
        ours, theirs = load_file(str(out / relative)), load_file(str(tmp_path / "peft" / relative))
        # PEFT also copies a targeted lm_head's frozen base weight (save_embedding_layers
        # "auto"): so does the engine's save now, tensor for tensor
        assert set(ours) == set(theirs) and ours
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), (relative, name)
    assert any("lora_A" in n and "up_proj" not in n for n in load_file(str(out / ADAPTER)))
    assert all("up_proj" in n for n in load_file(str(out / "second" / ADAPTER)))
    assert not (out / ".infinity-adapter-killed").exists()
    assert (out / ".infinity-adapter-mine" / "notes.txt").read_text() == "the user's\n"


ADAPTER = "adapter_model.safetensors"


def test_an_adapter_save_reads_the_adapters_parameters_only() -> None:
    """What an adapter save gathers: each adapter's own entries (PEFT keys them by its name),
    the trainable ones, never a base parameter whose path shares the adapter's name (an
    adapter named "model", as the base's ``model.layers...``)."""
    from infinity.engine.peft_save import adapter_parameter_names

    warnings.filterwarnings("ignore")
    base = make_model("llama", layers=2, width=32, seed=0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]),
                                adapter_name="model")
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["up_proj"]))
    names = adapter_parameter_names(model)
    lora = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert names == lora and any(".other." in n for n in names)


def test_a_merge_at_stage_3_runs_only_where_it_is_written_back(disk_dir) -> None:
    """PEFT's merge_and_unload() adds B @ A into the base weights: released at stage 3 (the
    merge changed nothing) or gathered without a modifier_rank (dropped at the exit), the
    adapter was lost without a word; refused there. Under GatheredParameters(...,
    modifier_rank=0) it runs and stays: the merged model's outputs are the adapter model's."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = peft.get_peft_model(make_model("llama", layers=1, width=32), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ds = hf_ds(disk_dir)
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
              gradient_clipping=0.0, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = infinity.initialize(model=model, config=ds)
    x = hf_data(1)[0]["input_ids"][None]
    try:
        with torch.no_grad():
            want = engine(input_ids=x).logits.clone()
        for gathered in (None, infinity.zero.GatheredParameters(list(model.parameters()))):
            with contextlib.nullcontext() if gathered is None else gathered:
                with pytest.raises(RuntimeError, match="merge_and_unload\\(\\) on a PEFT model"):
                    model.merge_and_unload()
        with infinity.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            merged = model.merge_and_unload()
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


def test_an_adapter_added_or_loaded_after_initialize_is_refused(disk_dir, tmp_path) -> None:
    """load_adapter(dir, name) after initialize returned normally and loaded nothing (its
    parameters are in no unit): the adapter evaluated at its fresh init, 0.6 off PEFT's."""
    warnings.filterwarnings("ignore")
    _lora(seed=3).save_pretrained(tmp_path / "other")
    ds = hf_ds(disk_dir)
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
              gradient_clipping=0.0, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    model = _lora()
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        with pytest.raises(RuntimeError, match=r"load_adapter\(\) after infinity\.initialize.*"
                                               r"before initialize"):
            model.load_adapter(str(tmp_path / "other"), "other")
        with pytest.raises(RuntimeError, match=r"add_adapter\(\) after infinity\.initialize"):
            model.add_adapter("more", peft.LoraConfig(r=4, target_modules=["q_proj"]))
    finally:
        engine.close()
    assert "load_adapter" not in model.__dict__      # close() gives PEFT's back


def test_an_adapter_save_keeps_a_resized_vocabulary(disk_dir, tmp_path) -> None:
    """A vocabulary resized for new tokens (a chat template's) before LoRA: PEFT's save adds the
    embedding weights (save_embedding_layers "auto"), picked from the state it is given, and
    the engine gave it the adapters' alone: the new rows were silently left out, and the
    adapter loaded over the base met embeddings without them. The saved ones are the model's."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    base = make_model("llama", layers=2, width=32)
    base.save_pretrained(tmp_path / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "infinity": {"compute_dtype": "fp32"}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        x = torch.randint(0, model.config.vocab_size, (2, 8))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(tmp_path / "adapter")
        saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
        current = engine.module_state_dict()
        for name in ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"):
            assert name in saved, sorted(saved)
            assert torch.equal(saved[name], current[name]), name
    finally:
        engine.close()


def test_exporting_a_peft_models_checkpoint_is_refused(disk_dir, tmp_path, capsys) -> None:
    """infinity export wrote PEFT's names (base_model.model....base_layer) under a config.json
    that transformers loaded with every weight missing, left random."""
    from infinity.cli import main

    warnings.filterwarnings("ignore")
    ds = hf_ds(disk_dir)
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
              gradient_clipping=0.0, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    engine, *_ = infinity.initialize(model=_lora(), config=ds)
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "the checkpoint is of a PEFT model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_merged_save_of_a_copied_tied_embedding_unties_it_as_peft(disk_dir, tmp_path) -> None:
    """modules_to_save=["embed_tokens"] on a tied model trains the embedding's copy apart from
    the head: the merged save kept tie_word_embeddings true and left the head out, and
    transformers made the head the trained copy (logits 0.67 off). Written untied, as PEFT's
    merge_and_unload saves it: transformers' load gives the engine's logits."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                      modules_to_save=["embed_tokens"]))
    ds = hf_ds(disk_dir)
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
              gradient_clipping=0.0, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    engine, *_ = infinity.initialize(model=model, config=ds)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(3):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            want = engine(input_ids=x).logits
        engine.save_pretrained(tmp_path / "merged", merged=True)
    finally:
        engine.close()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert loaded.config.tie_word_embeddings is False
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)


def test_an_adapter_save_with_ensure_weight_tying_saves_as_peft(disk_dir, tmp_path) -> None:
    """ensure_weight_tying ties the head's modules_to_save copy to the embedding's: PEFT's save
    looks the copy up under the head's name too, which the state given to it lacked
    (KeyError 'modules_to_save.default.weight')."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)

    def tied_base():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))

    def tied_lora():
        return peft.get_peft_model(tied_base(), peft.LoraConfig(
            r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"],
            ensure_weight_tying=True))

    ds = hf_ds(disk_dir)
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
              gradient_clipping=0.0, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    engine, *_ = infinity.initialize(model=tied_lora(), config=ds)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    try:
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        engine.eval()
        with torch.no_grad():
            want = engine(input_ids=x).logits
        engine.save_pretrained(tmp_path / "adapter")
    finally:
        engine.close()
    loaded = peft.PeftModel.from_pretrained(tied_base(), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)


def test_parameter_counts_of_a_held_model_are_the_models(disk_dir) -> None:
    """At stage 3 released parameters have 0 elements: PEFT's get_nb_trainable_parameters gave
    (0, 0) and print_trainable_parameters divided by zero; transformers' num_parameters gave 0."""
    warnings.filterwarnings("ignore")
    model = _lora()
    inner = model.get_base_model()
    before = (model.get_nb_trainable_parameters(), inner.num_parameters(),
              inner.num_parameters(exclude_embeddings=True), inner.num_parameters(True))
    ds = hf_ds(disk_dir)
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
              gradient_clipping=0.0, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        assert (model.get_nb_trainable_parameters(), inner.num_parameters(),
                inner.num_parameters(exclude_embeddings=True), inner.num_parameters(True)) == before
        model.print_trainable_parameters()
    finally:
        engine.close()
    assert "num_parameters" not in inner.__dict__


def _bf16_adapter_and_masters(model, tmp_path) -> tuple[dict, dict]:
    """``model`` (a PEFT model) trained 3 steps in bf16 at stage 3: its saved adapter file's
    tensors, and the fp32 masters of a checkpoint taken beside it."""
    from safetensors.torch import load_file

    from infinity.checkpoint import consolidated_state_dict

    ds = {"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}},
          "infinity": {"compute_dtype": "bf16"}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        x = torch.stack([d["input_ids"] for d in hf_data(2)])
        for _ in range(3):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        engine.save_pretrained(tmp_path / "adapter")
        engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    finally:
        engine.close()
    return (load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
            consolidated_state_dict(tmp_path / "ckpt", tag="t"))


def test_a_bf16_engine_saves_the_adapter_from_its_fp32_masters(disk_dir, tmp_path) -> None:
    """PEFT keeps adapters in fp32 on a 16-bit base and saves them so; the engine saved its
    bf16 compute copies (1e-3 off the masters it trains). The file holds the masters exactly."""
    saved, masters = _bf16_adapter_and_masters(_lora(), tmp_path)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A"
    ours = saved[f"{name}.weight"]
    assert ours.dtype == torch.float32
    assert torch.equal(ours, masters[f"{name}.default.weight"])
    assert not torch.equal(ours, ours.bfloat16().float())     # finer than the compute copy


def test_a_bf16_prompt_tuning_adapter_is_saved_from_its_fp32_master(disk_dir, tmp_path) -> None:
    """Prompt tuning's saved tensor is its prompt encoder's output (the embedding's rows), which
    PEFT's save computes by a forward: over the bf16 compute copy it was 7.5e-3 off the master."""
    model = peft.get_peft_model(make_model("llama", layers=2, width=32),
                                peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                        num_virtual_tokens=4))
    saved, masters = _bf16_adapter_and_masters(model, tmp_path)
    prompt = saved["prompt_embeddings"]
    master = masters["prompt_encoder.default.embedding.weight"]
    assert prompt.dtype == torch.float32 and torch.equal(prompt, master)
