"""The run plan (planner/run_plan.py): the decisions and pools ``plan_run`` makes for CPU and
GPU-described machines, the speculation rule, and the units' exact layouts against the bound
the planner uses for a model known by its counts. (Against a built engine: the "plan is the
engine" tests in tests/integration/test_plan_is_the_engine.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.engine.sizing import grouped_params, param_group_of, unit_params
from infinity.planner.alignment import flat_layout, shard_numel
from infinity.planner.engine_sizes import GRADS_HELD, step_slot_count
from infinity.planner.inputs import ModelStats
from infinity.planner.placement import resident_bytes
from infinity.planner.plan import plan_memory
from infinity.planner.run_plan import UnitParams, plan_run, stats_of_units, units_of_stats
from infinity.planner.sizes import DEVICE_GRAD_BUFFERS, derive_sizes, device_working, prefetch_bytes
from infinity.planner.tiers import Tier
from infinity.zero.partition import partition
from infinity.zero.unit import flat_nbytes

from fakes import CPU_BOX, GPU_BOX, least_budget_with_two_gradient_buffers

MODEL = ModelStats.from_counts(40_000_000, 4_000_000, 10, 4_000_000)


def config(stage: int, param: str, opt: str, world_size: int = 1, **extra: object
           ) -> InfinityConfig:
    zero = {"stage": stage, "offload_param": {"device": param, "nvme_path": "/swap"},
            "offload_optimizer": {"device": opt, "nvme_path": "/swap"}}
    return InfinityConfig.from_dict({"zero_optimization": zero, **extra}, world_size=world_size)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_gpu_keeps_a_separate_master_and_fetches_through_slots(dtype: str) -> None:
    plan = plan_run(config(3, "nvme", "nvme", infinity={"compute_dtype": dtype}), GPU_BOX,
                    stats=MODEL)
    assert not plan.device_is_cpu and plan.master_separate and not plan.direct_fetch
    assert (plan.param_tier, plan.optimizer_tier) == (Tier.NVME, Tier.NVME)
    assert plan.fetch_pool is not None and plan.fetch_pool.count == plan.sizes.fetch_slots
    assert not plan.optimizer.holds_grads      # off a CPU device gradients are copied out
    assert plan.optimizer.step is not None


def test_a_cpu_device_stores_fp32_once_and_reads_nvme_into_device_memory() -> None:
    plan = plan_run(config(3, "nvme", "cpu", infinity={"compute_dtype": "fp32"}), CPU_BOX,
                    stats=MODEL)
    assert plan.device_is_cpu and not plan.master_separate and plan.direct_fetch
    assert plan.fetch_pool is None and plan.param_tier is Tier.NVME   # the deeper tier
    # the same machine told the model computes on its GPU
    on_gpu = plan_run(config(3, "nvme", "cpu", infinity={"compute_dtype": "fp32"}), GPU_BOX,
                      stats=MODEL)
    assert on_gpu.master_separate and not on_gpu.direct_fetch
    # a model left on a GPU machine's CPU: its states are placed for the CPU it computes on,
    # its compute dtype follows the machine's rules (bf16.enabled on a GPU machine: bf16)
    assert plan_run(config(3, "nvme", "cpu", infinity={"compute_dtype": "fp32"}), GPU_BOX,
                    stats=MODEL, device_is_cpu=True).master_separate is False
    left = plan_run(config(3, "nvme", "cpu", bf16={"enabled": True}), GPU_BOX, stats=MODEL,
                    device_is_cpu=True)
    assert left.compute_dtype == "bf16" and left.compute_dtype_reason == "auto: GPU, bf16.enabled"
    assert left.direct_fetch and left.device_is_cpu


def test_the_early_step_without_gradient_homes_or_a_gradient_pool_on_a_cpu() -> None:
    plan = plan_run(config(3, "cpu", "cpu", infinity={"early_step": "on"}), CPU_BOX, stats=MODEL)
    assert plan.early_step and plan.optimizer.holds_grads and plan.optimizer.gradient is None
    gpu = plan_run(config(3, "cpu", "cpu", infinity={"early_step": "on"}), GPU_BOX, stats=MODEL)
    assert gpu.optimizer.gradient is not None and gpu.optimizer.gradient.count == GRADS_HELD


def test_the_step_pool_is_the_slot_rule_at_the_stepped_sub_group() -> None:
    plan = plan_run(config(3, "nvme", "nvme", infinity={"early_step": "off",
                                                         "speculative_step": "off"}),
                    GPU_BOX, stats=MODEL)
    step = plan.optimizer.step
    assert step.count == step_slot_count(Tier.NVME, Tier.NVME, plan.grad_tier, True, False)
    assert step.slot_bytes == plan.optimizer.sub_group_numel * 4
    assert plan.optimizer.sub_group_numel % 2048 == 0
    # the sized sub-group, rounded up to whole 2048-element blocks (4 KiB aligned)
    assert plan.sizes.sub_group_numel <= plan.optimizer.sub_group_numel \
        < plan.sizes.sub_group_numel + 2048


def test_speculation_one_rule_for_the_engine_and_the_planner() -> None:
    deferred = {"early_step": "off"}
    plan = plan_run(config(3, "nvme", "nvme", infinity=deferred), CPU_BOX, stats=MODEL)
    assert plan.speculative and plan.speculation_possible
    # several ranks never speculate (a redo would need the others' gradients)
    ranks = plan_run(config(3, "nvme", "nvme", world_size=2, infinity=deferred), GPU_BOX,
                     stats=MODEL)
    assert not ranks.speculative and not ranks.speculation_possible
    assert "2 ranks" in ranks.speculative_reason
    # "auto" without room for the second copies: off, saying how much is needed
    tight = dataclasses.replace(CPU_BOX, disk_free_bytes=plan.sizes.nvme_bytes)
    short = plan_run(config(3, "nvme", "nvme", infinity=deferred), tight, stats=MODEL)
    assert not short.speculative and short.speculation_possible
    assert "free" in short.speculative_reason and short.sizes.nvme_bytes < plan.sizes.nvme_bytes
    # asked for where it cannot apply: refused, naming why and the fix
    with pytest.raises(ValueError, match="both must be on NVMe.*'auto' or 'off'"):
        plan_run(config(3, "cpu", "cpu", infinity={**deferred, "speculative_step": "on"}),
                 CPU_BOX, stats=MODEL)
    # forced by a what-if: never where the rule forbids it
    assert not plan_run(config(3, "cpu", "cpu", infinity=deferred), CPU_BOX, stats=MODEL,
                        speculative=True).speculative


def test_pools_are_planned_for_the_rank_asked() -> None:
    """Rank 0 steps the first shard of each unit; the last rank's shard of a unit whose
    trainable part ends early is shorter, but its stepped sub-group is rank 0's (every rank
    plans one sub-group: a unit's int8 format is checked against it on each)."""
    units = [UnitParams(((5000, True), (3000, False)), ordered=True)] * 3
    cfg = config(2, "none", "nvme", world_size=2, infinity={"early_step": "off"},
                 zero_optimization={"stage": 2, "sub_group_size": 1 << 20,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}})
    first = plan_run(cfg, CPU_BOX, units=units, rank=0)
    last = plan_run(cfg, CPU_BOX, units=units, rank=1)
    # flat 8000 + padding -> shards of 4096; rank 0 steps 4096 of 5008 trainable, rank 1 the rest
    assert first.optimizer.sub_group_numel == last.optimizer.sub_group_numel == 4096
    assert first.optimizer.gradient.slot_bytes == last.optimizer.gradient.slot_bytes == 8192 * 4


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_several_ranks_on_a_gpu_reduce_in_device_buffers_and_hold_shards_on_the_host(
        stage: int) -> None:
    """[Note: gradients reduced on the device] (optim/device_gradients.py): with 2 ranks on a
    GPU, DEVICE_GRAD_BUFFERS fp32 device buffers of the unit's every shard and its own shard
    (stage 0: its trainable range) are device bytes of the plan, and the host gradient slots
    hold the rank's range, not the unit; on a CPU device (the host path) neither changes."""
    units = [UnitParams(((5000, True), (3000, False)), ordered=True)] * 3
    param = "nvme" if stage == 3 else "none"
    opt = "nvme" if stage else "none"
    cfg = config(stage, param, opt, world_size=2, infinity={"early_step": "off"})
    gpu = plan_run(cfg, GPU_BOX, units=units, rank=0)
    cpu = plan_run(cfg, CPU_BOX, units=units, rank=0)
    assert gpu.derived.device_grad_buffers == DEVICE_GRAD_BUFFERS == 2
    assert gpu.optimizer.device_grad_buffers == 2
    if stage:     # flat 8000 + padding -> shards of 4096; rank 0 steps 4096 of 5008
        assert gpu.sizes.device_gradient_bytes == 2 * (2 * 4096 + 4096) * 4
        assert gpu.optimizer.gradient.slot_bytes == 4096 * 4
        assert cpu.optimizer.gradient.slot_bytes == 8192 * 4
    else:         # the whole trainable range, all-reduced (5000 elements: 5120 bound)
        assert gpu.sizes.device_gradient_bytes == 2 * 5120 * 4
        assert gpu.optimizer.gradient.slot_bytes == cpu.optimizer.gradient.slot_bytes
    assert cpu.sizes.device_gradient_bytes == 0
    one = plan_run(config(stage, param, opt, infinity={"early_step": "off"}), GPU_BOX,
                   units=units)
    assert one.sizes.device_gradient_bytes == 0          # one rank: nothing to reduce


