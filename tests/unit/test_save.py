"""``save_checkpoint`` (checkpoint/save.py) at unit level, on real Units, real optimizer states
and a real save directory: the checks before a save, the manifest's state (JSON values, string keys), what the files and
the manifest hold, tags and latest, the free-space check and a disk filling up, and the
agreement between ranks (test_load.py reads such checkpoints back)."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from messages import raises_naming
from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.checkpoint import save
from infinity.checkpoint.directory import FORMAT, FP32_STATES_VERSION
from infinity.checkpoint.save import (
    RankAgreement, check_at_rest, json_value, manifest_state, save_checkpoint)
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader
from infinity.checkpoint.training_state import TrainingState
from infinity.config.precision import Fp16Config
from infinity.optim.loss_scaler import LossScaler
from infinity.optim.records import UnitOptimState
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.unit import Unit

from fakes import RecordingRun


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.frozen = nn.Parameter(torch.full((5,), -1.0), requires_grad=False)
        self.b = nn.Parameter(torch.arange(4.0) + 100)
        self.register_buffer("running", torch.tensor([1.5, 2.5]))


class _Comm:
    def __init__(self, rank: int, answers=None) -> None:
        self.rank, self.world_size = rank, 2
        self.answers = answers

    def all_gather_objects(self, value):
        other = (None, None) if self.answers is None else self.answers.pop(0)
        return [value, other] if self.rank == 0 else [other, value]


class _Scheduler:
    def state_dict(self):
        return {"last_batch_iteration": 6, "betas": (0.9, 0.99)}


@pytest.fixture
def manager():
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    yield m
    m.close()


def _state(manager: TierManager, log: list | None = None, with_states: bool = True,
           **over) -> TrainingState:
    log = [] if log is None else log
    model = _Model()
    units = [Unit(0, "u0", model, [("a", model.a, 0), ("frozen", model.frozen, -1)],
                  torch.float32, torch.device("cpu")),
             Unit(1, "u1", model, [("b", model.b, 1)], torch.float32, torch.device("cpu"))]
    units[0].adopt(manager, Tier.DEVICE, persistent=True)
    units[1].adopt(manager, Tier.HOST, persistent=False)
    states = []
    for u in units if with_states else []:
        avg = manager.create(f"{u.name}.exp_avg", u.trainable_numel, torch.float32, Tier.HOST)
        sq = manager.create(f"{u.name}.exp_avg_sq", u.trainable_numel, torch.float32, Tier.HOST)
        avg.tensor.fill_(2.0 + u.index)
        sq.tensor.fill_(4.0 + u.index)
        st = UnitOptimState(u, avg, sq, None, None)
        st.param_steps = {e.offset: 5 + u.index for e in u.params if e.trainable}
        states.append(st)
    fields = dict(
        module=model, units=units, unit_states=states,
        param_groups=[{"params": [model.a], "lr": 0.1, "betas": (0.9, 0.999)},
                      {"params": [model.b], "lr": 0.2, "betas": (0.8, 0.9)}],
        lr_scheduler=_Scheduler(), loss_scaler=None, global_steps=12, micro_steps=24,
        skipped_steps=1, stage=3, compute_dtype=torch.bfloat16, gradient_accumulation_steps=2,
        speculation_pays=True, backwards_since_step=0, manager=manager, lendable_pools=[],
        run=RecordingRun(log), model_files={"config.json": "{}"})
    fields.update(over)
    return TrainingState(**fields)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = TensorFileReader(path)
    try:
        return {n: reader.read(n) for n in reader.tensors}
    finally:
        reader.close()


def test_a_save_writes_the_files_and_the_manifest(tmp_path: Path, manager, infinity_info_log
                                                  ) -> None:
    """Tag global_step<N> by default, latest pointed at it; the model file holds every
    parameter and the persistent buffers, the optim file each trainable one's moments; the
    manifest every rank's files, the parameters' shapes, groups and steps, the engine's
    counters and settings, the client state; the engine asked and flushed; a log line."""
    log: list = []
    final = save_checkpoint(_state(manager, log), str(tmp_path), client_state={"epoch": 3})
    assert final == tmp_path / "global_step12"
    assert (tmp_path / "latest").read_text() == "global_step12"      # bare, as DeepSpeed writes it
    assert log == [("open", "save_checkpoint"), ("flush",)]
    model = _tensors(final / "rank0_model.safetensors")
    assert list(model) == ["a", "frozen", "b", "running"]
    assert torch.equal(model["a"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(model["b"], torch.arange(4.0) + 100)
    optim = _tensors(final / "rank0_optim.safetensors")
    assert list(optim) == ["a.exp_avg", "a.exp_avg_sq", "b.exp_avg", "b.exp_avg_sq"]
    assert torch.equal(optim["b.exp_avg_sq"], torch.full((4,), 5.0))
    assert torch.equal(optim["a.exp_avg"], torch.full((2, 3), 2.0))
    m = json.loads((final / "manifest.json").read_text())
    # fp32 states: the version every infinity reads (directory.FP32_STATES_VERSION)
    assert (m["format"], m["version"], m["tag"], m["world_size"]) == (
        FORMAT, FP32_STATES_VERSION, "global_step12", 1)
    assert sorted(m["files"]) == ["rank0_model.safetensors", "rank0_optim.safetensors"]
    for name, info in m["files"].items():
        assert info["bytes"] == (final / name).stat().st_size and len(info["sha256"]) == 64
    assert m["params"] == {
        "a": {"shape": [2, 3], "trainable": True, "group": 0, "steps": 5},
        "frozen": {"shape": [5], "trainable": False},
        "b": {"shape": [4], "trainable": True, "group": 1, "steps": 6}}
    assert m["aliases"] == {} and m["frozen_excluded"] is False
    assert m["buffers"] == ["running"]
    assert m["engine"] == {"global_steps": 12, "micro_steps": 24, "skipped_steps": 1,
                           "stage": 3, "compute_dtype": "bfloat16",
                           "gradient_accumulation_steps": 2, "speculation_pays": True}
    assert m["param_groups"] == [{"lr": 0.1, "betas": [0.9, 0.999]},
                                 {"lr": 0.2, "betas": [0.8, 0.9]}]
    # a tuple tagged (checkpoint/json_state.py), given back as one
    assert m["lr_scheduler"] == {"last_batch_iteration": 6,
                                 "betas": {"__infinity__": "tuple", "items": [0.9, 0.99]}}
    assert m["loss_scaler"] is None and m["client_state"] == {"epoch": 3}
    assert m["model_files"] == {"config.json": "{}"}
    assert m["saved_at"].endswith("+00:00")
    assert any(r.getMessage().startswith(f"saved checkpoint {final} (") for r in
               infinity_info_log.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step12", "latest"]


def test_a_tag_without_latest_and_without_frozen(tmp_path: Path, manager) -> None:
    final = save_checkpoint(_state(manager), tmp_path, tag="mine", save_latest=False,
                            exclude_frozen_parameters=True)
    assert final == tmp_path / "mine" and not (tmp_path / "latest").exists()
    assert list(_tensors(final / "rank0_model.safetensors")) == ["a", "b", "running"]
    m = json.loads((final / "manifest.json").read_text())
    assert "frozen" not in m["params"] and m["frozen_excluded"] is True
    assert m["client_state"] == {}


def test_a_loss_scaler_and_no_scheduler(tmp_path: Path, manager) -> None:
    scaler = LossScaler(Fp16Config(enabled=True))
    final = save_checkpoint(_state(manager, loss_scaler=scaler, lr_scheduler=None,
                                   model_files=None), tmp_path)
    m = json.loads((final / "manifest.json").read_text())
    assert m["loss_scaler"] == json.loads(json.dumps(scaler.state_dict()))
    assert m["lr_scheduler"] is None and m["model_files"] == {}


def test_units_without_optimizer_states_save_no_moments(tmp_path: Path, manager) -> None:
    final = save_checkpoint(_state(manager, with_states=False), tmp_path)
    assert _tensors(final / "rank0_optim.safetensors") == {}
    m = json.loads((final / "manifest.json").read_text())
    assert m["params"]["a"] == {"shape": [2, 3], "trainable": True}


@pytest.mark.parametrize("change,message", [
    ({"backwards_since_step": 1}, "engine.save_checkpoint() between backward() and step(): the "
     "gradients of this step would not be in it. Call engine.step() first"),
    ({"micro_steps": 25}, "engine.save_checkpoint() in the middle of a gradient accumulation "
     "cycle (micro-step 1 of 2): the accumulated gradients would not be in it. Call it after "
     "the step at the accumulation boundary"),
    ({"pinned": True}, "engine.save_checkpoint() inside GatheredParameters: leave "
     "the context first (its changes are written back on exit)")])
def test_a_save_not_at_rest_is_refused(tmp_path: Path, manager, change, message) -> None:
    log: list = []
    if "pinned" in change:
        change = {"run": RecordingRun(log, pinned=True)}
    with pytest.raises(RuntimeError) as info:
        save_checkpoint(_state(manager, log, **change), tmp_path)
    assert str(info.value) == message
    assert log == [("open", "save_checkpoint")] and list(tmp_path.iterdir()) == []


def test_check_at_rest_asks_the_engine_first(manager) -> None:
    closed = RecordingRun(closed=lambda what: RuntimeError(f"closed: {what}"))
    with pytest.raises(RuntimeError, match="closed: export"):
        check_at_rest(_state(manager, run=closed), "export")
    check_at_rest(_state(manager, micro_steps=0), "x")   # at a boundary: fine


def test_json_values_come_back_as_json_holds_them() -> None:
    assert json_value({"t": (1, 2), "n": float("inf")}, "x") == {"t": [1, 2], "n": float("inf")}
    with pytest.raises(TypeError) as info:
        json_value({"t": torch.zeros(1)}, "client_state")
    assert str(info.value) == (
        "client_state must be JSON-serializable (numbers, strings, booleans, lists and dicts "
        "with string keys) to go in a checkpoint manifest: Object of type Tensor is not JSON "
        "serializable. Convert tensors with .tolist() or .item()")
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("value", [{1: "x"}, [{"a": {2.5: 1}}], ({"k": [{None: 1}]},)])
def test_a_dict_key_that_is_not_a_string_is_refused_at_any_depth(value) -> None:
    key = {"{1: 'x'}": 1, "[{'a': {2.5: 1}}]": 2.5}.get(repr(value), None)
    with pytest.raises(TypeError) as info:
        json_value(value, "client_state")
    assert str(info.value) == (
        f"client_state has a dict key {key!r} of type {type(key).__name__}: a checkpoint "
        f"manifest is JSON, whose keys are strings, so it would come back as {str(key)!r}. Use "
        "string keys")


def test_a_very_deep_value_is_left_to_json() -> None:
    """Past 100 levels the key check stops (json reports a circular value itself); a
    non-string key deeper than that is not looked for."""
    deep: object = {1: "x"}
    for _ in range(101):
        deep = [deep]
    assert json_value(deep, "x") is not None
    shallow: object = {1: "x"}
    for _ in range(100):
        shallow = [shallow]
    with pytest.raises(TypeError, match="dict key 1 of type int"):
        json_value(shallow, "x")


def test_a_key_whose_repr_has_braces_is_named_not_an_index_error() -> None:
    """The message is built once (an f-string), so braces in the key's repr are text."""
    with pytest.raises(TypeError, match=r"dict key frozenset\(\{1\}\) of type frozenset.*"
                                        r"come back as 'frozenset\(\{1\}\)'"):
        json_value({frozenset({1}): 2}, "client_state")


