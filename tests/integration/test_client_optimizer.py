"""initialize(optimizer=torch.optim.AdamW(...)): the optimizer a user (or transformers.Trainer)
builds is taken over, its param groups and hyperparameters becoming the engine's offloaded
optimizer; other classes, and a run with no optimizer at all, are refused with what to do."""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from parity import VOCAB, loss_of, make_model, zero_config

STEPS = 4


def _decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """transformers.Trainer's groups: decay on matrices, none on biases and norms."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def _train_both(engine, reference: torch.nn.Module, ref_opt, schedule=None,
                ref_schedule=None) -> tuple[list[float], list[float]]:
    gen = torch.Generator().manual_seed(3)
    ours, theirs = [], []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (2, 16), generator=gen)
        loss = loss_of(engine(input_ids=x, labels=x))
        engine.backward(loss)
        engine.step()
        ref = loss_of(reference(input_ids=x, labels=x))
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if ref_schedule is not None:
            ref_schedule.step()
        ours.append(loss.item())
        theirs.append(ref.item())
    return ours, theirs


def _final_weights_equal(engine, reference: torch.nn.Module) -> None:
    mine = engine.module_state_dict()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(mine[name], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_a_torch_adam_with_decay_groups_is_taken_over(disk_dir, kind: str) -> None:
    """AdamW (decoupled decay) and Adam (L2 decay) with two groups (lr and decay of their own)
    train as torch's same optimizer does, on NVMe; the object passed is never stepped."""
    model = make_model("llama", layers=2, width=32)
    reference = copy.deepcopy(model)
    cls = getattr(torch.optim, kind)
    passed = cls(_decay_groups(model, 0.1), lr=2e-3, betas=(0.9, 0.95), eps=1e-7)
    passed.param_groups[1]["lr"] = 1e-3
    ref_opt = cls(_decay_groups(reference, 0.1), lr=2e-3, betas=(0.9, 0.95), eps=1e-7,
                  foreach=False)
    ref_opt.param_groups[1]["lr"] = 1e-3
    engine, optimizer, _, _ = infinity.initialize(
        model=model, optimizer=passed, config=zero_config(3, "nvme", "nvme", str(disk_dir)))
    try:
        assert optimizer is engine.optimizer and optimizer is not passed
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        assert [g["lr"] for g in groups] == [2e-3, 1e-3]
        assert all(g["adamw_mode"] is (kind == "AdamW") and g["betas"] == (0.9, 0.95)
                   and g["eps"] == 1e-7 for g in groups)
        ours, theirs = _train_both(engine, reference, ref_opt)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
        _final_weights_equal(engine, reference)
        # [Note: the optimizer taken over]: the object passed holds no state, and stepping it,
        # which would change nothing (no gradient is ever left on the parameters), is refused
        assert not passed.state
        before = engine.module_state_dict()
        with pytest.raises(RuntimeError, match="the engine took it over.*Call the optimizer "
                                               "initialize returned"):
            passed.step()
        after = engine.module_state_dict()
        assert all(torch.equal(before[n], after[n]) for n in before)
    finally:
        engine.close()


def test_a_scheduler_on_the_passed_optimizer_and_a_factory_drive_the_engine(disk_dir) -> None:
    """DeepSpeed's habit initialize(optimizer=opt, lr_scheduler=LambdaLR(opt, ...)): the
    scheduler moves to the engine's optimizer; a callable optimizer is called with the
    parameters."""
    model = make_model("torch", layers=2)
    reference = copy.deepcopy(model)
    warm = lambda step: min(1.0, (step + 1) / 3)   # noqa: E731
    passed = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(passed, warm)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, warm)
    engine, optimizer, _, scheduler = infinity.initialize(
        model=model, optimizer=passed, lr_scheduler=schedule,
        config=zero_config(3, "cpu", "cpu", str(disk_dir)))
    try:
        assert scheduler is schedule and scheduler.optimizer is optimizer
        assert engine.get_lr() == pytest.approx([1e-2 / 3])
        ours, theirs = _train_both(engine, reference, ref_opt, ref_schedule=ref_schedule)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
        assert engine.get_lr() == pytest.approx([1e-2])
    finally:
        engine.close()
    model = make_model("torch", layers=2)
    engine, optimizer, *_ = infinity.initialize(
        model=model, optimizer=lambda params: torch.optim.Adam(params, lr=5e-3),
        config=zero_config(2, "cpu", "cpu", str(disk_dir)))
    try:
        assert [g["lr"] for g in optimizer.param_groups] == [5e-3]
        assert optimizer.param_groups[0]["adamw_mode"] is False
    finally:
        engine.close()


