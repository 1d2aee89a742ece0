"""The deferred schedule's step runs when the next forward fetches each unit (see [Note: the
deferred step lands at the next fetch] in optim/step_stream.py): whatever reads a unit after
engine.step() -- a training forward, an eval forward, GatheredParameters -- sees it stepped, with
the learning rate of the step that asked for it, and units without gradients are not stepped."""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from parity import (VOCAB, accumulating_micro_steps, assert_same_parameters, loss_of,
                    make_model, zero_config)
from test_step_overlap import AlternatingHeadModel

LR, MIN_LR, WARMUP = 1e-3, 1e-4, 4


def _warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR, linear: the learning rate of optimizer step ``step`` (from 0); its
    count starts at -1, so steps 0 and 1 both run at the minimum."""
    return MIN_LR + (LR - MIN_LR) * min(1.0, max(0, step - 1) / WARMUP)


def _deferred_config(disk_dir, **infinity_section) -> dict:
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="off", **infinity_section)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    ds["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": MIN_LR, "warmup_max_lr": LR, "warmup_num_steps": WARMUP,
        "warmup_type": "linear"}}
    ds["gradient_clipping"] = 1.0
    return ds


def _alternating_heads(disk_dir, grad_home: str, **ds_extra):
    """AlternatingHeadModel (seed 0) under the deferred schedule with gradients at ``grad_home``,
    and a torch copy with its AdamW: (model, reference, ref_opt, engine)."""
    torch.manual_seed(0)
    model = AlternatingHeadModel(width=256)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    # 1 MiB of host memory does not hold the gradients (1.1 MB); the device pool is set apart
    budget = {"host_memory_budget": "1MiB", "device_memory_budget": "2MiB"} \
        if grad_home == "nvme" else {}
    ds = _deferred_config(disk_dir, **budget)
    del ds["scheduler"]
    ds.update(ds_extra)
    engine, *_ = infinity.initialize(model=model, config=ds)
    if any(s.grad_store.resident != (grad_home == "host") for s in engine.optimizer.states):
        engine.close()
        raise AssertionError(f"the gradients are not at {grad_home}: change the budgets")
    return model, reference, ref_opt, engine


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_deferred_step_lands_before_any_read_with_its_own_learning_rate(disk_dir,
                                                                        family: str) -> None:
    """After engine.step() the units' steps wait for their fetch; an eval forward between steps
    and the next training forward see them stepped, each with the learning rate of the step
    that asked for it (the scheduler has moved on by then); training equals torch AdamW with
    clipping and the same warm-up."""
    model = make_model(family, layers=3, width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    engine, *_ = infinity.initialize(model=model, config=_deferred_config(disk_dir))
    gen = torch.Generator().manual_seed(3)
    probe = torch.randint(0, VOCAB, (2, 16), generator=gen)
    try:
        assert not engine.optimizer.early_step
        for step in range(6):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            engine.train()
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            waiting = {u.name for u in engine.optimizer.waiting_units()}
            assert waiting, "the deferred step ran inside engine.step()"
            assert all(not u.persistent for u in engine.optimizer.waiting_units())

            ref_loss = loss_of(reference(input_ids=x, labels=x))
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            for group in ref_opt.param_groups:
                group["lr"] = _warmup_lr(step)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)

            engine.eval()
            reference.eval()
            with torch.no_grad():
                probe_loss = loss_of(engine(input_ids=probe, labels=probe))
                ref_probe = loss_of(reference(input_ids=probe, labels=probe))
            reference.train()
            torch.testing.assert_close(probe_loss, ref_probe, rtol=1e-5, atol=1e-6)
            assert engine.optimizer.waiting_units() == [], "the eval forward left steps waiting"
    finally:
        engine.close()


@pytest.mark.parametrize("grad_home", ["host", "nvme"])
def test_units_without_gradients_are_not_stepped(disk_dir, grad_home: str) -> None:
    """A model that alternates two heads: the head a step did not use has no gradient, so torch
    does not step it; the deferred schedule must not step it either (with gradients on NVMe it
    would otherwise step again with the gradient of two steps ago)."""
    model, reference, ref_opt, engine = _alternating_heads(disk_dir, grad_home)
    try:
        x = torch.randint(0, VOCAB, (2, 8))
        for _ in range(6):
            loss = engine(input_ids=x, labels=x)
            engine.backward(loss)
            engine.step()
            ref_loss = reference(input_ids=x, labels=x)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        engine.flush()
        steps = {s.unit.name: s.step for s in engine.optimizer.states}
        assert steps["heads.0"] == 3 and steps["heads.1"] == 3 and steps["block"] == 6, steps
        for name, param in reference.named_parameters():
            with infinity.zero.GatheredParameters([dict(model.named_parameters())[name]]):
                # atol: the clipping norm is summed in another order than torch's
                torch.testing.assert_close(dict(model.named_parameters())[name], param,
                                           rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


def test_gathered_parameters_see_the_waiting_step(disk_dir) -> None:
    """Right after engine.step(), GatheredParameters on one parameter runs that unit's step
    first; the other units' steps keep waiting for their fetch."""
    model = make_model("llama", layers=3, width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    ds = _deferred_config(disk_dir)
    del ds["scheduler"]
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        x = torch.randint(0, VOCAB, (2, 16))
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
        loss_of(reference(input_ids=x, labels=x)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        name = "model.layers.1.mlp.up_proj.weight"
        before = len(engine.optimizer.waiting_units())
        param = dict(model.named_parameters())[name]
        with infinity.zero.GatheredParameters([param]):
            torch.testing.assert_close(param, dict(reference.named_parameters())[name],
                                       rtol=1e-5, atol=1e-6)
        assert len(engine.optimizer.waiting_units()) == before - 1
    finally:
        engine.close()


@pytest.mark.parametrize("grad_home", ["host", "nvme"])
def test_accumulation_over_micro_steps_that_use_different_units(disk_dir, grad_home) -> None:
    """Two micro-steps per step, each using the other head. A head's first gradient of a cycle
    may come in the second micro-step: it must not be added to the gradient its NVMe home still
    holds from the last cycle. A head used only in the first micro-step still counts in the
    clipping norm (the norm covers the whole cycle, not the last backward)."""
    model, reference, ref_opt, engine = _alternating_heads(disk_dir, grad_home,
                                                           gradient_accumulation_steps=2)
    try:
        gen = torch.Generator().manual_seed(5)
        for _ in range(4):
            accumulating_micro_steps(engine, reference, [
                torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(2)])
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            assert norm > 1.0, "the test needs clipping to act"
            assert engine.optimizer.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        engine.flush()
        assert_same_parameters(model, reference)
    finally:
        engine.close()
