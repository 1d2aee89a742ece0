"""Room for the optimizer (planner/optimizer_room.py): where the host budget leaves the step
stream a sub-group too small to be worth its calls, the run plan gives up parameter buffers
(the prefetch follows them) and, last, the held-gradient room -- never a key the user set --
and the engine and ``infinity plan`` read the one choice from the run plan. The 7B Llama of
issue 38 under 3 GiB (int8 moments, a bf16 master, parameters and optimizer on NVMe) got
4,096-element sub-groups from the defaults; a budget with room plans what it did before."""
from __future__ import annotations

import pytest

from infinity.config import InfinityConfig
from infinity.planner.inputs import llama_stats
from infinity.planner.optimizer_room import NO_ROOM_NEEDED, make_room
from infinity.planner.plan import plan_memory
from infinity.planner.run_plan import UnitParams, plan_run
from infinity.planner.sizes import derive_sizes

from fakes import CPU_BOX, GPU_BOX

USEFUL = 1 << 20   # the rule the module docstring states (a test must not follow its constant)
LLAMA_7B = llama_stats({"hidden_size": 4096, "intermediate_size": 11008,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000})


def config(budget: str, zero: dict | None = None, **infinity: object) -> InfinityConfig:
    """Stage 3, parameters and optimizer on NVMe, int8 moments with a bf16 master, bf16 compute
    (pinned: "auto" follows the CPU), the other keys unset unless ``zero`` sets them."""
    z = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/swap"},
         "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}}
    for key, value in (zero or {}).items():
        z[key] = {**z[key], **value} if isinstance(value, dict) else value
    return InfinityConfig.from_dict({"zero_optimization": z, "infinity": {
        "host_memory_budget": budget, "optimizer_moments": "int8", "optimizer_master": "bf16",
        "compute_dtype": "bf16", **infinity}})


@pytest.mark.parametrize("early", ["auto", "off"])
def test_a_7b_llama_under_3_gib_gets_a_sub_group_of_millions(early: str) -> None:
    """The defaults (three parameter buffers, prefetch) left 4,096 elements; one buffer, the
    prefetch following the device pool, gives millions; the held-gradient room is kept."""
    plan = plan_run(config("3GiB", early_step=early), CPU_BOX, stats=LLAMA_7B)
    room = plan.room
    assert room.sub_group_before < USEFUL <= plan.optimizer.sub_group_numel, room
    assert plan.optimizer.sub_group_numel > 5_000_000
    assert room.param_buffer_count == 1 and plan.derived.param_buffer_count == 1
    assert not room.held_room_off and plan.optimizer.held_room_bytes > 0
    (line,) = room.changes
    assert "offload_param.buffer_count 1 (was 3" in line and "3.00 GiB" in line
    assert f"{room.sub_group_before:,}-element" in line
    # infinity plan shows the same choice: a note, the buffer count in its ds_config, the
    # optimizer slots of the engine's sub-group
    table = plan_memory(config("3GiB", early_step=early), LLAMA_7B, CPU_BOX)
    assert any(n.startswith("optimizer room: ") and "buffer_count 1" in n for n in table.notes)
    assert table.config.zero.offload_param.buffer_count == 1
    assert table.stepped_sub_group == plan.optimizer.sub_group_numel
    assert table.fits, table.warnings


def test_a_key_the_user_set_is_kept_and_warned_about() -> None:
    plan = plan_run(config("3GiB", {"offload_param": {"buffer_count": 3}}), CPU_BOX,
                    stats=LLAMA_7B)
    assert plan.room.param_buffer_count is None and not plan.room.changed
    assert plan.optimizer.sub_group_numel < USEFUL and plan.derived.param_buffer_count == 3
    (warning,) = plan.room.warnings
    assert "offload_param.buffer_count is set to 3 (kept)" in warning and "down to 1" in warning
    notes = plan_memory(config("3GiB", {"offload_param": {"buffer_count": 3}}), LLAMA_7B,
                        CPU_BOX).notes
    assert any(n.startswith("slow: ") and "buffer_count is set to 3" in n for n in notes)


