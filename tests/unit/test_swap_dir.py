"""Private swap directory: 0700 + marker, removal of only our files, reclaim of a dead owner's dir;
the lock's lifetime, a directory created but never marked, name collisions, cleanup after a failed
create, the marker file's mode and symlink refusal, a second remove()."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from infinity.storage import swap_dir as sd
from infinity.storage.swap_dir import (MARKER_NAME, Liveness, NotOursError, Owner,
                                       OwnerAliveError, SwapDir, SwapDirError, reclaim,
                                       reclaim_stale)


TMP_MARKER = MARKER_NAME + ".tmp"   # the marker before its rename
OLDER_THAN_GRACE_S = 120.0        # sd.ORPHAN_GRACE_S is 60


def dead_pid() -> int:
    """A pid that just exited (reuse within the test is vanishingly unlikely)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def fake_private_dir(parent: Path, owner: Owner, files: dict[str, int], name: str = "") -> Path:
    """A directory laid out like a killed run's: marker + listed files of the given sizes."""
    path = parent / (name or f"{sd.DIR_PREFIX}r{owner.rank}-p{owner.pid}-abcdef")
    path.mkdir(mode=0o700)
    marker = sd.Marker(owner=owner, files=list(files))
    (path / MARKER_NAME).write_text(marker.to_json())
    for file_name, size in files.items():
        with open(path / file_name, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
    return path


def test_create_makes_private_dir_with_marker(disk_dir: Path) -> None:
    d = SwapDir.create(disk_dir, rank=3)
    try:
        assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
        data = json.loads((d.path / MARKER_NAME).read_text())
        me = Owner.of_this_process(3)
        assert data["owner"] == {"pid": os.getpid(), "boot_id": me.boot_id,
                                 "start_time": me.start_time, "rank": 3, "hostname": me.hostname}
        assert me.boot_id and me.start_time > 0
        p = d.register_file("swap-0.bin")
        p.write_bytes(b"x" * 10)
        assert sd.read_marker(d.path).files == ["swap-0.bin"]
        with pytest.raises(ValueError, match="not a name the engine creates"):
            d.register_file("../escape")
        assert d.owner.liveness()[0] is Liveness.ALIVE
    finally:
        result = d.remove()
    assert result.dir_removed and result.files_removed == 1 and not d.path.exists()


def test_remove_keeps_foreign_files_and_the_directory(disk_dir: Path, infinity_log) -> None:
    d = SwapDir.create(disk_dir)
    d.register_file("swap-0.bin").write_bytes(b"ours")
    user_file = d.path / "notes.txt"
    user_file.write_text("a user's file")
    result = d.remove()
    assert not result.dir_removed and result.leftovers == ["notes.txt"]
    assert user_file.read_text() == "a user's file"
    assert not (d.path / "swap-0.bin").exists() and not (d.path / MARKER_NAME).exists()
    assert "notes.txt" in infinity_log.text


@pytest.mark.parametrize("how", ["pid_gone", "pid_reused", "rebooted"])
def test_dead_owner_is_reclaimed_with_a_log_line(disk_dir: Path, how: str, infinity_log) -> None:
    me = Owner.of_this_process(0)
    owner = {
        "pid_gone": Owner(dead_pid(), me.boot_id, 12345, 0, me.hostname),
        # an owner that had our pid before us: it started earlier (a later start cannot be)
        "pid_reused": Owner(os.getpid(), me.boot_id, me.start_time - 1, 0, me.hostname),
        "rebooted": Owner(os.getpid(), "00000000-dead-boot-0000-000000000000", me.start_time, 0,
                          me.hostname),
    }[how]
    path = fake_private_dir(disk_dir, owner, {"swap-0.bin": 1 << 20, "swap-1.bin": 1 << 20})
    assert owner.liveness()[0] is Liveness.DEAD
    results = reclaim_stale(disk_dir)
    assert [r.path for r in results] == [path] and not path.exists()
    assert results[0].bytes_freed >= 2 << 20 and results[0].files_removed == 2
    assert "2.00 MiB freed in 2 files" in infinity_log.text


@pytest.fixture
def running_child():
    """A real process that runs until the test ends: its pid and start time are the ones a
    marker's owner is judged against."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_pid_reused_by_a_later_process_is_dead_and_the_same_start_is_alive(running_child) -> None:
    """Pid reuse: the marker's owner had the pid before the process that holds it now, so its
    recorded start time is EARLIER than the current one: dead. The same start time is the
    owner itself: alive. (A comparison by "<" calls the reused pid alive; ">=", "<=" or "=="
    call the owner itself dead.)"""
    me = Owner.of_this_process(0)
    started = sd.process_start_time(running_child.pid)
    assert started is not None and started > 1
    reused = Owner(running_child.pid, me.boot_id, started - 1, 0, me.hostname)
    liveness, reason = reused.liveness()
    assert liveness is Liveness.DEAD, reason
    assert f"pid {running_child.pid} now belongs to another process" in reason
    itself = Owner(running_child.pid, me.boot_id, started, 0, me.hostname)
    assert itself.liveness()[0] is Liveness.ALIVE


def test_a_pid_reused_across_an_unseen_reboot_is_dead(running_child, monkeypatch) -> None:
    """Where the kernel exposes no boot id, a reboot cannot be seen: an owner of the previous
    boot that started late in it (a long uptime) has a start time LATER than the process that
    holds its pid in this boot. Another start time either way is another process (a comparison
    by ">" calls it alive)."""
    monkeypatch.setattr(sd, "boot_id", lambda: "")
    me = Owner.of_this_process(0)
    assert me.boot_id == ""
    started = sd.process_start_time(running_child.pid)
    assert started is not None
    previous_boot = Owner(running_child.pid, "", started + 100 * 86400 * 100, 0, me.hostname)
    liveness, reason = previous_boot.liveness()
    assert liveness is Liveness.DEAD, reason
    assert Owner(running_child.pid, "", started, 0, me.hostname).liveness()[0] is Liveness.ALIVE


def test_live_foreign_and_other_host_dirs_are_not_reclaimed(disk_dir: Path) -> None:
    live = SwapDir.create(disk_dir)
    live.register_file("swap-0.bin").write_bytes(b"live data")
    foreign = disk_dir / f"{sd.DIR_PREFIX}looks-like-ours"
    foreign.mkdir()
    (foreign / "precious.dat").write_text("keep")
    me = Owner.of_this_process(0)
    elsewhere = fake_private_dir(disk_dir, Owner(dead_pid(), "x", 1, 0, "another-host"),
                                 {"swap-0.bin": 4096})
    try:
        assert reclaim_stale(disk_dir) == []
        with pytest.raises(OwnerAliveError, match="still running"):
            reclaim(live.path)
        with pytest.raises(NotOursError, match="no infinity-swap.json marker"):
            reclaim(foreign)
        with pytest.raises(OwnerAliveError, match="another-host"):
            reclaim(elsewhere)
        assert (live.path / "swap-0.bin").read_bytes() == b"live data"
        assert (foreign / "precious.dat").read_text() == "keep"
        assert (elsewhere / "swap-0.bin").exists()
    finally:
        live.remove()
        for p in (foreign / "precious.dat", elsewhere / "swap-0.bin", elsewhere / MARKER_NAME):
            p.unlink()
        foreign.rmdir()
        elsewhere.rmdir()
    assert me.hostname != "another-host"


def test_a_dir_of_another_hostname_under_this_kernel_is_judged_by_its_lock(disk_dir: Path) -> None:
    """A container restarted under a new hostname (same boot id: same kernel) left its swap
    directory: refused forever before ("run it on that host"); now free when no process holds
    its lock, in use when one does."""
    import fcntl
    me = Owner.of_this_process(0)
    if not me.boot_id:
        pytest.skip("no boot id on this system")
    owner = Owner(dead_pid(), me.boot_id, 1, 0, "old-pod-name")
    held = fake_private_dir(disk_dir, owner, {"swap-0.bin": 4096}, name=f"{sd.DIR_PREFIX}held")
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(OwnerAliveError, match="'old-pod-name' .*holds its lock"):
            reclaim(held)
    finally:
        os.close(fd)
    result = reclaim(held)
    assert result.files_removed == 1 and not held.exists()
    assert "same boot id" in result.reason


def test_marker_never_deletes_outside_names(disk_dir: Path) -> None:
    outside = disk_dir / "victim.txt"
    outside.write_text("must survive")
    owner = Owner(dead_pid(), "", 0, 0, Owner.of_this_process(0).hostname)
    path = fake_private_dir(disk_dir, owner, {})
    marker = sd.Marker(owner=owner, files=["../victim.txt", "/etc/hostname", ".hidden"])
    (path / MARKER_NAME).write_text(marker.to_json())
    reclaim(path)
    assert outside.read_text() == "must survive" and not path.exists()
    outside.unlink()


def test_killed_process_dir_is_reclaimed_by_next_start(disk_dir: Path) -> None:
    """A real SIGKILL: the child creates a swap dir with a file and is killed; we reclaim it."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from infinity.storage.swap_dir import SwapDir
        d = SwapDir.create({str(disk_dir)!r}, rank=1)
        with open(d.register_file("swap-0.bin"), "wb") as f:
            os.posix_fallocate(f.fileno(), 0, 1 << 20)
        print(d.path, flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    path = Path(child.stdout.readline().strip())
    assert (path / "swap-0.bin").exists()
    assert reclaim_stale(disk_dir) == []  # still alive
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    results = reclaim_stale(disk_dir)
    assert [r.path for r in results] == [path] and not path.exists()


def test_unreadable_directory_does_not_stop_reclaim(disk_dir: Path, monkeypatch, infinity_log) -> None:
    # Another user's 0700 swap dir cannot be read by a normal user (root reads anything: simulate).
    me = Owner.of_this_process(0)
    blocked = fake_private_dir(disk_dir, Owner(dead_pid(), me.boot_id, 1, 0, me.hostname), {},
                               name=f"{sd.DIR_PREFIX}a-blocked")
    stale = fake_private_dir(disk_dir, Owner(dead_pid(), me.boot_id, 1, 0, me.hostname),
                             {"swap-0.bin": 4096}, name=f"{sd.DIR_PREFIX}b-stale")
    real_read = sd.read_marker

    def read_marker(path):
        if Path(path) == blocked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(sd, "read_marker", read_marker)
    assert [r.path for r in reclaim_stale(disk_dir)] == [stale]
    assert blocked.exists() and "could not check or reclaim" in infinity_log.text
    monkeypatch.undo()
    reclaim(blocked)


def _killed_during_create(parent: Path) -> Path:
    """A real SIGTERM (default action: no unwinding) between the marker's write and its rename."""
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from infinity.storage.swap_dir import SwapDir
        os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGTERM)
        SwapDir.create({str(parent)!r}, rank=2)
        """)], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGTERM, child.stderr
    (path,) = [p for p in parent.iterdir() if p.name.startswith(sd.DIR_PREFIX)]
    assert os.listdir(path) == [TMP_MARKER]
    return path


def test_dir_left_with_only_the_temporary_marker_is_reclaimed(disk_dir: Path) -> None:
    """It was refused ("no marker") by infinity clean and by the next start, forever."""
    path = _killed_during_create(disk_dir)
    assert reclaim(path, dry_run=True).files_removed == 0 and path.exists()
    assert [r.path for r in reclaim_stale(disk_dir)] == [path] and not path.exists()


def test_temporary_marker_cut_short_is_reclaimed_only_when_old_and_its_pid_is_gone(
        disk_dir: Path) -> None:
    text = sd.Marker(owner=Owner(dead_pid(), "", 0, 0, "h")).to_json()
    for pid, content in ((dead_pid(), ""), (dead_pid(), text[:40]), (os.getpid(), text[:40])):
        path = disk_dir / f"{sd.DIR_PREFIX}r0-p{pid}-abc123"
        path.mkdir(mode=0o700)
        tmp = path / TMP_MARKER
        tmp.write_text(content)
        with pytest.raises(OwnerAliveError, match="may be creating it right now"):
            reclaim(path)      # a fresh file: its writer may still run
        old = tmp.stat().st_mtime - OLDER_THAN_GRACE_S
        os.utime(tmp, (old, old))
        if pid == os.getpid():
            with pytest.raises(OwnerAliveError, match="still running"):
                reclaim(path)
            tmp.unlink()
            path.rmdir()
        else:
            assert reclaim(path).dir_removed and not path.exists()


def test_only_an_exact_orphan_is_ours(disk_dir: Path) -> None:
    """Anything beside the temporary marker, another name, or foreign content: refused, untouched."""
    owner = Owner(dead_pid(), "", 0, 0, Owner.of_this_process(0).hostname)
    text = sd.Marker(owner=owner).to_json()
    cases = {  # directory name -> (its entries, the error)
        f"{sd.DIR_PREFIX}r0-p{owner.pid}-aaaaaa": ({TMP_MARKER: text, "data.bin": "x"},
                                                 NotOursError),
        f"{sd.DIR_PREFIX}mine": ({TMP_MARKER: text}, NotOursError),
        f"{sd.DIR_PREFIX}r0-p{owner.pid}-bbbbbb": ({TMP_MARKER: "my notes"}, NotOursError),
    }
    for name, (entries, error) in cases.items():
        path = disk_dir / name
        path.mkdir()
        for entry, content in entries.items():
            (path / entry).write_text(content)
            old = (path / entry).stat().st_mtime - OLDER_THAN_GRACE_S
            os.utime(path / entry, (old, old))
        with pytest.raises(error):
            reclaim(path)
        assert sorted(os.listdir(path)) == sorted(entries)
        for entry in entries:
            (path / entry).unlink()
        path.rmdir()


def test_create_interrupted_before_the_rename_leaves_nothing(disk_dir: Path, monkeypatch) -> None:
    """SIGTERM in a run is SystemExit: the rmdir of the half-made directory failed on the
    temporary marker (OSError instead of SystemExit, and the directory stayed)."""
    def interrupted(src, dst):
        raise SystemExit(143)

    monkeypatch.setattr(sd.os, "replace", interrupted)
    with pytest.raises(SystemExit):
        SwapDir.create(disk_dir)
    assert list(disk_dir.iterdir()) == []


def test_a_live_run_in_another_pid_namespace_keeps_its_directory(disk_dir: Path) -> None:
    """Seen from here, a run in another PID namespace (a container on this host) has a marker
    pid that is gone or someone else's; its lock on the directory says it runs. Simulated: a
    live SwapDir whose marker names a dead pid."""
    live = SwapDir.create(disk_dir)
    live.register_file("swap-0.bin").write_bytes(b"live data")
    owner = live.owner
    live._marker.owner = Owner(dead_pid(), owner.boot_id, owner.start_time, 0, owner.hostname)
    live._write_marker()
    try:
        with pytest.raises(OwnerAliveError, match="a running process holds its lock"):
            reclaim(live.path)
        assert reclaim_stale(disk_dir) == []
        assert (live.path / "swap-0.bin").read_bytes() == b"live data"
    finally:
        live.remove()
    assert not live.path.exists()


def test_a_zombie_owner_counts_as_gone(disk_dir: Path) -> None:
    """A run that exited but whose parent has not reaped it yet still has a /proc entry."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # wait for its exit without reaping it (polling for 10 s went on to the asserts when a
    # loaded machine started the child more slowly)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1].startswith("Z")
        assert sd.process_start_time(child.pid) is None
        me = Owner.of_this_process(0)
        path = fake_private_dir(disk_dir, Owner(child.pid, me.boot_id, 1, 0, me.hostname),
                                {"swap-0.bin": 4096})
        assert reclaim(path).dir_removed
    finally:
        child.wait()


def test_an_empty_directory_of_ours_left_by_a_kill_after_mkdir_is_reclaimed(disk_dir: Path) -> None:
    """Killed between mkdir and the first marker write: an empty directory with our name, which
    clean called "not created by infinity" forever. Reclaimed once past the grace period."""
    path = disk_dir / f"{sd.DIR_PREFIX}r0-p{dead_pid()}-abcdef"
    path.mkdir(mode=0o700)
    with pytest.raises(OwnerAliveError, match="is empty from 0 s ago"):
        reclaim(path)
    old = time.time() - sd.ORPHAN_GRACE_S - 5
    os.utime(path, (old, old))
    assert reclaim(path).dir_removed and not path.exists()


# -- the lock's lifetime, unmarked and colliding directories, failed creates, the marker file ----

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
    pid = dead_pid()
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


def test_a_forked_child_does_not_keep_the_lock_of_its_parent(tmp_path):
    """A child forked without exec (a DataLoader worker) that outlived its killed parent kept
    the parent's lock through its copy of the descriptor: the dead run's directory stayed
    "alive", never reclaimed and refused by infinity clean. The child closes its copy at fork;
    the parent's lock holds until the parent lets it go."""
    d = SwapDir.create(tmp_path)
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:                       # the child: say it runs, wait until told to exit
        os.close(write)
        os.write(ready_write, b"r")
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"r"
    os.close(ready_read)
    try:
        assert sd._lock_state(d.path) is True      # the parent's
        d._release_lock()                          # as the parent's death would
        assert sd._lock_state(d.path) is False     # the child holds none
    finally:
        os.close(write)
        os.waitpid(pid, 0)
    d.remove()


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
        d.register_file("swap-0.bin")
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
        d.register_file("swap-0.bin")
    assert victim.read_text() == "untouched"


def test_second_remove_reports_the_dir_removed_and_registering_after_fails(tmp_path):
    d = SwapDir.create(tmp_path)
    d.register_file("swap-0.bin").write_bytes(b"1234")
    first = d.remove()
    assert first.dir_removed and first.files_removed == 1
    second = d.remove()
    assert second.path == d.path and second.dir_removed and second.files_removed == 0
    with pytest.raises(SwapDirError):
        d.register_file("swap-1.bin")


def test_marker_json_round_trip_and_missing_created():
    owner = sd.Owner(pid=12, boot_id="b", start_time=34, rank=3, hostname="h")
    m = sd.Marker(owner=owner, files=["swap-0.bin", "swap-1.bin"], created=1234.5)
    assert sd.Marker.from_json(m.to_json(), None) == m
    import json
    data = json.loads(m.to_json())
    del data["created"]
    assert sd.Marker.from_json(json.dumps(data), None).created == 0.0


def test_dry_run_reports_the_listed_files_blocks(tmp_path):
    pid = dead_pid()
    owner = sd.Owner(pid=pid, boot_id=sd.boot_id(), start_time=1, rank=0, hostname=sd.socket.gethostname())
    path = tmp_path / f"{sd.DIR_PREFIX}r0-p{pid}-abcdef"
    path.mkdir()
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=["swap-0.bin", "swap-1.bin"]).to_json())
    for name, size in (("swap-0.bin", 8192), ("swap-1.bin", 12288)):
        with open(path / name, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
    expected = sum(os.lstat(path / n).st_blocks * 512 for n in ("swap-0.bin", "swap-1.bin"))
    result = sd.reclaim(path, dry_run=True)
    assert result.path == path and result.bytes_freed == expected and result.files_removed == 2
    assert (path / "swap-0.bin").exists()


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
    (real / "swap-0.bin").write_text("keep")
    link = tmp_path / "link"
    os.symlink(real, link)
    with pytest.raises(OSError):
        sd._remove_listed(link, ["swap-0.bin"])
    assert (real / "swap-0.bin").read_text() == "keep"


# -- boot ids, markers, orphans and reclaim: what each names; listed files removed one by one ---

def _dead_owner_dir(parent, name="", files=None):
    """A killed run's directory: marker naming a gone pid of this host, listed files allocated."""
    pid = dead_pid()
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
    path, pid = _dead_owner_dir(tmp_path, files={"swap-0.bin": 1 << 20, "swap-1.bin": 8192})
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
    empty = tmp_path / f"{sd.DIR_PREFIX}r0-p{dead_pid()}-abcdef"
    empty.mkdir()
    with pytest.raises(sd.OwnerAliveError, match=f"{empty} is empty from"):
        sd.reclaim(empty)
    partial = tmp_path / f"{sd.DIR_PREFIX}r0-p{dead_pid()}-fedcba"
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
    d.register_file("swap-0.bin")
    with pytest.raises(ValueError, match=f"'swap-0.bin' is already registered in {d.path}"):
        d.register_file("swap-0.bin")
    d.remove()
    with pytest.raises(SwapDirError, match=f"{d.path} was already removed"):
        d.register_file("swap-1.bin")


def test_reclaim_stale_goes_on_past_live_and_foreign_dirs_and_logs_what_it_freed(tmp_path,
                                                                                 infinity_log):
    live = SwapDir.create(tmp_path)                                # infinity-swap-r0-p<pid>-...
    foreign = tmp_path / f"{sd.DIR_PREFIX}m-foreign"                # no marker
    foreign.mkdir()
    stale, pid = _dead_owner_dir(tmp_path, name=f"{sd.DIR_PREFIX}z-stale", files={"swap-0.bin": 4096})
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


def test_a_marker_is_believed_only_for_names_the_engine_creates(tmp_path, infinity_log):
    """A marker in a directory named like ours, with a dead owner, listing a user's file: the
    file stays (it was unlinked: any plain name was taken for one of ours)."""
    path, _ = _dead_owner_dir(tmp_path)
    owner = sd.read_marker(path).owner
    (path / "thesis.tex").write_text("mine")
    (path / "swap-0.bin").write_bytes(b"ours")
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner,
                                              files=["thesis.tex", "swap-0.bin"]).to_json())
    sd.reclaim(path)
    assert (path / "thesis.tex").read_text() == "mine"
    assert not (path / "swap-0.bin").exists()
    assert f"swap dir {path}: marker lists 'thesis.tex'" in infinity_log.text


