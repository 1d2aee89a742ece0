"""``infinity train``'s checkpoint flags (infinity/train/checkpoints.py): bad combinations, no
room, and a --save-dir whose ``latest`` is gone are refused before the run trains."""
from __future__ import annotations

import pytest

from infinity.train import checkpoints as module
from infinity.train.checkpoints import RunCheckpoints


def test_flags_are_checked_up_front(tmp_path) -> None:
    with pytest.raises(ValueError, match="need --save-dir"):
        RunCheckpoints.from_options(None, 5, False, "infinity")
    with pytest.raises(ValueError, match="at least 1"):
        RunCheckpoints.from_options(str(tmp_path), 0, False, "infinity")
    with pytest.raises(ValueError, match="--engine infinity"):
        RunCheckpoints.from_options(str(tmp_path), None, False, "torch")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a writable directory"):
        RunCheckpoints.from_options(str(tmp_path / "file" / "ck"), None, False, "infinity")


def test_a_disk_without_room_for_one_checkpoint_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(module, "free_bytes", lambda path: 10**6)
    run = RunCheckpoints.from_options(str(tmp_path / "new" / "ck"), None, False, "infinity")
    with pytest.raises(ValueError, match="needs about 1.12 GiB"):
        run.check_room(100_000_000)
    run.check_room(10_000)


class _NoLatestEngine:
    def load_checkpoint(self, path):
        return None, None


def test_resume_without_latest_but_with_tags_is_refused(tmp_path) -> None:
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "manifest.json").write_text("{}")
    run = RunCheckpoints.from_options(str(tmp_path), None, True, "infinity")
    with pytest.raises(ValueError, match="has checkpoints \\(global_step4\\) but no 'latest'"):
        run.resume_into(_NoLatestEngine(), sampler=None, identity={}, last_step=10)
    empty = RunCheckpoints.from_options(str(tmp_path / "empty"), None, True, "infinity")
    assert empty.resume_into(_NoLatestEngine(), sampler=None, identity={}, last_step=10) == 0


class _UnloadableEngine:
    def load_checkpoint(self, path):
        raise AssertionError("the engine's load was called for a directory without checkpoints")


def test_a_first_run_with_resume_starts_without_asking_the_engine(tmp_path) -> None:
    """The engine's load of a directory without checkpoints warned "no .../latest: no
    checkpoint loaded (pass tag= to load a given one)", its API's advice, at every first run."""
    run = RunCheckpoints.from_options(str(tmp_path / "new"), None, True, "infinity")
    assert run.resume_into(_UnloadableEngine(), sampler=None, identity={}, last_step=10) == 0


class _SavedEngine:
    """An engine whose checkpoint, at step 12, was saved by a run of ``schedule``."""

    global_steps = 12

    def __init__(self, schedule) -> None:
        self.client = {"seed": 0, "batches_drawn": 12, "schedule": schedule}

    def load_checkpoint(self, path):
        return path / "global_step12", self.client


class _Sampler:
    def skip(self, drawn: int) -> None:
        self.skipped = drawn


def test_a_resume_under_another_lr_schedule_says_it_is_not_the_interrupted_run(
        tmp_path, infinity_log) -> None:
    """--steps sizes the schedule: a run of 12 steps resumed with --steps 24 follows a 24-step
    decay from step 13 on (its losses are neither run's), and says so; the same schedule is
    silent."""
    twelve = {"type": "WarmupDecayLR", "params": {"total_num_steps": 12}}
    longer = {"type": "WarmupDecayLR", "params": {"total_num_steps": 24}}
    (tmp_path / "latest").write_text("global_step12")      # what _SavedEngine loads
    run = RunCheckpoints.from_options(str(tmp_path), None, True, "infinity", schedule=longer)
    assert run.resume_into(_SavedEngine(twelve), _Sampler(), {"seed": 0}, last_step=24) == 12
    assert "the steps from 13 on follow the new one" in infinity_log.text
    assert '"total_num_steps": 12' in infinity_log.text
    infinity_log.clear()
    assert run.resume_into(_SavedEngine(longer), _Sampler(), {"seed": 0}, last_step=24) == 12
    assert "schedule" not in infinity_log.text


def test_a_save_lock_another_host_holds_is_refused_before_training(tmp_path) -> None:
    """A writer killed on another host leaves a lock no flock here can judge: the first save
    refused it, a --save-interval of training later; refused before the run trains now."""
    import json as _json

    (tmp_path / ".infinity-save.lock").write_text(_json.dumps({
        "format": "infinity-save-lock/1", "owner": {
            "pid": 4242, "boot_id": "0b8c3a3e-1111-2222-3333-444455556666", "start_time": 123,
            "rank": 0, "hostname": "gpu-node-17"}}))
    run = RunCheckpoints.from_options(str(tmp_path), None, True, "infinity")
    with pytest.raises(ValueError, match=r"--save-dir .*pid 4242 on host 'gpu-node-17'"):
        run.check_lock()
    (tmp_path / ".infinity-save.lock").unlink()
    run.check_lock()
    assert not (tmp_path / ".infinity-save.lock").exists()
