"""``infinity clean``: removes a dead run's swap dir; refuses a live owner and a foreign dir (exit 2)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.cli import main
from infinity.storage import swap_dir as sd
from infinity.storage.swap_dir import MARKER_NAME, Owner, SwapDir

TMP_MARKER = MARKER_NAME + ".tmp"   # the marker before its rename


def _dead_owner(rank: int = 0) -> Owner:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    me = Owner.of_this_process(rank)
    return Owner(proc.pid, me.boot_id, 1, rank, me.hostname)


def _stale_dir(parent: Path, name: str = "infinity-swap-r0-p1-dead00") -> Path:
    path = parent / name
    path.mkdir(mode=0o700)
    (path / MARKER_NAME).write_text(sd.Marker(owner=_dead_owner(), files=["swap-0.bin"]).to_json())
    with open(path / "swap-0.bin", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
    return path


def test_clean_removes_a_dead_runs_directory(disk_dir: Path, capsys: pytest.CaptureFixture) -> None:
    path = _stale_dir(disk_dir)
    assert main(["clean", str(path), "--dry-run"]) == 0
    assert "would free 1.00 MiB in 1 swap files" in capsys.readouterr().out and path.exists()
    assert main(["clean", str(path)]) == 0
    out = capsys.readouterr().out
    assert "freed 1.00 MiB in 1 swap files" in out and "is gone" in out
    assert not path.exists()


def test_clean_of_a_dead_runs_directory_given_as_dot(disk_dir: Path, capsys, monkeypatch) -> None:
    """`cd infinity-swap-...; infinity clean .`: "." has no name, and the directory was taken
    for a parent holding no swap directory ("nothing to clean", exit 0, its files kept)."""
    path = _stale_dir(disk_dir)
    monkeypatch.chdir(path)
    assert main(["clean", "."]) == 0
    assert "freed 1.00 MiB in 1 swap files" in capsys.readouterr().out
    assert not (disk_dir / path.name).exists()


def test_clean_of_the_parent_reclaims_every_dead_dir(disk_dir: Path, capsys) -> None:
    a, b = _stale_dir(disk_dir, "infinity-swap-r0-p1-aaaaaa"), _stale_dir(disk_dir, "infinity-swap-r1-p2-bbbbbb")
    assert main(["clean", str(disk_dir)]) == 0
    assert not a.exists() and not b.exists()
    assert capsys.readouterr().out.count("freed 1.00 MiB") == 2


def test_clean_refuses_a_live_owner(disk_dir: Path, capsys: pytest.CaptureFixture) -> None:
    live = SwapDir.create(disk_dir)
    try:
        live.register_file("swap-0.bin").write_bytes(b"in use")
        assert main(["clean", str(live.path)]) == 2
        err = capsys.readouterr().err
        assert "is in use" in err and f"pid {os.getpid()}" in err and "stop that run first" in err
        assert main(["clean", str(disk_dir)]) == 2  # via the parent as well
        assert (live.path / "swap-0.bin").read_bytes() == b"in use"
    finally:
        live.remove()


def test_clean_refuses_a_foreign_directory(disk_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (disk_dir / "data.bin").write_bytes(b"user data")
    assert main(["clean", str(disk_dir)]) == 0     # nothing of ours: says so, touches nothing
    assert "nothing to clean" in capsys.readouterr().out
    lookalike = disk_dir / "infinity-swap-r0-p1-user"
    lookalike.mkdir()
    (lookalike / "swap-0.bin").write_bytes(b"not ours")
    assert main(["clean", str(lookalike)]) == 2
    assert main(["clean", str(disk_dir)]) == 2
    assert "nothing there was touched" in capsys.readouterr().err
    assert (lookalike / "swap-0.bin").read_bytes() == b"not ours"
    assert (disk_dir / "data.bin").read_bytes() == b"user data"
    (lookalike / "swap-0.bin").unlink()
    lookalike.rmdir()


def test_clean_of_a_missing_path(disk_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["clean", str(disk_dir / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_clean_removes_a_dir_left_with_only_the_temporary_marker(disk_dir: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """A run killed between writing its marker and renaming it; named directly or via its parent."""
    owner = _dead_owner()
    for how in ("directly", "parent"):
        path = disk_dir / f"infinity-swap-r0-p{owner.pid}-{'ab' if how == 'parent' else 'cd'}0000"
        path.mkdir(mode=0o700)
        (path / TMP_MARKER).write_text(sd.Marker(owner=owner).to_json())
        assert main(["clean", str(path if how == "directly" else disk_dir)]) == 0, capsys.readouterr().err
        assert "freed 0 B in 0 swap files" in capsys.readouterr().out and not path.exists()
    # beside anything else it is not recognised: refused, nothing touched
    path = disk_dir / f"infinity-swap-r0-p{owner.pid}-ef0000"
    path.mkdir(mode=0o700)
    (path / TMP_MARKER).write_text(sd.Marker(owner=owner).to_json())
    (path / "data.bin").write_bytes(b"not ours")
    assert main(["clean", str(path)]) == 2
    assert "nothing there was touched" in capsys.readouterr().err
    assert sorted(os.listdir(path)) == ["data.bin", TMP_MARKER]
    for name in os.listdir(path):
        (path / name).unlink()
    path.rmdir()


def test_clean_of_a_parent_through_a_link_or_holding_a_marker_named_file(disk_dir: Path,
                                                                          tmp_path: Path) -> None:
    """An nvme_path given as a symbolic link (/scratch -> /mnt/nvme) was refused as "a symlink";
    a user's own file named like the marker in the parent made clean refuse the whole parent.
    Both are parents: their dead runs' directories are reclaimed, the user's files kept."""
    real = disk_dir / "nvme"
    real.mkdir()
    (real / MARKER_NAME).write_text("the user's own file")
    dead = _stale_dir(real)
    link = tmp_path / "scratch"
    link.symlink_to(real)
    assert main(["clean", str(link)]) == 0
    assert not dead.exists() and (real / MARKER_NAME).read_text() == "the user's own file"
    dead = _stale_dir(real)
    assert main(["clean", str(real)]) == 0
    assert not dead.exists() and (real / MARKER_NAME).exists()
    (real / MARKER_NAME).unlink()
    real.rmdir()


def _unreadable(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Make ``path`` unreadable: chmod 000, and (as root, whom that does not stop) listing it
    raises the PermissionError a non-root user would get."""
    real_listdir = os.listdir

    def listdir(p=".") -> list[str]:
        if Path(p) == path or Path(p).resolve() == path.resolve():
            raise PermissionError(13, "Permission denied", str(p))
        return real_listdir(p)

    path.chmod(0)
    monkeypatch.setattr(os, "listdir", listdir)


