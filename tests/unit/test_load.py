"""A checkpoint loaded into an engine's homes (checkpoint/load.py), at unit level. A real checkpoint is written by
``save_checkpoint`` from real Units and optimizer states (host and NVMe homes), then loaded into
another set holding other values: every value, step count and buffer comes back; names found
through tied parameters and saved aliases; frozen parameters left out; and each way a
checkpoint can fail to fit (shapes, missing and unexpected names, groups, Adam states, step
counts, buffers) refused before anything is written, or warned about and skipped."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from infinity.checkpoint.directory import resummed
from infinity.base.budget import MemoryBudget
from infinity.checkpoint.pinned import PinnedSave
from infinity.checkpoint.load import CheckpointLoad, prepare_load
from infinity.checkpoint.save import save_checkpoint
from infinity.checkpoint.tensor_file import CheckpointError
from infinity.checkpoint.training_state import TrainingState
from infinity.optim.records import UnitOptimState
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.unit import Unit

from fakes import RecordingRun

SHAPES = {"a": (2, 3), "b": (4,), "c": (3,), "frozen": (5,)}
GROUPS = {"a": 0, "b": 1, "c": 1, "frozen": -1}


class _Model(nn.Module):
    def __init__(self, seed: float, shapes: dict) -> None:
        super().__init__()
        for i, (name, shape) in enumerate(shapes.items()):
            values = torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 10 * i
            setattr(self, name, nn.Parameter(values * seed))
        self.register_buffer("running", torch.tensor([1.0, 2.0]) * seed)
        self.register_buffer("scratch", torch.zeros(1), persistent=False)


class Rig:
    """An engine's parts as a load sees them: u0 holds a and frozen (in memory for good), u1
    holds b and c (released to ``home``); Adam states in ``home`` (an fp32 master too when the
    units compute in bf16), every value a multiple of ``seed``."""

    def __init__(self, seed: float, home: Tier = Tier.HOST, nvme: Path | None = None,
                 dtype: torch.dtype = torch.float32, names: dict | None = None,
                 groups: dict | None = None, shapes: dict | None = None,
                 drop: tuple = (), n_groups: int = 2, steps: int | None = 3, extra: int = 0,
                 u0: tuple = ("a", "frozen"), doubled: bool = False, lend: bool = False,
                 comm=None, tie: bool = False, buffers: dict | None = None,
                 scheduler=None) -> None:
        self.log: list = []
        shapes = dict(SHAPES, **(shapes or {}))
        groups = dict(GROUPS, **(groups or {}))
        for i in range(extra):                     # e0, e1, ... in u1, group 1
            shapes.setdefault(f"e{i}", (2,))
            groups.setdefault(f"e{i}", 1)
        names = names or {}
        self.model = _Model(seed, shapes)
        if tie:
            self.model.tied_b = self.model.b       # b under a second name
        for name, shape in (buffers or {}).items():
            self.model.register_buffer(name, torch.zeros(shape))
        self.manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                                   nvme_path=None if nvme is None else str(nvme))
        sharded = {} if comm is None else {"comm": comm, "shards": comm.world_size,
                                           "params_sharded": True}

        def unit(index: int, members: list[str]) -> Unit:
            named = [(names.get(n, n), getattr(self.model, n), groups[n]) for n in members
                     if n not in drop]
            return Unit(index, f"u{index}", self.model, named, dtype, torch.device("cpu"),
                        **sharded)

        self.units = [unit(0, list(u0)),
                      unit(1, ["b", "c"] + [f"e{i}" for i in range(extra)])]
        initial = {id(p): p.detach().float().reshape(-1).clone()
                   for p in self.model.parameters()}
        self.units[0].adopt(self.manager, Tier.DEVICE, persistent=True)
        self.units[1].adopt(self.manager, home, persistent=False, doubled=doubled)
        self.states = []
        for u in self.units:
            lo, hi = (0, u.trainable_numel) if comm is None else \
                (min(u.shard_start, u.trainable_numel),
                 min(u.shard_start + u.shard_numel, u.trainable_numel))
            stores = {}
            for what in ("exp_avg", "exp_avg_sq") + (("master",) if dtype != torch.float32
                                                     else ()):
                store = self.manager.create(f"{u.name}.{what}", max(hi - lo, 1), torch.float32,
                                            home)
                values = torch.zeros(lo + store.padded)
                for e in u.params:
                    if e.trainable:
                        src = initial[id(e.param)] if what == "master" else \
                            _moment(seed, what, e.numel)
                        values[e.offset:e.offset + e.numel] = src[:max(0, values.numel()
                                                                       - e.offset)]
                _put(self.manager, store, values[lo:])
                stores[what] = store
            state = UnitOptimState(u, stores["exp_avg"], stores["exp_avg_sq"],
                                   stores.get("master"), None,
                                   shard=None if comm is None else (lo, hi))
            state.param_steps = {} if steps is None else {
                e.offset: steps + i for i, e in enumerate(u.params) if e.trainable}
            state.step = max(state.param_steps.values(), default=0)
            self.states.append(state)
        self.lent = BufferPool(self.manager, 8192, 3, "lent") if lend else None
        self.state = TrainingState(
            module=self.model, units=self.units, unit_states=self.states,
            param_groups=[{"params": [], "lr": 0.1 * (g + 1)} for g in range(n_groups)],
            lr_scheduler=scheduler, loss_scaler=None, global_steps=7, micro_steps=7, skipped_steps=1,
            stage=3, compute_dtype=dtype, gradient_accumulation_steps=1, speculation_pays=None,
            backwards_since_step=0, manager=self.manager, lendable_pools=[self.lent],
            run=RecordingRun(self.log), comm=comm)

    def close(self) -> None:
        self.manager.close()

    def entry(self, name: str):
        return next((u, e) for u in self.units for e in u.params if e.name == name)

    def param(self, name: str) -> torch.Tensor:
        """A parameter's values in its home (u1's is released: read from its store)."""
        u, e = self.entry(name)
        if u.param_store is None:
            flat = u.flat
        else:
            flat = _get(self.manager, u.param_store)
        return flat[e.offset:e.offset + e.numel].float()

    def moment(self, name: str, what: str) -> torch.Tensor:
        u, e = self.entry(name)
        store = getattr(self.states[u.index], what)
        return _get(self.manager, store)[e.offset:e.offset + e.numel]

    def steps(self, name: str) -> int:
        u, e = self.entry(name)
        return self.states[u.index].param_steps[e.offset]


def _moment(seed: float, what: str, numel: int) -> torch.Tensor:
    """A parameter's moment as a rig holds it: element i is seed * (2 or 3) + i / 4."""
    return seed * (2 if what == "exp_avg" else 3) + torch.arange(float(numel)) / 4


