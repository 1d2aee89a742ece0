"""Checkpoints (infinity/checkpoint): a run resumed from a checkpoint is the run that was not
interrupted, bit for bit with the same config; a checkpoint holds what torch AdamW holds; it
loads into another stage, tier and schedule; its files are plain safetensors."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.checkpoint import consolidated_state_dict
from infinity.checkpoint.pretrained_write import export_pretrained
from infinity.checkpoint.tensor_file import CheckpointError
from parity import (VOCAB, backward_both, engine_and_reference, make_model,
                    train_steps, zero_config)

SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                            "warmup_num_steps": 8, "warmup_type": "linear"}}


def _config(disk_dir, stage: int, param: str, optimizer: str, **extra) -> dict:
    ds = zero_config(stage, param, optimizer, str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["scheduler"] = copy.deepcopy(SCHEDULER)
    ds.update(extra)
    return ds


def _batches(count: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(count)]


def _files(directory) -> dict[str, torch.Tensor]:
    return {**load_file(str(directory / "rank0_model.safetensors")),
            **load_file(str(directory / "rank0_optim.safetensors"))}


def _assert_same_states(a_dir, b_dir) -> None:
    a, b = _files(a_dir), _files(b_dir)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]
    steps = [{n: e.get("steps") for n, e in json.loads((d / "manifest.json").read_text())
              ["params"].items()} for d in (a_dir, b_dir)]
    assert steps[0] == steps[1]


RESUME_CASES = {
    # family, (stage, param tier, optimizer tier), extra config
    "llama-s3-nvme-early": ("llama", (3, "nvme", "nvme"), {}),
    # a frozen parameter in a speculated unit: its value must reach both extents of the store
    "qwen2-s3-nvme-speculative-clip": ("qwen2", (3, "nvme", "nvme"), {"gradient_clipping": 0.3}),
    # speculation kept at every step, with a frozen parameter in a speculated unit: its value
    # must reach both extents of the store
    "llama-s3-nvme-speculative-frozen": ("llama", (3, "nvme", "nvme"),
                                         {"infinity": {"early_step": "off"},
                                          "_frozen": "model.layers.0.mlp.up_proj.weight"}),
    "gpt2-s3-cpu-accumulation": ("gpt2", (3, "cpu", "cpu"), {"gradient_accumulation_steps": 2}),
    "gpt2-s2-cpu-fp16": ("gpt2", (2, "none", "cpu"),
                         {"fp16": {"enabled": True, "initial_scale_power": 6,
                                   "loss_scale_window": 2}}),
    "torch-s3-nvme-deferred-bf16": ("torch", (3, "nvme", "nvme"),
                                    {"bf16": {"enabled": True}, "gradient_clipping": 1.0,
                                     "infinity": {"speculative_step": "off"}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_a_resumed_run_is_the_uninterrupted_run(disk_dir, case) -> None:
    """A trains 3 steps, saves, trains 3 more; B (another init) loads A's checkpoint and trains
    the same 3 batches: same losses, and bit-equal parameters, Adam states and step counts."""
    family, tiers, extra = RESUME_CASES[case]
    extra = dict(extra)
    frozen = extra.pop("_frozen", None)
    ds = _config(disk_dir, *tiers, **extra)
    accumulation = ds.get("gradient_accumulation_steps", 1)
    batches = _batches(6 * accumulation)
    first, rest = batches[:3 * accumulation], batches[3 * accumulation:]

    def model(seed: int):
        m = make_model(family, seed=seed, layers=2)
        if frozen:
            m.get_parameter(frozen).requires_grad_(False)
        return m

    a, *_ = infinity.initialize(model=model(0), config=ds)
    try:
        train_steps(a, first)
        saved = a.save_checkpoint(disk_dir / "ckpt", client_state={"batches_seen": len(first)})
        lr_at_save, scale_at_save = a.get_lr(), a.loss_scale
        losses_a = train_steps(a, rest)
        a.save_checkpoint(disk_dir / "final_a", tag="end")
    finally:
        a.close()
    assert saved.name == "global_step3"
    b, *_ = infinity.initialize(model=model(7), config=ds)
    try:
        path, client_state = b.load_checkpoint(disk_dir / "ckpt")
        assert (path, client_state) == (str(saved), {"batches_seen": len(first)})
        assert b.global_steps == 3 and b.micro_steps == 3 * accumulation
        assert b.get_lr() == lr_at_save and b.loss_scale == scale_at_save
        assert train_steps(b, rest) == losses_a
        b.save_checkpoint(disk_dir / "final_b", tag="end")
    finally:
        b.close()
    _assert_same_states(disk_dir / "final_a" / "end", disk_dir / "final_b" / "end")


@pytest.mark.slow
def test_the_checkpoint_holds_what_torch_adamw_holds_and_resumes_in_lock_step(disk_dir) -> None:
    """After 3 steps the checkpoint's weights, exp_avg and exp_avg_sq are torch AdamW's (fp32,
    1e-5); an engine that loads it goes on in lock step with torch."""
    model = make_model("llama", layers=2, width=32)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    engine, reference, ref_opt = engine_and_reference(model, ds)
    batches = _batches(6, seed=3)
    try:
        for x in batches[:3]:
            backward_both(engine, reference, x)
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        directory = engine.save_checkpoint(disk_dir / "ckpt")
    finally:
        engine.close()
    weights = consolidated_state_dict(disk_dir / "ckpt")
    moments = load_file(str(directory / "rank0_optim.safetensors"))
    steps = json.loads((directory / "manifest.json").read_text())["params"]
    for name, p in reference.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)
        state = ref_opt.state[p]
        torch.testing.assert_close(moments[f"{name}.exp_avg"], state["exp_avg"], rtol=1e-5,
                                   atol=1e-7)
        torch.testing.assert_close(moments[f"{name}.exp_avg_sq"], state["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)
        assert steps[name]["steps"] == int(state["step"])
    b, *_ = infinity.initialize(model=make_model("llama", seed=9, layers=2, width=32),
                                config={**ds, "optimizer": {"type": "AdamW", "params": {
                                    "lr": 1e-3, "weight_decay": 0.01}}})
    try:
        b.load_checkpoint(disk_dir / "ckpt")
        for x in batches[3:]:
            backward_both(b, reference, x)     # asserts the losses agree (1e-5)
            b.step()
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        b.close()


@pytest.mark.slow
@pytest.mark.parametrize("target", [(2, "none", "cpu"), (3, "cpu", "cpu"), (1, "none", "none")])
def test_a_checkpoint_loads_into_another_stage_and_tier(disk_dir, target) -> None:
    """Saved at stage 3 with everything on NVMe (deferred schedule), resumed elsewhere: the
    losses are the uninterrupted run's (1e-5; the schedules sum gradients in other orders)."""
    source = _config(disk_dir, 3, "nvme", "nvme", gradient_clipping=1.0)
    batches = _batches(6, seed=5)
    a, *_ = infinity.initialize(model=make_model("gpt2", layers=2), config=source)
    try:
        train_steps(a, batches[:3])
        a.save_checkpoint(disk_dir / "ckpt")
        losses_a = train_steps(a, batches[3:])
    finally:
        a.close()
    b, *_ = infinity.initialize(model=make_model("gpt2", seed=4, layers=2),
                                config=_config(disk_dir, *target, gradient_clipping=1.0))
    try:
        b.load_checkpoint(disk_dir / "ckpt")
        torch.testing.assert_close(torch.tensor(train_steps(b, batches[3:])), torch.tensor(losses_a),
                                   rtol=1e-5, atol=0)
    finally:
        b.close()


