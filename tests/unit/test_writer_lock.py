"""The checkpoint save lock (checkpoint/writer_lock.py) at unit level, without an engine: what
tells a broken lock from a working one -- who may take it, what a refusal says, what release removes, the races it handles."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.checkpoint import writer_lock as wl
from infinity.checkpoint.tensor_file import CheckpointError
from infinity.checkpoint.writer_lock import LOCK_FORMAT, LOCK_NAME, SaveDirBusyError, SaveLock
from infinity.storage.swap_dir import Owner


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _lock_text(owner: Owner, fmt: str = LOCK_FORMAT) -> str:
    return json.dumps({"format": fmt, "owner": {
        "pid": owner.pid, "boot_id": owner.boot_id, "start_time": owner.start_time,
        "rank": owner.rank, "hostname": owner.hostname}})


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_acquire_writes_the_owner_and_release_removes_the_file(tmp_path: Path) -> None:
    before = _open_fds()
    lock = SaveLock.acquire(tmp_path)
    assert lock.held and lock.save_dir == tmp_path
    me = Owner.of_this_process(rank=0)
    assert lock.owner == me
    data = json.loads((tmp_path / LOCK_NAME).read_text())
    assert data == {"format": LOCK_FORMAT, "owner": {
        "pid": me.pid, "boot_id": me.boot_id, "start_time": me.start_time, "rank": 0,
        "hostname": me.hostname}}
    assert oct(os.stat(tmp_path / LOCK_NAME).st_mode & 0o777) == oct(0o644 & ~_umask())
    lock.release()
    assert not lock.held and os.listdir(tmp_path) == []
    assert _open_fds() <= before        # both descriptors closed
    lock.release()                      # idempotent
    with SaveLock.acquire(tmp_path) as again:
        assert again.held
    assert not again.held and os.listdir(tmp_path) == []


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_the_lock_fds_are_not_inherited(tmp_path: Path) -> None:
    lock = SaveLock.acquire(tmp_path)
    try:
        for fd in (lock._fd, lock._dir_fd):
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        lock.release()


def test_a_second_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = SaveLock.acquire(tmp_path)
    before = _open_fds()
    try:
        with pytest.raises(SaveDirBusyError) as info:
            SaveLock.acquire(tmp_path)      # a second open file: a second writer
        assert str(info.value) == (
            f"{tmp_path} is being saved into by another process (pid {os.getpid()} on host "
            f"{socket.gethostname()!r}), which holds {tmp_path / LOCK_NAME}: one writer per "
            "checkpoint directory at a time. Stop that job, or save this one to another save_dir")
        assert _open_fds() <= before        # the refused writer closed what it opened
        assert (tmp_path / LOCK_NAME).exists() and first.held
    finally:
        first.release()


def test_a_refusal_while_the_holder_has_not_written_its_name_yet(tmp_path: Path) -> None:
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SaveDirBusyError,
                           match=r"another process \(a process whose lock file says nothing yet\)"):
            SaveLock.acquire(tmp_path)
    finally:
        os.close(fd)


def test_a_dead_writers_lock_file_is_taken_over_with_a_log_line(tmp_path: Path, infinity_info_log) -> None:
    me = Owner.of_this_process(rank=0)
    dead = Owner(_dead_pid(), me.boot_id, 1, 3, me.hostname)
    (tmp_path / LOCK_NAME).write_text(_lock_text(dead) + " " * 50)   # longer than ours
    lock = SaveLock.acquire(tmp_path)
    try:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["owner"]["pid"] == me.pid
        assert (f"taking over the save lock of {tmp_path} from a dead writer (its owner pid "
                f"{dead.pid} is gone)") in infinity_info_log.text
    finally:
        lock.release()


def test_our_own_lock_file_left_behind_is_taken_without_judging(tmp_path: Path, infinity_info_log) -> None:
    """The same process's file (a save of this process that died before removing it)."""
    (tmp_path / LOCK_NAME).write_text(_lock_text(Owner.of_this_process(rank=0)))
    lock = SaveLock.acquire(tmp_path)
    lock.release()
    assert "taking over" not in infinity_info_log.text


@pytest.mark.parametrize("content", ["", "garbage", "[1]", '{"format": "other/1", "owner": {}}',
                                     '{"format": "infinity-save-lock/1"}',
                                     '{"format": "infinity-save-lock/1", "owner": {"pid": "x"}}',
                                     b"\xff\xfe"])
def test_a_lock_file_that_names_no_owner_is_taken_silently(tmp_path: Path, content,
                                                           infinity_info_log) -> None:
    path = tmp_path / LOCK_NAME
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    lock = SaveLock.acquire(tmp_path)
    lock.release()
    assert "taking over" not in infinity_info_log.text and os.listdir(tmp_path) == []