def _put(manager: TierManager, store, values: torch.Tensor) -> None:
    if store.resident:
        store.tensor.copy_(values.to(store.dtype))
        return
    from infinity.io import aligned_empty

    buf = aligned_empty(store.nbytes).view(store.dtype)
    buf.copy_(values.to(store.dtype))
    manager.wait(store.store_async(buf))


def _get(manager: TierManager, store) -> torch.Tensor:
    if store.resident:
        return store.tensor.clone()
    from infinity.io import aligned_empty

    buf = aligned_empty(store.nbytes).view(store.dtype)
    manager.wait(store.load_async(buf))
    return buf.clone()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(*args, **kwargs) -> Rig:
        made.append(Rig(*args, **kwargs))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def _saved(rig: Rig, directory: Path, **kwargs) -> Path:
    return save_checkpoint(rig.state, directory, tag="step7", client_state={"epoch": 2},
                           **kwargs)


def _load(rig: Rig, directory: Path, **kwargs) -> CheckpointLoad:
    load = prepare_load(rig.state, directory, **kwargs)
    assert load is not None
    with load:
        load.write()
    return load


def _edit(directory: Path, change) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(resummed(manifest)))


def _refused(rig: Rig, directory: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        prepare_load(rig.state, directory, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("home", [Tier.HOST, Tier.NVME])
def test_a_checkpoint_loads_every_value_back(tmp_path: Path, disk_dir: Path, rigs,
                                             home: Tier) -> None:
    """Parameters, moments, step counts, the unit's step, buffers and client_state, into
    homes that held other values; the engine asked, flushed and its units released; a save
    directory's latest is found."""
    old = rigs(1.0, home, disk_dir)
    _saved(old, tmp_path)
    new = rigs(5.0, home, disk_dir, steps=40)
    load = _load(new, tmp_path)
    for name in ("a", "b", "c", "frozen"):
        assert torch.equal(new.param(name), old.param(name)), name
    for name in ("a", "b", "c"):
        for what in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new.moment(name, what), old.moment(name, what)), (name, what)
    assert [new.steps(n) for n in ("a", "b", "c")] == [3, 3, 4]
    assert [s.step for s in new.states] == [3, 4]
    assert torch.equal(new.model.running, torch.tensor([1.0, 2.0]))
    assert load.client_state == {"epoch": 2}
    assert load.restore is not None and load.restore.global_steps == 7
    assert new.log == [("open", "load_checkpoint"), ("flush",), ("release",)]
    assert load.model is None and load.optim is None        # closed on leaving


def test_without_latest_nothing_is_loaded(tmp_path: Path, rigs, infinity_log) -> None:
    rig = rigs(1.0)
    assert prepare_load(rig.state, tmp_path) is None
    assert f"no {tmp_path}/latest: no checkpoint loaded (pass tag= to load a given one)" in \
        infinity_log.text


def test_a_tag_and_a_checkpoint_directory_are_loaded(tmp_path: Path, rigs) -> None:
    old = rigs(1.0)
    directory = _saved(old, tmp_path, save_latest=False)
    new = rigs(2.0)
    _load(new, tmp_path, tag="step7")
    assert torch.equal(new.param("b"), old.param("b"))
    other = rigs(3.0)
    _load(other, directory)
    assert torch.equal(other.param("b"), old.param("b"))


def test_a_bf16_engine_loads_its_master_and_casts_its_parameters(tmp_path: Path, disk_dir: Path,
                                                                 rigs) -> None:
    """The files hold the fp32 master; a bf16 engine's master gets them exactly, its
    parameters as bf16 (cast while read); an fp32 engine loads the same file."""
    old = rigs(1.0, Tier.NVME, disk_dir, dtype=torch.bfloat16)
    _saved(old, tmp_path)
    new = rigs(5.0, Tier.NVME, disk_dir, dtype=torch.bfloat16)
    _load(new, tmp_path)
    for name in ("a", "b", "c"):
        assert torch.equal(new.moment(name, "master"), old.moment(name, "master"))
        assert torch.equal(new.param(name), old.param(name))
    fp32 = rigs(5.0)
    _load(fp32, tmp_path)
    assert torch.equal(fp32.param("c"), old.moment("c", "master"))


def test_module_only_loads_parameters_and_buffers(tmp_path: Path, rigs) -> None:
    """load_module_only: no restore, moments and step counts kept, the optimizer files not
    even read (a damaged one is no matter)."""
    old = rigs(1.0)
    directory = _saved(old, tmp_path)
    (directory / "rank0_optim.safetensors").write_bytes(b"damaged")
    new = rigs(5.0, steps=40)
    load = _load(new, tmp_path, load_module_only=True)
    assert load.restore is None
    assert torch.equal(new.param("a"), old.param("a"))
    assert torch.equal(new.moment("a", "exp_avg"), _moment(5.0, "exp_avg", 6))
    assert new.steps("a") == 40
    assert torch.equal(new.model.running, torch.tensor([1.0, 2.0]))


def test_without_optimizer_states_the_moments_are_kept(tmp_path: Path, rigs) -> None:
    old = rigs(1.0)
    directory = _saved(old, tmp_path)
    (directory / "rank0_optim.safetensors").write_bytes(b"damaged")
    new = rigs(5.0, steps=40)
    load = _load(new, tmp_path, load_optimizer_states=False)
    assert load.restore is not None and load.restore.param_groups is None
    assert torch.equal(new.param("b"), old.param("b"))
    assert torch.equal(new.moment("b", "exp_avg_sq"), _moment(5.0, "exp_avg_sq", 4))
    assert new.steps("b") == 40


def test_a_damaged_file_is_refused_unless_checksums_are_skipped(tmp_path: Path, rigs) -> None:
    old = rigs(1.0)
    directory = _saved(old, tmp_path)
    path = directory / "rank0_optim.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    new = rigs(5.0)
    assert "rank0_optim.safetensors" in _refused(new, tmp_path)
    assert new.log == [("open", "load_checkpoint"), ("flush",)]     # nothing released
    _load(new, tmp_path, verify_checksums=False)
    assert torch.equal(new.param("b"), old.param("b"))


def test_names_are_found_through_tied_names_and_saved_aliases(tmp_path: Path, rigs) -> None:
    """A unit entry named otherwise than the module's name of its parameter loads from the
    module's name; a checkpoint that saved it under another name maps it by its aliases."""
    old = rigs(1.0, names={"b": "b_saved"})
    directory = _saved(old, tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["aliases"] == {"b": "b_saved"}
    new = rigs(5.0, names={"b": "b_new"})
    _load(new, tmp_path)
    assert torch.equal(new.param("b_new"), old.param("b_saved"))
    assert torch.equal(new.moment("b_new", "exp_avg"), old.moment("b_saved", "exp_avg"))
    plain = rigs(6.0)
    _load(plain, tmp_path)
    assert torch.equal(plain.param("b"), old.param("b_saved"))


def test_frozen_parameters_left_out_of_a_save_keep_their_values(tmp_path: Path, rigs) -> None:
    old = rigs(1.0)
    _saved(old, tmp_path, exclude_frozen_parameters=True)
    new = rigs(5.0)
    _load(new, tmp_path)
    assert torch.equal(new.param("frozen"), torch.arange(5.0) * 5 + 150)
    assert torch.equal(new.param("a"), old.param("a"))


def test_a_trainable_parameter_missing_from_a_frozen_less_save_is_still_missing(
        tmp_path: Path, rigs) -> None:
    """frozen_excluded excuses frozen parameters only."""
    _saved(rigs(1.0, drop=("c",)), tmp_path, exclude_frozen_parameters=True)
    message = _refused(rigs(5.0), tmp_path)
    assert message == (f"checkpoint {tmp_path / 'step7'} does not match the model: 1 of the "
                       "model's parameters are not in it (c): it was saved with "
                       "exclude_frozen_parameters=True, which leaves out the parameters frozen "
                       "at the save. Pass load_module_strict=False to load what matches")


def test_missing_frozen_parameters_are_missing_in_a_whole_save(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0, drop=("frozen",)), tmp_path)
    assert "1 of the model's parameters are not in it (frozen)" in _refused(rigs(5.0), tmp_path)


def test_shapes_that_differ_are_refused_naming_both(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0), tmp_path)
    message = _refused(rigs(5.0, shapes={"b": (5,), "a": (3, 2)}), tmp_path)
    assert message == (f"checkpoint {tmp_path / 'step7'} does not fit the model: shapes differ "
                       "for 2 parameter(s): a: checkpoint [2, 3], model [3, 2]; b: checkpoint "
                       "[4], model [5]")
    _saved(rigs(1.0), tmp_path / "x")
    assert "shapes differ" in _refused(rigs(5.0, shapes={"b": (5,)}), tmp_path / "x",
                                       load_module_strict=False)


