"""The plan is the engine (issue 35): for a matrix of configs (stages 0-3, offload none / cpu /
nvme, compute fp32 / bf16 / fp16, both schedules, and the Adam state formats of issue 38: bf16
and int8 moments, a bf16 master; two ranks in tests/distributed/test_plan_ranks.py) the engine
is built from
one run plan (planner/run_plan.py) and holds what it says:

- the states it allocates (parameters, the fp32 master with Adam's m and v, the gradients'
  home; m and v in their format, the int8 scales in host memory) are, per tier and in bytes,
  what ``infinity plan`` shows for the same config, model and machine (``plan_memory``);
- its host pools (fetch slots, gradient buffers, step-stream slots) are the plan's, and the
  plan made from the partition before any unit existed sizes them as the built units do;
- the plan ``infinity plan`` makes from the model's counts alone takes the same decisions
  (compute dtype, tiers, single copy, schedule, speculation, direct fetch, gradient home) and
  pool counts, its slots within a unit's padding of the engine's;
- the host budget holds exactly the host stores, the plan's pools and its staging;
- ``infinity plan``'s host "buffers" rows are those pools, count x slot bytes each;
- under a tight budget the engine takes the parameter buffers its plan gave up for the
  optimizer's sub-group (planner/optimizer_room.py).

Measured after ``initialize`` and again after two steps (nothing is re-homed or re-sized by
training; see plan_check.py for how). CPU devices only: a GPU-described machine's plan has no
engine here to compare with (tests/unit/test_run_plan.py covers its decisions)."""
from __future__ import annotations

import pytest

import infinity
from infinity.planner.inputs import ModelStats
from parity import make_model, train_random, zero_config
from plan_check import check, compare, counted_plan, recording_stores


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


@pytest.mark.parametrize("stage, param, opt, dtype, early", _configs())
def test_the_engine_holds_the_states_the_plan_shows(disk_dir, stage, param, opt,
                                                    dtype, early) -> None:
    _check_engine(disk_dir, stage, param, opt, dtype, early)


# (stage, param, opt, compute, early, optimizer_moments, optimizer_master, width): width 32
# makes every unit an int8 one (4288 and 8192 elements), 16 keeps the blocks (1104) in fp32
# moments with an fp32 master beside int8 embeddings (see [Note: a unit's state format])
FORMATS = [
    (3, "nvme", "nvme", "bf16", "off", "bf16", "fp32", 32),
    (3, "cpu", "nvme", "bf16", "off", "int8", "fp32", 32),
    (3, "nvme", "nvme", "fp32", "off", "int8", "fp32", 32),
    (3, "cpu", "cpu", "bf16", "on", "int8", "fp32", 32),
    (2, "none", "cpu", "fp32", "off", "int8", "fp32", 32),
    (3, "nvme", "nvme", "bf16", "off", "int8", "bf16", 32),
    (3, "nvme", "nvme", "bf16", "off", "int8", "bf16", 16),
    (3, "cpu", "cpu", "bf16", "on", "bf16", "bf16", 32),
]


@pytest.mark.parametrize("stage, param, opt, dtype, early, moments, master, width", FORMATS)
def test_the_engine_holds_the_formats_the_plan_shows(disk_dir, stage, param, opt, dtype, early,
                                                     moments, master, width) -> None:
    _check_engine(disk_dir, stage, param, opt, dtype, early, width=width,
                  optimizer_moments=moments, optimizer_master=master)


