"""Habits of a plain torch loop under the engine: zero_grad() between a backward and a step
discards the gradients, loss.backward() called directly is a backward like engine.backward's
(without its loss scaling), torch.autograd.grad() is not; where the schedule cannot honour the
habit, a clear error says so."""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from parity import VOCAB, loss_of, make_model, reference_step, with_adamw, zero_config


def _setup(disk_dir, tier: str, early_step: str, clip: float = 0.0, accumulation: int = 1,
           **fp16):
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ds = zero_config(3, tier, tier, str(disk_dir), early_step=early_step)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["gradient_clipping"] = clip
    ds["gradient_accumulation_steps"] = accumulation
    if fp16:
        ds["fp16"] = {"enabled": True, **fp16}
    engine, *_ = infinity.initialize(model=model, config=ds)
    return engine, model, reference, ref_opt


def _batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(count)]


def _assert_same_weights(engine, reference) -> None:
    engine.flush()
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["speculated", "clipped"])
@pytest.mark.parametrize("how", ["engine", "optimizer", "module"])
def test_zero_grad_between_backward_and_step_discards(disk_dir, tier, clip, how) -> None:
    """backward(a); zero_grad(); backward(b); step() steps with b's gradients alone, as torch."""
    engine, model, reference, ref_opt = _setup(disk_dir, tier, "off", clip)
    zero_grad = {"engine": engine.zero_grad, "optimizer": engine.optimizer.zero_grad,
                 "module": model.zero_grad}[how]
    try:
        for a, b in zip(*[iter(_batches(6))] * 2):
            engine.backward(loss_of(engine(input_ids=a, labels=a)))
            zero_grad()
            engine.backward(loss_of(engine(input_ids=b, labels=b)))
            engine.step()
            loss_of(reference(input_ids=a, labels=a)).backward()
            ref_opt.zero_grad()
            loss_of(reference(input_ids=b, labels=b)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad()
        _assert_same_weights(engine, reference)
    finally:
        engine.close()


@pytest.mark.parametrize("tier,early_step", [("cpu", "off"), ("nvme", "auto")])
@pytest.mark.parametrize("how", ["engine", "optimizer", "module"])
def test_zero_grad_after_each_micro_step_keeps_the_cycle(disk_dir, tier, early_step, how):
    """``backward(); step(); zero_grad()`` every micro-batch under gradient_accumulation_steps
    2 accumulates both micro-batches, as DeepSpeed's ZeRO does (it kept the last alone); a
    zero_grad() after a second micro-batch's backward, which cannot drop it without the
    first's, is refused (see [Note: what zero_grad discards] in engine/guards.py)."""
    engine, model, reference, ref_opt = _setup(disk_dir, tier, early_step, accumulation=2)
    zero_grad = {"engine": engine.zero_grad, "optimizer": engine.optimizer.zero_grad,
                 "module": model.zero_grad}[how]
    try:
        for a, b in zip(*[iter(_batches(6))] * 2):
            for x in (a, b):
                engine.backward(loss_of(engine(input_ids=x, labels=x)))
                engine.step()
                zero_grad()
                (loss_of(reference(input_ids=x, labels=x)) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        _assert_same_weights(engine, reference)
        assert engine.global_steps == 3
        a, b = _batches(2)
        engine.backward(loss_of(engine(input_ids=a, labels=a)))
        engine.step()
        if early_step == "off":     # the early step refuses any zero_grad after a backward
            engine.backward(loss_of(engine(input_ids=b, labels=b)))
            with pytest.raises(RuntimeError, match="micro-batch 2 of 2.*cannot be discarded "
                                                   "without the earlier micro-batches'"):
                zero_grad()
    finally:
        engine.close()


def test_zero_grad_after_an_early_step_backward_is_refused(disk_dir) -> None:
    engine, model, *_ = _setup(disk_dir, "cpu", "on")
    x = _batches(1)[0]
    try:
        model.zero_grad()                       # before the backward: nothing to discard
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        with pytest.raises(RuntimeError, match="already stepped during the backward"):
            model.zero_grad()
        engine.step()
        engine.optimizer.zero_grad()            # after the step: fine
    finally:
        engine.close()
    assert "zero_grad" not in model.__dict__    # close() gave the module its own zero_grad back


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("early_step,clip", [("on", 0.0), ("off", 0.0), ("off", 0.5)],
                         ids=["early", "speculated", "clipped"])
def test_loss_backward_called_directly_trains_like_torch(disk_dir, tier, early_step, clip) -> None:
    """Before: the clipping norm was never reset for such backwards (it summed every step's),
    so clipping grew stronger each step."""
    engine, _, reference, ref_opt = _setup(disk_dir, tier, early_step, clip)
    try:
        for x in _batches(4):
            loss = loss_of(engine(input_ids=x, labels=x))
            loss.backward()
            engine.step()
            ref_loss = reference_step(reference, ref_opt, x, clip)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        _assert_same_weights(engine, reference)
    finally:
        engine.close()


def test_direct_backwards_the_schedule_cannot_honour_are_refused(disk_dir) -> None:
    """Two under the early step (each would step every unit) and one under fp16 loss scaling
    (its loss is not scaled): errors that say to call engine.backward; the engine goes on."""
    x, y = _batches(2)
    engine, *_ = _setup(disk_dir, "cpu", "on")
    try:
        loss_of(engine(input_ids=x, labels=x)).backward()
        with pytest.raises(RuntimeError, match=r"loss\.backward\(\) was called twice"):
            loss_of(engine(input_ids=y, labels=y)).backward()
        engine.step()
        engine.backward(loss_of(engine(input_ids=y, labels=y)))
        engine.step()
    finally:
        engine.close()
    engine, *_ = _setup(disk_dir, "cpu", "auto", initial_scale_power=8)
    try:
        with pytest.raises(RuntimeError, match="fp16 loss scaling.*engine.backward"):
            loss_of(engine(input_ids=x, labels=x)).backward()
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
        assert engine.global_steps == 1
    finally:
        engine.close()


def test_autograd_grad_is_not_a_backward(disk_dir) -> None:
    """torch.autograd.grad of the loss (here w.r.t. the input embeddings) between steps does not
    count as the early step's backward: engine.backward after it is accepted."""
    engine, model, *_ = _setup(disk_dir, "cpu", "on")
    x = _batches(1)[0]
    try:
        embeds = model.get_input_embeddings()(x).detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_of(engine(inputs_embeds=embeds, labels=x)), embeds)
        assert grad.abs().sum() > 0
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
    finally:
        engine.close()


def test_an_lr_change_between_an_early_backward_and_its_step_is_warned(disk_dir, infinity_log) -> None:
    """Under the early step the units were stepped during the backward: an lr set between
    backward() and step() applies from the next step, and a warning says so (once); the
    monitors get the lr the step used (they got the new one, which it never used)."""
    engine, *_ = _setup(disk_dir, "cpu", "on")
    x = _batches(1)[0]
    reported = []
    after_step = engine.report.after_step

    def record(**kwargs) -> None:
        reported.append(kwargs["lr"])
        after_step(**kwargs)
    engine.report.after_step = record
    try:
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
        assert "changed between backward() and step()" not in infinity_log.text
        used = engine.get_lr()
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        for group in engine.optimizer.param_groups:
            group["lr"] = 5e-4
        engine.step()
        assert infinity_log.text.count("changed between backward() and step()") == 1
        assert reported == [used, used] and used != [5e-4] * len(used), reported
    finally:
        engine.close()


class _Critic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _penalised_loss(model, x: torch.Tensor) -> torch.Tensor:
    """A gradient penalty (WGAN-GP style): a double backward through the model."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).mean() + grad.pow(2).sum(-1).mean()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_double_backward_trains_at_stage_2_and_is_refused_clearly_at_stage_3(stage) -> None:
    """Stage 3 releases parameters after their backward, so the graph create_graph=True builds
    cannot be run again: a clear error that names stage 1/2 (before: transformers-like "got [0]"
    errors naming register_external_parameter, or, on some tiers, the right numbers by luck),
    and the engine trains on. Stage 2 keeps parameters: equal to torch."""
    torch.manual_seed(0)
    model = _Critic()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:      # (threshold 0: no unit stays fetched for being small)
        zero.update(offload_param={"device": "cpu"}, stage3_param_persistence_threshold=0)
    engine, *_ = infinity.initialize(model=model, config={
        "zero_optimization": zero, "infinity": {"compute_dtype": "fp32"},   # torch parity at 1e-5
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}})
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(3):
            x = torch.randn(4, 16, generator=gen)
            if stage == 3:
                with pytest.raises(RuntimeError, match="create_graph=True.*stage 1 or 2"):
                    _penalised_loss(engine, x)
                engine.backward(engine(x).pow(2).mean())     # the engine goes on
                engine.step()
                continue
            loss = _penalised_loss(engine, x)
            engine.backward(loss)
            engine.step()
            ref_loss = _penalised_loss(reference, x)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert engine.global_steps == 3
    finally:
        engine.close()


def _tied_llama(seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("early_step,clip", [("on", 0.0), ("off", 0.5)], ids=["early", "clipped"])
def test_load_state_dict_on_the_held_model_reaches_every_unit(disk_dir, tier, early_step,
                                                              clip) -> None:
    """model.load_state_dict(sd) mid-training (a deferred step still waiting for its units):
    training goes on from the loaded weights with the Adam moments it had, as torch's does
    (before: a size-mismatch error after a partial load on host tiers, or the waiting step
    applied on top of the loaded values on NVMe). Tied embeddings: loaded under both names."""
    model, other = _tied_llama(0), _tied_llama(5).state_dict()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ds = zero_config(3, tier, tier, str(disk_dir), early_step=early_step)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["gradient_clipping"] = clip
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        for step, x in enumerate(_batches(5)):
            if step == 2:
                result = model.load_state_dict(other)
                assert not result.missing_keys and not result.unexpected_keys
                reference.load_state_dict(other)
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            ref_loss = reference_step(reference, ref_opt, x, clip)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        _assert_same_weights(engine, reference)
    finally:
        engine.close()


def test_load_state_dict_checks_everything_before_writing(disk_dir) -> None:
    engine, model, reference, _ = _setup(disk_dir, "nvme", "off")
    sd = {k: v.clone() for k, v in reference.state_dict().items()}
    try:
        bad = dict(sd, **{"lm_head.weight": torch.zeros(3, 3)})
        bad["model.norm.weight"] = bad["model.norm.weight"] + 1      # would change if written
        with pytest.raises(RuntimeError, match=r"size mismatch for lm_head\.weight.*nothing was loaded"):
            model.load_state_dict(bad)
        partial = {k: v for k, v in sd.items() if not k.startswith("model.layers.1.")}
        with pytest.raises(RuntimeError, match=r"missing keys \['model\.layers\.1\."):
            model.load_state_dict(partial)
        partial["model.norm.weight"] = partial["model.norm.weight"] * 2
        partial["extra"] = torch.zeros(1)
        result = model.load_state_dict(partial, strict=False)
        assert result.unexpected_keys == ["extra"] and len(result.missing_keys) > 0
        reference.model.norm.weight.data.mul_(2)
        _assert_same_weights(engine, reference)
    finally:
        engine.close()
    assert "load_state_dict" not in model.__dict__


def test_infinitys_own_errors_carry_no_external_parameter_note(disk_dir) -> None:
    """The register_external_parameter note is for errors a stray parameter read causes in the
    model's code, not for infinity's own refusals (a beta1 of 1.5 here)."""
    engine, *_ = _setup(disk_dir, "cpu", "on")
    x = _batches(1)[0]
    try:
        for group in engine.optimizer.param_groups:
            group["betas"] = (1.5, 0.999)
        with pytest.raises(ValueError, match="beta1") as caught:
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
        assert not getattr(caught.value, "__notes__", None)
    finally:
        engine.close()


@pytest.mark.parametrize("early_step", ["on", "off"])
def test_a_torch_loop_with_optimizer_step_trains_like_torch(disk_dir, early_step) -> None:
    """``loss.backward(); optimizer.step(); optimizer.zero_grad()`` with the optimizer
    initialize returned: the engine's step runs (counted, units released), the loop's own
    scheduler steps once per step. Before, the early step refused the zero_grad after the
    step and the second backward ("twice without engine.step()")."""
    engine, _, reference, ref_opt = _setup(disk_dir, "nvme", early_step)
    optimizer = engine.optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    try:
        for x in _batches(3):
            loss = loss_of(engine(input_ids=x, labels=x))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            ref_loss = reference_step(reference, ref_opt, x, 0.0)
            ref_sched.step()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert engine.global_steps == 3
        assert optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 1e-3 / 8
        _assert_same_weights(engine, reference)
    finally:
        engine.close()


def test_the_engines_step_is_torchs_optimizer_step_to_hooks_and_schedulers(disk_dir) -> None:
    """engine.step() runs the optimizer's step through torch's wrapper of it: step hooks fire
    once a step, and a torch scheduler built on the optimizer (the HF Trainer's way) sees the
    optimizer step before it (no "lr_scheduler.step() before optimizer.step()" warning)."""
    import warnings

    engine, *_ = _setup(disk_dir, "cpu", "off")
    optimizer = engine.optimizer
    steps = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x in _batches(2):
                engine.backward(loss_of(engine(input_ids=x, labels=x)))
                engine.step()
                scheduler.step()
        assert steps == [1, 1] and engine.global_steps == 2
        assert not [w for w in caught if "before `optimizer.step()`" in str(w.message)], \
            [str(w.message) for w in caught]
    finally:
        engine.close()


def test_optimizer_state_dict_is_refused_with_the_checkpoint_calls(disk_dir) -> None:
    """Its states live in their tiers: torch's empty dict would load as a silent Adam reset."""
    engine, *_ = _setup(disk_dir, "cpu", "auto")
    try:
        with pytest.raises(RuntimeError, match=r"optimizer.state_dict\(\).*save_checkpoint"):
            engine.optimizer.state_dict()
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\).*load_checkpoint"):
            engine.optimizer.load_state_dict({"state": {}, "param_groups": []})
    finally:
        engine.close()


def test_calling_the_model_itself_runs_the_engines_forward_pass(disk_dir) -> None:
    """A torch loop calls the model, not the engine: each call is a pass of its mode (the
    traces stay one pass long, so prefetch follows them), its activations are swapped, a call
    that raises leaves the engine usable, and training equals torch. Before, such calls
    appended every fetch to one growing trace and never prefetched."""
    torch.manual_seed(0)
    model = make_model("llama", layers=3, width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="off",
                     offload_activations="nvme", activation_min_bytes=4096, activation_window=0)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["zero_optimization"]["stage3_max_reuse_distance"] = 0
    engine, optimizer, *_ = infinity.initialize(model=model, config=ds)
    units = len(engine.units)
    armed = []

    def fail_once(module, args):
        if armed:
            armed.clear()
            raise RuntimeError("a bad batch")

    model.model.layers[1].register_forward_pre_hook(fail_once)
    try:
        for step, x in enumerate(_batches(6)):
            if step == 2:
                armed.append(True)
                with pytest.raises(RuntimeError, match="a bad batch"):
                    model(input_ids=x, labels=x)
            loss = loss_of(model(input_ids=x, labels=x))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ref_loss = reference_step(reference, ref_opt, x, 0.0)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            model.eval()
            with torch.no_grad():
                model(input_ids=x)
            model.train()
        traces = engine.coordinator.traces
        assert len(traces["train_fwd"].order) <= units and len(traces["eval_fwd"].order) <= units, \
            {k: len(t.order) for k, t in traces.items()}
        assert engine.coordinator.fetch_stats["prefetch_hits"] > 0, engine.coordinator.fetch_stats
        assert engine.activation_swapper.stats.written > 0, engine.activation_swapper.stats
        _assert_same_weights(engine, reference)
    finally:
        engine.close()


def test_torch_schedulers_that_cycle_betas_work_and_add_param_group_is_refused(disk_dir) -> None:
    """torch's OneCycleLR looks for betas in optimizer.defaults (it was empty: initialize
    failed); it then trains like torch with the same scheduler. add_param_group after
    initialize was accepted and the new group never trained: refused."""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)

    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8)

    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="off")
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    engine, optimizer, _, scheduler = infinity.initialize(model=model, config=ds,
                                                         lr_scheduler=one_cycle)
    ref_sched = one_cycle(ref_opt)
    try:
        assert optimizer.defaults["betas"] == (0.9, 0.999)
        for x in _batches(4):
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            ref_loss = reference_step(reference, ref_opt, x, 0.0)
            ref_sched.step()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert optimizer.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
        _assert_same_weights(engine, reference)
        extra = torch.nn.Parameter(torch.zeros(3))
        with pytest.raises(ValueError, match="add_param_group.*would never be stepped"):
            optimizer.add_param_group({"params": [extra]})
    finally:
        engine.close()