def test_missing_and_unexpected_names_refused_when_strict(tmp_path: Path, rigs) -> None:
    directory = _saved(rigs(1.0, drop=("c",), names={"b": "b_old"}), tmp_path)
    _edit(directory, lambda m: m["aliases"].clear())   # b_old no longer found as b
    message = _refused(rigs(5.0, names={"b": "b_old2"}), tmp_path)
    assert message == (f"checkpoint {tmp_path / 'step7'} does not match the model: 2 of the "
                       "model's parameters are not in it (b_old2, c); 1 of its parameters are "
                       "not in the model (b_old). Pass load_module_strict=False to load what "
                       "matches")


def test_not_strict_loads_what_matches_and_warns(tmp_path: Path, disk_dir: Path, rigs,
                                                 infinity_log) -> None:
    """A parameter missing from the checkpoint keeps its value, also in an NVMe home where
    it shares a chunk with one that loads (the chunk is read before it is filled), and so do
    its moments; one the model lacks is skipped; each named in a warning."""
    old = rigs(1.0, Tier.NVME, disk_dir, drop=("c",), names={"b": "b_old"})
    directory = _saved(old, tmp_path)
    _edit(directory, lambda m: m["aliases"].clear())
    new = rigs(5.0, Tier.NVME, disk_dir, steps=40)
    c_before, c_moment = new.param("c").clone(), new.moment("c", "exp_avg").clone()
    _load(new, tmp_path, load_module_strict=False, load_optimizer_states=False)
    assert torch.equal(new.param("c"), c_before) and torch.equal(new.param("a"), old.param("a"))
    assert torch.equal(new.moment("c", "exp_avg"), c_moment)
    warnings = [r.getMessage() for r in infinity_log.records if r.levelname == "WARNING"]
    where = tmp_path / "step7"
    assert f"loading {where}: 2 of the model's parameters are not in it (b, c); those keep " \
           "their current values" in warnings
    assert f"loading {where}: 1 of its parameters are not in the model (b_old); those keep " \
           "their current values" in warnings