def test_read_owner_reads_every_field(tmp_path: Path) -> None:
    owner = Owner(pid=12, boot_id="b", start_time=34, rank=5, hostname="h")
    path = tmp_path / "f"
    path.write_text(_lock_text(owner))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert wl._read_owner(fd) == owner
    finally:
        os.close(fd)
    path.write_text(_lock_text(owner, fmt="infinity-save-lock/2"))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert wl._read_owner(fd) is None
    finally:
        os.close(fd)


def _no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")


@pytest.fixture
def live_child():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        yield child
    finally:
        child.stdin.close()
        child.wait(timeout=60)


@pytest.mark.parametrize("code", sorted(wl._NO_FLOCK))
def test_without_flock_the_named_owner_decides(tmp_path: Path, monkeypatch, live_child,
                                               code) -> None:
    def no_flock(fd, op):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(wl.fcntl, "flock", no_flock)
    me = Owner.of_this_process(rank=0)
    from infinity.storage.swap_dir import process_start_time
    alive = Owner(live_child.pid, me.boot_id, process_start_time(live_child.pid), 0, me.hostname)
    (tmp_path / LOCK_NAME).write_text(_lock_text(alive))
    with pytest.raises(SaveDirBusyError) as info:
        SaveLock.acquire(tmp_path)
    assert str(info.value) == (
        f"{tmp_path} may be in use by another writer (pid {alive.pid} on host "
        f"{me.hostname!r}): its owner pid {alive.pid} (rank 0) is still running. One writer per "
        f"checkpoint directory at a time: stop that job, or save to another save_dir; if you "
        f"know it is gone, remove {tmp_path / LOCK_NAME}")
    (tmp_path / LOCK_NAME).write_text(_lock_text(Owner(_dead_pid(), me.boot_id, 1, 0,
                                                       me.hostname)))
    lock = SaveLock.acquire(tmp_path)
    lock.release()
    assert os.listdir(tmp_path) == []


def test_an_owner_on_another_host_is_not_taken_over(tmp_path: Path, monkeypatch) -> None:
    """Without flock (a shared filesystem), a lock of another host cannot be judged from here."""
    monkeypatch.setattr(wl.fcntl, "flock", _no_flock)
    other = Owner(_dead_pid(), "another-boot", 1, 0, "another-host")
    (tmp_path / LOCK_NAME).write_text(_lock_text(other))
    with pytest.raises(SaveDirBusyError, match="'another-host'.*cannot be seen from here"):
        SaveLock.acquire(tmp_path)


def test_a_flock_error_other_than_no_support_is_raised(tmp_path: Path, monkeypatch) -> None:
    def failing(fd, op):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(wl.fcntl, "flock", failing)
    before = _open_fds()
    with pytest.raises(OSError, match="I/O error"):
        SaveLock.acquire(tmp_path)
    assert _open_fds() <= before


def test_the_lock_is_exclusive_and_never_waits(tmp_path: Path, monkeypatch) -> None:
    real = fcntl.flock

    def never_blocking(fd, op):          # a request that would wait fails the test, not hangs it
        if not op & fcntl.LOCK_NB:
            raise AssertionError("a blocking flock request")
        return real(fd, op)
    # a shared lock held elsewhere: an exclusive request is refused at once
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        monkeypatch.setattr(wl.fcntl, "flock", never_blocking)
        with pytest.raises(SaveDirBusyError):
            SaveLock.acquire(tmp_path)
    finally:
        monkeypatch.undo()
        os.close(fd)


def test_a_lock_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target.txt"
    target.write_text("keep")
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / LOCK_NAME).symlink_to(target)
    before = _open_fds()
    with pytest.raises(CheckpointError) as info:
        SaveLock.acquire(save_dir)
    assert str(info.value) == (f"{save_dir / LOCK_NAME} is a symbolic link; it is left alone: "
                               "remove it (infinity creates this file itself)")
    assert target.read_text() == "keep" and _open_fds() <= before


def test_a_lock_that_cannot_be_created_says_so(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).mkdir()          # EISDIR
    with pytest.raises(OSError) as info:
        SaveLock.acquire(tmp_path)
    assert info.value.errno == errno.EISDIR
    assert f"cannot create the save lock {tmp_path / LOCK_NAME}: Is a directory" in str(info.value)
    assert not isinstance(info.value, CheckpointError)


def test_a_save_dir_that_is_a_symbolic_link_is_locked_in_its_target(tmp_path: Path) -> None:
    real = tmp_path / "scratch"
    real.mkdir()
    link = tmp_path / "ckpt"
    link.symlink_to(real)
    with SaveLock.acquire(link):
        assert (real / LOCK_NAME).is_file()
    assert os.listdir(real) == []


def test_a_lock_file_replaced_meanwhile_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    """Its holder removed it between our open and our flock (and a third writer made a new one):
    the lock taken must be the file the name points to."""
    real_flock = fcntl.flock
    replaced = []

    def flock_after_replacement(fd, op):
        if not replaced:
            replaced.append(True)
            os.unlink(tmp_path / LOCK_NAME)
            (tmp_path / LOCK_NAME).write_text("")
        return real_flock(fd, op)
    monkeypatch.setattr(wl.fcntl, "flock", flock_after_replacement)
    lock = SaveLock.acquire(tmp_path)
    try:
        assert os.fstat(lock._fd).st_ino == os.stat(tmp_path / LOCK_NAME).st_ino
        assert json.loads((tmp_path / LOCK_NAME).read_text())["owner"]["pid"] == os.getpid()
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []


def test_a_lock_file_removed_meanwhile_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    real_flock = fcntl.flock
    removed = []

    def flock_after_removal(fd, op):
        if not removed:
            removed.append(True)
            os.unlink(tmp_path / LOCK_NAME)
        return real_flock(fd, op)
    monkeypatch.setattr(wl.fcntl, "flock", flock_after_removal)
    lock = SaveLock.acquire(tmp_path)
    try:
        assert os.fstat(lock._fd).st_ino == os.stat(tmp_path / LOCK_NAME).st_ino
    finally:
        lock.release()


def test_a_lock_replaced_every_time_gives_up_after_100_tries(tmp_path: Path, monkeypatch) -> None:
    tries = []
    real_is_the_path = wl._is_the_path

    def never(fd, dir_fd):
        tries.append(real_is_the_path(fd, dir_fd))
        return False
    monkeypatch.setattr(wl, "_is_the_path", never)
    before = _open_fds()
    with pytest.raises(SaveDirBusyError) as info:
        SaveLock.acquire(tmp_path)
    assert str(info.value) == (f"could not take the save lock {tmp_path / LOCK_NAME}: it kept "
                               "being replaced; is another job saving here in a loop?")
    assert len(tries) == 100 and all(tries)
    assert _open_fds() <= before


def test_release_never_removes_a_lock_file_that_is_not_its_own(tmp_path: Path) -> None:
    lock = SaveLock.acquire(tmp_path)
    os.unlink(tmp_path / LOCK_NAME)
    (tmp_path / LOCK_NAME).write_text("another writer's")
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == "another writer's"
    lock = SaveLock.acquire(tmp_path)
    os.unlink(tmp_path / LOCK_NAME)
    lock.release()                      # its file is gone: nothing to remove
    assert os.listdir(tmp_path) == []


def test_release_tolerates_the_file_vanishing_between_check_and_unlink(tmp_path: Path,
                                                                       monkeypatch) -> None:
    lock = SaveLock.acquire(tmp_path)
    real_unlink = os.unlink

    def unlink_raced(name, *a, **kw):
        real_unlink(name, *a, **kw)
        raise FileNotFoundError(errno.ENOENT, "gone", name)
    monkeypatch.setattr(wl.os, "unlink", unlink_raced)
    before = _open_fds()
    lock.release()
    monkeypatch.undo()
    assert not lock.held and os.listdir(tmp_path) == []
    assert len(before - _open_fds()) == 2      # both descriptors closed anyway


def test_is_the_path(tmp_path: Path) -> None:
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    (tmp_path / LOCK_NAME).write_text("")
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDONLY)
    try:
        assert wl._is_the_path(fd, dir_fd) is True
        other = tmp_path / "other"
        other.write_text("")
        fd2 = os.open(other, os.O_RDONLY)
        try:
            assert wl._is_the_path(fd2, dir_fd) is False
        finally:
            os.close(fd2)
        os.unlink(tmp_path / LOCK_NAME)
        os.symlink(other, tmp_path / LOCK_NAME)
        fd3 = os.open(other, os.O_RDONLY)
        try:
            assert wl._is_the_path(fd3, dir_fd) is False     # the link itself, not its target
        finally:
            os.close(fd3)
        os.unlink(tmp_path / LOCK_NAME)
        assert wl._is_the_path(fd, dir_fd) is False
    finally:
        os.close(fd)
        os.close(dir_fd)


def test_acquire_of_a_missing_directory_raises_and_leaks_nothing(tmp_path: Path) -> None:
    before = _open_fds()
    with pytest.raises(FileNotFoundError):
        SaveLock.acquire(tmp_path / "missing")
    assert _open_fds() <= before


def test_a_lock_of_another_hostname_under_this_kernel_is_judged_by_the_flock(tmp_path: Path,
                                                                             monkeypatch) -> None:
    """A container restarted under a new name (same boot id): nobody holds the flock, so its
    lock is taken over; without flock on the filesystem it cannot be told, so it is refused."""
    me = Owner.of_this_process(rank=0)
    if not me.boot_id:
        pytest.skip("no boot id on this system")
    old_pod = Owner(_dead_pid(), me.boot_id, 1, 0, "old-pod-name")
    (tmp_path / LOCK_NAME).write_text(_lock_text(old_pod))
    monkeypatch.setattr(wl.fcntl, "flock", _no_flock)
    with pytest.raises(SaveDirBusyError, match="'old-pod-name'"):
        SaveLock.acquire(tmp_path)
    monkeypatch.undo()
    lock = SaveLock.acquire(tmp_path)
    lock.release()
    assert os.listdir(tmp_path) == []