def test_frozen_parameters_and_buffers_are_saved_and_tied_names_exported(disk_dir) -> None:
    """Frozen parameters (no Adam states) and persistent buffers come back; the export names
    a tied weight under both of its names and loads into a plain model."""
    model = make_model("gpt2", layers=2)
    model.transformer.wpe.weight.requires_grad_(False)
    model.register_buffer("seen", torch.zeros(3))
    ds = _config(disk_dir, 3, "nvme", "nvme")
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        train_steps(engine, _batches(2))
        model.seen += torch.tensor([1.0, 2.0, 3.0])
        directory = engine.save_checkpoint(disk_dir / "ckpt", tag="frozen")
    finally:
        engine.close()
    moments = load_file(str(directory / "rank0_optim.safetensors"))
    assert "transformer.wpe.weight.exp_avg" not in moments
    assert "transformer.h.0.attn.c_attn.weight.exp_avg" in moments
    state = consolidated_state_dict(directory)
    plain = make_model("gpt2", seed=3, layers=2)
    plain.register_buffer("seen", torch.zeros(3))
    plain.load_state_dict(state, strict=True)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    assert torch.equal(plain.seen, torch.tensor([1.0, 2.0, 3.0]))
    reloaded = make_model("gpt2", seed=3, layers=2)
    reloaded.transformer.wpe.weight.requires_grad_(False)
    reloaded.register_buffer("seen", torch.zeros(3))
    b, *_ = infinity.initialize(model=reloaded, config=ds)
    try:
        b.load_checkpoint(disk_dir / "ckpt")
        assert torch.equal(reloaded.seen, torch.tensor([1.0, 2.0, 3.0]))
        b.save_checkpoint(disk_dir / "again", tag="frozen")
    finally:
        b.close()
    _assert_same_states(directory, disk_dir / "again" / "frozen")