def test_a_partial_unit_keeps_the_moments_of_what_is_not_loaded(tmp_path: Path, disk_dir: Path,
                                                                rigs) -> None:
    """Optimizer states with a parameter missing: the loaded one's moments and steps come
    back, the missing one's moments stay (NVMe chunks merged, not zeroed)."""
    old = rigs(1.0, Tier.NVME, disk_dir, drop=("c",))
    _saved(old, tmp_path)
    new = rigs(5.0, Tier.NVME, disk_dir, steps=40)
    c_moment = new.moment("c", "exp_avg_sq").clone()
    _load(new, tmp_path, load_module_strict=False)
    assert torch.equal(new.moment("b", "exp_avg_sq"), old.moment("b", "exp_avg_sq"))
    assert torch.equal(new.moment("c", "exp_avg_sq"), c_moment)
    assert new.steps("b") == 3 and new.steps("c") == 41


def test_five_names_at_most_in_a_mismatch(tmp_path: Path, rigs) -> None:
    """Missing names in the units' order; of 6 unexpected names the first 5."""
    directory = _saved(rigs(1.0, drop=("a", "b", "c")), tmp_path)
    _edit(directory, lambda m: m["params"].update({f"x{i}": {"shape": [1]} for i in range(6)}))
    message = _refused(rigs(5.0), tmp_path)
    assert "3 of the model's parameters are not in it (a, b, c)" in message
    assert "6 of its parameters are not in the model (x0, x1, x2, x3, x4). Pass" in message


def test_a_different_number_of_groups_is_refused(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0), tmp_path)
    assert _refused(rigs(5.0, n_groups=3), tmp_path) == (
        f"checkpoint {tmp_path / 'step7'} has 2 optimizer param group(s), the engine 3: build "
        "the engine with the same groups, or pass load_optimizer_states=False to load the model "
        "only")
    _load(rigs(5.0, n_groups=3), tmp_path, load_optimizer_states=False)


def test_a_parameter_frozen_when_saved_has_no_adam_states(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0, groups={"b": -1}), tmp_path)
    assert _refused(rigs(5.0), tmp_path) == (
        f"checkpoint {tmp_path / 'step7'} has no Adam states for 1 trainable parameter(s) (b): "
        "they were frozen when it was saved. Pass load_optimizer_states=False to load the "
        "model only")


def test_a_parameter_in_another_group_is_refused(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0), tmp_path)
    message = _refused(rigs(5.0, groups={"c": 0}), tmp_path)
    assert message.startswith(
        f"checkpoint {tmp_path / 'step7'}: 1 parameter(s) are in another optimizer param "
        "group than when it was saved (c (group 1 then, 0 now)), and the groups' settings")


def test_a_parameter_without_a_group_in_the_manifest_is_not_moved(tmp_path: Path, rigs) -> None:
    """A manifest entry without "group" is taken as the engine's group."""
    old = rigs(1.0)
    directory = _saved(old, tmp_path)
    _edit(directory, lambda m: m["params"]["c"].pop("group"))
    new = rigs(5.0, groups={"c": 0})
    _load(new, tmp_path)
    assert torch.equal(new.moment("c", "exp_avg"), old.moment("c", "exp_avg"))


@pytest.mark.parametrize("damage", ["steps", "entry"])
def test_a_step_count_that_is_missing_or_not_an_integer_is_refused(tmp_path: Path, rigs,
                                                                   damage: str) -> None:
    directory = _saved(rigs(1.0), tmp_path)

    def change(m: dict) -> None:
        if damage == "steps":
            m["params"]["b"]["steps"] = "3"
        else:
            m["params"]["b"] = [4]
    _edit(directory, change)
    assert _refused(rigs(5.0), tmp_path) == (
        f"checkpoint {tmp_path / 'step7'}: its manifest.json has no step count for 1 "
        "parameter(s) (b) although its tensor files hold them: the manifest was edited or "
        "damaged. Load another checkpoint, or pass load_optimizer_states=False to load the "
        "model only")


