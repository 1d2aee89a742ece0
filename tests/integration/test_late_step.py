"""The late step (see [Note: late step] in optim/late_step.py): under the early step, the units
the next forward uses last are stepped after ``step()`` returns, and whatever reads them first
waits for their kernels. Checked against torch AdamW with the late kernels slowed down, so a
read that did not wait would see the parameters of the step before."""
from __future__ import annotations

import time

import pytest
import torch

import infinity
from infinity.config import ConfigError
from infinity.optim.partitioned import PartitionedOptimizer
from infinity.storage.tiers import Residency
from parity import (
    VOCAB,
    ArmedBackwardHook,
    engine_and_reference,
    loss_of,
    make_model,
    run_parity,
    zero_config,
)

SLOW_KERNEL_S = 0.15


@pytest.fixture
def slow_late_kernels(monkeypatch):
    """Each late unit's kernels sleep first: its step is still running when ``step()``
    returns."""
    kernel = PartitionedOptimizer._kernel

    def slow(self, state, *args, **kwargs):
        if state.unit.index in self.late_ids:
            time.sleep(SLOW_KERNEL_S)
        return kernel(self, state, *args, **kwargs)

    monkeypatch.setattr(PartitionedOptimizer, "_kernel", slow)


@pytest.mark.parametrize("family", ["llama", "gpt2", "torch"])
def test_a_forward_waits_for_the_late_steps_and_training_equals_torch(
        disk_dir, slow_late_kernels, family: str) -> None:
    model = make_model(family, layers=3, width=64)
    result = run_parity(model, zero_config(3, "nvme", "nvme", str(disk_dir)), steps=6,
                        close=False)
    engine = result.engine
    try:
        opt = engine.optimizer
        assert opt.late_step and opt.late_ids, "the late step is on by default with NVMe states"
        forward_order = engine.coordinator.forward_order()
        assert forward_order[-1] in opt.late_ids    # the forward's last unit is stepped late
        assert forward_order[0] not in opt.late_ids   # (GPT-2's tied embedding is its first)
        assert opt.late_stats["parked"] >= 5 * len(opt.late_ids), opt.late_stats
        # the forward reached a late unit while its slowed step was still running
        assert opt.late_stats["waited_for"] >= 1, opt.late_stats
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    finally:
        engine.close()


def test_late_on_and_off_give_the_same_losses_and_norm(disk_dir) -> None:
    """Moving a step in time changes no value: the losses and the global norm (the late
    kernels sum their gradients' squares) equal those of the early step without it."""
    runs = {}
    for late in ("on", "off"):
        (disk_dir / late).mkdir()
        model = make_model("llama", layers=3, width=64)
        result = run_parity(model, zero_config(3, "nvme", "nvme", str(disk_dir / late),
                                               late_step=late), steps=5, close=False)
        runs[late] = (result.losses, result.engine.get_global_grad_norm())
        assert bool(result.engine.optimizer.late_ids) == (late == "on")
        result.engine.close()
    assert runs["on"][0] == runs["off"][0]
    # the same squares, summed in another order
    assert runs["on"][1] == pytest.approx(runs["off"][1], rel=1e-12)


def test_reads_after_step_see_the_late_units_stepped(disk_dir, slow_late_kernels) -> None:
    """Right after ``step()`` (the late steps still running): GatheredParameters and an eval
    forward see every parameter as torch has it after its step."""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    engine, reference, ref_opt = engine_and_reference(
        model, zero_config(3, "nvme", "nvme", str(disk_dir)))
    gen = torch.Generator().manual_seed(3)
    try:
        for step in range(3):
            x = torch.randint(0, VOCAB, (2, 12), generator=gen)
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            loss_of(reference(input_ids=x, labels=x)).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            if step == 0:
                continue            # the late set is chosen from the first recorded forward
            late = [u for u in engine.units if u.index in engine.optimizer.late_ids]
            assert late, "no late unit"
            if step == 1:
                head = dict(reference.named_parameters())["lm_head.weight"]
                with infinity.zero.GatheredParameters([engine.module.lm_head.weight]):
                    # (a step moves each weight by ~lr = 1e-3: not seeing it fails here)
                    torch.testing.assert_close(engine.module.lm_head.weight, head,
                                               rtol=1e-5, atol=1e-6)
            else:
                engine.eval()
                with torch.no_grad():
                    logits = engine(input_ids=x).logits
                    ref_logits = reference(input_ids=x).logits
                engine.train()
                torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_a_failed_backward_drops_the_parked_gradients(disk_dir) -> None:
    """A backward raises after the late units' gradients were parked: they are dropped with
    the rest (nothing was stepped), their device copies are released, and training goes on
    equal to torch skipping that batch."""
    torch.manual_seed(0)
    model = make_model("llama", layers=3, width=64)
    failing = ArmedBackwardHook(error="injected backward failure")
    model.model.layers[-1].register_full_backward_pre_hook(failing)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    ds["zero_optimization"]["stage3_max_reuse_distance"] = 0    # nothing kept for reuse
    engine, reference, ref_opt = engine_and_reference(model, ds)
    gen = torch.Generator().manual_seed(2)
    try:
        for step in range(5):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            loss = loss_of(engine(input_ids=x, labels=x))
            if step == 2:
                opt = engine.optimizer
                steps_before = {s.unit.name: s.step for s in opt.states}
                failing.armed = True
                with pytest.raises(RuntimeError, match="injected backward failure"):
                    engine.backward(loss)
                assert opt.parked_units() == []
                assert {s.unit.name: s.step for s in opt.states} == steps_before
                late = [u for u in engine.units if u.index in opt.late_ids]
                assert late and all(u.residency == Residency.RELEASED for u in late), \
                    [(u.name, u.residency) for u in late]
                continue
            engine.backward(loss)
            engine.step()
            ref_loss = loss_of(reference(input_ids=x, labels=x))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_closing_with_parked_gradients_releases_them(disk_dir) -> None:
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    engine, *_ = engine_and_reference(model, zero_config(3, "nvme", "nvme", str(disk_dir)))
    x = torch.randint(0, VOCAB, (2, 8))
    engine.backward(loss_of(engine(input_ids=x, labels=x)))
    engine.step()
    engine.backward(loss_of(engine(input_ids=x, labels=x)))   # parks, no step follows
    assert engine.optimizer.parked_units()
    engine.close()
    assert engine.optimizer.parked_units() == []
    assert list(disk_dir.iterdir()) == []


def test_late_step_on_where_it_cannot_run_says_why(disk_dir) -> None:
    with pytest.raises(ConfigError, match="late_step = 'on'.*early_step is 'off'"):
        infinity.initialize(model=make_model("torch"), config=zero_config(
            3, "nvme", "nvme", str(disk_dir), early_step="off", late_step="on"))
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), late_step="on")
    ds["gradient_clipping"] = 1.0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    with pytest.raises(ValueError, match="late_step = 'on' cannot be used: the early step"):
        infinity.initialize(model=make_model("torch"), config=ds)
