"""Behaviour the first mutation run of infinity/storage/swap_dir.py found untested (BENCHMARKS.md,
Mutation testing): the lock's lifetime, a directory created but never marked, name collisions,
cleanup after a failed create, the marker file's mode and symlink refusal, a second remove()."""
from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import time

import pytest

from infinity.storage import swap_dir as sd
from infinity.storage.swap_dir import MARKER_NAME, SwapDir, SwapDirError

TMP_MARKER = MARKER_NAME + ".tmp"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_created_name_matches_the_pattern_reclaim_recognises(tmp_path):
    d = SwapDir.create(tmp_path, rank=5)
    match = sd._DIR_NAME.match(d.path.name)
    assert match is not None
    assert (int(match.group(1)), int(match.group(2))) == (5, os.getpid())
    d.remove()


def test_marker_records_creation_time(tmp_path):
    before = time.time()
    d = SwapDir.create(tmp_path)
    created = sd.read_marker(d.path).created
    assert before - 5 <= created <= time.time() + 5
    d.remove()


def test_orphan_empty_dir_owner_comes_from_its_name(tmp_path):
    pid = _dead_pid()
    path = tmp_path / f"{sd.DIR_PREFIX}r7-p{pid}-abcdef"
    path.mkdir()
    old = time.time() - 3600
    os.utime(path, (old, old))
    marker = sd._orphan_marker(path)
    assert (marker.owner.rank, marker.owner.pid) == (7, pid)
    assert marker.created == pytest.approx(os.lstat(path).st_mtime)
    result = sd.reclaim(path)
    assert result.dir_removed and not path.exists()


def test_lock_fd_is_close_on_exec(tmp_path):
    d = SwapDir.create(tmp_path)
    assert fcntl.fcntl(d._lock_fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    d.remove()


def test_lock_held_while_alive_and_released_by_remove_even_if_dir_stays(tmp_path):
    d = SwapDir.create(tmp_path)
    assert sd._lock_state(d.path) is True
    (d.path / "users-file").write_text("x")      # the directory will have to stay
    result = d.remove()
    assert not result.dir_removed and result.leftovers == ["users-file"]
    assert sd._lock_state(d.path) is False


def test_hold_lock_on_exclusively_locked_dir_raises_oserror(tmp_path):
    d = SwapDir.create(tmp_path)
    d._release_lock()
    fd = os.open(d.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            d._hold_lock()
        assert d._lock_fd is None
    finally:
        os.close(fd)
    d.remove()


def test_create_never_reuses_an_existing_directory(tmp_path, monkeypatch):
    taken = tmp_path / f"{sd.DIR_PREFIX}r0-p{os.getpid()}-aaaaaa"
    taken.mkdir()
    (taken / "precious").write_text("keep")
    names = iter(["aaaaaa", "bbbbbb"])
    monkeypatch.setattr(sd.secrets, "token_hex", lambda n: next(names))
    d = SwapDir.create(tmp_path)
    assert d.path.name.endswith("-bbbbbb")
    assert not (taken / MARKER_NAME).exists() and (taken / "precious").read_text() == "keep"
    d.remove()


def test_failed_marker_write_keeps_first_exception_and_removes_dir(tmp_path, monkeypatch):
    def boom(self):
        raise RuntimeError("disk full")
    monkeypatch.setattr(SwapDir, "_write_marker", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        SwapDir.create(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_failed_create_with_stray_entry_keeps_first_exception(tmp_path, monkeypatch):
    def boom(self):
        (self.path / "stray").write_text("x")
        raise RuntimeError("killed")
    monkeypatch.setattr(SwapDir, "_write_marker", boom)
    with pytest.raises(RuntimeError, match="killed"):
        SwapDir.create(tmp_path)


def test_marker_file_mode_is_0600(tmp_path):
    old = os.umask(0)
    try:
        d = SwapDir.create(tmp_path)
        d.register_file("a.bin")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(d.path / MARKER_NAME).st_mode) == 0o600
    d.remove()


def test_marker_write_refuses_a_planted_symlink(tmp_path):
    (tmp_path / "p").mkdir()
    d = SwapDir.create(tmp_path / "p")
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    os.symlink(victim, d.path / TMP_MARKER)
    with pytest.raises(OSError):
        d.register_file("a.bin")
    assert victim.read_text() == "untouched"


def test_second_remove_reports_the_dir_removed_and_registering_after_fails(tmp_path):
    d = SwapDir.create(tmp_path)
    d.register_file("a.bin").write_bytes(b"1234")
    first = d.remove()
    assert first.dir_removed and first.files_removed == 1
    second = d.remove()
    assert second.path == d.path and second.dir_removed and second.files_removed == 0
    with pytest.raises(SwapDirError):
        d.register_file("b.bin")


def test_marker_json_round_trip_and_missing_created():
    owner = sd.Owner(pid=12, boot_id="b", start_time=34, rank=3, hostname="h")
    m = sd.Marker(owner=owner, files=["a.bin", "b.bin"], created=1234.5)
    assert sd.Marker.from_json(m.to_json(), None) == m
    import json
    data = json.loads(m.to_json())
    del data["created"]
    assert sd.Marker.from_json(json.dumps(data), None).created == 0.0


def test_dry_run_reports_the_listed_files_blocks(tmp_path):
    pid = _dead_pid()
    owner = sd.Owner(pid=pid, boot_id=sd.boot_id(), start_time=1, rank=0, hostname=sd.socket.gethostname())
    path = tmp_path / f"{sd.DIR_PREFIX}r0-p{pid}-abcdef"
    path.mkdir()
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=["a.bin", "b.bin"]).to_json())
    for name, size in (("a.bin", 8192), ("b.bin", 12288)):
        with open(path / name, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
    expected = sum(os.lstat(path / n).st_blocks * 512 for n in ("a.bin", "b.bin"))
    result = sd.reclaim(path, dry_run=True)
    assert result.path == path and result.bytes_freed == expected and result.files_removed == 2
    assert (path / "a.bin").exists()


def test_lock_state_cannot_be_told_through_a_symlink_or_of_a_file(tmp_path):
    d = SwapDir.create(tmp_path)
    link = tmp_path / "link"
    os.symlink(d.path, link)
    assert sd._lock_state(link) is None
    regular = tmp_path / "file"
    regular.write_text("x")
    assert sd._lock_state(regular) is None
    d.remove()


def test_remove_listed_refuses_a_symlinked_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.bin").write_text("keep")
    link = tmp_path / "link"
    os.symlink(real, link)
    with pytest.raises(OSError):
        sd._remove_listed(link, ["a.bin"])
    assert (real / "a.bin").read_text() == "keep"