def test_one_device_gradient_buffer_where_two_do_not_fit() -> None:
    """A device budget with room for one buffer beside a fetched unit and one fetched ahead,
    not two: the plan takes one (the next unit's gradient then waits on the device for the
    copy out before it), and counts its bytes."""
    stats = ModelStats.from_counts(400_000_000, 40_000_000, 10, 40_000_000)
    base = {"compute_dtype": "bf16", "early_step": "off"}
    # 2 ranks, stage 3: a 40M-element unit's fp32 buffer is (2 x 20M + 20M) x 4 = 240 MB
    roomy = plan_run(config(3, "nvme", "nvme", world_size=2, communication_data_type="fp32",
                            infinity={**base, "device_memory_budget": 4 << 30}), GPU_BOX,
                     stats=stats)
    tight = plan_run(config(3, "nvme", "nvme", world_size=2, communication_data_type="fp32",
                            infinity={**base, "device_memory_budget": 600 << 20}), GPU_BOX,
                     stats=stats)
    assert roomy.derived.device_grad_buffers == 2 and tight.derived.device_grad_buffers == 1
    assert tight.sizes.device_gradient_bytes * 2 == roomy.sizes.device_gradient_bytes
    assert tight.optimizer.device_grad_buffers == 1
    assert tight.derived.device_grad_dtype == tight.optimizer.device_grad_dtype == "fp32"


