"""A unit's Adam state format is the unit's, not a rank's (optim/state_formats.py build_state):
each rank steps its shard of a unit, and a shard of a small unit may be under the 4096
elements int8 needs while the unit is not. Were the rule applied to the shard, the ranks would
store one unit in two formats (int8 codes and a bf16 master on one, fp32 moments and an fp32
master on the other): model files of two dtypes for one parameter, which no load accepts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.config.aio import AioConfig
from infinity.optim.state_formats import build_state
from infinity.planner.placement import state_bytes
from infinity.planner.state_format import MIN_INT8_NUMEL, StateFormat
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.unit import Unit

INT8_BF16 = StateFormat("int8", "bf16")


def _unit(numel: int, manager: TierManager, shards: int = 1) -> Unit:
    param = nn.Parameter(torch.randn(numel).to(torch.bfloat16))
    unit = Unit(0, "u0", nn.Module(), [("w", param, 0)], torch.bfloat16, torch.device("cpu"),
                shards=shards)
    unit.adopt(manager, Tier.HOST, persistent=False)
    return unit


def test_every_rank_stores_a_unit_in_the_unit_s_format() -> None:
    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                          aio_config=AioConfig(backend="auto", block_size=1 << 20, queue_depth=4))
    unit = _unit(6000, manager)           # over 4096; each of two shards under it
    try:
        states = [build_state(manager, unit, span, [INT8_BF16], 8192, optimizer_tier=Tier.HOST,
                              grad_tier=Tier.HOST, grad_dtype=torch.float32, early_step=True,
                              master_separate=False, doubled=False, sharded=True)
                  for span in ((0, 4096), (4096, 6000))]
        assert [s.fmt for s in states] == [INT8_BF16, INT8_BF16]
        assert all(s.master is None and s.exp_avg.dtype == torch.uint8 for s in states)
        # and a unit under 4096 keeps fp32 moments and an fp32 master on every rank
        small = _unit(1500, manager)
        assert small.trainable_numel < MIN_INT8_NUMEL
        state = build_state(manager, small, (0, 1024), [INT8_BF16], 8192,
                            optimizer_tier=Tier.HOST, grad_tier=Tier.HOST,
                            grad_dtype=torch.float32, early_step=True, master_separate=False,
                            doubled=False, sharded=True)
        assert state.fmt == StateFormat() and state.master is not None
    finally:
        manager.close()


def test_the_plan_counts_the_unit_s_format_on_each_rank() -> None:
    """The plan's bytes follow the same rule: a unit of 6000 trainable elements at two ranks is
    int8 on each (3000-element shares), not fp32."""
    got = state_bytes(INT8_BF16, [(6000, 3000)], ranks=2, sharded=True, master_separate=False,
                      compute_itemsize=2)
    assert got.kept_fp32 == 0 and got.scales > 0
    assert got.optimizer == 2 * 1 * 3000         # int8 m and v, no master


def test_a_rank_range_no_larger_than_its_sub_group_is_stepped_in_int8() -> None:
    """At three ranks the plan clamps the sub-group to the largest range a rank steps (2048
    elements for a 6000-element unit's shards): each range is then one sub-group, whatever
    int8's 4096-element chunk, and is accepted (it was refused on the rank whose ranges were
    all small, the others then losing it in their next collective). A sub-group smaller than
    the largest range is refused on every rank, the one whose own range fits it too (the
    ranks decide alike: an 8500-element unit's ranges are 4096, 4096 and 308)."""
    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                          aio_config=AioConfig(backend="auto", block_size=1 << 20, queue_depth=4))

    def state(unit: Unit, span: tuple[int, int], sharded: bool = True):
        return build_state(manager, unit, span, [INT8_BF16], 2048, optimizer_tier=Tier.HOST,
                           grad_tier=Tier.HOST, grad_dtype=torch.float32, early_step=True,
                           master_separate=False, doubled=False, sharded=sharded)
    try:
        small = _unit(6000, manager, shards=3)
        assert small.shard_numel == 2048
        for span in ((0, 2048), (2048, 4096), (4096, 6000)):
            assert state(small, span).fmt == INT8_BF16
        large = _unit(8500, manager, shards=3)
        for span in ((0, 4096), (4096, 8192), (8192, 8500)):
            with pytest.raises(ValueError, match="chunks of at least 4096"):
                state(large, span)
        with pytest.raises(ValueError, match="chunks of at least 4096"):
            state(_unit(6000, manager), (0, 6000), sharded=False)
    finally:
        manager.close()
