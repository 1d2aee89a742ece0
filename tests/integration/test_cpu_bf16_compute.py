"""compute_dtype "auto" on a CPU-only machine: bf16 where the CPU multiplies bf16 natively (the
probe's answer forced both ways through INFINITY_CPU_BF16, so both kinds of CPU are tested on
either), fp32 otherwise; and bf16 training equals torch running the same recipe.

The recipe: forward and backward in bf16, fp32 master weights stepped by AdamW, the bf16
parameters rounded from the master after each step. Tolerance: 2e-2 relative loss per step over
10 steps (issue 28); both sides round the same values to bf16, but the order of the reductions in
a bf16 matmul differs between a flat shard's views and torch's own tensors.
"""
from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.base.cpu_bf16 import ENV
from parity import VOCAB, half_recipe_losses, loss_of, make_model, zero_config

STEPS = 10
LR, WD = 1e-3, 0.01


def _ds(stage: int, param: str, optimizer: str, disk_dir, compute_dtype: str = "auto") -> dict:
    ds = zero_config(stage, param, optimizer, str(disk_dir), compute_dtype=compute_dtype)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
    ds["train_micro_batch_size_per_gpu"] = 2
    return ds


def _batches(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, VOCAB, (4, 2, 16), generator=gen)
    return [pool[i % 4] for i in range(STEPS)]


@pytest.mark.parametrize("family", ["torch", "llama"])
@pytest.mark.parametrize("stage,param,optimizer", [(3, "nvme", "nvme"), (3, "cpu", "cpu"),
                                                   (2, "none", "cpu")])
def test_auto_on_a_bf16_cpu_trains_like_torch_bf16(family: str, stage: int, param: str,
                                                   optimizer: str, disk_dir,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    model = make_model(family, layers=3, width=64)
    reference = half_recipe_losses(copy.deepcopy(model), _batches(), LR, WD)
    engine, *_ = infinity.initialize(model=model, config=_ds(stage, param, optimizer, disk_dir))
    try:
        assert engine.compute_dtype == torch.bfloat16 and engine.master_separate
        assert all(u.flat.dtype == torch.bfloat16 for u in engine.units)  # parameters move as bf16
        chosen = infinity.native_info()["in_use"]["compute_dtype"]
        assert chosen.startswith("bf16 (auto: CPU-only") and ENV in chosen
        losses = []
        for x in _batches():
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.close()
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert worst <= 2e-2, (losses, reference)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("forced, dtype, separate", [("0", torch.float32, False),
                                                     ("1", torch.bfloat16, True)])
def test_auto_follows_the_probe(forced: str, dtype: torch.dtype, separate: bool, disk_dir,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without native bf16 "auto" stays fp32 and the parameter is the master (stored once)."""
    monkeypatch.setenv(ENV, forced)
    engine, *_ = infinity.initialize(model=make_model("torch", layers=2),
                                     config=_ds(3, "nvme", "nvme", disk_dir))
    try:
        assert engine.compute_dtype == dtype and engine.master_separate is separate
        assert infinity.native_info()["in_use"]["compute_dtype"].startswith(
            "fp32 (auto: CPU-only, and the CPU has no native bf16" if forced == "0"
            else "bf16 (auto: CPU-only, and the CPU multiplies bf16 natively")
    finally:
        engine.close()


@pytest.mark.parametrize("forced", ["0", "1"])
@pytest.mark.parametrize("asked", ["fp32", "bf16"])
def test_an_explicit_compute_dtype_wins_over_the_cpu(forced: str, asked: str, disk_dir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, forced)
    engine, *_ = infinity.initialize(model=make_model("torch", layers=2),
                                     config=_ds(2, "none", "cpu", disk_dir, compute_dtype=asked))
    try:
        assert engine.compute_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[asked]
        assert "in the config" in infinity.native_info()["in_use"]["compute_dtype"]
    finally:
        engine.close()


class _Ranks:
    """A stand-in for Collectives with two ranks, the other one's CPU answer given."""

    active = True
    rank = 0

    def __init__(self, other: bool) -> None:
        self.other = other

    def all_gather_objects(self, value):
        import dataclasses

        return [value, dataclasses.replace(value, cpu_bf16=self.other)]


@pytest.mark.parametrize("other, dtype", [(True, "bf16"), (False, "fp32")])
def test_ranks_agree_on_bf16_only_where_every_cpu_has_it(other: bool, dtype: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from infinity.config import InfinityConfig
    from infinity.engine.sizing import engine_plan
    from infinity.zero.partition import partition

    monkeypatch.setenv(ENV, "1")
    if torch.cuda.is_available():
        pytest.skip("with a GPU the CPU's bf16 is not asked")
    cfg = InfinityConfig.from_dict({"zero_optimization": {"stage": 3}})
    specs = partition(make_model("torch", layers=2))
    assert engine_plan(cfg, specs, [], torch.device("cpu"), _Ranks(other)).compute_dtype == dtype
    if not other:
        assert "rank(s) 1 have no native bf16" in infinity.native_info()["in_use"]["compute_dtype"]


@pytest.mark.parametrize("unused", [False, True])
def test_deferred_bf16_step_leaves_parameters_the_masters_rounding(
        unused: bool, disk_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """After deferred bf16 steps (clipping on, masters in host memory) every parameter's home
    holds exactly its fp32 master rounded to bf16: where the kernel rounds into the device copy
    (the step's runs cover a sub-group) and where it does not (a block's parameter that never
    gets a gradient: its sub-group keeps the master's own rounding there)."""
    monkeypatch.setenv(ENV, "1")
    torch.manual_seed(0)
    model = make_model("torch", layers=2, width=64)
    if unused:
        model.blocks[0].norm.register_parameter("unused", torch.nn.Parameter(torch.randn(64)))
    ds = _ds(3, "cpu", "cpu", disk_dir)
    ds["gradient_clipping"] = 1.0
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        assert engine.compute_dtype == torch.bfloat16 and engine.master_separate
        for x in _batches()[:3]:
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
        engine.flush()          # the deferred steps run (they land at the next fetch otherwise)
        checked = set()
        for state in engine.optimizer.states:
            unit = state.unit
            with infinity.zero.GatheredParameters([e.param for e in unit.params]):
                master = state.master.tensor[: state.hi - state.lo]
                for entry in unit.trainable_entries():
                    got = entry.param.detach().reshape(-1)
                    want = master[entry.offset - state.lo:entry.offset - state.lo + entry.numel]
                    assert torch.equal(got, want.to(torch.bfloat16)), entry.name
                    checked.add(entry.name)
        assert ("blocks.0.norm.unused" in checked) == unused
    finally:
        engine.close()