def test_a_scheduler_built_on_the_passed_optimizer_after_initialize_drives_the_engine(
        disk_dir) -> None:
    """A torch scheduler made on the object passed after ``initialize`` (and an lr written
    into its groups) changed dicts the engine never read: the schedule decayed on paper while
    the engine kept the first lr (weights 3% off torch). Its groups are the engine's now."""
    model = make_model("torch", layers=2)
    reference = copy.deepcopy(model)
    decay = lambda step: 0.5 ** step   # noqa: E731
    passed = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    engine, *_ = infinity.initialize(model=model, optimizer=passed,
                                     config=zero_config(3, "cpu", "cpu", str(disk_dir)))
    schedule = torch.optim.lr_scheduler.LambdaLR(passed, decay)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, decay)
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(STEPS):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            schedule.step()
            loss_of(reference(input_ids=x, labels=x)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_schedule.step()
        assert ref_schedule.get_last_lr() == pytest.approx([1e-2 * 0.5 ** STEPS])
        assert engine.get_lr() == pytest.approx(ref_schedule.get_last_lr())
        _final_weights_equal(engine, reference)
        passed.param_groups[0]["lr"] = 1e-4            # the torch habit, on the object passed
        assert engine.get_lr() == [1e-4]
        # its other calls are the engine's optimizer's: torch's own acted on an object the
        # engine never reads (state_dict() gave no state; zero_grad() kept the gradients)
        for call in ("zero_grad", "state_dict", "load_state_dict", "add_param_group"):
            assert getattr(passed, call) == getattr(engine.optimizer, call), call
        with pytest.raises(RuntimeError):
            passed.state_dict()
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["SequentialLR", "OneCycleLR"])
def test_a_composite_or_stateful_schedule_on_the_passed_optimizer_drives_the_engine(
        disk_dir, kind: str) -> None:
    """A SequentialLR's children kept setting the passed optimizer's rate (the engine trained
    at the warm-up's first rate throughout, silently); OneCycleLR's first step raised KeyError
    'max_lr' (its keys in the passed groups were not carried). Both now follow torch's same
    schedule on torch's AdamW, step by step."""
    S = torch.optim.lr_scheduler

    def schedule(opt):
        if kind == "SequentialLR":
            return S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=2),
                                        S.CosineAnnealingLR(opt, T_max=4)], milestones=[2])
        return S.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 1)

    model = make_model("torch", layers=2)
    reference = copy.deepcopy(model)
    passed = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    ref_schedule = schedule(ref_opt)
    engine, _, _, _ = infinity.initialize(model=model, optimizer=passed,
                                          lr_scheduler=schedule(passed),
                                          config=zero_config(3, "cpu", "cpu", str(disk_dir)))
    try:
        rates, ref_rates = [], []
        gen = torch.Generator().manual_seed(3)
        for _ in range(STEPS):
            rates.append(engine.get_lr()[0])
            ref_rates.append(ref_opt.param_groups[0]["lr"])
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            ref = loss_of(reference(input_ids=x, labels=x))
            ref.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_schedule.step()
        assert rates == pytest.approx(ref_rates, rel=1e-12) and len(set(rates)) == STEPS
        _final_weights_equal(engine, reference)
    finally:
        engine.close()


def test_a_passed_optimizers_group_keeps_its_own_state_format(disk_dir) -> None:
    """docs/optimizer-formats.md's per-group "optimizer_moments" in an optimizer's groups (the
    Hugging Face path): it was dropped, the group stored in the config's int8."""
    model = make_model("torch", layers=2, width=64)
    groups = [{"params": [p for n, p in model.named_parameters() if not n.startswith("embed")]},
              {"params": [model.embed.weight], "optimizer_moments": "fp32"}]
    ds = zero_config(2, "cpu", "cpu", str(disk_dir))
    ds.setdefault("infinity", {})["optimizer_moments"] = "int8"
    engine, optimizer, _, _ = infinity.initialize(
        model=model, config=ds, optimizer=torch.optim.AdamW(groups, lr=1e-3))
    try:
        assert [g["optimizer_moments"] for g in optimizer.param_groups] == ["int8", "fp32"]
        stored = {s.unit.name: s.fmt.moments for s in engine.optimizer.states}
        assert stored["embed"] == "fp32" and set(stored.values()) == {"int8", "fp32"}, stored
    finally:
        engine.close()