def test_clean_of_a_parent_goes_on_past_an_unreadable_directory(
        disk_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's 0700 swap directory sorted before a stale one stopped clean there (exit 2,
    the stale one kept); it is reported as refused, naming the path and the error, and the stale
    directories after it are still reclaimed; exit 2 at the end."""
    locked = _stale_dir(disk_dir, "infinity-swap-r0-p1-aaaaaa")
    stale = _stale_dir(disk_dir, "infinity-swap-r1-p2-bbbbbb")
    assert sd.find_swap_dirs(disk_dir) == [locked, stale]    # the unreadable one comes first
    _unreadable(monkeypatch, locked)
    try:
        assert main(["clean", str(disk_dir)]) == 2
    finally:
        locked.chmod(0o700)
    out, err = capsys.readouterr()
    assert not stale.exists() and "freed 1.00 MiB in 1 swap files" in out
    assert f"refused: {locked} could not be checked: Permission denied (errno 13)" in err
    assert (locked / "swap-0.bin").exists()
    monkeypatch.undo()
    assert main(["clean", str(disk_dir)]) == 0 and not locked.exists()


def test_clean_of_an_unlistable_parent(disk_dir: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    parent = disk_dir / "nvme"
    parent.mkdir()
    _unreadable(monkeypatch, parent)
    try:
        assert main(["clean", str(parent)]) == 2
    finally:
        parent.chmod(0o700)
    err = capsys.readouterr().err
    assert f"cannot list {parent} to find its swap directories: Permission denied" in err
    parent.rmdir()


def test_clean_of_a_checkpoint_directory_removes_unfinished_saves_staging(
        disk_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """A save killed with kill -9 leaves ``.<tag>.partial.<token>``; ``infinity clean SAVE_DIR``
    removes the files a save writes from it, gives the user's back to their tag, and refuses
    while a live process holds the save lock."""
    from infinity.checkpoint.writer_lock import SaveLock

    ckpt = disk_dir / "ckpt"
    (ckpt / "t").mkdir(parents=True)
    (ckpt / "t" / "manifest.json").write_text("{}")
    staging = ckpt / ".t.partial.0a1b2c3d"
    staging.mkdir()
    (staging / "rank0_model.safetensors").write_bytes(b"half")
    (staging / "notes.txt").write_text("the user's")
    (ckpt / "mine.txt").write_text("keep")
    assert main(["clean", str(ckpt), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "would remove" in said and staging.exists()
    assert f"files of other names in it would go back into {ckpt / 't'}" in said
    with SaveLock.acquire(ckpt):        # a save running now (another fd: another writer)
        assert main(["clean", str(ckpt)]) == 2
        assert "being saved into by another process" in capsys.readouterr().err
        assert staging.exists()
    assert main(["clean", str(ckpt)]) == 0
    assert "removed, left by a checkpoint save" in capsys.readouterr().out
    assert sorted(p.name for p in ckpt.iterdir()) == ["mine.txt", "t"]
    assert (ckpt / "t" / "notes.txt").read_text() == "the user's"


def test_clean_removes_the_latest_a_killed_save_never_renamed(disk_dir: Path, capsys) -> None:
    """A save killed between writing its new ``latest`` and the rename left
    ``.latest.<8 hex>.pending``: the next saves kept it, and clean said "nothing to clean".
    Names that only look like it are the user's."""
    ckpt = disk_dir / "ckpt"
    (ckpt / "t").mkdir(parents=True)
    (ckpt / "latest").write_text("t")
    pending = ckpt / ".latest.00bc4625.pending"
    pending.write_text("t2")
    (ckpt / ".latest.mine.pending").write_text("the user's")
    assert main(["clean", str(ckpt), "--dry-run"]) == 0
    assert f"{pending}: would remove it" in capsys.readouterr().out and pending.exists()
    assert main(["clean", str(ckpt)]) == 0
    assert f"{pending}: removed" in capsys.readouterr().out
    assert sorted(p.name for p in ckpt.iterdir()) == [".latest.mine.pending", "latest", "t"]


def test_clean_of_a_parent_leaves_hidden_partial_names_that_are_not_a_saves(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A user's ``.dataset.partial`` directory (no writer's token) and a ``.tokenizer.json.partial``
    in a directory that holds no weights are not what a save left: untouched (clean removed the
    files of a save's names from the one, moved the rest into ``dataset``, and deleted the other)."""
    users = tmp_path / ".dataset.partial"
    users.mkdir()
    for name in ("manifest.json", "rank0_model.safetensors", "notes.txt"):
        (users / name).write_text(name)
    (tmp_path / "dataset").mkdir()
    (tmp_path / ".tokenizer.json.partial").write_text("theirs")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main(["clean", str(tmp_path)]) == 0     # nothing of ours: nothing to do, not a failure
    assert "nothing to clean" in capsys.readouterr().out
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    # the same hidden file beside a weights save is that save's: removed
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    assert main(["clean", str(tmp_path)]) == 0
    assert not (tmp_path / ".tokenizer.json.partial").exists()
    assert sorted(p.name for p in users.iterdir()) == ["manifest.json", "notes.txt",
                                                       "rank0_model.safetensors"]