def test_a_refused_load_says_why_a_name_is_missing_or_extra(disk_dir) -> None:
    """An untied head saved, loaded into a tied model: "lm_head.weight is not in the model"
    (it is, as the embedding's other name). A parameter frozen at a save that left frozen ones
    out, trainable now: "not in it" without the reason. Both now say why."""
    ds = _config(disk_dir, 2, "cpu", "cpu")
    model = make_model("llama", layers=1)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        train_steps(engine, _batches(1))
        engine.save_checkpoint(disk_dir / "ckpt", tag="t", exclude_frozen_parameters=True)
    finally:
        engine.close()
    tied = make_model("llama", layers=1)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    engine, *_ = infinity.initialize(model=tied, config=ds)
    try:
        with pytest.raises(CheckpointError) as refused:
            engine.load_checkpoint(disk_dir / "ckpt", tag="t")
        said = str(refused.value)
        assert "lm_head.weight, tied to model.embed_tokens.weight" in said, said
        assert "build it untied (tie_word_embeddings=False)" in said, said
        assert "saved with exclude_frozen_parameters=True, which leaves out the parameters " \
            "frozen at the save" in said, said
        assert "not in the model" not in said, said
    finally:
        engine.close()


def test_load_module_only_keeps_the_optimizer_and_counters(disk_dir) -> None:
    ds = _config(disk_dir, 3, "cpu", "cpu")
    a, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    try:
        train_steps(a, _batches(3))
        a.save_checkpoint(disk_dir / "ckpt")
    finally:
        a.close()
    model = make_model("llama", seed=2, layers=2)
    b, *_ = infinity.initialize(model=model, config=ds)
    try:
        b.load_checkpoint(disk_dir / "ckpt", load_module_only=True)
        assert b.global_steps == 0 and b.get_lr() == [1e-4]
        b.save_checkpoint(disk_dir / "b")
    finally:
        b.close()
    saved, loaded = _files(disk_dir / "ckpt" / "global_step3"), _files(disk_dir / "b" / "global_step0")
    for name in saved:
        same = torch.equal(saved[name], loaded[name])
        assert same if not name.endswith(("exp_avg", "exp_avg_sq")) else not same, name


