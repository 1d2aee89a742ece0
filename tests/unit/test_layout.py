"""What a checkpoint holds of an engine and in which order (checkpoint/layout.py), at unit level
on a real Unit: the file
names, the range each rank saves, where each part's values come from (master, parameters,
frozen ones or not), their file names and dtypes, the buffers and the aliases."""
from __future__ import annotations

import torch
from torch import nn

from infinity.checkpoint.layout import (
    MOMENTS, Placed, UnitLayout, aliases, model_file, optim_file, persistent_buffers,
    slice_name, unit_layouts)
from infinity.checkpoint.training_state import TrainingState
from infinity.optim.records import UnitOptimState
from infinity.zero.unit import Unit

from fakes import RecordingRun


def _unit(index: int = 0, dtype: torch.dtype = torch.float32) -> Unit:
    """a (group 0) at [0, 3000), b (group 1) at [3008, 4508), frozen d at [5120, 5620); 6144
    elements, so two ranks own [0, 4096) and [4096, 6144)."""
    named = [("a", nn.Parameter(torch.zeros(3000)), 0),
             ("b", nn.Parameter(torch.zeros(30, 50)), 1),
             ("d", nn.Parameter(torch.zeros(500), requires_grad=False), -1)]
    return Unit(index, f"u{index}", nn.Module(), named, dtype, torch.device("cpu"))


def _names(parts) -> list[tuple[str, int, int]]:
    return [(e.name, x, y) for e, x, y in parts]


def test_file_names_of_a_rank() -> None:
    assert model_file(0) == "rank0_model.safetensors"
    assert optim_file(3) == "rank3_optim.safetensors"
    assert slice_name("layer.w.exp_avg", 128) == "layer.w.exp_avg#128"
    assert MOMENTS == ("exp_avg", "exp_avg_sq")


def test_one_rank_saves_whole_parameters_under_their_names() -> None:
    unit = _unit()
    layout = UnitLayout(unit, None)
    assert layout.owned == (0, 6144)
    assert [e.name for e in layout.entries] == ["a", "b", "d"]
    assert [e.name for e in layout.trainable] == ["a", "b"]
    assert [e.name for e in layout.frozen] == ["d"]
    a, b, d = layout.entries
    assert layout.tensor_name((b, 3008, 4508)) == ("b", (30, 50))
    assert layout.tensor_name((a, 0, 3000), ".exp_avg") == ("a.exp_avg", (3000,))
    # the parameters are their own master: every entry from the parameters, in their dtype
    assert layout.master is None and layout.params is unit.flat
    [(placed, parts)] = layout.model_sources()
    assert placed == Placed(unit.flat, 0, (0, 6144))
    assert _names(parts) == [("a", 0, 3000), ("b", 3008, 4508), ("d", 5120, 5620)]
    assert layout.file_dtype(a) == torch.float32
    half = UnitLayout(_unit(dtype=torch.bfloat16), None)
    assert half.file_dtype(half.entries[0]) == torch.bfloat16


def test_two_ranks_save_slices_of_their_own_range() -> None:
    """[Note: checkpoints by parameter and slice]: rank r saves the parts in the r-th shard,
    as 1-D slices named by their first element."""
    unit = _unit()
    r0, r1 = UnitLayout(unit, None, rank=0, world_size=2), UnitLayout(unit, None, rank=1,
                                                                        world_size=2)
    assert r0.owned == (0, 4096) and r1.owned == (4096, 6144)
    [(_, parts0)] = r0.model_sources()
    [(_, parts1)] = r1.model_sources()
    assert _names(parts0) == [("a", 0, 3000), ("b", 3008, 4096)]
    assert _names(parts1) == [("b", 4096, 4508), ("d", 5120, 5620)]
    assert [r0.tensor_name(p) for p in parts0] == [("a#0", (3000,)), ("b#0", (1088,))]
    assert [r1.tensor_name(p, ".exp_avg") for p in parts1] == [("b.exp_avg#1088", (412,)),
                                                                ("d.exp_avg#0", (500,))]
    # the last rank's range ends at the unit's end, not past it
    r2 = UnitLayout(unit, None, rank=2, world_size=3)
    assert r2.owned == (4096, 6144)


def test_a_separate_master_saves_trainable_parameters_from_it() -> None:
    """With an fp32 master (a state over its shard [lo, hi)): the trainable parts from the
    master, in fp32, then the frozen ones from the parameters in their dtype; a save without
    frozen parameters leaves them out; parts are cut to what each place holds."""
    unit = _unit(dtype=torch.bfloat16)
    master = torch.zeros(4096)
    state = UnitOptimState(unit, None, None, master, None, shard=(0, 4096))
    layout = UnitLayout(unit, state, rank=0, world_size=1)
    assert layout.master is master
    assert layout.placed_state(master) == Placed(master, 0, (0, 4096))
    (pm, trainable), (pp, frozen) = layout.model_sources()
    assert pm == Placed(master, 0, (0, 4096)) and pp == Placed(unit.flat, 0, (0, 6144))
    assert _names(trainable) == [("a", 0, 3000), ("b", 3008, 4096)]
    assert _names(frozen) == [("d", 5120, 5620)]
    a, b, d = layout.entries
    assert layout.file_dtype(a) == torch.float32 and layout.file_dtype(d) == torch.bfloat16
    assert [e.name for e in layout.saved] == ["a", "b", "d"]
    lean = UnitLayout(unit, state, with_frozen=False)
    (pm2, trainable2), (pp2, frozen2) = lean.model_sources()
    assert (pm2, pp2) == (pm, pp) and frozen2 == [] and _names(trainable2) == _names(trainable)
    assert [e.name for e in lean.saved] == ["a", "b"]
    # without a master and without frozen parameters: the trainable ones from the parameters
    [(placed, parts)] = UnitLayout(unit, None, with_frozen=False).model_sources()
    assert placed.source is unit.flat and _names(parts) == [("a", 0, 3000), ("b", 3008, 4508)]