def test_a_listed_symlink_is_removed_counting_its_own_blocks_not_its_targets(tmp_path):
    target = tmp_path / "big-outside"
    with open(target, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
    path, _ = _dead_owner_dir(tmp_path, files={"swap-0.bin": 4096})
    owner = sd.read_marker(path).owner
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=["swap-1.bin", "swap-0.bin"]).to_json())
    os.symlink(target, path / "swap-1.bin")
    result = sd.reclaim(path)
    assert result.dir_removed and result.files_removed == 2
    assert result.bytes_freed < 1 << 20
    assert os.lstat(target).st_size == 1 << 20


def test_a_listed_directory_is_left_and_the_files_after_it_removed(tmp_path):
    path, _ = _dead_owner_dir(tmp_path, files={"swap-1.bin": 4096})
    owner = sd.read_marker(path).owner
    (path / MARKER_NAME).write_text(sd.Marker(owner=owner, files=["sub", "swap-1.bin"]).to_json())
    (path / "sub").mkdir()
    result = sd.reclaim(path)
    assert not result.dir_removed and result.leftovers == ["sub"] and result.files_removed == 1
    assert sorted(os.listdir(path)) == ["sub"]


def test_a_directory_removed_meanwhile_by_another_cleaner_counts_as_removed(tmp_path, monkeypatch):
    path, _ = _dead_owner_dir(tmp_path, files={"swap-0.bin": 4096})
    real_rmdir = os.rmdir

    def raced(p, *args, **kwargs):   # the other cleaner's rmdir won
        real_rmdir(p, *args, **kwargs)
        raise FileNotFoundError(2, "No such file or directory", str(p))

    monkeypatch.setattr(sd.os, "rmdir", raced)
    result = sd.reclaim(path)
    assert result.dir_removed is True and not path.exists()


def test_a_directory_that_stays_and_cannot_be_listed_is_reported_unreadable(tmp_path, monkeypatch,
                                                                            infinity_log):
    path, _ = _dead_owner_dir(tmp_path, files={"swap-0.bin": 4096})
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
    with pytest.raises(ValueError, match="not a name the engine creates"):
        d.register_file("a.bin\n")
    d.remove()
    path = tmp_path / f"{sd.DIR_PREFIX}r0-p{dead_pid()}-abcdef\n"
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