def test_a_missing_step_count_is_zero(tmp_path: Path, rigs) -> None:
    directory = _saved(rigs(1.0), tmp_path)
    _edit(directory, lambda m: m["params"]["b"].pop("steps"))
    new = rigs(5.0, steps=40)
    _load(new, tmp_path)
    assert new.steps("b") == 0 and new.steps("c") == 4 and new.states[1].step == 4


def test_buffers_that_do_not_fit_are_refused(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0), tmp_path)
    new = rigs(5.0)
    new.model.running = torch.zeros(3)
    assert _refused(new, tmp_path, load_module_strict=False) == (
        f"checkpoint {tmp_path / 'step7'} does not match the model's buffers: running: "
        "checkpoint [2], model [3]")


def test_a_missing_buffer_is_refused_when_strict_and_kept_when_not(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0), tmp_path)
    new = rigs(5.0)
    new.model.register_buffer("extra", torch.full((2,), 9.0))
    assert _refused(new, tmp_path) == (
        f"checkpoint {tmp_path / 'step7'} does not match the model's buffers: missing extra")
    _load(new, tmp_path, load_module_strict=False)
    assert torch.equal(new.model.extra, torch.full((2,), 9.0))
    assert torch.equal(new.model.running, torch.tensor([1.0, 2.0]))


def test_a_load_refused_closes_its_files(tmp_path: Path, rigs, monkeypatch) -> None:
    """A check that fails after the files were opened closes them (no fd left behind)."""
    import os

    _saved(rigs(1.0), tmp_path)
    new = rigs(5.0, n_groups=1)
    before = set(os.listdir("/proc/self/fd"))
    _refused(new, tmp_path)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_write_before_check_is_a_programming_error(tmp_path: Path, rigs) -> None:
    rig = rigs(1.0)
    directory = _saved(rig, tmp_path)
    load = CheckpointLoad(rig.state, PinnedSave(directory), None)
    with pytest.raises(AssertionError, match="check\\(\\) first"):
        load.write()
    load.close()


# -- aliases, partial loads, other ranks, and refusals that list five ----------------------------

class _Comm:
    """Rank ``rank`` of two; the other rank always succeeds, with this rank's result (it
    opened the same save)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, 2

    def all_gather_objects(self, value):
        other = (value[0], None)
        return [value, other] if self.rank == 0 else [other, value]


def test_a_manifest_without_aliases_loads(tmp_path: Path, rigs) -> None:
    old = rigs(1.0)
    directory = _saved(old, tmp_path)
    _edit(directory, lambda m: m.pop("aliases"))
    new = rigs(5.0)
    _load(new, tmp_path)
    assert torch.equal(new.param("b"), old.param("b"))


def test_a_tied_parameter_is_found_under_its_other_name(tmp_path: Path, rigs) -> None:
    """b is also the module's tied_b; saved under tied_b with no alias recorded, it loads
    into the unit entry named b through the module's other name for it."""
    old = rigs(1.0, tie=True, names={"b": "tied_b"})
    directory = _saved(old, tmp_path)
    _edit(directory, lambda m: m["aliases"].clear())
    new = rigs(5.0, tie=True)
    _load(new, tmp_path)
    assert torch.equal(new.param("b"), old.param("tied_b"))


def test_a_frozen_parameter_left_out_does_not_stop_the_rest_of_its_unit(tmp_path: Path,
                                                                         rigs) -> None:
    """Saved without frozen parameters; now u0 holds frozen then a (frozen now, trainable
    then, so in the checkpoint): a still loads after the skipped one."""
    old = rigs(1.0)
    _saved(old, tmp_path, exclude_frozen_parameters=True)
    new = rigs(5.0, u0=("frozen", "a"), groups={"a": -1})
    _load(new, tmp_path)
    assert torch.equal(new.param("a"), old.param("a"))
    assert torch.equal(new.param("frozen"), torch.arange(5.0) * 5 + 150)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_parameter_missing_between_loaded_ones_keeps_its_values(tmp_path: Path, disk_dir: Path,
                                                                  rigs, dtype) -> None:
    """u1 holds b, c, e0 in one NVMe chunk; the checkpoint lacks c: its parameter, master
    and moments keep their values (the chunk is read before it is filled), b and e0 load."""
    old = rigs(1.0, Tier.NVME, disk_dir, dtype=dtype, extra=1, drop=("c",))
    _saved(old, tmp_path)
    new = rigs(5.0, Tier.NVME, disk_dir, dtype=dtype, extra=1)
    kept = {what: new.moment("c", what).clone() for what in
            ("exp_avg", "exp_avg_sq") + (("master",) if dtype != torch.float32 else ())}
    c = new.param("c").clone()
    _load(new, tmp_path, load_module_strict=False)
    assert torch.equal(new.param("c"), c) and c.abs().sum() > 0
    for what, values in kept.items():
        assert torch.equal(new.moment("c", what), values), what
    assert torch.equal(new.param("e0"), old.param("e0"))
    assert torch.equal(new.moment("e0", "exp_avg"), old.moment("e0", "exp_avg"))