@pytest.mark.parametrize("asked, dtype, itemsize", [(None, "bf16", 2), ("bf16", "bf16", 2),
                                                    ("fp32", "fp32", 4)])
def test_device_gradient_buffers_are_in_the_communication_dtype(asked, dtype, itemsize) -> None:
    """``communication_data_type`` (unset: the compute dtype, bf16 here) is the device buffers'
    dtype: their bytes, and the optimizer's pools say it."""
    stats = ModelStats.from_counts(400_000_000, 40_000_000, 10, 40_000_000)
    extra = {} if asked is None else {"communication_data_type": asked}
    plan = plan_run(config(3, "nvme", "nvme", world_size=2, **extra,
                           infinity={"compute_dtype": "bf16", "early_step": "off",
                                     "device_memory_budget": 4 << 30}), GPU_BOX, stats=stats)
    assert plan.derived.device_grad_dtype == plan.optimizer.device_grad_dtype == dtype
    assert plan.sizes.device_gradient_bytes == 2 * (2 * 20_000_768 + 20_000_768) * itemsize


def test_a_unit_fetched_ahead_goes_before_a_second_device_gradient_buffer() -> None:
    """Two buffers that fit beside the fetched unit but leave no room to fetch the next one
    ahead: the plan keeps one and prefetches (planner/sizes.py ``derive_sizes``)."""
    stats = ModelStats.from_counts(400_000_000, 40_000_000, 10, 40_000_000)
    # bf16: the fetched unit and its gradients 160 MB, one unit ahead 80 MB, a buffer 120 MB
    def plan(budget: int):
        return plan_run(config(3, "nvme", "nvme", world_size=2,
                               infinity={"compute_dtype": "bf16", "early_step": "off",
                                         "device_memory_budget": budget}), GPU_BOX, stats=stats)
    both, squeezed = plan(520_000_000), plan(440_000_000)
    assert both.derived.device_grad_buffers == 2
    assert both.derived.prefetch_bucket_size >= 40_000_000
    two = 2 * both.sizes.device_gradient_bytes // both.derived.device_grad_buffers
    fetched, ahead = 2 * 2 * 40_000_000, 2 * 40_000_000
    assert fetched + two <= 440_000_000 < fetched + ahead + two     # the case described
    assert squeezed.derived.device_grad_buffers == 1
    assert squeezed.derived.prefetch_bucket_size >= 40_000_000