def test_a_state_of_the_second_shard_is_placed_at_its_range() -> None:
    unit = _unit()
    store = torch.zeros(2048)
    state = UnitOptimState(unit, None, None, store, None, shard=(4096, 6144))
    layout = UnitLayout(unit, state, rank=1, world_size=2)
    placed = layout.placed_state(store)
    assert placed == Placed(store, 4096, (4096, 6144))
    assert _names(layout.saved_parts(placed, layout.trainable)) == [("b", 4096, 4508)]
    # a place holding less than the rank owns: the parts are cut to the place
    narrow = Placed(store, 4096, (4096, 4200))
    assert _names(layout.saved_parts(narrow, layout.trainable)) == [("b", 4096, 4200)]
    wide = Placed(store, 0, (0, 6144))
    assert _names(layout.saved_parts(wide, layout.entries)) == [("b", 4096, 4508),
                                                                 ("d", 5120, 5620)]


class _Comm:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def _training_state(units, unit_states, comm=None, dtype=torch.bfloat16) -> TrainingState:
    return TrainingState(
        module=nn.Module(), units=units, unit_states=unit_states, param_groups=[],
        lr_scheduler=None, loss_scaler=None, global_steps=0, micro_steps=0, skipped_steps=0,
        stage=3, compute_dtype=dtype, gradient_accumulation_steps=1, speculation_pays=None,
        backwards_since_step=0, manager=None, lendable_pools=[], run=RecordingRun(), comm=comm)


def test_unit_layouts_pair_each_unit_with_its_state_rank_and_world() -> None:
    """Every unit in order, with the optimizer state of the same unit index (None for a unit
    without one), the training state's rank and world size, and ``with_frozen``."""
    u0, u1, u2 = _unit(0), _unit(1), _unit(2)
    s2 = UnitOptimState(u2, None, None, None, None)
    s0 = UnitOptimState(u0, None, None, None, None)
    layouts = unit_layouts(_training_state([u0, u1, u2], [s2, s0], _Comm(1, 2)))
    assert [(lay.unit, lay.state) for lay in layouts] == [(u0, s0), (u1, None), (u2, s2)]
    assert all(lay.rank == 1 and lay.world_size == 2 and lay.with_frozen for lay in layouts)
    lean = unit_layouts(_training_state([u0], [s0]), with_frozen=False)
    assert [(lay.rank, lay.world_size, lay.with_frozen) for lay in lean] == [(0, 1, False)]


def test_training_state_rank_world_and_dtype_name() -> None:
    one = _training_state([], [])
    assert (one.rank, one.world_size, one.compute_dtype_name) == (0, 1, "bfloat16")
    two = _training_state([], [], _Comm(1, 2), dtype=torch.float16)
    assert (two.rank, two.world_size, two.compute_dtype_name) == (1, 2, "float16")


class _Shared(nn.Module):
    def __init__(self, buf: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", buf)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = torch.arange(3.0)
        self.first = _Shared(shared)
        self.second = _Shared(shared)
        self.embed = nn.Embedding(4, 2)
        self.head = nn.Linear(2, 4, bias=False)
        self.head.weight = self.embed.weight          # tied
        self.register_buffer("own", torch.ones(1))


def test_persistent_buffers_are_saved_once_under_their_first_name() -> None:
    model = _Model()
    found = persistent_buffers(model)
    assert [name for name, _ in found] == ["own", "first.table"]
    assert found[1][1] is model.first.table


def test_aliases_map_other_names_of_tied_parameters_and_shared_buffers() -> None:
    """The other names of a tied parameter point at the name its unit saves it under, those
    of a shared buffer at its first name; a name that is its own canonical is no alias."""
    model = _Model()
    unit = Unit(0, "u", model, [("embed.weight", model.embed.weight, 0)], torch.float32,
                torch.device("cpu"))
    assert aliases(model, [unit]) == {"head.weight": "embed.weight",
                                      "second.table": "first.table"}
    # the unit owning it under the head's name: the embedding's name is the alias
    unit = Unit(0, "u", model, [("head.weight", model.head.weight, 0)], torch.float32,
                torch.device("cpu"))
    assert aliases(model, [unit]) == {"embed.weight": "head.weight",
                                      "second.table": "first.table"}
    assert aliases(nn.Linear(2, 2), []) == {}