def test_a_whole_load_reads_nothing_from_the_homes_it_overwrites(tmp_path: Path, disk_dir: Path,
                                                                 rigs) -> None:
    """Every parameter, master and moment loaded: the NVMe chunks are zeroed and filled, not
    read first (a read of every chunk would double the load's I/O)."""
    old = rigs(1.0, Tier.NVME, disk_dir, dtype=torch.bfloat16, extra=1)
    _saved(old, tmp_path)
    new = rigs(5.0, Tier.NVME, disk_dir, dtype=torch.bfloat16, extra=1)
    load = prepare_load(new.state, tmp_path)
    before = new.manager.counters.nvme_read_bytes
    with load:
        load.write()
    assert new.manager.counters.nvme_read_bytes == before
    assert new.manager.counters.nvme_write_bytes > 0
    assert torch.equal(new.moment("c", "master"), old.moment("c", "master"))


def test_a_doubled_home_gets_the_values_in_both_extents(tmp_path: Path, disk_dir: Path,
                                                        rigs) -> None:
    """A speculative step's parameter store has a shadow extent: the load writes both, so a
    flip after the load shows the checkpoint's values too."""
    old = rigs(1.0)
    _saved(old, tmp_path)
    new = rigs(5.0, Tier.NVME, disk_dir, doubled=True)
    _load(new, tmp_path)
    store = new.units[1].param_store
    assert store.doubled
    _, b = new.entry("b")
    from infinity.io import aligned_empty

    shadow = aligned_empty(store.nbytes).view(store.dtype)
    new.manager.wait(store.load_async(shadow, shadow=True))
    assert torch.equal(shadow[b.offset:b.offset + b.numel], old.param("b"))
    assert torch.equal(new.param("b"), old.param("b"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_parameter_over_several_chunks_loads_each_from_its_own_elements(
        tmp_path: Path, disk_dir: Path, rigs, dtype) -> None:
    """b (3000 elements) crosses chunks of a lent 8 KiB pool: each chunk is filled from the
    file tensor's elements at its place, also when the values are cast (bf16 parameters
    from an fp32 master file)."""
    old = rigs(1.0, Tier.NVME, disk_dir, dtype=dtype, shapes={"b": (3000,)})
    _saved(old, tmp_path)
    new = rigs(5.0, Tier.NVME, disk_dir, dtype=dtype, shapes={"b": (3000,)}, lend=True)
    _load(new, tmp_path)
    assert torch.equal(new.param("b"), old.param("b"))
    assert torch.equal(new.moment("b", "exp_avg"), old.moment("b", "exp_avg"))


def test_a_fresh_engine_that_loads_none_of_a_units_parameters_keeps_step_zero(
        tmp_path: Path, rigs) -> None:
    """No step taken yet (no step counts), and none of u1's parameters in the checkpoint
    (non-strict): u1's step stays 0; u0's comes from the checkpoint."""
    directory = _saved(rigs(1.0, names={"b": "b_x", "c": "c_x"}), tmp_path)
    _edit(directory, lambda m: m["aliases"].clear())
    new = rigs(5.0, steps=None)
    _load(new, tmp_path, load_module_strict=False)
    assert new.states[1].step == 0 and new.states[1].param_steps == {}
    assert new.states[0].step == 3


def test_rank_one_of_two_loads_its_shard(tmp_path: Path, rigs) -> None:
    """Rank 1 of 2 (a checkpoint saved by one rank): its parameter home holds the unit's
    elements [2048, 4096), its master and moments [2048, trainable end): each is filled from
    the checkpoint at its own place in the unit."""
    old = rigs(1.0, dtype=torch.bfloat16, shapes={"b": (3000,)})
    _saved(old, tmp_path)
    new = rigs(5.0, dtype=torch.bfloat16, shapes={"b": (3000,)}, comm=_Comm(1))
    _load(new, tmp_path)
    u1, st = new.units[1], new.states[1]
    _, b = new.entry("b")
    _, c = new.entry("c")
    assert u1.home_start == 2048 and (st.lo, st.hi) == (2048, 3072)  # trainable end, padded
    home = u1.param_store.tensor.float()
    assert torch.equal(home[:3000 - 2048], old.param("b")[2048:])
    assert torch.equal(home[c.offset - 2048:c.offset - 2048 + 3], old.param("c"))
    master = st.master.tensor
    assert torch.equal(master[:952], old.moment("b", "master")[2048:])
    assert torch.equal(master[c.offset - 2048:c.offset - 2045], old.moment("c", "master"))
    assert torch.equal(st.exp_avg.tensor[:952], _moment(1.0, "exp_avg", 3000)[2048:])
    assert torch.equal(st.exp_avg_sq.tensor[c.offset - 2048:c.offset - 2045],
                       _moment(1.0, "exp_avg_sq", 3))


def _many(tmp_path: Path, rigs, **save_kwargs) -> Path:
    return _saved(rigs(1.0, extra=6, **save_kwargs), tmp_path)


def test_no_adam_states_for_six_lists_five(tmp_path: Path, rigs) -> None:
    frozen = {n: -1 for n in ("b", "c", "e0", "e1", "e2", "e3")}
    _many(tmp_path, rigs, groups=frozen)
    assert _refused(rigs(5.0, extra=6), tmp_path) == (
        f"checkpoint {tmp_path / 'step7'} has no Adam states for 6 trainable parameter(s) (b, c, "
        "e0, e1, e2): they were frozen when it was saved. Pass load_optimizer_states=False to "
        "load the model only")


def test_four_moved_parameters_list_three_in_the_whole_message(tmp_path: Path, rigs) -> None:
    _many(tmp_path, rigs)
    message = _refused(rigs(5.0, extra=6, groups={n: 0 for n in ("b", "c", "e0", "e1")}),
                       tmp_path)
    assert message == (
        f"checkpoint {tmp_path / 'step7'}: 4 parameter(s) are in another optimizer param group "
        "than when it was saved (b (group 1 then, 0 now); c (group 1 then, 0 now); e0 (group 1 "
        "then, 0 now)), and the groups' settings (lr, weight decay, betas) are restored by "
        "position: they would train with another group's settings. Build the param groups in "
        "the order and by the rules used when saving, or pass load_optimizer_states=False to "
        "load the model only")


def test_six_damaged_step_counts_list_five(tmp_path: Path, rigs) -> None:
    directory = _many(tmp_path, rigs)

    def damage(m: dict) -> None:
        for n in ("b", "c", "e0", "e1", "e2", "e3"):
            m["params"][n]["steps"] = 1.5
    _edit(directory, damage)
    assert _refused(rigs(5.0, extra=6), tmp_path).startswith(
        f"checkpoint {tmp_path / 'step7'}: its manifest.json has no step count for 6 "
        "parameter(s) (b, c, e0, e1, e2) although its tensor files hold them: ")


def test_buffer_mismatches_list_five_of_each(tmp_path: Path, rigs) -> None:
    _saved(rigs(1.0, buffers={f"w{i}": (2,) for i in range(6)}), tmp_path)
    new = rigs(5.0, buffers={**{f"w{i}": (3,) for i in range(6)},
                             **{f"m{i}": (1,) for i in range(6)}})
    wrong = "; ".join(f"w{i}: checkpoint [2], model [3]" for i in range(5))
    missing = "; ".join(f"missing m{i}" for i in range(5))
    assert _refused(new, tmp_path) == (
        f"checkpoint {tmp_path / 'step7'} does not match the model's buffers: {wrong}; {missing}")


def test_write_needs_both_the_files_and_the_match(tmp_path: Path, rigs) -> None:
    rig = rigs(1.0)
    directory = _saved(rig, tmp_path)
    load = CheckpointLoad(rig.state, PinnedSave(directory), None)
    load.model = object()           # files open, but never matched
    with pytest.raises(AssertionError) as info:
        load.write()
    assert str(info.value) == "check() first"


def test_a_manifest_without_params_loads_the_model_only(tmp_path: Path, rigs) -> None:
    """A manifest without "params" (edited): a module-only load reads the whole tensors of
    the files (it needs no step counts), instead of a KeyError after the buffers were already
    written (write() once read
    ``manifest["params"]`` for every unit); with optimizer states it is refused up front."""
    old = rigs(1.0)
    directory = _saved(old, tmp_path)
    _edit(directory, lambda m: m.pop("params"))
    new = rigs(5.0)
    _load(new, tmp_path, load_module_only=True)
    assert torch.equal(new.param("b"), old.param("b"))
    assert torch.equal(new.model.running, torch.tensor([1.0, 2.0]))
    assert "has no step count for 3 parameter(s) (a, b, c)" in _refused(rigs(6.0), tmp_path)


class _Schedule:
    def __init__(self, at: int) -> None:
        self.at = at

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.at}


def test_a_load_restores_the_schedule_and_the_optimizer_settings_by_default(tmp_path: Path,
                                                                            rigs) -> None:
    _saved(rigs(1.0, scheduler=_Schedule(6)), tmp_path)
    load = _load(rigs(5.0, scheduler=_Schedule(0)), tmp_path)
    assert load.restore.lr_scheduler == {"last_batch_iteration": 6}
    assert load.restore.param_groups == [{"lr": 0.1}, {"lr": 0.2}]
    assert load.restore.lr_from_scheduler is False


def test_damaged_counters_are_refused_naming_the_checkpoint(tmp_path: Path, rigs) -> None:
    directory = _saved(rigs(1.0), tmp_path)
    _edit(directory, lambda m: m.update(engine=[1]))
    assert _refused(rigs(5.0), tmp_path) == (
        f"checkpoint {directory}: its manifest.json's engine counters are not a dict: the "
        "manifest was edited or damaged")
    _edit(directory, lambda m: m.update(world_size=0))
    assert _refused(rigs(5.0), tmp_path).startswith(
        f"checkpoint {directory}: its manifest.json has world_size = 0")


def test_without_latest_the_warning_says_so(tmp_path: Path, rigs, infinity_log) -> None:
    assert prepare_load(rigs(1.0).state, tmp_path) is None
    assert [r.getMessage() for r in infinity_log.records if r.levelname == "WARNING"] == [
        f"no {tmp_path}/latest: no checkpoint loaded (pass tag= to load a given one)"]


def test_another_rank_failing_to_read_fails_this_one(tmp_path: Path, rigs) -> None:
    class _Failed(_Comm):
        def all_gather_objects(self, value):
            return [value, (None, "CheckpointError: damaged")]

    _saved(rigs(1.0), tmp_path)
    with pytest.raises(CheckpointError) as info:
        prepare_load(rigs(5.0, comm=_Failed(0)).state, tmp_path)
    assert str(info.value) == ("rank 1 could not read the checkpoint (CheckpointError: "
                               "damaged); nothing was loaded")


def test_each_rank_hashes_only_its_share_of_the_files(tmp_path: Path, rigs) -> None:
    """Rank 1 of 2 hashes the second of the two files; a damaged first file is rank 0's to
    find (and its failure fails every rank), not read twice."""
    directory = _saved(rigs(1.0), tmp_path)
    path = directory / "rank0_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    load = prepare_load(rigs(5.0, comm=_Comm(1)).state, tmp_path)
    assert load is not None
    load.close()
    with pytest.raises(CheckpointError, match="rank0_model.safetensors does not match"):
        prepare_load(rigs(5.0, comm=_Comm(0)).state, tmp_path)


def test_six_missing_or_mismatched_list_five(tmp_path: Path, rigs) -> None:
    six = ("b", "c", "e0", "e1", "e2", "e3")
    directory = _saved(rigs(1.0, extra=6, names={n: f"{n}_x" for n in six}), tmp_path / "m")
    _edit(directory, lambda m: m["aliases"].clear())
    assert "6 of the model's parameters are not in it (b, c, e0, e1, e2); 6 of" in \
        _refused(rigs(5.0, extra=6), tmp_path / "m", load_optimizer_states=False)
    _saved(rigs(1.0, extra=6), tmp_path / "s")
    message = _refused(rigs(5.0, extra=6, shapes={f"e{i}": (3,) for i in range(6)}),
                       tmp_path / "s")
    assert message.endswith("shapes differ for 6 parameter(s): " + "; ".join(
        f"e{i}: checkpoint [2], model [3]" for i in range(5)))


def _split_into_two_ranks(directory: Path) -> None:
    """The checkpoint as two ranks would have saved it: every parameter's tensor (and its
    moments) as a 1-D slice from element 0 in rank 0's file and the rest, ``name#k``, in rank
    1's; buffers whole in rank 0's."""
    import hashlib

    from infinity.checkpoint.tensor_file import TensorFileReader, TensorFileWriter

    manifest = json.loads((directory / "manifest.json").read_text())
    params = manifest["params"]
    files = {}
    for kind in ("model", "optim"):
        reader = TensorFileReader(directory / f"rank0_{kind}.safetensors")
        whole = {n: reader.read(n) for n in reader.tensors}
        metadata = reader.metadata      # the save's id, which a load checks
        reader.close()
        ranks: list[dict] = [{}, {}]
        for name, t in whole.items():
            if name.split(".exp_avg")[0] in params:
                flat = t.reshape(-1)
                k = max(1, flat.numel() // 2)
                ranks[0][f"{name}#0"], ranks[1][f"{name}#{k}"] = flat[:k], flat[k:]
            else:
                ranks[0][name] = t
        for r, tensors in enumerate(ranks):
            path = directory / f"rank{r}_{kind}.safetensors"
            path.unlink(missing_ok=True)
            writer = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape))
                                             for n, t in tensors.items()], metadata)
            for n, t in tensors.items():
                writer.append(n, t.reshape(-1))
            writer.close()
            data = path.read_bytes()
            files[path.name] = {"bytes": len(data),
                                "sha256": hashlib.sha256(data).hexdigest()}
    manifest.update(world_size=2, files=files)
    (directory / "manifest.json").write_text(json.dumps(resummed(manifest)))