def test_exact_layouts_against_the_bound_from_counts() -> None:
    units = [UnitParams(((1000, True), (7, True), (3, False)), ordered=True),
             UnitParams(((64, True),), ordered=True)]
    stats = stats_of_units(units)
    assert (stats.total_params, stats.trainable_params, stats.n_units) == (1074, 1071, 2)
    for unit in units:
        numel, trainable = unit.layout(4)
        bound = UnitParams(unit.params).layout(4)
        assert numel <= bound[0] and trainable <= bound[1]
    # from counts the frozen elements fill the first units (36M of 40M here: nine units)
    assert [u.params for u in units_of_stats(MODEL)][-1] == ((4_000_000, True),)
    assert [u.params for u in units_of_stats(MODEL)][0] == ((0, True), (4_000_000, False))


def test_a_plan_is_frozen_and_needs_a_model() -> None:
    plan = plan_run(config(0, "none", "none"), CPU_BOX, stats=MODEL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.speculative = True            # type: ignore[misc]
    with pytest.raises(ValueError, match="units or its stats"):
        plan_run(config(0, "none", "none"), CPU_BOX)


def _pool_bytes(units: list[UnitParams], world: int, stage: int, itemsize: int,
                comm_itemsize: int, buffers: int) -> int:
    """The device gradient buffers the optimizer's pool allocates for ``units`` (the runtime's
    own arithmetic, not the planner's): each Unit lays its parameters out with ``flat_layout``
    in the compute dtype, and ``DeviceGradientPool`` takes ``collect_numel`` + the own shard of
    the largest (optim/device_gradients.py ``pool_buffer_numel``) in the communication dtype."""
    per = 0
    for unit in units:
        _, numel, trainable = flat_layout(unit.params, itemsize)
        if stage >= 1:
            shard = shard_numel(numel, world)
            per = max(per, world * shard + shard)
        else:
            per = max(per, trainable)
    return buffers * per * comm_itemsize


def _padded_units(world: int) -> list[UnitParams]:
    """Units whose elements are a whole number of shards unpadded, whose flat layout is not:
    a parameter off the 64-byte alignment, and a frozen one after the trainable range (padded
    to 4 KiB of fp32) -- the layout crosses into one more 2048-element shard a rank."""
    whole = world * 2048 * 5
    return [UnitParams(((whole - 5, True), (5, True)), ordered=True),
            UnitParams(((3, True), (whole - 3, False)), ordered=True),
            UnitParams(((1000, True),), ordered=True)]


def _aligned_units(world: int) -> list[UnitParams]:
    """Units with nothing to pad: every parameter a multiple of 4 KiB, whole shards."""
    whole = world * 2048 * 5
    return [UnitParams(((whole // 2, True), (whole // 2, True)), ordered=True),
            UnitParams(((4096, True),), ordered=True)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("comm", ["fp32", "bf16"])
@pytest.mark.parametrize("padded", [True, False])
def test_the_device_gradient_bytes_counted_are_the_bytes_reserved_and_bound_the_pool(
        stage: int, world: int, comm: str, padded: bool) -> None:
    """One count of the device gradient buffers (planner/sizes.py ``device_gradient_bytes``):
    what ``derive_sizes`` counts in the device budget (and chose two or one buffers by) is what
    ``engine_sizes`` reserves, from the units' padded layouts, and at least what the
    optimizer's pool allocates -- equal where the layout has no padding. (The largest unit's
    element count alone, as counted before, was below the pool where its layout is padded.)"""
    units = _padded_units(world) if padded else _aligned_units(world)
    param = "cpu" if stage == 3 else "none"
    opt = "cpu" if stage else "none"
    plan = plan_run(config(stage, param, opt, world_size=world, communication_data_type=comm,
                           infinity={"compute_dtype": "bf16", "early_step": "off",
                                     "device_memory_budget": 4 << 30}),
                    GPU_BOX, units=units)
    comm_itemsize = 4 if comm == "fp32" else 2
    buffers = plan.derived.device_grad_buffers
    pool = _pool_bytes(units, world, stage, 2, comm_itemsize, buffers)
    assert plan.derived.device_grad_bytes == plan.sizes.device_gradient_bytes >= pool > 0
    if not padded:
        assert plan.sizes.device_gradient_bytes == pool
    elif stage >= 1:                 # the elements alone: one 2048-element shard a rank short
        largest = max(sum(n for n, _ in u.params) for u in units)
        shard = shard_numel(largest, world)
        assert buffers * (world * shard + shard) * comm_itemsize < pool


def test_engine_sizes_refuses_a_reservation_above_what_the_plan_counted() -> None:
    """Derived sizes made for other units (the counts' single-parameter units) than the
    engine's (padded ones): the reservation would exceed the count; ``engine_sizes`` says so
    with both numbers instead of leaving it to the first backward."""
    units = _padded_units(2)
    cfg = config(3, "cpu", "cpu", world_size=2, communication_data_type="fp32",
                 infinity={"compute_dtype": "bf16", "early_step": "off",
                           "device_memory_budget": 4 << 30})
    stats = ModelStats.from_counts(2 * 20_480 + 1000, 20_480, 3)    # the same elements
    counted = derive_sizes(cfg, stats, GPU_BOX)                        # not told the units
    # counted: 2 x (2 x 10,240 + 10,240) x 4; reserved: shards of 12,288
    with pytest.raises(ValueError, match=r"reserves 294,912 bytes .* more than the 245,760"):
        plan_run(cfg, GPU_BOX, units=units, derived=counted)


def _device_use(plan, units: list[UnitParams]) -> int:
    """The device bytes a plan holds in backward (rank_memory's sum without activations): the
    resident states, a fetched unit, its prefetch, a unit's gradients and the gradient
    buffers as the engine reserves them."""
    lay, derived = plan.placement, plan.derived
    resident = sum(b for (_, tier), b in resident_bytes(lay).items() if tier == Tier.DEVICE)
    return resident + device_working(lay, derived.unit_device_bytes,
                                     derived.prefetch_device_bytes, 0, 0) \
        + plan.sizes.device_gradient_bytes


def test_a_plan_at_the_device_budgets_edge_holds_its_reservation() -> None:
    """The least device budget at which the plan keeps two gradient buffers beside a unit
    fetched ahead is exactly what it then holds: the reservation of the padded buffers fits
    (the buffers counted from the unpadded elements chose two at a budget 2 x 2048 x 3 x 4
    bytes short of them, and prefetched into those bytes); a byte less keeps one."""
    units = _padded_units(2)

    def plan(budget: int):
        return plan_run(config(3, "cpu", "cpu", world_size=2, communication_data_type="fp32",
                               infinity={"compute_dtype": "bf16", "early_step": "off",
                                         "device_memory_budget": budget}),
                        GPU_BOX, units=units)
    low = least_budget_with_two_gradient_buffers(plan)
    edge = plan(low)
    assert edge.derived.device_grad_buffers == 2 and plan(low - 1).derived.device_grad_buffers == 1
    # the prefetch takes the room counted for the unit fetched ahead: its bytes (with the shard
    # padding of every unit the bucket may hold) are at most that unit's reservation
    assert 0 < edge.derived.prefetch_device_bytes <= edge.derived.unit_device_bytes
    assert _device_use(edge, units) <= low
    assert _device_use(plan(low - 1), units) <= low - 1


def test_a_prefetch_bucket_the_user_set_that_leaves_no_room_for_the_gradient_buffers() -> None:
    """``stage3_prefetch_bucket_size`` set is taken as given: where the budget holds it and a
    fetched unit but not even one gradient buffer beside them, the plan says so, with the
    numbers and the prefetch that would fit (which then does, with no warning)."""
    stats = ModelStats.from_counts(400_000_000, 40_000_000, 10, 400_000_000)

    def cfg(prefetch: int) -> InfinityConfig:
        return InfinityConfig.from_dict({
            "zero_optimization": {
                "stage": 3, "stage3_prefetch_bucket_size": prefetch,
                "offload_param": {"device": "nvme", "nvme_path": "/swap"},
                "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}},
            "communication_data_type": "fp32",
            "infinity": {"compute_dtype": "bf16", "early_step": "off",
                         "device_memory_budget": 600 << 20}}, world_size=2)
    # a fetched 40M-element bf16 unit is padded to 40,001,536 elements, two shards of
    # 20,000,768: 80,003,072 B, and as much for its gradients; 629,145,600 B less both:
    # 469,139,456. The prefetch takes 400,000,000 of it and 4 x 2 x 2048 x 2 B of the shard
    # padding of the (at most 4) units it may hold: 400,032,768. One fp32 buffer of the unit's
    # two shards and its own is 3 x 20,000,768 x 4 = 240,009,216 B, so 229,130,240 B are left
    # for the prefetch: 114,556,928 elements and two units' padding (16,384 B)
    crowded = plan_memory(cfg(200_000_000), stats, GPU_BOX)
    message = ("zero_optimization.stage3_prefetch_bucket_size 200,000,000 elements (381.50 MiB)"
               " leaves 65.91 MiB of the device budget beside the resident states and a fetched "
               "unit, but the gradients reduced on the device need 228.89 MiB (1 fp32 buffer of "
               "the largest unit's gradient): lower stage3_prefetch_bucket_size to at most "
               "114,556,928 elements (or \"auto\"), or raise infinity.device_memory_budget by "
               "162.99 MiB")
    assert message in crowded.warnings and not crowded.fits
    assert crowded.sizes.prefetch_bucket_size == 200_000_000      # as given
    fitting = plan_memory(cfg(114_556_928), stats, GPU_BOX)
    assert fitting.sizes.device_room_warning == "" and fitting.sizes.device_grad_buffers == 1
    assert not any("stage3_prefetch_bucket_size" in w for w in fitting.warnings)
    assert plan_memory(cfg(114_556_929), stats, GPU_BOX).sizes.device_room_warning
    # a CPU device reduces no gradients on it: a DeepSpeed-sized bucket crowds nothing (it
    # warned that "0 B" were needed, mended by raising the budget "by 0 B")
    on_cpu = plan_memory(cfg(500_000_000), stats, CPU_BOX)
    assert on_cpu.sizes.device_grad_bytes == 0
    assert on_cpu.sizes.device_room_warning == ""
    assert not any("gradients reduced on the device" in w for w in on_cpu.warnings), on_cpu.warnings


class _SmallBlock(nn.Module):
    """A block of several small parameters (8 x 24, 24, 24 x 8, 8, and a norm's 8 and 8):
    432 elements, 464 on 64-byte boundaries, a 4 KiB flat buffer of 1,024 fp32 elements --
    more than twice its elements."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class _SmallParams(nn.Module):
    """Three small blocks and a head (one unit each); ``frozen``: the last two blocks' first
    layer frozen, so their frozen part starts after the trainable range padded to 4 KiB of
    fp32 (2,048 fp32 elements in all, the others' 1,024), while the counts, which take the
    frozen elements from the first units, see a whole frozen block and two trainable ones;
    ``width`` 37: odd sizes, every parameter padded to 64 bytes."""

    def __init__(self, width: int = 8, frozen: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_SmallBlock(width) for _ in range(3))
        self.head = nn.Linear(width, 1)
        if frozen:
            for block in self.blocks[1:]:
                block.up.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("model", ["small", "frozen", "odd"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_fetched_unit_is_counted_as_a_fetch_reserves_it(stage: int, world: int, model: str,
                                                          dtype: str) -> None:
    """The device bytes the planner counts for a fetched unit (``DerivedSizes.unit_device_bytes``,
    what ``device_working`` counts for the unit and its gradients) are at least what a fetch of
    the largest unit reserves (``Unit.nbytes`` of its padded layout and shards, through
    zero/unit.py ``flat_nbytes``): equal from the engine's units, an upper bound from the
    model's counts (``infinity plan``). The element count alone was below it."""
    torch.manual_seed(0)
    net = _SmallParams(width=37 if model == "odd" else 8, frozen=model == "frozen")
    specs = partition(net)
    groups = [{"params": [p for p in net.parameters() if p.requires_grad]}]
    group_of = param_group_of(groups)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    shards = world if stage >= 1 else 1
    reserved = max(flat_nbytes(grouped_params(spec.params, group_of), torch_dtype, shards)
                   for spec in specs)
    param = "cpu" if stage == 3 else "none"
    cfg = config(stage, param, "cpu" if stage else "none", world_size=world,
                 infinity={"compute_dtype": dtype, "device_memory_budget": 1 << 30})
    units = [u.params for u in unit_params(specs, groups)]
    engine = derive_sizes(cfg, stats_of_units(unit_params(specs, groups)), GPU_BOX, units=units)
    stats = ModelStats.from_module(net)
    counted = derive_sizes(cfg, stats, GPU_BOX)
    assert engine.unit_device_bytes == reserved
    assert counted.unit_device_bytes >= reserved
    itemsize = torch_dtype.itemsize
    assert itemsize * stats.largest_unit_params < reserved        # the count from elements


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_direct_fetch_prefetch_fits_the_device_budget_in_the_bytes_a_fetch_reserves(
        world: int) -> None:
    """NVMe reads into a CPU device's memory (direct fetch): the run plan widens the automatic
    prefetch to the room the fetch slots left; the prefetched units' bytes, with their shards'
    padding (``prefetch_bytes``), and a fetched unit with its gradients (``unit_device_bytes``
    twice) fit the device budget. Units of 1,000,003 elements are no whole number of shards:
    counted in elements, 2 ranks went 41,000 B over a budget of 3.5 units and 4 ranks 90,152."""
    unit = 1_000_003
    stats = ModelStats.from_counts(10 * unit, unit, 10, unit)
    for budget in (int(3.5 * 4 * unit), 8 * 4 * unit):
        cfg = config(3, "nvme", "cpu", world_size=world,
                     infinity={"compute_dtype": "fp32", "device_memory_budget": budget})
        plan = plan_run(cfg, CPU_BOX, stats=stats)
        assert plan.direct_fetch
        prefetch = plan.sizes.prefetch_bucket_numel
        held = prefetch_bytes(prefetch, [unit] * 10, world, 3, 4) \
            + 2 * plan.derived.unit_device_bytes
        assert held <= plan.sizes.device_budget, (budget, prefetch, held)
        assert prefetch >= unit      # a unit ahead at least: the budget holds 3.5 of them


class _Uneven(nn.Module):
    """An embedding (64 x 300), a 300 -> 63 layer and a head: at 4 ranks the last rank's
    shards of the small units are short or empty."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 300)
        self.layer = nn.Linear(300, 63)
        self.head = nn.Linear(63, 64)


@pytest.mark.parametrize("budget", ["1320KiB", "1560KiB", "2220KiB"])
@pytest.mark.parametrize("world", [3, 4])
def test_every_rank_plans_the_same_run(world: int, budget: str) -> None:
    """Each rank plans from its own shard ranges and must take every decision alike: sizes,
    buffers, the gradient home, the step schedule. The room rule took the largest range of its
    own rank (the last rank's short shards): at 4 ranks and 1320 KiB that rank alone kept 4
    parameter buffers (the others 1) and ran out of host memory at initialize, and the others
    died waiting at their first collective."""
    torch.manual_seed(0)
    net = _Uneven()
    specs = partition(net)
    groups = [{"params": list(net.parameters())}]
    units = unit_params(specs, groups)
    cfg = InfinityConfig.from_dict({
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": "/swap"},
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}},
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "infinity": {"compute_dtype": "fp32", "host_memory_budget": budget}},
        world_size=world)

    def decided(rank: int) -> tuple:
        plan = plan_run(cfg, CPU_BOX, stats=stats_of_units(units), units=units,
                        device_is_cpu=True, direct_reads=True, keeps_gradients=True, rank=rank)
        return (plan.optimizer.sub_group_numel, plan.sizes.sub_group_numel,
                plan.derived.param_buffer_count, plan.grad_tier, plan.boundary_steps,
                plan.sizes.persistence_threshold, plan.sizes.fetch_slots, plan.room)

    plans = [decided(rank) for rank in range(world)]
    assert all(p == plans[0] for p in plans), plans
