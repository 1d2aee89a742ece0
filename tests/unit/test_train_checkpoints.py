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