@pytest.mark.parametrize("how", ["model", "engine"])
def test_a_forward_cut_short_by_ctrl_c_leaves_no_pass_open(disk_dir, how) -> None:
    """torch runs always_call forward hooks for an Exception only: a KeyboardInterrupt inside a
    forward skipped the pass's end, so every later call counted as nested (no pass began,
    the traces and the used-unit list grew), the units stayed fetched, and the activation
    swapper's hooks stayed on the thread (after close() any autograd failed). Now the next
    call (or engine.forward itself, or close) ends it."""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), offload_activations="nvme",
                     activation_min_bytes=4096)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    engine, optimizer, *_ = infinity.initialize(model=model, config=ds)
    call = model if how == "model" else engine
    armed = []

    def interrupt_once(module, args):
        if armed:
            armed.clear()
            raise KeyboardInterrupt

    model.model.layers[1].register_forward_pre_hook(interrupt_once)
    try:
        for step, x in enumerate(_batches(5)):
            if step == 2:
                armed.append(True)
                with pytest.raises(KeyboardInterrupt):
                    call(input_ids=x, labels=x)
            loss = loss_of(call(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            torch.testing.assert_close(loss, reference_step(reference, ref_opt, x, 0.0),
                                       rtol=1e-5, atol=1e-6)
        assert not engine._passes.in_pass
        assert len(engine.coordinator.traces["train_fwd"].order) <= len(engine.units)
    finally:
        engine.close()
    a = torch.randn(16, 16, requires_grad=True)
    (a.sin() * a).sum().backward()          # no swapper hook left on the thread


def test_a_copy_of_the_model_made_after_initialize_runs_on_its_own(disk_dir) -> None:
    """An EMA or teacher copy made with copy.deepcopy after initialize (stage 2: full weights)
    shares the hooks' closures: its calls began passes of this engine, and after close()
    raised "engine.forward() after engine.close()"."""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    ds = zero_config(2, "cpu", "cpu", str(disk_dir))
    engine, *_ = infinity.initialize(model=model, config=with_adamw(ds))
    x = _batches(1)[0]
    try:
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
        copy_of_model = copy.deepcopy(model)
        expected = loss_of(copy_of_model(input_ids=x, labels=x))
    finally:
        engine.close()
    torch.testing.assert_close(loss_of(copy_of_model(input_ids=x, labels=x)), expected)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_copy_or_pickle_that_would_be_wrong_is_refused_naming_the_way(disk_dir, stage) -> None:
    """torch.save(model) failed on "Can't pickle local object" (the engine's closures); a deep
    copy at stage 3 had empty weights and failed in its forward on "mat2 must be a matrix".
    Both are refused, saying how to get a copy with values; a deep copy of whole weights (stage
    2, or gathered at stage 3) stays torch's and computes as the engine, and close() gives the
    model its own methods back."""
    import io

    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    tier = "cpu" if stage == 3 else "none"
    ds = zero_config(stage, tier, "cpu", str(disk_dir))
    engine, *_ = infinity.initialize(model=model, config=with_adamw(ds))
    try:
        with pytest.raises(TypeError, match=r"pickling \(torch\.save\(model\)\) of model after "
                                            r"infinity\.initialize.*model\.state_dict\(\)"):
            torch.save(model, io.BytesIO())
        with pytest.raises(TypeError, match=r"pickling .* of model\.model\.layers\.0 after"):
            torch.save(model.model.layers[0], io.BytesIO())
        if stage == 3:
            with pytest.raises(TypeError, match=r"copy\.deepcopy of model after .* is released"
                                                r".*no weights.*GatheredParameters"):
                copy.deepcopy(model)
            with infinity.zero.GatheredParameters(list(model.parameters())):
                copied = copy.deepcopy(model)     # whole weights: torch's copy (DeepSpeed's idiom)
        else:
            copied = copy.deepcopy(model)
        x = _batches(1)[0]
        with torch.no_grad():
            torch.testing.assert_close(loss_of(copied(input_ids=x, labels=x)),
                                       loss_of(engine(input_ids=x, labels=x)), rtol=1e-6, atol=0)
        torch.save(model.state_dict(), io.BytesIO())
        shallow = copy.copy(model)          # torch's: it shares the weights
        assert shallow is not model and shallow.model is model.model
    finally:
        engine.close()
    assert not any(name in m.__dict__ for m in model.modules()
                   for name in ("__deepcopy__", "__reduce_ex__"))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("early_step", ["auto", "off"])
def test_a_step_between_two_backwards_of_one_forward_is_refused_as_torch(disk_dir, stage,
                                                                         early_step):
    """``backward(l1, retain_graph=True); step(); backward(l2)``: the step changed weights the
    graph saved, which torch refuses ("modified by an inplace operation"); the engine's writes
    are not torch ops, so the second backward ran on the updated weights (a.weight 5e-3 off
    the gradient the graph recorded). Backing the sum of the losses works."""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    ds = zero_config(stage, "cpu", "cpu", str(disk_dir), early_step=early_step)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = infinity.initialize(model=model, config=ds)
    x = _batches(1)[0]
    try:
        logits = engine(input_ids=x).logits
        first, second = logits[..., :8].square().mean(), logits[..., 8:].square().mean()
        engine.backward(first, retain_graph=True)
        engine.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation.*optimizer "
                                               "step since the forward"):
            engine.backward(second)
        logits = engine(input_ids=x).logits
        engine.backward(logits[..., :8].square().mean() + logits[..., 8:].square().mean())
        engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("how", ["gathered", "load_state_dict"])
def test_changing_weights_between_backward_and_step_under_the_early_step_is_refused(
        disk_dir, how) -> None:
    """Under the early step the backward already updated each unit: a change made before
    step() would replace the update instead of being updated by it (torch steps the changed
    weights); refused before anything is changed. After step() it is a plain change."""
    engine, model, *_ = _setup(disk_dir, "cpu", "on")
    x = _batches(1)[0]
    weight = model.model.embed_tokens.weight

    def change() -> None:
        if how == "gathered":
            with infinity.zero.GatheredParameters([weight], modifier_rank=0):
                weight.data.mul_(0.5)
        else:
            model.load_state_dict(state, strict=False)

    try:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        with pytest.raises(RuntimeError, match="already updated each unit"):
            change()
        engine.step()
        before = model.state_dict()["model.embed_tokens.weight"].clone()
        change()
        after = model.state_dict()["model.embed_tokens.weight"]
        want = before * 0.5 if how == "gathered" else state["model.embed_tokens.weight"]
        torch.testing.assert_close(after, want)
    finally:
        engine.close()


@pytest.mark.parametrize("stage,tier,dtype", [(3, "nvme", "fp32"), (2, "cpu", "bf16"),
                                               (3, "cpu", "bf16")])
def test_a_parts_load_state_dict_writes_its_units_homes(disk_dir, stage, tier, dtype) -> None:
    """``model.lm_head.load_state_dict(head)``: torch's copy met a released parameter's empty
    tensor (stage 3 on NVMe: a size mismatch), or wrote the bf16 compute copy only, which the
    next step overwrote from the fp32 master ("All keys matched", the head gone a step later).
    Now it loads as the whole model's load does; a wrong key is refused with nothing loaded."""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    ds = zero_config(stage, tier, tier, str(disk_dir), compute_dtype=dtype)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    x, y = _batches(2)
    try:
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
        head = {k: torch.full_like(v, 0.25) for k, v in model.lm_head.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"unexpected keys \['bias'\].*nothing was loaded"):
            model.lm_head.load_state_dict({**head, "bias": torch.zeros(1)})
        result = model.lm_head.load_state_dict(head)
        assert not result.missing_keys and not result.unexpected_keys
        engine.backward(loss_of(engine(input_ids=y, labels=y)))
        engine.step()
        # one AdamW step (lr 1e-3) after the load moves a weight by a few lr at most, and bf16
        # holds 0.25 exactly (its spacing there is 2e-3): the random init is ~0.02 from 0
        weight = model.lm_head.state_dict()["weight"].float()
        assert (weight - 0.25).abs().max() < 6e-3, (weight - 0.25).abs().max()
    finally:
        engine.close()
    assert "load_state_dict" not in model.lm_head.__dict__, "routing left after close()"


@pytest.mark.parametrize("tier,early_step", [("cpu", "on"), ("nvme", "off")])
def test_a_parts_state_dict_holds_its_current_values(disk_dir, tier, early_step) -> None:
    """``model.model.layers[0].state_dict()`` at stage 3: the released parameters came back as
    empty tensors (a saved head was an empty file), a fetched one as it was before a pending
    step. Now the current values, as the whole model's state dict; close() removes the hooks."""
    engine, model, reference, ref_opt = _setup(disk_dir, tier, early_step)
    try:
        for x in _batches(3):
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            loss_of(reference(input_ids=x, labels=x)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for part, ref_part in ((model.model.layers[0], reference.model.layers[0]),
                               (model.lm_head, reference.lm_head)):
            got, want = part.state_dict(), ref_part.state_dict()
            assert got.keys() == want.keys()
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    finally:
        engine.close()
    assert not any(m._state_dict_hooks for m in model.modules()), "hooks left after close()"


class _DetachedRead(torch.nn.Module):
    """A block that also reads its own weight through ``.detach()`` (the saved tensor is the
    weight itself, which the early step changes in place unless the engine holds it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.nn.functional.linear(x, self.a.weight.detach())
        return x + torch.tanh(self.a(x)) + 0.5 * torch.tanh(g)


@pytest.mark.parametrize("stage,tier", [(2, "cpu"), (3, "nvme")])
def test_training_in_eval_mode_is_training(disk_dir, stage, tier) -> None:
    """A model trained in eval mode (from_pretrained leaves it there; eval turns dropout off):
    a forward under grad trains whatever the mode, as torch's autograd. Taken for an evaluation
    before, its weights read through .detach() were not held against the early step (the loss
    1% off torch within four steps) and its activations were not offloaded."""
    width = 64
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width),
                                *[_DetachedRead(width) for _ in range(3)])
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    ds = zero_config(stage, tier, tier, str(disk_dir), early_step="auto")
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    ds["infinity"].update(offload_activations="nvme" if tier == "nvme" else "none",
                          activation_min_bytes=1)
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        engine.eval()
        reference.eval()
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            x = torch.randn(2, 8, width, generator=gen)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            want = reference(x).pow(2).mean()
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=0)
        _assert_same_weights(engine, reference)
        if tier == "nvme":
            assert engine.activation_swapper.stats.swapped > 0, engine.activation_swapper.describe()
    finally:
        engine.close()


@pytest.mark.parametrize("cast", ["half", "bfloat16", "to_dtype", "part", "part_to", "apply"])
def test_a_cast_of_the_held_model_is_refused_naming_the_config(disk_dir, cast) -> None:
    """model.half() after initialize left the units' copies and masters in fp32: the next forward
    failed ("mat1 and mat2 must have the same dtype"), at stage 2 after a first step in fp16.
    Refused; a cast to the compute dtype and a device move are torch's. A part's cast (a head
    kept in another dtype) cut its parameters from the engine's stores, and the same failure
    followed: refused too, and ``model.apply`` of one meets the first held part's."""
    engine, model, *_ = _setup(disk_dir, "cpu", "off")
    try:
        call = {"half": model.half, "bfloat16": model.bfloat16,
                "to_dtype": lambda: model.to(torch.float16),
                "part": model.lm_head.half, "part_to": lambda: model.lm_head.to(torch.bfloat16),
                "apply": lambda: model.apply(lambda m: m.half())}[cast]
        with pytest.raises(RuntimeError, match=r"after infinity\.initialize: the engine computes "
                                               r"in float32.*infinity\.compute_dtype"):
            call()
        assert model.float() is model and model.to("cpu") is model
        assert model.lm_head.float() is model.lm_head
        assert all(p.dtype == torch.float32 for p in model.parameters())
        x = _batches(1)[0]
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
    finally:
        engine.close()
    assert "half" not in model.__dict__ and "to" not in model.__dict__     # close() undid it
    assert "half" not in model.lm_head.__dict__ and "to" not in model.lm_head.__dict__


def test_a_cast_the_models_own_forward_makes_is_torchs(disk_dir) -> None:
    """SwitchTransformers' router casts its classifier to fp32 inside its forward
    (``self.classifier.to(self.dtype)``): the part casts refused outside a forward refused it
    too, and a model that trained under bf16 failed at its first forward."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=2, encoder_sparse_step=1, decoder_sparse_step=1,
        expert_capacity=64)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg)
    ds = {"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}},
          "infinity": {"compute_dtype": "bf16"}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        x = torch.randint(0, 64, (2, 8))
        for _ in range(2):
            out = engine(input_ids=x, decoder_input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
            assert torch.isfinite(out.loss)
        router = model.encoder.block[1].layer[1].mlp.router.classifier
        with pytest.raises(RuntimeError, match=r"classifier\.float\(\) after infinity"):
            router.float()                  # outside a forward: the user's, refused
    finally:
        engine.close()


def test_a_models_outputs_pickle_as_torchs(disk_dir) -> None:
    """torch.save of an output still in the graph (the loss, the logits) works as torch's: the
    engine's backward bookkeeping for a unit's outputs is kept beside them, not on them (kept
    on the tensor, its closure made the save fail)."""
    import io

    engine, *_ = _setup(disk_dir, "cpu", "off")
    try:
        x = _batches(1)[0]
        out = engine(input_ids=x, labels=x, output_hidden_states=True)
        for tensor in (out.logits, loss_of(out), *out.hidden_states):   # layers' own outputs
            torch.save(tensor, io.BytesIO())
        engine.backward(loss_of(out))
        engine.step()
    finally:
        engine.close()