def test_manifest_state_refuses_before_anything_is_written(tmp_path: Path, manager) -> None:
    with raises_naming(TypeError, "client_state: client_state has a key frozenset({1})",
                       "strings, numbers, booleans, None or tuples of them", ends=True):
        save_checkpoint(_state(manager), tmp_path, client_state={frozenset({1}): 2})
    with raises_naming(TypeError, "the optimizer's param group settings must be JSON",
                       "Convert tensors with .tolist() or .item()", ends=True):
        manifest_state(_state(manager, param_groups=[{"params": [], "x": object()}]), {})

    class Bad:
        def state_dict(self):
            return {"f": object()}

    with raises_naming(TypeError, "the LR scheduler's state_dict() must hold numbers",
                       "Convert tensors with .tolist() or .item()", ends=True):
        save_checkpoint(_state(manager, lr_scheduler=Bad()), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_writing(tmp_path: Path, manager,
                                                          monkeypatch) -> None:
    """The files' bytes (model in its dtypes, moments in fp32, buffers) against the free
    space: one byte short refused, naming both; the staging directory removed."""
    need = (6 + 5 + 4) * 4 + 2 * 4 + 2 * (6 + 4) * 4
    monkeypatch.setattr(save, "free_bytes", lambda path: need - 1)
    with pytest.raises(OSError) as info:
        save_checkpoint(_state(manager), tmp_path, tag="t")
    assert info.value.errno == errno.ENOSPC
    assert info.value.strerror == (f"checkpoint t needs {need} B in {tmp_path}, which has "
                                   f"{need - 1} B free; free space or choose another save_dir")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(save, "free_bytes", lambda path: need)
    assert save_checkpoint(_state(manager), tmp_path, tag="t") == tmp_path / "t"


def test_a_disk_filling_up_while_writing_says_so_and_keeps_the_previous(tmp_path: Path, manager,
                                                                        monkeypatch) -> None:
    first = save_checkpoint(_state(manager), tmp_path, tag="t1")
    real = save._write_optim

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save, "_write_optim", full)
    with pytest.raises(OSError) as info:
        save_checkpoint(_state(manager), tmp_path, tag="t2")
    assert info.value.errno == errno.ENOSPC
    assert info.value.strerror.startswith(
        f"checkpoint t2: the disk of {tmp_path} filled up (or its quota) while it was written (")
    assert info.value.strerror.endswith(
        "free now that its partial files are removed); the previous checkpoint and latest are "
        "unchanged: free space or choose another save_dir")
    assert isinstance(info.value.__cause__, OSError)
    assert (tmp_path / "latest").read_text().strip() == "t1" and first.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t1"]

    def other(*args):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(save, "_write_optim", other)
    with pytest.raises(OSError) as info:
        save_checkpoint(_state(manager), tmp_path, tag="t2")
    # any other error names the checkpoint and says nothing earlier changed (it was the bare
    # "I/O error"; "[Errno 27] File too large" under ulimit -f)
    assert info.value.errno == errno.EIO and info.value.strerror == (
        f"checkpoint t2 in {tmp_path}: I/O error; the previous checkpoint and latest are "
        "unchanged")
    assert (tmp_path / "latest").read_text().strip() == "t1"
    monkeypatch.setattr(save, "_write_optim", real)