def test_save_16bit_model_is_what_transformers_loads(disk_dir) -> None:
    """``save_16bit_model``: the weights a forward uses, in one safetensors file that
    ``from_pretrained`` loads (tied head saved once) and that computes the engine's logits."""
    import transformers

    model = make_model("gpt2", layers=2)
    engine, *_ = infinity.initialize(model=model, config=_config(disk_dir, 3, "nvme", "nvme"))
    x = _batches(1, seed=8)[0]
    try:
        train_steps(engine, _batches(2))
        engine.eval()
        with torch.no_grad():
            expected = engine(input_ids=x).logits
        model.config.save_pretrained(disk_dir / "export")
        path = engine.save_16bit_model(disk_dir / "export")
        with pytest.raises(ValueError, match="safetensors only"):
            engine.save_16bit_model(disk_dir / "export", "pytorch_model.bin")
    finally:
        engine.close()
    assert path.name == "model.safetensors"
    assert "lm_head.weight" not in load_file(str(path))
    plain = transformers.GPT2LMHeadModel.from_pretrained(disk_dir / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=x).logits, expected, rtol=0, atol=0)


def test_save_16bit_model_can_leave_frozen_parameters_out(disk_dir) -> None:
    """DeepSpeed's ``exclude_frozen_parameters``: an adapter's save holds the trained weights
    only, with the values the engine has."""
    model = make_model("llama", layers=2)
    model.model.embed_tokens.weight.requires_grad_(False)
    engine, *_ = infinity.initialize(model=model, config=_config(disk_dir, 3, "nvme", "nvme"))
    try:
        train_steps(engine, _batches(2))
        full = load_file(str(engine.save_16bit_model(disk_dir / "full")))
        trained = load_file(str(engine.save_16bit_model(disk_dir / "adapter",
                                                        exclude_frozen_parameters=True)))
    finally:
        engine.close()
    assert "model.embed_tokens.weight" in full
    assert "model.embed_tokens.weight" not in trained
    assert set(trained) == set(full) - {"model.embed_tokens.weight"}
    for name, values in trained.items():
        torch.testing.assert_close(values, full[name], rtol=0, atol=0)


def test_resuming_with_another_accumulation_starts_a_whole_cycle(disk_dir) -> None:
    """Saved with 2 micro-steps a step, resumed with 4: the first step after the load takes 4
    micro-steps (the saved micro-step count is not carried over as is)."""
    a, *_ = infinity.initialize(model=make_model("torch", layers=2),
                                config=_config(disk_dir, 3, "cpu", "cpu",
                                               gradient_accumulation_steps=2))
    try:
        train_steps(a, _batches(6))
        a.save_checkpoint(disk_dir / "ckpt")
    finally:
        a.close()
    b, *_ = infinity.initialize(model=make_model("torch", seed=2, layers=2),
                                config=_config(disk_dir, 3, "cpu", "cpu",
                                               gradient_accumulation_steps=4))
    try:
        b.load_checkpoint(disk_dir / "ckpt")
        counts = []
        for x in _batches(4, seed=2):
            train_steps(b, [x])
            counts.append(b.global_steps)
        assert counts == [3, 3, 3, 4]
    finally:
        b.close()


def test_a_buffer_shared_by_two_modules_is_exported_under_both_names(disk_dir) -> None:
    model = make_model("torch", layers=2)
    table = torch.arange(4.0)
    model.blocks[0].register_buffer("table", table)
    model.blocks[1].register_buffer("table", table)
    engine, *_ = infinity.initialize(model=model, config=_config(disk_dir, 3, "cpu", "cpu"))
    try:
        engine.save_checkpoint(disk_dir / "ckpt")
    finally:
        engine.close()
    state = consolidated_state_dict(disk_dir / "ckpt")
    assert torch.equal(state["blocks.1.table"], table) and torch.equal(state["blocks.0.table"], table)


