"""The plan is the engine (issue 35): for a matrix of configs (stages 0-3, offload none / cpu /
nvme, compute fp32 / bf16 / fp16) the states the engine allocates -- parameters, the fp32
master with Adam's m and v, the gradients' home -- are, per tier and in bytes, what
``infinity plan`` shows for the same config, model and machine (``plan_memory``), and the
engine's tiers are the planner's (one rule: planner/placement.py ``state_tiers``). Measured
from the stores the engine's tier manager creates, after ``initialize`` and again after two
steps (nothing is re-homed by training). CPU devices only: a GPU-described machine's plan has
no engine here to compare with (tests/unit/test_planner.py covers its rule's choices)."""
from __future__ import annotations

from collections import defaultdict

import pytest

import infinity
from infinity.planner.inputs import ModelStats, detect_hardware
from infinity.planner.plan import plan_memory
from infinity.storage.manager import TierManager
from parity import make_model, train_random, zero_config

COMPONENT_OF = {"params": "params", "master": "optimizer_states", "exp_avg": "optimizer_states",
                "exp_avg_sq": "optimizer_states", "grad": "grads"}


def _configs() -> list[tuple[int, str, str, str, str]]:
    out = []
    for stage in range(4):
        for opt in (("none", "cpu", "nvme") if stage else ("none",)):
            for param in (("none", "cpu", "nvme") if stage == 3 else ("none",)):
                for dtype in ("fp32", "bf16"):
                    out.append((stage, param, opt, dtype, "off"))
    out += [(3, "nvme", "nvme", "fp16", "off"), (2, "none", "cpu", "fp16", "off")]
    # the early step: gradients have no home
    out += [(3, "nvme", "nvme", "fp32", "on"), (3, "cpu", "cpu", "bf16", "on"),
            (2, "none", "nvme", "bf16", "on")]
    return out


def _held(engine, created: list) -> dict[tuple[str, str], int]:
    """Bytes of each (component, tier) the engine's stores hold, counted in the elements of
    the parameters they hold: its tier manager's stores of parameters, master, m, v and
    gradients (the optimizer's and the gradients' over the trainable ones); a unit kept on the
    device (below stage 3, or persistent) holds its parameters in the device tier without a
    store. The engine also pads each parameter to 64 B and each store to 4 KiB (O_DIRECT),
    which the plan leaves out (at most 4 KiB + 64 B a tensor per store: 10% of this tiny
    model, nothing at 1B parameters), hence elements, not the stores' sizes."""
    units = {unit.name: unit for unit in engine.units}
    held: dict[tuple[str, str], int] = defaultdict(int)
    for store in created:
        unit_name, kind = store.name.rsplit(".", 1)
        if store._host is None and store._extent is None:
            continue        # freed
        entries = units[unit_name].params
        numel = sum(e.numel for e in entries if kind == "params" or e.trainable)
        held[(COMPONENT_OF[kind], str(store.home))] += numel * store.itemsize
    for unit in engine.units:
        if unit.param_store is None:
            held[("params", "device")] += sum(e.numel for e in unit.params) * unit.dtype.itemsize
    return dict(held)


def _planned(engine, model_stats: ModelStats, nvme: str) -> dict[tuple[str, str], int]:
    plan = plan_memory(engine.config, model_stats, detect_hardware(nvme))
    return {(item.component, str(item.tier)): item.nbytes for item in plan.items
            if item.component in ("params", "grads", "optimizer_states") and item.nbytes}


@pytest.mark.parametrize("stage, param, opt, dtype, early", _configs())
def test_the_engine_holds_the_states_the_plan_shows(disk_dir, monkeypatch, stage, param, opt,
                                                    dtype, early) -> None:
    created: list = []
    create = TierManager.create

    def recorded(self, name, *args, **kwargs):
        store = create(self, name, *args, **kwargs)
        created.append(store)
        return store
    monkeypatch.setattr(TierManager, "create", recorded)
    ds = zero_config(stage, param, opt, str(disk_dir), compute_dtype=dtype, early_step=early)
    ds["gradient_clipping"] = 1.0 if early == "off" else 0.0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["train_micro_batch_size_per_gpu"] = 2
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if dtype == "fp16":
        ds["fp16"] = {"enabled": True}
    model = make_model("torch", layers=2, width=32)
    stats = ModelStats.from_module(model)
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        planned = _planned(engine, stats, str(disk_dir))
        assert _held(engine, created) == planned, (engine.param_tier, engine.optimizer_tier,
                                                   engine.master_separate)
        train_random(engine, 2)
        assert _held(engine, created) == planned
    finally:
        engine.close()
