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
