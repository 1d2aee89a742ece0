"""Checkpoint directories: behaviours that mutation testing (tools/mutation.py, issue 23) found
unchecked -- that a re-save of a tag swaps the directories in one step where the filesystem can
(the tag never goes missing), and which directories count as tags."""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import pytest

from infinity.checkpoint import directory as d


def _can_exchange(base: Path) -> bool:
    a, b = base / "probe-a", base / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "renameat2", None)
        return fn is not None and fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0
    finally:
        a.rmdir()
        b.rmdir()


def _staged(save_dir: Path, tag: str, step: int) -> Path:
    staging = d.prepare_staging(save_dir, tag)
    (staging / d.MANIFEST).write_text(json.dumps({"step": step}))
    return staging


def test_a_resave_swaps_the_tag_in_one_step_where_the_filesystem_can(tmp_path: Path,
                                                                     monkeypatch) -> None:
    if not _can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange directories (RENAME_EXCHANGE)")
    d.ensure_save_dir(tmp_path)
    d.commit(_staged(tmp_path, "t", 1), tmp_path, "t")
    (tmp_path / "t" / "notes.txt").write_text("the user's")
    renames = []
    real_rename = os.rename

    def watched_rename(src, dst, *a, **kw):
        renames.append((Path(src).name, Path(dst).name))
        assert (tmp_path / "t").is_dir(), "the tag went missing during a re-save"
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", watched_rename)
    staging = _staged(tmp_path, "t", 2)
    final = d.commit(staging, tmp_path, "t")
    assert final == tmp_path / "t"
    assert json.loads((final / d.MANIFEST).read_text()) == {"step": 2}
    assert (final / "notes.txt").read_text() == "the user's"
    assert ("t", d.replaced_dir(tmp_path, "t").name) not in renames
    assert not d.replaced_dir(tmp_path, "t").exists()


def test_only_visible_directories_with_a_manifest_are_tags(tmp_path: Path) -> None:
    for name in ("b", "a", ".a.partial.0123abcd", ".hidden", "no_manifest"):
        (tmp_path / name).mkdir()
    for name in ("b", "a", ".a.partial.0123abcd", ".hidden"):
        (tmp_path / name / d.MANIFEST).write_text("{}")
    (tmp_path / "file").write_text("")
    assert d.available_tags(tmp_path) == ["a", "b"]
    assert d.available_tags(tmp_path / "missing") == []


def _manifest(files: list[str]) -> str:
    return json.dumps({"format": d.FORMAT, "version": d.VERSION,
                       "files": {name: {"bytes": 1, "sha256": "0" * 64} for name in files}})


def test_a_resave_carries_the_users_files_but_no_file_of_the_old_checkpoint(tmp_path: Path) -> None:
    """The old tag's manifest listed a rank-1 shard (a save at world size 2); the new save has
    rank 0 only: the old shard must not come along into the new checkpoint, the user's file
    and a written-like name the old manifest did not list (not the old save's) do."""
    d.ensure_save_dir(tmp_path)
    first = d.prepare_staging(tmp_path, "t")
    for name in ("rank0_model.safetensors", "rank1_model.safetensors"):
        (first / name).write_text("old " + name)
    (first / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors",
                                               "rank1_model.safetensors"]))
    d.commit(first, tmp_path, "t")
    (tmp_path / "t" / "adapter.safetensors").write_text("the user's")
    (tmp_path / "t" / "rank7_optim.safetensors").write_text("not listed: the user's")
    second = d.prepare_staging(tmp_path, "t")
    (second / "rank0_model.safetensors").write_text("new")
    (second / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors"]))
    final = d.commit(second, tmp_path, "t")
    assert sorted(p.name for p in final.iterdir()) == [
        "adapter.safetensors", d.MANIFEST, "rank0_model.safetensors", "rank7_optim.safetensors"]
    assert (final / "rank0_model.safetensors").read_text() == "new"


def test_a_failed_exchange_names_both_directories(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    with pytest.raises(OSError) as caught:
        d._exchange(tmp_path / "missing", tmp_path / "b")
    assert caught.value.errno == 2
    assert f"cannot exchange {tmp_path / 'missing'} and {tmp_path / 'b'}: No such file" in str(caught.value)
