"""The speculative step (see [Note: speculative step] in optim/speculation.py): the deferred
schedule's step runs during backward into second copies of the NVMe states and is kept when no
clipping acts, else rolled back and redone. Whichever happens, training equals torch AdamW with
clipping, and nothing reads a speculated value that was not kept."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import infinity
from infinity.engine import sizing as engine_sizing
from parity import (
    VOCAB,
    backward_both,
    engine_and_reference,
    loss_of,
    make_model,
    run_parity,
    with_adamw,
    zero_config,
)
from test_step_overlap import _LateWrites

# The tiny models' gradient norms lie between ~2.2 and ~2.6 in these runs: a threshold in
# between clips some steps and not others, so both commits and roll-backs happen.
CLIP_SOME = 2.45


def _config(disk_dir, mode: str = "on", **infinity_section) -> dict:
    return zero_config(3, "nvme", "nvme", str(disk_dir), early_step="off",
                       speculative_step=mode, **infinity_section)


def _both_outcomes(engine) -> dict:
    stats = engine.optimizer.speculation_stats
    assert stats["committed"] > 0 and stats["rolled_back"] > 0, \
        f"the test needs commits and roll-backs: {stats}; move CLIP_SOME"
    return stats


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kept_and_rolled_back_steps_train_like_torch(disk_dir, family: str) -> None:
    """Steps alternate between kept and redone speculation; each step's loss equals torch's."""
    model = make_model(family, layers=3, width=64)
    result = run_parity(model, _config(disk_dir), steps=8, clip=CLIP_SOME, close=False)
    try:
        _both_outcomes(result.engine)
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
        result.engine.flush()
        counts = {s.unit.name: s.step for s in result.engine.optimizer.states}
        assert set(counts.values()) == {8}, f"step counts after roll-backs: {counts}"
    finally:
        result.engine.close()


@pytest.mark.parametrize("reuse", [None, 0])
def test_speculated_writes_are_never_read_before_they_land_or_when_dropped(disk_dir, monkeypatch,
                                                                           reuse) -> None:
    """Writes land late (see test_step_overlap._LateWrites): no read of a current extent races
    a write to it (a commit flips extents with writes still in flight), no unit is released
    while its device copy is being written from, and training equals torch."""
    late = _LateWrites(monkeypatch)
    ds = _config(disk_dir)
    if reuse is not None:
        ds["zero_optimization"]["stage3_max_reuse_distance"] = reuse
    result = run_parity(make_model("llama", layers=3, width=64), ds, steps=6, clip=CLIP_SOME,
                        close=False)
    try:
        _both_outcomes(result.engine)
        assert late.violations == [], late.violations[:5]
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    finally:
        result.engine.close()


def test_accumulation_speculates_at_the_boundary(disk_dir) -> None:
    """With two micro-steps the last backward speculates on the accumulated gradient."""
    model = make_model("llama", layers=3, width=64)
    result = run_parity(model, _config(disk_dir), steps=6, clip=CLIP_SOME * 0.9, accumulation=2,
                        close=False)
    try:
        stats = result.engine.optimizer.speculation_stats
        assert stats["committed"] + stats["rolled_back"] == 6, stats
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    finally:
        result.engine.close()


def test_a_forward_before_step_sees_the_parameters_before_the_step(disk_dir) -> None:
    """An eval forward between backward and step (through the engine, or the model called
    directly) must not see speculated parameters: the speculation is voided (rolled back) and
    the deferred step takes the cycle over."""
    torch.manual_seed(0)
    model = make_model("llama", layers=3, width=64)
    engine, reference, ref_opt = engine_and_reference(model, _config(disk_dir))
    gen = torch.Generator().manual_seed(3)
    try:
        for step in range(3):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            backward_both(engine, reference, x)
            if step >= 1:
                # through the engine, then calling the model itself (as generate() does)
                engine.eval()
                reference.eval()
                with torch.no_grad():
                    seen = (engine if step == 1 else model)(input_ids=x).logits
                    expected = reference(input_ids=x).logits
                torch.testing.assert_close(seen, expected, rtol=1e-5, atol=1e-5)
                engine.train()
                reference.train()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        stats = engine.optimizer.speculation_stats
        assert stats["voided"] == 2 and stats["committed"] == 1, stats
    finally:
        engine.close()


def test_a_training_forward_before_step_does_not_leave_stale_reads_for_the_next(disk_dir) -> None:
    """A training forward (grad enabled, output dropped) between backward and step expects the
    next backward's units (speculation planned) and reads their Adam states ahead; the step then
    changes those states, so those reads must be dropped: the next steps equal torch."""
    torch.manual_seed(0)
    model = make_model("llama", layers=3, width=64)
    engine, reference, ref_opt = engine_and_reference(model, _config(disk_dir, mode="auto"))
    gen = torch.Generator().manual_seed(5)
    try:
        for step in range(4):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            backward_both(engine, reference, x)
            if step == 1:
                engine(input_ids=x, labels=x)        # training mode, grad enabled, dropped
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        assert engine.optimizer.speculation_stats["voided"] == 1, \
            engine.optimizer.speculation_stats
        weights = engine.module_state_dict()
        for name, expected in reference.state_dict().items():
            torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    finally:
        engine.close()


@pytest.mark.parametrize("clip,expected", [(1e-3, {"committed": 0, "rolled_back": 1}),
                                           (100.0, {"committed": 4, "rolled_back": 0})])
def test_auto_stops_speculating_while_steps_are_clipped(disk_dir, clip: float,
                                                        expected: dict) -> None:
    """"auto" speculates on the first step and then only after a step that needed no clipping:
    a run clipped at every step pays one roll-back, not one per step."""
    model = make_model("llama", layers=2, width=64)
    result = run_parity(model, _config(disk_dir, mode="auto"), steps=4, clip=clip, close=False)
    try:
        stats = result.engine.optimizer.speculation_stats
        assert {k: stats[k] for k in expected} == expected, stats
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    finally:
        result.engine.close()


def test_on_where_it_cannot_apply_is_a_clear_error(disk_dir) -> None:
    ds = zero_config(3, "cpu", "cpu", str(disk_dir), early_step="off", speculative_step="on")
    with pytest.raises(ValueError, match="both must be on NVMe"):
        infinity.initialize(model=make_model("llama", layers=1, width=32),
                            config=with_adamw(ds))
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on", speculative_step="on")
    with pytest.raises(ValueError, match="early step is in use"):
        infinity.initialize(model=make_model("llama", layers=1, width=32),
                            config=with_adamw(ds))


def test_auto_leaves_it_off_when_the_disk_lacks_room_for_second_copies(disk_dir,
                                                                       monkeypatch) -> None:
    model = make_model("llama", layers=1, width=32)
    detect = engine_sizing.detect_hardware
    monkeypatch.setattr(engine_sizing, "detect_hardware",       # 4 KiB free on the swap path
                        lambda path: dataclasses.replace(detect(path), disk_free_bytes=4096))
    engine, *_ = infinity.initialize(model=model, config=with_adamw(_config(disk_dir, mode="auto")))
    try:
        assert not engine.speculative and engine.optimizer.speculation == "off"
        assert not any(s.exp_avg.doubled for s in engine.optimizer.states)
    finally:
        engine.close()


@pytest.mark.parametrize("retain", [False, True])
def test_two_backwards_before_a_step_add_up_or_are_refused(disk_dir, retain: bool) -> None:
    """Two backwards and one step (two forward/backward pairs, or one forward and two
    backwards with retain_graph): the deferred schedule adds the gradients up (a speculation
    of the first backward is voided by the second forward or backward), as torch does; the
    early step, which has already stepped the units, refuses the second backward clearly."""
    torch.manual_seed(0)
    engine, reference, ref_opt = engine_and_reference(make_model("llama", layers=2, width=64),
                                                      _config(disk_dir))
    gen = torch.Generator().manual_seed(5)
    try:
        for _ in range(3):
            for micro in range(2):
                if micro == 0 or not retain:
                    x = torch.randint(0, VOCAB, (2, 16), generator=gen)
                    loss = loss_of(engine(input_ids=x, labels=x))
                    ref_loss = loss_of(reference(input_ids=x, labels=x))
                engine.backward(loss, retain_graph=retain and micro == 0)
                ref_loss.backward(retain_graph=retain and micro == 0)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        assert engine.optimizer.speculation_stats["voided"] == 3
    finally:
        engine.close()
    ds = with_adamw(zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on"))
    engine, *_ = infinity.initialize(model=make_model("llama", layers=1, width=32), config=ds)
    try:
        x = torch.randint(0, VOCAB, (1, 8))
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        with pytest.raises(RuntimeError, match="twice without engine.step"):
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
    finally:
        engine.close()


def test_a_learning_rate_set_between_backward_and_step_is_the_one_used(disk_dir) -> None:
    """The speculated step ran with the learning rate of backward time; a rate set before
    step() (by hand, as some loops do) makes step() redo it with the new one."""
    torch.manual_seed(0)
    engine, reference, ref_opt = engine_and_reference(make_model("llama", layers=2, width=64),
                                                      _config(disk_dir))
    gen = torch.Generator().manual_seed(6)
    try:
        for lr in (1e-2, 3e-3, 2e-2):
            backward_both(engine, reference, torch.randint(0, VOCAB, (2, 16), generator=gen))
            for group in engine.optimizer.param_groups + ref_opt.param_groups:
                group["lr"] = lr
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        assert engine.optimizer.speculation_stats["rolled_back"] == 3
    finally:
        engine.close()


def test_on_without_room_for_second_copies_says_speculation_doubles_them(disk_dir,
                                                                         monkeypatch) -> None:
    from infinity.storage import preflight

    monkeypatch.setattr(preflight, "free_bytes", lambda path: 4096)     # 4 KiB free
    with pytest.raises(preflight.SwapPathError, match="speculative step keeps second copies.*"
                                                      "speculative_step"):
        infinity.initialize(model=make_model("llama", layers=1, width=32),
                            config=with_adamw(_config(disk_dir, mode="on")))
    assert list(disk_dir.iterdir()) == []


@pytest.mark.parametrize("optimizer,betas", [("Adam", (0.8, 0.99)), ("AdamW", (0.9, 0.999)),
                                             ("AdamW", (0.0, 0.999))])
def test_a_rolled_back_step_rebuilds_the_gradient_it_did_not_write(disk_dir, optimizer: str,
                                                                    betas) -> None:
    """Without clipping a speculated step writes no gradient home (see [Note: the gradient of
    a speculated step]); when it is rolled back (here: a learning rate set by hand before
    every step) the gradient rebuilt from m is autograd's element by element, and the redone
    steps leave the parameters of the deferred step without speculation. (Adam's L2 mode
    writes the gradient home instead: the same checks hold.)"""
    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    models = {"reference": copy.deepcopy(model), "off": copy.deepcopy(model), "on": model}
    engines = {}
    for mode in ("on", "off"):
        ds = _config(disk_dir / mode, mode=mode)
        ds["optimizer"] = {"type": optimizer, "params": {
            "lr": 1e-3, "betas": list(betas), "weight_decay": 0.1,
            "adam_w_mode": optimizer == "AdamW"}}     # DeepSpeed's "Adam" is AdamW by default
        (disk_dir / mode).mkdir()
        engines[mode] = infinity.initialize(model=models[mode], config=ds)[0]
    reference = models["reference"]
    ref_opt = (torch.optim.Adam if optimizer == "Adam" else torch.optim.AdamW)(
        reference.parameters(), lr=1e-3, betas=betas, weight_decay=0.1, foreach=False)
    reference_of = dict(zip(map(id, model.parameters()), reference.parameters()))
    gen = torch.Generator().manual_seed(3)
    try:
        for step in range(4):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            backward_both(engines["on"], reference, x)
            engines["off"].backward(loss_of(engines["off"](input_ids=x, labels=x)))
            for opt in [e.optimizer for e in engines.values()] + [ref_opt]:
                for group in opt.param_groups:
                    group["lr"] = 1e-3 * (1.1 + 0.1 * step)     # another rate each step
            for engine in engines.values():
                engine.step()
            worst, opt = 0.0, engines["on"].optimizer
            for state in opt.states:
                home = torch.cat([v for _, v in opt.gradients.home_gradient(state)])
                for entry in state.unit.trainable_entries():
                    rebuilt = home[entry.offset:entry.offset + entry.numel].view(entry.shape)
                    expected = reference_of[id(entry.param)].grad
                    scale = expected.abs().max().item() + 1e-12
                    error = (rebuilt - expected).abs().max().item() / scale
                    if error > worst:
                        worst, worst_name = error, entry.name
            # the rounding of m' (a few ulps of m), over 1 - beta1; the redone step takes the
            # (1 - beta1) back (the comparison below)
            assert worst <= 1e-4, \
                f"step {step}: rebuilt gradient of {worst_name} off by {worst:.2e} of its max"
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        assert opt.speculation_stats["rolled_back"] == 4, opt.speculation_stats
        on, off, ref = (list(models[m].parameters()) for m in ("on", "off", "reference"))
        with infinity.zero.GatheredParameters(on), infinity.zero.GatheredParameters(off):
            for a, b, c in zip(on, off, ref):
                # what the rebuild adds is of the order of what the engine's own deferred
                # step differs from torch by (Adam's m / sqrt(v) where m nearly cancels, and
                # the embedding's gradient summed in another order, amplify ulps alike)
                added = (a - b).abs().max().item()
                allowed = 2 * max((b - c).abs().max().item(), 1e-6 * c.abs().max().item())
                assert added <= allowed, (added, allowed)
    finally:
        for engine in engines.values():
            engine.close()