@pytest.mark.parametrize("path", ["optimizer", "model_parameters"])
def test_a_groups_own_keys_are_kept_for_the_schedule_that_reads_them(disk_dir, path) -> None:
    """Layer-wise lr decay (timm, BEiT, MAE) writes "lr_scale" into each group and its schedule
    sets ``g["lr"] = lr * g["lr_scale"]``: the engine's groups lost the key (an optimizer
    passed) or refused it (model_parameters), so every layer trained at the full rate."""
    model = make_model("llama", layers=2, width=32)
    reference = copy.deepcopy(model)

    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if "layers.0" in n],
                 "lr_scale": 0.25, "layer_id": 1},
                {"params": [p for n, p in m.named_parameters() if "layers.0" not in n],
                 "lr_scale": 1.0, "layer_id": 2}]

    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    if path == "optimizer":
        engine, optimizer, _, _ = infinity.initialize(
            model=model, config=ds, optimizer=torch.optim.AdamW(groups(model), lr=1e-2))
    else:
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
        engine, optimizer, _, _ = infinity.initialize(model=model, config=ds,
                                                      model_parameters=groups(model))
    ref_opt = torch.optim.AdamW(groups(reference), lr=1e-2, foreach=False)
    try:
        assert [(g["lr_scale"], g["layer_id"]) for g in optimizer.param_groups] == [(0.25, 1),
                                                                                    (1.0, 2)]
        for opt in (optimizer, ref_opt):        # MAE's util/lr_sched.py
            for g in opt.param_groups:
                g["lr"] = 1e-2 * g["lr_scale"] if "lr_scale" in g else 1e-2
        assert engine.get_lr() == [2.5e-3, 1e-2]
        ours, theirs = _train_both(engine, reference, ref_opt)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
        _final_weights_equal(engine, reference)
    finally:
        engine.close()


def test_what_cannot_be_taken_over_is_refused_with_what_to_do() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"torch\.optim\.sgd\.SGD.*Adam/AdamW only.*"
                                        r"torch\.optim\.Adam, torch\.optim\.AdamW"):
        infinity.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad=True.*pass amsgrad=False"):
        infinity.initialize(model=model,
                            optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))
    stepped = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"already been stepped \(4 parameters"):
        infinity.initialize(model=model, optimizer=stepped)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"initialize got an optimizer \(AdamW\) and the config "
                                         r"has an \"optimizer\" section"):
        infinity.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                            config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    with pytest.raises(ValueError, match=r"no \"optimizer\" section and no optimizer was passed"
                                         r".*\"optimizer\": \{\"type\": \"AdamW\".*"
                                         r"torch\.optim\.AdamW\(model\.parameters\(\)"):
        infinity.initialize(model=model, config={})
    with pytest.raises(ValueError, match="both model_parameters .* and an optimizer"):
        infinity.initialize(model=model, model_parameters=list(model[0].parameters()),
                            optimizer=torch.optim.AdamW(model.parameters()))


def test_a_subclass_with_its_own_step_is_taken_over_with_a_warning(disk_dir, infinity_log) -> None:
    """A torch Adam subclass overriding step() (a custom variant) was taken over as plain Adam
    without a word; now a warning names it (plain AdamW says nothing)."""
    class Mine(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    for cls, warned in ((torch.optim.AdamW, False), (Mine, True)):
        infinity_log.clear()
        model = make_model("torch", layers=1)
        engine, *_ = infinity.initialize(model=model, optimizer=cls(model.parameters(), lr=1e-3),
                                         config=zero_config(2, "cpu", "cpu", str(disk_dir)))
        engine.close()
        assert ("Mine overrides step(), which the engine never calls" in infinity_log.text) \
            is warned, infinity_log.text
