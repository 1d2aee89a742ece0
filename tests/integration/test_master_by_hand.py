"""A change by hand to a model the engine holds, with 16-bit compute and a separate fp32 master
([Note: a change by hand reaches the master] in optim/master_seed.py): the master takes the
elements that changed and keeps the rest. Seeded again from the whole bf16 copy, as it was, a
``GatheredParameters(..., modifier_rank=0)`` that changed nothing left every element of the
unit bf16-exact (the updates below bf16's precision lost), and ``model.load_state_dict`` of fp32
values kept them only as bf16. The masters are read from a checkpoint (its model file holds the
fp32 masters); compared bit for bit: nothing else writes them between the two saves."""
from __future__ import annotations

import pytest
import torch

import infinity
from infinity.checkpoint.export import consolidated_state_dict
from parity import VOCAB, loss_of, make_model, with_adamw, zero_config


def _engine(disk_dir, stage: int, param: str, optimizer: str):
    ds = with_adamw(zero_config(stage, param, optimizer, str(disk_dir)))
    ds["infinity"]["compute_dtype"] = "bf16"
    model = make_model("llama", layers=2, width=64)
    engine, *_ = infinity.initialize(model=model, config=ds)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2, 16), generator=gen)
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
    return engine, model


def _masters(engine, disk_dir, tag: str) -> dict[str, torch.Tensor]:
    engine.save_checkpoint(disk_dir / "ckpt", tag=tag)
    return consolidated_state_dict(disk_dir / "ckpt", tag=tag)


@pytest.mark.parametrize("stage, param, optimizer", [(3, "cpu", "cpu"), (3, "nvme", "nvme"),
                                                     (2, "none", "cpu")])
def test_a_gathered_change_reaches_the_master_and_nothing_else_moves(
        disk_dir, stage, param, optimizer) -> None:
    engine, model = _engine(disk_dir, stage, param, optimizer)
    try:
        before = _masters(engine, disk_dir, "before")
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(before[name], before[name].bfloat16().float()), \
            "the masters hold nothing below bf16: the test would prove nothing"
        weight = dict(model.named_parameters())[name]
        with infinity.zero.GatheredParameters([weight], modifier_rank=0):
            pass                                               # read only
        same = _masters(engine, disk_dir, "same")
        changed_to = torch.tensor(0.3125)                      # bf16-exact
        with infinity.zero.GatheredParameters([weight], modifier_rank=0):
            with torch.no_grad():
                weight[0, 0] = changed_to
        after = _masters(engine, disk_dir, "after")
    finally:
        engine.close()
    for key in before:
        assert torch.equal(same[key], before[key]), key
        if key != name:
            assert torch.equal(after[key], before[key]), key
    expected = before[name].clone()
    expected[0, 0] = changed_to
    assert torch.equal(after[name], expected)


def test_a_state_dict_of_fp32_values_is_the_master_as_loaded(disk_dir) -> None:
    engine, model = _engine(disk_dir, 3, "cpu", "cpu")
    gen = torch.Generator().manual_seed(5)
    try:
        loaded = {k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                  for k, v in _masters(engine, disk_dir, "shapes").items()}
        model.load_state_dict(loaded)
        masters = _masters(engine, disk_dir, "loaded")
    finally:
        engine.close()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    for key in trained:
        assert torch.equal(masters[key], loaded[key]), \
            (key, (masters[key] - loaded[key]).abs().max())


def test_fp32_values_rebound_under_gathered_parameters_are_the_master(disk_dir) -> None:
    """``p.data = fp32_tensor`` under ``GatheredParameters(..., modifier_rank=0)`` (an EMA
    written back, a re-init): the master took them only as the bf16 copy rounded them, and an
    edit under half a bf16 step (x 1.001 here) not at all."""
    engine, model = _engine(disk_dir, 3, "cpu", "cpu")
    try:
        name = "model.layers.1.mlp.up_proj.weight"
        before = _masters(engine, disk_dir, "before")
        target = before[name] * 1.001
        weight = dict(model.named_parameters())[name]
        with infinity.zero.GatheredParameters([weight], modifier_rank=0):
            weight.data = target.clone()
        after = _masters(engine, disk_dir, "after")
    finally:
        engine.close()
    assert torch.equal(after[name], target)
    assert all(torch.equal(after[k], before[k]) for k in before if k != name)


def test_the_copys_own_values_rebound_in_fp32_leave_the_master_as_it_was(disk_dir) -> None:
    """``p.data = p.data.float()`` (or an edit of some rows of such an upcast): the values the
    copy already held are no change; taken as exact, the whole master became bf16-exact
    (2.4e-4 of training lost)."""
    engine, model = _engine(disk_dir, 3, "cpu", "cpu")
    try:
        name = "model.layers.0.self_attn.q_proj.weight"
        before = _masters(engine, disk_dir, "before")
        weight = dict(model.named_parameters())[name]
        with infinity.zero.GatheredParameters([weight], modifier_rank=0):
            edited = weight.data.float()
            edited[0] = 0.25                            # one row re-initialised
            weight.data = edited
        after = _masters(engine, disk_dir, "after")
    finally:
        engine.close()
    expected = before[name].clone()
    expected[0] = 0.25
    assert torch.equal(after[name], expected)
