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


# -- second round (the recheck's survivors that were real gaps) -------------------------------------

def _dead_owner_dir(parent, name="", files=None):
    """A killed run's directory: marker naming a gone pid of this host, listed files allocated."""
    pid = _dead_pid()
    owner = sd.Owner(pid=pid, boot_id=sd.boot_id(), start_time=1, rank=0,
                     hostname=sd.socket.gethostname())
    path = parent / (name or f"{sd.DIR_PREFIX}r0-p{pid}-abcdef")
    path.mkdir(mode=0o700)
    files = files or {}
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=list(files)).to_json())
    for file_name, size in files.items():
        with open(path / file_name, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
    return path, pid


def test_boot_id_is_empty_when_the_kernel_does_not_expose_one(tmp_path, monkeypatch):
    monkeypatch.setattr(sd, "_BOOT_ID_PATH", str(tmp_path / "no-such-file"))
    assert sd.boot_id() == ""


def test_start_time_is_stable_across_a_parenthesised_name_and_memory_growth():
    """The start time is the pid-reuse check's key: it must not change while the process runs,
    whatever its command name (which may hold ') ' and look like a state) or its memory size."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys\n"
        "sys.stdin.readline()\n"
        "open('/proc/self/comm', 'w').write('x) Z 1 2 3 4')\n"
        "m = mmap.mmap(-1, 1 << 30)\n"          # 1 GiB of address space, no memory used
        "print('renamed', flush=True)\n"
        "sys.stdin.readline()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = sd.process_start_time(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "renamed"
        assert open(f"/proc/{child.pid}/comm").read().startswith("x) Z")
        assert sd.process_start_time(child.pid) == before
        # clock ticks since boot: after our own start, not after now
        uptime_ticks = float(open("/proc/uptime").read().split()[0]) * os.sysconf("SC_CLK_TCK")
        assert sd.process_start_time(os.getpid()) <= before <= uptime_ticks + 1
    finally:
        child.stdin.close()
        child.wait(timeout=60)
        child.stdout.close()


def test_dry_run_and_real_run_agree_on_reason_and_bytes(tmp_path):
    path, pid = _dead_owner_dir(tmp_path, files={"a.bin": 1 << 20, "b.bin": 8192})
    dry = sd.reclaim(path, dry_run=True)
    assert f"pid {pid} is gone" in dry.reason
    real = sd.reclaim(path)
    assert real.reason == dry.reason
    assert real.bytes_freed == dry.bytes_freed >= (1 << 20) + 8192
    assert real.files_removed == dry.files_removed == 2 and not path.exists()


def test_read_marker_errors_name_what_is_wrong(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        sd.read_marker(missing)
    regular = tmp_path / "regular"
    regular.write_text("x")
    with pytest.raises(sd.NotOursError, match=f"{regular} is not a directory"):
        sd.read_marker(regular)
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(regular, linked / MARKER_NAME)
    with pytest.raises(sd.NotOursError, match=f"{linked / MARKER_NAME} is not a regular file"):
        sd.read_marker(linked)
    other = tmp_path / "other"
    other.mkdir()
    (other / MARKER_NAME).write_text('{"format": "someone-else/9"}')
    with pytest.raises(sd.NotOursError) as info:
        sd.read_marker(other)
    message = str(info.value)
    assert str(other / MARKER_NAME) in message and "'someone-else/9'" in message
    assert sd.MARKER_FORMAT in message


def test_a_young_orphan_is_refused_naming_the_directory_and_its_state(tmp_path):
    empty = tmp_path / f"{sd.DIR_PREFIX}r0-p{_dead_pid()}-abcdef"
    empty.mkdir()
    with pytest.raises(sd.OwnerAliveError, match=f"{empty} is empty from"):
        sd.reclaim(empty)
    partial = tmp_path / f"{sd.DIR_PREFIX}r0-p{_dead_pid()}-fedcba"
    partial.mkdir()
    (partial / TMP_MARKER).write_text('{\n "format": ')
    with pytest.raises(sd.OwnerAliveError,
                       match=f"{partial} holds only a partly written {TMP_MARKER} from"):
        sd.reclaim(partial)


def test_no_free_name_left_names_the_parent(tmp_path, monkeypatch):
    monkeypatch.setattr(sd.secrets, "token_hex", lambda n: "aaaaaa")
    (tmp_path / f"{sd.DIR_PREFIX}r0-p{os.getpid()}-aaaaaa").mkdir()
    with pytest.raises(SwapDirError, match=f"fresh swap directory under {tmp_path}"):
        SwapDir.create(tmp_path)


def test_register_errors_name_the_file_and_the_directory(tmp_path):
    d = SwapDir.create(tmp_path)
    d.register_file("a.bin")
    with pytest.raises(ValueError, match=f"'a.bin' is already registered in {d.path}"):
        d.register_file("a.bin")
    d.remove()
    with pytest.raises(SwapDirError, match=f"{d.path} was already removed"):
        d.register_file("b.bin")


def test_reclaim_stale_goes_on_past_live_and_foreign_dirs_and_logs_what_it_freed(tmp_path,
                                                                                 infinity_log):
    live = SwapDir.create(tmp_path)                                # infinity-swap-r0-p<pid>-...
    foreign = tmp_path / f"{sd.DIR_PREFIX}m-foreign"                # no marker
    foreign.mkdir()
    stale, pid = _dead_owner_dir(tmp_path, name=f"{sd.DIR_PREFIX}z-stale", files={"s.bin": 4096})
    assert sorted(sd.find_swap_dirs(tmp_path)) == sorted([live.path, foreign, stale])
    assert sd.find_swap_dirs(tmp_path)[-1] == stale
    with infinity_log.at_level("DEBUG", logger="infinity"):
        done = sd.reclaim_stale(tmp_path)
    assert [r.path for r in done] == [stale] and not stale.exists()
    assert live.path.exists() and foreign.exists()
    assert f"reclaimed swap dir {stale}" in infinity_log.text
    assert f"pid {pid} is gone" in infinity_log.text
    # INFINITY_LOG_LEVEL=DEBUG says why each other directory was left
    assert f"not reclaiming {live.path}: {live.path} is in use: its owner pid" in infinity_log.text
    assert f"skipping {foreign}: {foreign} has no {MARKER_NAME} marker" in infinity_log.text
    live.remove()


def test_a_directory_that_cannot_be_checked_is_named_in_the_warning(tmp_path, monkeypatch,
                                                                    infinity_log):
    blocked, _ = _dead_owner_dir(tmp_path, name=f"{sd.DIR_PREFIX}a-blocked")
    real_read = sd.read_marker

    def read_marker(path):
        if sd.Path(path) == blocked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(sd, "read_marker", read_marker)
    assert sd.reclaim_stale(tmp_path) == []
    assert f"could not check or reclaim {blocked} ([Errno 13] Permission denied" in infinity_log.text


def test_unlisted_names_are_refused_with_a_warning_naming_them(tmp_path, infinity_log):
    path, _ = _dead_owner_dir(tmp_path)
    owner = sd.read_marker(path).owner
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=["../victim"]).to_json())
    sd.reclaim(path)
    assert f"swap dir {path}: marker lists '../victim'" in infinity_log.text


def test_a_listed_symlink_is_removed_counting_its_own_blocks_not_its_targets(tmp_path):
    target = tmp_path / "big-outside"
    with open(target, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
    path, _ = _dead_owner_dir(tmp_path, files={"a.bin": 4096})
    owner = sd.read_marker(path).owner
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=["link.bin", "a.bin"]).to_json())
    os.symlink(target, path / "link.bin")
    result = sd.reclaim(path)
    assert result.dir_removed and result.files_removed == 2
    assert result.bytes_freed < 1 << 20
    assert os.lstat(target).st_size == 1 << 20


def test_a_listed_directory_is_left_and_the_files_after_it_removed(tmp_path):
    path, _ = _dead_owner_dir(tmp_path, files={"b.bin": 4096})
    owner = sd.read_marker(path).owner
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=["sub", "b.bin"]).to_json())
    (path / "sub").mkdir()
    result = sd.reclaim(path)
    assert not result.dir_removed and result.leftovers == ["sub"] and result.files_removed == 1
    assert sorted(os.listdir(path)) == ["sub"]


def test_a_directory_removed_meanwhile_by_another_cleaner_counts_as_removed(tmp_path, monkeypatch):
    path, _ = _dead_owner_dir(tmp_path, files={"a.bin": 4096})
    real_rmdir = os.rmdir

    def raced(p, *args, **kwargs):   # the other cleaner's rmdir won
        real_rmdir(p, *args, **kwargs)
        raise FileNotFoundError(2, "No such file or directory", str(p))

    monkeypatch.setattr(sd.os, "rmdir", raced)
    result = sd.reclaim(path)
    assert result.dir_removed is True and not path.exists()


def test_a_directory_that_stays_and_cannot_be_listed_is_reported_unreadable(tmp_path, monkeypatch,
                                                                            infinity_log):
    path, _ = _dead_owner_dir(tmp_path, files={"a.bin": 4096})
    (path / "users-file").write_text("x")
    real_listdir, real_rmdir = os.listdir, os.rmdir
    tried_rmdir = []

    def rmdir(p, *args, **kwargs):
        tried_rmdir.append(sd.Path(p))
        return real_rmdir(p, *args, **kwargs)

    def listdir(p="."):   # readable until the removal (as after a permission change meanwhile)
        if sd.Path(p) == path and path in tried_rmdir:
            raise PermissionError(13, "Permission denied", str(p))
        return real_listdir(p)

    monkeypatch.setattr(sd.os, "rmdir", rmdir)
    monkeypatch.setattr(sd.os, "listdir", listdir)
    result = sd.reclaim(path)
    assert not result.dir_removed and result.leftovers == []
    assert f"left {path} in place" in infinity_log.text and "(unreadable)" in infinity_log.text
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == ["users-file"]


def test_names_ending_in_a_newline_are_not_ours(tmp_path):
    """The name patterns ended in "$", which also matches before a final newline."""
    d = SwapDir.create(tmp_path)
    with pytest.raises(ValueError, match="plain name"):
        d.register_file("a.bin\n")
    d.remove()
    path = tmp_path / f"{sd.DIR_PREFIX}r0-p{_dead_pid()}-abcdef\n"
    path.mkdir()
    old = time.time() - 3600
    os.utime(path, (old, old))
    assert sd._orphan_marker(path) is None
    with pytest.raises(sd.NotOursError):
        sd.reclaim(path)
    assert path.is_dir()


def test_a_lock_that_cannot_be_taken_fails_create_with_its_error_and_leaves_nothing(tmp_path,
                                                                                   monkeypatch):
    """A filesystem whose flock fails: create raises the lock's error (not one of its cleanup)
    and leaves no directory behind."""
    def no_flock(fd, op):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(sd.fcntl, "flock", no_flock)
    with pytest.raises(OSError, match="Function not implemented"):
        SwapDir.create(tmp_path)
    assert list(tmp_path.iterdir()) == []