def test_rank_agreement_with_one_rank_is_plain_calls(manager) -> None:
    one = RankAgreement(_state(manager))
    assert one.comm is None and one.rank == 0 and one.nothing_done == "nothing was committed"
    assert one.decided_by_first(lambda: 3) == 3
    assert one.all_succeed(lambda: 4, "x") == 4 and one.all_succeed(lambda: 4, "x", True) == [4]


def test_rank_agreement_first_decides(manager) -> None:
    """Rank 0's result goes to every rank; its failure raises there as itself, on the others
    as a CheckpointError naming it; rank 1 does not run the action."""
    r0 = RankAgreement(_state(manager, comm=_Comm(0)), "nothing done")
    assert r0.decided_by_first(lambda: "staging") == "staging"
    with pytest.raises(KeyError):
        RankAgreement(_state(manager, comm=_Comm(0, [(None, None)]))).decided_by_first(
            lambda: {}["k"])
    ran = []
    r1 = RankAgreement(_state(manager, comm=_Comm(1, [("dir", None)])))
    assert r1.decided_by_first(lambda: ran.append(1)) == "dir" and ran == []
    r1 = RankAgreement(_state(manager, comm=_Comm(1, [(None, "OSError: full")])), "no save")
    with pytest.raises(CheckpointError) as info:
        r1.decided_by_first(lambda: None)
    assert str(info.value) == "rank 0 failed (OSError: full); no save"
    # a failure after the commit: the others do not say nothing was saved
    r1 = RankAgreement(_state(manager, comm=_Comm(1, [(None, "SavedError: latest")])), "no save")
    with pytest.raises(CheckpointError) as info:
        r1.decided_by_first(lambda: None)
    assert str(info.value).endswith("the checkpoint was committed before it: it is in place, "
                                    "whole")