def test_exclude_frozen_parameters_leaves_them_out_and_keeps_them_at_load(disk_dir) -> None:
    """DeepSpeed's ``exclude_frozen_parameters``: a fine-tuning checkpoint without the frozen
    base weights; a strict load takes the rest and the frozen ones keep their values."""
    def model(seed: int):
        m = make_model("gpt2", seed=seed, layers=2)
        for p in m.transformer.h[0].parameters():
            p.requires_grad_(False)
        return m

    ds = _config(disk_dir, 3, "nvme", "nvme")
    a, *_ = infinity.initialize(model=model(0), config=ds)
    try:
        train_steps(a, _batches(2))
        a.save_checkpoint(disk_dir / "full", tag="t")
        a.save_checkpoint(disk_dir / "lora", tag="t", exclude_frozen_parameters=True)
    finally:
        a.close()
    full = load_file(str(disk_dir / "full" / "t" / "rank0_model.safetensors"))
    lora = load_file(str(disk_dir / "lora" / "t" / "rank0_model.safetensors"))
    frozen = {n for n in full if n.startswith("transformer.h.0.")}
    assert frozen and set(full) - set(lora) == frozen
    # not a whole model: weights made of it alone are refused (a loader would leave the frozen
    # ones random), unless asked for the trainable ones
    for make in (lambda: consolidated_state_dict(disk_dir / "lora"),
                 lambda: export_pretrained(disk_dir / "lora", disk_dir / "exported")):
        with pytest.raises(CheckpointError, match="exclude_frozen_parameters=True"):
            make()
    assert not (disk_dir / "exported").exists()
    trained = consolidated_state_dict(disk_dir / "lora", trainable_only=True)
    assert frozen.isdisjoint(trained) and set(lora) <= set(trained)
    assert set(consolidated_state_dict(disk_dir / "full")) >= frozen
    b_model = model(0)        # same frozen base (seed 0): loading the rest gives the full state
    b, *_ = infinity.initialize(model=b_model, config=ds)
    try:
        b.load_checkpoint(disk_dir / "lora")
        b.save_checkpoint(disk_dir / "again", tag="t")
    finally:
        b.close()
    _assert_same_states(disk_dir / "full" / "t", disk_dir / "again" / "t")


def test_trainable_only_reads_a_checkpoint_whose_frozen_weight_is_tied(disk_dir) -> None:
    """The LoRA case: GPT-2's frozen wte, tied to lm_head, left out by
    exclude_frozen_parameters: trainable_only leaves both names out (it raised a KeyError on
    the alias). A model with nothing frozen saved with the flag is whole: it exports."""
    model = make_model("gpt2", seed=0, layers=2)
    model.transformer.wte.weight.requires_grad_(False)
    engine, *_ = infinity.initialize(model=model, config=_config(disk_dir, 3, "cpu", "cpu"))
    try:
        train_steps(engine, _batches(1))
        engine.save_checkpoint(disk_dir / "tied", exclude_frozen_parameters=True)
    finally:
        engine.close()
    trained = consolidated_state_dict(disk_dir / "tied", trainable_only=True)
    assert "transformer.wte.weight" not in trained and "lm_head.weight" not in trained
    assert "transformer.h.0.attn.c_attn.weight" in trained
    whole, *_ = infinity.initialize(model=make_model("torch", layers=2),
                                    config=_config(disk_dir, 3, "cpu", "cpu"))
    try:
        whole.save_checkpoint(disk_dir / "whole", exclude_frozen_parameters=True)
    finally:
        whole.close()
    assert set(consolidated_state_dict(disk_dir / "whole")) == \
        set(consolidated_state_dict(disk_dir / "whole", trainable_only=True))