@pytest.mark.parametrize("budget", ["16GiB", "64GiB"])
def test_a_roomy_budget_plans_what_the_defaults_gave(budget: str) -> None:
    """Nothing given up where memory is plentiful: the derived sizes are the config's own, and
    the pools the numbers the plan gave before the rule existed (commit fcd03b8), but for the
    persistent bytes: the layer norms inside the blocks no longer count as kept on the device
    (the engine keeps whole units only, and no unit of this model is under the threshold), so
    the emulated device takes 512 KiB less of the host and the 16 GiB sub-group is 4,096
    elements larger."""
    cfg = config(budget)
    plan = plan_run(cfg, CPU_BOX, stats=LLAMA_7B)
    assert plan.room == NO_ROOM_NEEDED
    assert plan.derived == derive_sizes(cfg, LLAMA_7B, CPU_BOX)
    before = {"16GiB": 121_563_136, "64GiB": 202_383_360}[budget]
    assert plan.optimizer.sub_group_numel == before
    assert plan.sizes.device_budget == 3_238_951_872            # four buffers moved in
    assert plan.sizes.prefetch_bucket_numel == 404_766_720      # two units ahead
    assert plan.optimizer.held_room_bytes == 809_533_440
    assert [(p.name, p.count, p.slot_bytes) for p in plan.pools] == [
        ("optimizer", 8, 4 * before)]


# ten units of eight 8M-element parameters: a layer's largest part is an eighth of it, so
# giving up the held-gradient room frees most of a unit's fp32 gradient (256 MB)
EIGHTHS = [UnitParams(tuple((8_000_000, True) for _ in range(8)))] * 10


def test_the_held_gradient_room_goes_last() -> None:
    """900 MiB: one buffer is enough, the room stays. 800 MiB: one buffer is not, and the room
    goes too; the optimizer then holds no room (the backward waits for each step)."""
    enough = plan_run(config("900MiB"), CPU_BOX, units=EIGHTHS)
    assert enough.room.param_buffer_count == 1 and not enough.room.held_room_off
    assert enough.optimizer.sub_group_numel >= USEFUL
    both = plan_run(config("800MiB"), CPU_BOX, units=EIGHTHS)
    assert both.room.param_buffer_count == 1 and both.room.held_room_off
    assert both.optimizer.held_room_bytes == 0 and both.optimizer.sub_group_numel >= USEFUL
    assert "no held-gradient room" in both.room.changes[0]
    # where nothing frees enough, nothing is given up for nothing: a warning instead
    none = plan_run(config("600MiB"), CPU_BOX, units=EIGHTHS)
    assert not none.room.changed and none.optimizer.held_room_bytes > 0
    assert "raise infinity.host_memory_budget" in none.room.warnings[0]


def test_through_fetch_slots_the_prefetch_follows_the_buffers() -> None:
    """A GPU reads parameters through host fetch slots: the rule stops at two (the unit being
    fetched and the one in use) and sets the prefetch to the slots left, (buffers - 2) units;
    the gradients are copied out (no held room to give up)."""
    cfg = InfinityConfig.from_dict({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/swap"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}},
        "bf16": {"enabled": True},
        "infinity": {"host_memory_budget": "3GiB", "device_memory_budget": "2GiB"}})
    plan = plan_run(cfg, GPU_BOX, stats=LLAMA_7B)
    assert plan.room.param_buffer_count == 3 and plan.fetch_pool.count == 3
    unit = LLAMA_7B.largest_unit_params
    assert plan.room.prefetch_bucket_size == unit == plan.sizes.prefetch_bucket_numel
    assert plan.optimizer.sub_group_numel >= USEFUL and not plan.room.held_room_off


def test_make_room_takes_the_economies_in_order_and_stops_at_a_useful_one() -> None:
    """Buffers one at a time, then the held room; the first useful choice is kept."""
    cfg = config("3GiB")
    derived = derive_sizes(cfg, LLAMA_7B, CPU_BOX)
    real = plan_run(cfg, CPU_BOX, stats=LLAMA_7B)
    asked: list[tuple[int | None, bool]] = []

    def sizer(c: InfinityConfig, room_off: bool):
        asked.append((c.zero.offload_param.buffer_count, room_off))
        useful = room_off      # only the last economy is enough here
        sub_group = USEFUL if useful else 4096
        return derived, real.sizes.__class__(**{**real.sizes.__dict__,
                                                "sub_group_numel": sub_group})
    small = real.sizes.__class__(**{**real.sizes.__dict__, "sub_group_numel": 4096})
    room, _, sizes = make_room(cfg, (derived, small), sizer, largest_range=202_383_360,
                               largest_unit=202_383_360, direct_fetch=True,
                               params_fetched=True, holds_grads=True)
    assert asked == [(2, False), (1, False), (1, True)]
    assert room.held_room_off and room.param_buffer_count == 1
    assert sizes.sub_group_numel == USEFUL