def test_rank_agreement_all_succeed(manager) -> None:
    """Every rank's result (shared by rank), or every rank raising, naming each that failed."""
    r0 = RankAgreement(_state(manager, comm=_Comm(0, [("b", None)])))
    assert r0.all_succeed(lambda: "a", "x", share=True) == ["a", "b"]
    r0 = RankAgreement(_state(manager, comm=_Comm(0, [(None, None)])))
    assert r0.all_succeed(lambda: "a", "x") == "a"
    r1 = RankAgreement(_state(manager, comm=_Comm(1, [(None, "OSError: gone")])), "kept")
    with pytest.raises(CheckpointError) as info:
        r1.all_succeed(lambda: "b", "write its files")
    assert str(info.value) == "rank 0 could not write its files (OSError: gone); kept"
    r1 = RankAgreement(_state(manager, comm=_Comm(1, [(None, None)])))
    with pytest.raises(ValueError, match="mine"):
        r1.all_succeed(lambda: (_ for _ in ()).throw(ValueError("mine")), "x")


def test_a_rank_that_cannot_see_the_staging_directory(tmp_path: Path) -> None:
    save._check_visible(tmp_path, 1)
    with pytest.raises(OSError) as info:
        save._check_visible(tmp_path / "gone", 3)
    assert info.value.errno == errno.ENOENT
    assert info.value.strerror == (
        f"rank 3 cannot see {tmp_path / 'gone'}, the staging directory rank 0 made: the save "
        "directory must be on a file system every rank mounts (a shared disk across nodes)")