class WithEmptyParameter(torch.nn.Module):
    """A root-level trainable parameter with no elements (a placeholder some models keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.placeholder = torch.nn.Parameter(torch.empty(0))
        self.second = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.second(self.first(x)).pow(2).mean() + self.placeholder.sum()


@pytest.mark.parametrize("tiers", [("cpu", "cpu"), ("nvme", "nvme")])
def test_a_parameter_without_elements_trains_and_checkpoints(disk_dir, tiers) -> None:
    torch.manual_seed(0)
    model = WithEmptyParameter()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ds = _config(disk_dir, 3, *tiers)
    del ds["scheduler"]
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        for x in torch.randn(3, 2, 8):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            ref_loss = reference(x)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
        directory = engine.save_checkpoint(disk_dir / "ckpt")
        assert engine.load_checkpoint(disk_dir / "ckpt")[0] == str(directory)
    finally:
        engine.close()
    assert consolidated_state_dict(directory)["placeholder"].shape == (0,)


def test_a_multistep_schedule_and_a_tuple_client_state_resume_as_saved(disk_dir) -> None:
    """torch's MultiStepLR keeps its milestones as a Counter of int keys: the first save
    failed ("Use string keys"), hours into a run. ``random.getstate()`` in client_state came
    back a list, which ``random.setstate`` refuses at resume. Both come back as saved, and
    the resumed run's rates and losses are the uninterrupted run's."""
    import random

    def build(model):
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                  "infinity": {"compute_dtype": "fp32"}}
        return infinity.initialize(
            model=model, config=config,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, [2, 4], 0.5))[0]

    batches = [torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(i))
               for i in range(6)]

    def train(engine, xs):
        losses = []
        for x in xs:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append((loss.item(), engine.get_lr()[0]))
        return losses

    rng = random.Random(11).getstate()
    engine = build(make_model("llama", layers=2))
    try:
        train(engine, batches[:3])
        engine.save_checkpoint(disk_dir / "ckpt", client_state={"rng": rng})
        expected = train(engine, batches[3:])
    finally:
        engine.close()
    engine = build(make_model("llama", seed=9, layers=2))
    try:
        _, client = engine.load_checkpoint(disk_dir / "ckpt")
        random.Random().setstate(client["rng"])             # a tuple again
        assert client["rng"] == rng
        milestones = engine.lr_scheduler.milestones
        assert type(milestones).__name__ == "Counter" and milestones == {2: 1, 4: 1}
        assert train(engine, batches[3:]) == expected
    finally:
        engine.close()


def test_a_scheduler_no_checkpoint_can_hold_is_said_at_initialize(infinity_log) -> None:
    """Its state found unsaveable at the first save was hours into a run: warned at once."""

    class SetInState(torch.optim.lr_scheduler.LambdaLR):
        def state_dict(self):
            return {**super().state_dict(), "seen": {1, 2}}

    engine = infinity.initialize(
        model=make_model("llama", layers=1),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}},
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        lr_scheduler=lambda opt: SetInState(opt, lambda step: 1.0))[0]
    engine.close()
    assert "engine.save_checkpoint will refuse this run's LR scheduler" in infinity_log.text
    assert "Object of type set" in infinity_log.text

    class StepOnly:                     # DeepSpeed trains with one: no state_dict() at all
        def __init__(self, optimizer) -> None:
            self.optimizer = optimizer

        def step(self) -> None:
            pass

    # a class is a factory (called with the optimizer), not a scheduler: taken for one, its
    # unbound step() failed at the first optimizer step
    engine = infinity.initialize(
        model=make_model("llama", layers=1),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}},
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), lr_scheduler=StepOnly)[0]
    try:
        assert isinstance(engine.lr_scheduler, StepOnly)
        x = torch.randint(0, VOCAB, (2, 8))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    finally:
        engine.close()
    assert "a StepOnly has no state_dict()" in infinity_log.text
    # a class that needs more than the optimizer: said before anything moves
    with pytest.raises(TypeError, match=r"lr_scheduler=StepLR: a class is called with the "
                                        r"optimizer alone.*functools\.partial\(StepLR"):
        infinity.initialize(
            model=make_model("llama", layers=1),
            config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}},
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            lr_scheduler=torch.optim.lr_scheduler.StepLR)
