"""fp16 loss scaling on the out-of-core path: scaled losses train like torch (powers of two are
divided out exactly in fp32), and a step whose gradients overflow is skipped whole."""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from parity import (VOCAB, ArmedBackwardHook, engine_and_reference, loss_of, make_model,
                    run_parity, with_adamw, zero_config)


def _fp16(ds: dict, **fp16) -> dict:
    ds["fp16"] = {"enabled": True, **fp16}
    return ds


@pytest.mark.parametrize("fp16", [{"initial_scale_power": 10}, {"loss_scale": 64.0}])
def test_scaled_loss_trains_like_torch(disk_dir, fp16) -> None:
    model = make_model("llama", layers=2, width=64)
    ds = _fp16(zero_config(3, "nvme", "nvme", str(disk_dir)), **fp16)
    result = run_parity(model, ds, steps=5, clip=1.0, close=False)
    try:
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
        assert result.engine.loss_scale == fp16.get("loss_scale", 1024.0)
        assert result.engine.skipped_steps == 0
    finally:
        result.engine.close()


def test_an_overflowing_step_is_skipped_and_the_scale_comes_down(disk_dir) -> None:
    """Step 2's gradients are inf: no parameter or Adam state moves, the LR schedule does not
    advance, the dynamic scale halves (hysteresis 1); training goes on equal to torch that
    skipped the batch."""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    inf_once = ArmedBackwardHook(factor=float("inf"))
    model.model.layers[0].register_full_backward_pre_hook(inf_once)
    ds = _fp16(zero_config(3, "nvme", "nvme", str(disk_dir)), initial_scale_power=8,
               hysteresis=1)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 5,
                                                      "warmup_type": "linear"}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    gen = torch.Generator().manual_seed(4)
    ref_step = 0
    try:
        for step in range(5):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            inf_once.armed = step == 2
            lr_before = engine.get_lr()[0]
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            if step == 2:
                assert engine.skipped_steps == 1 and engine.loss_scale == 128.0
                # DeepSpeed's optimizer.loss_scale / cur_scale: the scale now (it was stale)
                assert engine.optimizer.loss_scale == engine.optimizer.cur_scale == 128.0
                assert engine.get_lr()[0] == lr_before, "a skipped step moved the schedule"
                continue
            ref_loss = loss_of(reference(input_ids=x, labels=x))
            ref_loss.backward()
            for group in ref_opt.param_groups:
                # DeepSpeed's count starts at -1: steps 1 and 2 both run at warmup_min_lr
                group["lr"] = 1e-4 + (1e-3 - 1e-4) * min(1.0, max(0, ref_step - 1) / 5)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_step += 1
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        engine.flush()
        steps = {s.unit.name: s.step for s in engine.optimizer.states}
        assert set(steps.values()) == {4}, steps
    finally:
        engine.close()


def test_an_overflow_at_the_minimum_scale_stops_the_run_as_deepspeed_does(disk_dir) -> None:
    """Every step overflows: the scale comes down to min_loss_scale, and the overflow there
    raises (every later step would be skipped, forever, with a warning each), after the step
    was skipped whole; before that, overflows only skip."""
    model = make_model("llama", layers=2, width=64)
    inf_always = ArmedBackwardHook(factor=float("inf"))
    model.model.layers[0].register_full_backward_pre_hook(inf_always)
    ds = _fp16(zero_config(3, "cpu", "cpu", str(disk_dir)), initial_scale_power=2, hysteresis=1,
               min_loss_scale=1)
    engine, *_ = infinity.initialize(model=model, config=with_adamw(ds))
    x = torch.randint(0, VOCAB, (2, 16))
    try:
        scales = []
        for _ in range(2):
            inf_always.armed = True
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            scales.append(engine.loss_scale)
        assert scales == [2.0, 1.0] and engine.skipped_steps == 2
        inf_always.armed = True
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        with pytest.raises(FloatingPointError, match=r"minimum loss scale.*min_loss_scale = 1\b"):
            engine.step()
        assert engine.skipped_steps == 3 and engine.global_steps == 3
    finally:
        engine.close()


def test_clipping_on_some_steps_only_under_a_dynamic_loss_scale_trains_like_torch(disk_dir) -> None:
    """fp16 (dynamic scale 2**10) with gradient_clipping 20: the loss is weighted 1 or 4 per step,
    so the gradient norm is ~10 on some steps (not clipped) and ~40 on others (clipped), and the
    clipping factor must go together with the loss scale into the one divisor of the gradients.
    Against torch (unscaled gradients, clip_grad_norm_, AdamW foreach=False): every step's loss
    within rtol 1e-5 (fp32 compute on the CPU: the scale is divided out exactly). A clipping
    factor that lost the loss scale leaves the clipped steps' gradients 1024 times too large;
    Adam's moments then mix scales, and the losses part after the first clipped step."""
    clip, weights = 20.0, [1, 1, 4, 1, 4, 4, 1, 4, 1]
    model = make_model("torch", layers=2, width=32)
    ds = _fp16(zero_config(3, "nvme", "nvme", str(disk_dir)), initial_scale_power=10)
    ds["gradient_clipping"] = clip
    engine, reference, ref_opt = engine_and_reference(model, ds, lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(4)
    norms = []
    try:
        for step, weight in enumerate(weights):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            loss = loss_of(engine(input_ids=x, labels=x)) * weight
            engine.backward(loss)
            engine.step()
            ref_loss = loss_of(reference(input_ids=x, labels=x)) * weight
            ref_loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, step=step: f"step {step}: {m}")
        # the case this is about: clipping acted on the weighted steps only
        assert [n > clip for n in norms] == [w == 4 for w in weights], norms
        assert engine.loss_scale == 1024.0 and engine.skipped_steps == 0
        x = torch.randint(0, VOCAB, (2, 16), generator=gen)     # after the last step
        with torch.no_grad():
            torch.testing.assert_close(loss_of(engine(input_ids=x, labels=x)),
                                       loss_of(reference(input_ids=x, labels=x)),
                                       rtol=1e-5, atol=1e-6)
    finally:
        engine.close()