# -- metadata, free space, other ranks' failures, the key check and the log line -----------------

def test_the_files_carry_the_format_and_the_save_id_in_their_metadata(tmp_path: Path,
                                                                     manager) -> None:
    """The save id: random, one per save, the manifest's (see [Note: which save a file
    belongs to])."""
    ids = []
    for tag in ("one", "two"):
        final = save_checkpoint(_state(manager), tmp_path, tag=tag)
        save_id = json.loads((final / "manifest.json").read_text())["save_id"]
        for name in ("rank0_model.safetensors", "rank0_optim.safetensors"):
            with TensorFileReader(final / name) as reader:
                assert dict(reader.metadata) == {"format": FORMAT, "save_id": save_id}
        ids.append(save_id)
    assert ids[0] != ids[1] and all(len(i) == 32 for i in ids)


def test_a_fresh_engine_saves_zero_steps(tmp_path: Path, manager) -> None:
    """No step taken yet (no step counts): each trainable parameter's steps are 0 in the
    manifest (null or 1 would make the load refuse it or restart Adam's bias correction
    wrong)."""
    state = _state(manager)
    for st in state.unit_states:
        st.param_steps = {}
    m = json.loads((save_checkpoint(state, tmp_path) / "manifest.json").read_text())
    assert m["params"]["a"]["steps"] == 0 and m["params"]["b"]["steps"] == 0


