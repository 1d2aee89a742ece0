"""Private swap directory: 0700 + marker, removal of only our files, reclaim of a dead owner's dir."""
from __future__ import annotations

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
                                       OwnerAliveError, SwapDir, reclaim, reclaim_stale)

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
        with pytest.raises(ValueError, match="plain name"):
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