def _check_engine(disk_dir, stage, param, opt, dtype, early, width=32, **formats) -> None:
    ds = zero_config(stage, param, opt, str(disk_dir), compute_dtype=dtype, early_step=early,
                     **formats)
    ds["gradient_clipping"] = 1.0 if early == "off" else 0.0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["train_micro_batch_size_per_gpu"] = 2
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if dtype == "fp16":
        ds["fp16"] = {"enabled": True}
    model = make_model("torch", layers=2, width=width)
    stats = ModelStats.from_module(model)
    with recording_stores() as created:
        engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        first = compare(engine, created, stats, str(disk_dir))
        check(first)
        if formats:      # the engine stores the formats asked (the plan's bytes say the same)
            kinds = {s.name.rsplit(".", 1)[1]: s.dtype for s in created if s.allocated}
            assert ("scales" in kinds) == (formats["optimizer_moments"] == "int8"), kinds
        train_random(engine, 2)
        after = compare(engine, created, stats, str(disk_dir))
        check(after)
        assert after == first        # nothing re-homed or re-sized by training
    finally:
        engine.close()


def test_the_engine_takes_the_room_its_plan_gives_the_optimizer(disk_dir) -> None:
    """Under a tight budget the run plan gives up parameter buffers for the optimizer's
    sub-group ([Note: room for the optimizer] in planner/optimizer_room.py): 1M-element units
    under 28 MiB get 2,048-element sub-groups from the defaults; the engine is built from the
    plan's one buffer, holds what ``infinity plan`` shows, and the plan made from the counts
    alone takes the same choice (``decisions`` compares it)."""
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), host_memory_budget="28MiB")
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["train_micro_batch_size_per_gpu"] = 2
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model = make_model("torch", layers=4, width=512)
    stats = ModelStats.from_module(model)
    with recording_stores() as created:
        engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        room = engine.plan.room
        assert room.param_buffer_count == 1 and room.sub_group_before == 2048
        assert engine.plan.optimizer.sub_group_numel > 50 * room.sub_group_before
        first = compare(engine, created, stats, str(disk_dir))
        check(first)
        train_random(engine, 2)
        assert compare(engine, created, stats, str(disk_dir)) == first
    finally:
        engine.close()


@pytest.mark.parametrize("threshold", [0, 3_000, 10**9])
def test_the_plan_counts_the_units_the_engine_keeps_on_the_device(disk_dir, threshold) -> None:
    """At stage 3 the engine keeps a unit on the device when all of it is at most the
    persistence threshold (engine/wiring.py: the unit is what a fetch moves); the plan counts
    those units' whole flat buffers (``persistent_device_bytes``), from the units it is given
    and from the model's counts alone. Width 16: blocks of 1,104 elements (2,048 laid out:
    the threshold compares the padded layout, as the engine), embeddings of 4,096; thresholds
    keeping none, the blocks, every unit."""
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["train_micro_batch_size_per_gpu"] = 2
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    model = make_model("torch", layers=2, width=16)
    stats = ModelStats.from_module(model)
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        kept = [u for u in engine.units if u.persistent]
        assert 0 < len(kept) < len(engine.units) if threshold == 3_000 else True
        assert (len(kept) == len(engine.units)) == (threshold == 10**9)
        held = sum(u.nbytes for u in kept)
        assert engine.plan.derived.persistent_device_bytes == held
        assert counted_plan(engine, stats, str(disk_dir)).derived.persistent_device_bytes == held
    finally:
        engine.close()


@pytest.mark.parametrize("early", ["on", "off"])
def test_the_swap_files_hold_the_plans_disk_bytes(disk_dir, early) -> None:
    """The swap files on disk after two steps are the plan's NVMe bytes, no more: the reserve
    was split into ~4 files whose tails (shorter than the next extent, which never spans two
    files) went unused, and the shortfall came as one more file of a quarter of the space
    (this model: 26% over what ``infinity plan`` said it would take)."""
    model = make_model("llama", layers=4, width=512)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step=early)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        train_random(engine, steps=2)
        files = [p for p in disk_dir.rglob("swap-*.bin")]
        assert files, list(disk_dir.rglob("*"))
        on_disk = sum(p.stat().st_size for p in files)
        assert engine.sizes.nvme_bytes > 64 << 20, engine.sizes.nvme_bytes   # several old files
        assert on_disk == engine.sizes.nvme_bytes, (on_disk, engine.sizes.nvme_bytes, files)
    finally:
        engine.close()