def test_a_unit_without_optimizer_state_before_others(tmp_path: Path, manager) -> None:
    """A unit with nothing to train (no optimizer state) first: the units after it still
    save their moments."""
    state = _state(manager)
    state = _state(manager, unit_states=[state.unit_states[1]])
    final = save_checkpoint(state, tmp_path)
    assert list(_tensors(final / "rank0_optim.safetensors")) == ["b.exp_avg", "b.exp_avg_sq"]


def test_the_free_space_needed_counts_16_bit_files_in_16_bits(tmp_path: Path, manager,
                                                              monkeypatch) -> None:
    """bf16 units without a master: the model file holds bf16 parameters (2 bytes each),
    the moments fp32, the buffers their dtype."""
    model = _Model()
    units = [Unit(0, "u0", model, [("a", model.a, 0), ("frozen", model.frozen, -1)],
                  torch.bfloat16, torch.device("cpu")),
             Unit(1, "u1", model, [("b", model.b, 1)], torch.bfloat16, torch.device("cpu"))]
    for u in units:
        u.adopt(manager, Tier.DEVICE, persistent=True)
    need = (6 + 5 + 4) * 2 + 2 * 4
    monkeypatch.setattr(save, "free_bytes", lambda path: need - 1)
    state = _state(manager, with_states=False, units=units, module=model)
    with pytest.raises(OSError, match=f"needs {need} B in"):
        save_checkpoint(state, tmp_path, tag="t")
    monkeypatch.setattr(save, "free_bytes", lambda path: need)
    save_checkpoint(state, tmp_path, tag="t")


class _Recording:
    """Rank ``rank`` of ``world``: records what this rank sends, pickles it as
    torch.distributed's object collectives do, and plays the other ranks' ``answers``."""

    def __init__(self, rank: int, world: int, answers: list) -> None:
        self.rank, self.world_size, self.answers, self.sent = rank, world, answers, []

    def all_gather_objects(self, value):
        import pickle

        pickle.dumps(value)
        self.sent.append(value)
        others = list(self.answers)
        return others[:self.rank] + [value] + others[self.rank:]


def test_a_rank_tells_the_others_its_failure_and_shares_only_what_is_asked(manager) -> None:
    """all_succeed sends (None, "<type>: <message>") when it fails, (None, None) when not
    sharing (the result may not even be picklable: a CheckpointLoad), its result when
    sharing; decided_by_first's rank 0 sends its failure the same way."""
    comm = _Recording(0, 2, [(None, None)])
    agree = RankAgreement(_state(manager, comm=comm))
    with pytest.raises(ValueError, match="mine"):
        agree.all_succeed(lambda: (_ for _ in ()).throw(ValueError("mine")), "x")
    assert comm.sent == [(None, "ValueError: mine")]
    unpicklable = lambda: None     # noqa: E731 - a result that cannot be pickled
    assert agree.all_succeed(lambda: unpicklable, "x") is unpicklable
    assert comm.sent[-1] == (None, None)
    comm.answers = [("theirs", None)]
    assert agree.all_succeed(lambda: "mine", "x", share=True) == ["mine", "theirs"]
    assert comm.sent[-1] == ("mine", None)
    comm.answers = [(None, None)]
    with pytest.raises(KeyError):
        agree.decided_by_first(lambda: {}["k"])
    assert comm.sent[-1] == (None, "KeyError: 'k'")


def test_every_failed_rank_is_named(manager) -> None:
    comm = _Recording(0, 3, [(None, "OSError: a"), (None, "OSError: b")])
    with pytest.raises(CheckpointError) as info:
        RankAgreement(_state(manager, comm=comm), "kept").all_succeed(lambda: 1, "write")
    assert str(info.value) == "rank 1 could not write (OSError: a); rank 2 could not write " \
                              "(OSError: b); kept"