def test_a_checkpoint_of_two_ranks_loads_its_slices_by_the_manifests_shapes(tmp_path: Path,
                                                                          rigs) -> None:
    old = rigs(1.0)
    _split_into_two_ranks(_saved(old, tmp_path))
    new = rigs(5.0, steps=40)
    _load(new, tmp_path)
    for name in ("a", "b", "c", "frozen"):
        assert torch.equal(new.param(name), old.param(name)), name
    assert torch.equal(new.moment("a", "exp_avg_sq"), old.moment("a", "exp_avg_sq"))
    assert new.steps("c") == 4


def test_rank_one_saves_its_shard_from_its_own_places(tmp_path: Path, rigs) -> None:
    """save.py at rank 1 of 2 (rank 0's answers played by the comm): its files hold the
    slices of its range [2048, 4096) of u1, read from its master and moments at their own
    place (store element 0 = unit element 2048), named by their first element."""
    from infinity.checkpoint.tensor_file import TensorFileReader

    staging = tmp_path / ".step7.partial"
    staging.mkdir()

    class _Rank0Said(_Comm):
        def __init__(self) -> None:
            super().__init__(1)
            self.said = [((str(tmp_path.resolve()), "step7"), None),    # the save's target
                         ((staging, "id"), None), (None, None), (None, None),
                         (tmp_path / "step7", None), (None, None)]

        def all_gather_objects(self, value):
            return [self.said.pop(0), value]

    rig = rigs(1.0, dtype=torch.bfloat16, shapes={"b": (3000,)}, comm=_Rank0Said())
    assert save_checkpoint(rig.state, tmp_path, tag="step7") == tmp_path / "step7"

    def read(name: str) -> dict:
        reader = TensorFileReader(staging / name)
        try:
            return {n: reader.read(n) for n in reader.tensors}
        finally:
            reader.close()

    model, optim = read("rank1_model.safetensors"), read("rank1_optim.safetensors")
    b = torch.arange(3000.0) + 10
    assert sorted(model) == ["b#2048", "c#0"]
    assert torch.equal(model["b#2048"], b[2048:])
    assert torch.equal(model["c#0"], torch.arange(3.0) + 20)
    assert torch.equal(optim["b.exp_avg#2048"], _moment(1.0, "exp_avg", 3000)[2048:])
    assert torch.equal(optim["c.exp_avg_sq#0"], _moment(1.0, "exp_avg_sq", 3))