def test_the_key_check_counts_depth_through_dicts() -> None:
    """A bad key under 100 nested dicts is found; under 101 it is left to json (the limit
    that keeps a circular value from recursing forever)."""
    def nested(levels: int) -> dict:
        value: dict = {1: "x"}
        for _ in range(levels):
            value = {"k": value}
        return value

    with pytest.raises(TypeError, match="dict key 1 of type int"):
        json_value(nested(100), "x")
    assert json_value(nested(101), "x") is not None


def test_the_save_log_line_says_size_and_seconds(tmp_path: Path, manager,
                                                  infinity_info_log) -> None:
    import re

    final = save_checkpoint(_state(manager), tmp_path)
    [line] = [r.getMessage() for r in infinity_info_log.records
              if r.getMessage().startswith("saved checkpoint")]
    found = re.fullmatch(rf"saved checkpoint {re.escape(str(final))} \(([0-9.]+ [KMG]?i?B)\) in "
                         r"([0-9.]+) s", line)
    assert found is not None and float(found.group(2)) < 600


def _rank(rank: int, answers: list, save_dir: Path, tag: str = "t") -> _Recording:
    """Rank ``rank`` of 2, the other's ``answers`` played in order, after its agreement on
    where the save goes (``save_dir``, ``tag``)."""
    comm = _Recording(rank, 2, [])
    said = [((str(save_dir.resolve()), tag), None), *answers]

    def gather(value):
        comm.sent.append(value)
        other = said.pop(0)
        return [value, other] if rank == 0 else [other, value]

    comm.all_gather_objects = gather
    return comm


def test_other_ranks_failures_are_named_by_step(tmp_path: Path, manager) -> None:
    """Rank 0 told that rank 1 could not see the staging directory, or could not write its
    files: a CheckpointError naming the step, and nothing committed."""
    comm = _rank(0, [(None, None), (None, "OSError: not mounted")], tmp_path)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(_state(manager, comm=comm), tmp_path, tag="t")
    assert str(info.value) == ("rank 1 could not see rank 0's staging directory (OSError: not "
                               "mounted); nothing was committed")
    comm = _rank(0, [(None, None), (None, None), (None, "OSError: full")], tmp_path)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(_state(manager, comm=comm), tmp_path, tag="t")
    assert str(info.value) == ("rank 1 could not write its checkpoint files (OSError: full); "
                               "nothing was committed")
    assert not (tmp_path / "t").exists()


def test_rank_one_checks_the_staging_directory_and_never_removes_it(tmp_path: Path, manager,
                                                                   monkeypatch) -> None:
    """Rank 1 that cannot see rank 0's staging directory says so naming itself; rank 1 whose
    write fails leaves the staging directory (rank 0's to remove) as it is."""
    comm = _rank(1, [((tmp_path / "gone", "id"), None), (None, None)], tmp_path)
    with pytest.raises(OSError) as info:
        save_checkpoint(_state(manager, comm=comm), tmp_path, tag="t")
    assert info.value.strerror.startswith(f"rank 1 cannot see {tmp_path / 'gone'}, the staging")
    staging = tmp_path / ".t.partial"
    staging.mkdir()
    (staging / "rank0_model.safetensors").write_bytes(b"rank 0's")

    def full(*args):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(save, "_write_optim", full)
    comm = _rank(1, [((staging, "id"), None), (None, None), (None, None)], tmp_path)
    with pytest.raises(OSError, match="I/O error"):
        save_checkpoint(_state(manager, comm=comm), tmp_path, tag="t")
    assert (staging / "rank0_model.safetensors").read_bytes() == b"rank 0's"


def test_a_rank_lost_right_after_the_staging_was_made_leaves_no_staging(tmp_path: Path,
                                                                         manager) -> None:
    """Rank 0 made the staging directory, then the exchange that tells the others its name
    failed (a rank gone): the empty staging stayed until the next save."""
    comm = _rank(0, [], tmp_path)

    def gone(value):
        raise RuntimeError("rank 1 has stopped")

    comm.all_gather_objects = gone
    with pytest.raises(RuntimeError, match="rank 1 has stopped"):
        save_checkpoint(_state(manager, comm=comm), tmp_path, tag="t")
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []
