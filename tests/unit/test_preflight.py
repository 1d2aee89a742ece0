"""Preflight of a swap path: each bad path is a clear SwapPathError naming path, cause and remedy;
the free-space arithmetic and its boundary, the O_DIRECT probe's file (flags, mode, name, bytes,
removal) and its failures, and every SwapPathError's message -- on a real directory, with the
filesystem's answers (statvfs, the mount table, access, the probe) replaced where a real one cannot
be had."""
from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from infinity.io.files import mount_of
from infinity.storage import preflight
from infinity.storage.preflight import PreflightReport, SwapPathError, check_swap_path


# -- bad paths on real filesystems ---------------------------------------------------------------

def test_good_disk_path_passes(disk_dir: Path) -> None:
    report = check_swap_path(disk_dir, 1 << 20)
    assert report.direct_io and report.free_bytes >= 1 << 20
    assert report.fs_type not in preflight.MEMORY_FILESYSTEMS
    assert os.listdir(disk_dir) == []  # the O_DIRECT probe file is gone


def test_missing_directory(disk_dir: Path) -> None:
    with pytest.raises(SwapPathError, match=r"missing-dir does not exist; create it"):
        check_swap_path(disk_dir / "missing-dir")


def test_a_file_is_not_a_directory(disk_dir: Path) -> None:
    (disk_dir / "f").write_text("x")
    with pytest.raises(SwapPathError, match="is not a directory"):
        check_swap_path(disk_dir / "f")


@pytest.mark.skipif(mount_of("/dev/shm")[0] != "tmpfs", reason="/dev/shm is not tmpfs here")
def test_tmpfs_is_refused_as_memory() -> None:
    with pytest.raises(SwapPathError, match=r"filesystem tmpfs.*is memory, not a disk"):
        check_swap_path("/dev/shm")


def test_full_disk_names_both_numbers(disk_dir: Path) -> None:
    st = os.statvfs(disk_dir)
    free = st.f_bavail * st.f_frsize
    need = free + (1 << 40)
    with pytest.raises(SwapPathError) as info:
        check_swap_path(disk_dir, need)
    message = str(info.value)
    assert f"({need} bytes)" in message and "are free on" in message and str(disk_dir) in message


def test_not_writable_via_access(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, which ignores chmod 0500: simulate what os.access reports to a normal user.
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: False)
    with pytest.raises(SwapPathError, match="is not writable by this user"):
        check_swap_path(disk_dir)


def test_no_direct_io_suggests_mmap(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def open_without_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:     # as such a kernel does: the file is made, the open fails
            if flags & os.O_CREAT:
                os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kwargs))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(preflight.os, "open", open_without_direct)
    with pytest.raises(SwapPathError) as info:
        check_swap_path(disk_dir)
    assert os.listdir(disk_dir) == []       # no probe file left in the user's directory
    message = str(info.value)
    assert "O_DIRECT does not work" in message and '"mmap"' in message
    assert f"filesystem {mount_of(disk_dir)[0]}" in message
    check_swap_path(disk_dir, direct_io=False)  # the mmap backend skips the probe


def _in_private_mount_namespace(script: str, python_code: str = "",
                                directory: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (sh) in a private mount namespace: its mounts vanish when it exits.

    ``$DIR`` is ``directory`` and ``$PY`` runs ``python_code`` with this interpreter.
    """
    env = dict(os.environ, DIR=str(directory or ""), CODE=python_code)
    script = script.replace("$PY", f'{sys.executable} -c "$CODE"')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec", script],
                          capture_output=True, text=True, timeout=120, env=env)


def _can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return _in_private_mount_namespace("mount -t tmpfs none /mnt").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_mount_ns = pytest.mark.skipif(not _can_unshare_mounts(),
                                    reason="needs `unshare --mount` (root or user namespaces)")


@needs_mount_ns
def test_read_only_bind_mount(disk_dir: Path) -> None:
    """A real read-only directory: a read-only bind mount inside a private mount namespace."""
    check = textwrap.dedent("""
        import os
        from infinity.storage.preflight import SwapPathError, check_swap_path
        try:
            check_swap_path(os.environ["DIR"])
        except SwapPathError as exc:
            print("ERR", exc)
        """)
    result = _in_private_mount_namespace(
        'mount --bind "$DIR" "$DIR"; mount -o remount,bind,ro "$DIR"; $PY', check, disk_dir)
    assert result.returncode == 0, result.stderr
    assert "ERR swap path" in result.stdout and "is on a read-only mount" in result.stdout


@needs_mount_ns
def test_small_filesystem_refuses_more_than_it_has(disk_dir: Path) -> None:
    """A real full disk: a 1 MiB tmpfs (allowed as memory here) cannot hold 2 MiB of swap."""
    check = textwrap.dedent("""
        import os
        from infinity.storage.preflight import SwapPathError, check_swap_path
        check_swap_path(os.environ["DIR"], 512 << 10, allow_memory_fs=True)
        try:
            check_swap_path(os.environ["DIR"], 2 << 20, allow_memory_fs=True)
        except SwapPathError as exc:
            print("ERR", exc)
        """)
    result = _in_private_mount_namespace('mount -t tmpfs -o size=1m none "$DIR"; $PY', check, disk_dir)
    assert result.returncode == 0, result.stderr
    assert "ERR not enough free space" in result.stdout and "(2097152 bytes)" in result.stdout


def _fake_mount_table(monkeypatch: pytest.MonkeyPatch, module, table: str) -> None:
    """``module`` reads ``table`` as its /proc/mounts (and /proc/self/mounts)."""
    import builtins
    import io

    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        if str(file) in ("/proc/mounts", "/proc/self/mounts"):
            return io.StringIO(table)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(module, "open", fake_open, raising=False)


def test_a_mount_point_matches_whole_path_components_only(tmp_path: Path, monkeypatch) -> None:
    """With mounts at .../data and .../data2, .../data2/x is on data2 (whichever comes first in
    the table) and .../database/x is on neither: a mount point is a prefix of whole path
    components, not of characters. (One reader of the mount table serves the I/O engine and the
    swap-path preflight.)"""
    from infinity.io import files

    base = os.path.realpath(tmp_path)
    for name in ("data", "data2", "database", "my disk"):
        os.mkdir(os.path.join(base, name))
    table = "\n".join([
        "/dev/root / rootfs rw 0 0",
        f"/dev/sdb1 {base}/data2 btrfs rw 0 0",
        f"/dev/sda1 {base}/data xfs rw 0 0",
        f"/dev/sdc1 {base}/my\\040disk ext2 rw 0 0",
        f"/dev/sdd1 {base}/data2/inner ext3 rw 0 0",
    ]) + "\n"
    _fake_mount_table(monkeypatch, files, table)

    def fs_of(path: str) -> tuple[str, str | None]:
        fs_type, mount = files.mount_of(path)
        assert files.filesystem_of(path) == fs_type
        return fs_type, None if mount is None else str(mount)

    def expect(fs_type: str, mount: str) -> tuple[str, str]:
        return fs_type, mount

    assert fs_of(f"{base}/data2/x") == expect("btrfs", f"{base}/data2")
    assert fs_of(f"{base}/data2") == expect("btrfs", f"{base}/data2")
    assert fs_of(f"{base}/data/x") == expect("xfs", f"{base}/data")
    assert fs_of(f"{base}/database/x") == expect("rootfs", "/")
    assert fs_of(f"{base}/data2/inner/y") == expect("ext3", f"{base}/data2/inner")
    assert fs_of(f"{base}/data2/innermost") == expect("btrfs", f"{base}/data2")
    assert fs_of(f"{base}/my disk/z") == expect("ext2", f"{base}/my disk")


# -- free space, the O_DIRECT probe and each refusal, with the filesystem's answers stubbed ------

def fake_statvfs(monkeypatch, *, bavail: int, frsize: int = 4096, flag: int = 0) -> None:
    """statvfs with ``bavail`` blocks of ``frsize`` free to users (more free to root, larger
    f_bsize: neither may be counted)."""
    st = types.SimpleNamespace(f_bavail=bavail, f_bfree=bavail + 1000, f_frsize=frsize,
                               f_bsize=frsize * 4, f_blocks=bavail * 10, f_flag=flag)
    monkeypatch.setattr(preflight.os, "statvfs", lambda path: st)


def fake_mount(monkeypatch, fs_type: str = "ext4", mount: str | None = "/mnt/disk") -> None:
    monkeypatch.setattr(preflight, "mount_of",
                        lambda path: (fs_type, None if mount is None else Path(mount)))


def test_free_bytes_are_the_users_blocks_times_the_fragment_size(tmp_path, monkeypatch) -> None:
    fake_statvfs(monkeypatch, bavail=3, frsize=2048)
    assert preflight.free_bytes(tmp_path) == 6144


def test_free_space_exactly_enough_passes_one_byte_more_fails(tmp_path, monkeypatch) -> None:
    """``need > free`` is the refusal: equal fits. The message names what, where, both numbers
    (readable and in bytes), the mount point (or "its filesystem") and the filesystem."""
    fake_statvfs(monkeypatch, bavail=256)          # 1 MiB
    fake_mount(monkeypatch)
    assert preflight.check_free_space(tmp_path, 1 << 20) == 1 << 20
    with pytest.raises(SwapPathError) as info:
        preflight.check_free_space(tmp_path, (1 << 20) + 1)
    assert str(info.value) == (
        f"not enough free space for swap files in {tmp_path}: need 1.00 MiB (1048577 bytes) but "
        "only 1.00 MiB (1048576 bytes) are free on /mnt/disk (ext4); free some space, point "
        "nvme_path at a larger disk, or offload less to NVMe")
    fake_mount(monkeypatch, "unknown", None)
    with pytest.raises(SwapPathError, match=r"for checkpoints in .* are free on its filesystem "
                       r"\(unknown\); free"):
        preflight.check_free_space(tmp_path, 2 << 20, "checkpoints")


def test_the_probe_file_is_new_private_direct_and_removed(disk_dir: Path, monkeypatch) -> None:
    """The probe makes a fresh ``.infinity-probe-<pid>-<8 hex>`` with O_RDWR|O_CREAT|O_EXCL,
    mode 0600, opens it with O_DIRECT, writes one page starting "infinity-probe" (zeros after),
    and unlinks that same file."""
    opened, seen = [], {}
    real_open, real_unlink = os.open, os.unlink

    def spy_open(path, flags, mode=0o777):
        opened.append((str(path), flags, mode))
        return real_open(path, flags, mode)

    def spy_unlink(path):
        st = os.stat(path)
        with open(path, "rb") as f:
            seen.update(path=str(path), mode=st.st_mode & 0o777, data=f.read())
        real_unlink(path)

    monkeypatch.setattr(preflight.os, "open", spy_open)
    monkeypatch.setattr(preflight.os, "unlink", spy_unlink)
    preflight.probe_direct_io(disk_dir)
    (path, flags, mode), (again, direct, _) = opened      # made, then opened with O_DIRECT
    assert re.fullmatch(rf"{re.escape(str(disk_dir))}/\.infinity-probe-{os.getpid()}-[0-9a-f]{{8}}",
                        path)
    assert flags == os.O_RDWR | os.O_CREAT | os.O_EXCL and mode == 0o600
    assert again == path and direct == os.O_RDWR | os.O_DIRECT
    assert seen["path"] == path and seen["mode"] == 0o600
    assert seen["data"] == b"infinity-probe".ljust(4096, b"\0")
    assert os.listdir(disk_dir) == []


def test_a_short_probe_write_is_an_error_and_the_file_goes(disk_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(preflight.os, "pwritev", lambda fd, bufs, off: 4095)
    with pytest.raises(OSError) as info:
        preflight.probe_direct_io(disk_dir)
    assert info.value.errno == errno.EIO
    assert re.fullmatch(r"short O_DIRECT write of the probe .*/\.infinity-probe-\d+-[0-9a-f]{8}",
                        info.value.strerror)
    assert os.listdir(disk_dir) == []


@pytest.mark.parametrize("got", [4096, 4095])
def test_a_probe_read_back_that_differs_is_an_error(disk_dir: Path, monkeypatch, got) -> None:
    """A read that brings nothing back (the buffer was cleared before it) or a short one."""
    monkeypatch.setattr(preflight.os, "preadv", lambda fd, bufs, off: got)
    with pytest.raises(OSError) as info:
        preflight.probe_direct_io(disk_dir)
    assert info.value.errno == errno.EIO
    assert re.fullmatch(r"O_DIRECT read-back of the probe .*/\.infinity-probe-\d+-[0-9a-f]{8} did "
                        r"not match", info.value.strerror)
    assert os.listdir(disk_dir) == []


def test_a_good_path_reports_what_it_found(disk_dir: Path, monkeypatch) -> None:
    fake_mount(monkeypatch, "xfs", "/mnt/nvme")
    fake_statvfs(monkeypatch, bavail=10)
    assert check_swap_path(disk_dir, 40960) == PreflightReport(
        path=disk_dir, fs_type="xfs", mount_point=Path("/mnt/nvme"), free_bytes=40960,
        direct_io=True)
    assert check_swap_path(str(disk_dir), direct_io=False).direct_io is False


def test_missing_and_not_a_directory_messages(tmp_path) -> None:
    with pytest.raises(SwapPathError) as info:
        check_swap_path(tmp_path / "nope")
    assert str(info.value) == (f"swap path {tmp_path}/nope does not exist; create it (mkdir -p "
                               f"{tmp_path}/nope) or choose an existing directory on a local disk")
    (tmp_path / "f").write_text("x")
    with pytest.raises(SwapPathError) as info:
        check_swap_path(tmp_path / "f")
    assert str(info.value) == (f"swap path {tmp_path}/f is not a directory; give the directory "
                               "that should hold the swap files")


@pytest.mark.parametrize("fs_type", sorted(preflight.MEMORY_FILESYSTEMS))
def test_memory_filesystems_are_refused_unless_allowed(disk_dir: Path, monkeypatch, fs_type) -> None:
    fake_mount(monkeypatch, fs_type, "/run/x")
    with pytest.raises(SwapPathError) as info:
        check_swap_path(disk_dir, direct_io=False)
    assert str(info.value) == (
        f"swap path {disk_dir} (filesystem {fs_type}, mounted at /run/x) is memory, not a disk: "
        "swap files there would use the RAM that offloading is meant to save; choose a directory "
        "on an NVMe/SSD (e.g. /var/tmp or /local_nvme)")
    assert check_swap_path(disk_dir, direct_io=False, allow_memory_fs=True).fs_type == fs_type


@pytest.mark.parametrize("flag,cause", [(0, "is not writable by this user"),
                                        (os.ST_RDONLY, "is on a read-only mount")])
def test_not_writable_says_why(disk_dir: Path, monkeypatch, flag, cause) -> None:
    """os.access asked for write and search permission; a read-only mount (statvfs ST_RDONLY)
    is told apart from permissions. An unknown mount point is "?"."""
    asked = []
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: asked.append(mode) or False)
    fake_statvfs(monkeypatch, bavail=10, flag=flag | os.ST_NOSUID)
    fake_mount(monkeypatch, "ext4", None)
    with pytest.raises(SwapPathError) as info:
        check_swap_path(disk_dir)
    assert asked == [os.W_OK | os.X_OK]
    assert str(info.value) == (f"swap path {disk_dir} (filesystem ext4, mounted at ?) {cause}; "
                               "choose a writable directory or fix its permissions")


@pytest.mark.parametrize("code,says", [
    (errno.EROFS, "is not writable (Read-only file system); choose a writable directory"),
    (errno.EACCES, "is not writable (Permission denied); choose a writable directory"),
    (errno.EPERM, "is not writable (Operation not permitted); choose a writable directory"),
    (errno.ENOSPC, "is full (no room for a 4 KiB probe); free space or choose another path")])
def test_probe_failures_that_are_not_about_direct_io(disk_dir: Path, monkeypatch, code,
                                                     says) -> None:
    err = OSError(code, os.strerror(code))
    monkeypatch.setattr(preflight, "probe_direct_io", lambda path: (_ for _ in ()).throw(err))
    fake_mount(monkeypatch, "ext4", "/")
    with pytest.raises(SwapPathError) as info:
        check_swap_path(disk_dir)
    assert str(info.value) == f"swap path {disk_dir} (filesystem ext4, mounted at /) {says}"
    assert info.value.__cause__ is err


@pytest.mark.parametrize("code", [errno.EINVAL, None])
def test_no_direct_io_names_the_errno_and_the_mmap_backend(disk_dir: Path, monkeypatch,
                                                           code) -> None:
    err = OSError(code, "x") if code else OSError("no errno")
    monkeypatch.setattr(preflight, "probe_direct_io", lambda path: (_ for _ in ()).throw(err))
    fake_mount(monkeypatch, "fuse", "/mnt/f")
    with pytest.raises(SwapPathError) as info:
        check_swap_path(disk_dir)
    assert str(info.value) == (
        f"O_DIRECT does not work in {disk_dir} (filesystem fuse, mounted at /mnt/f): "
        f"{os.strerror(code or 0)} (errno {code}); use the \"mmap\" I/O backend (aio backend "
        "\"mmap\"), or a swap path on a filesystem with direct I/O (ext4, xfs, btrfs on a local "
        "disk)")
    assert info.value.__cause__ is err


def test_the_free_space_check_comes_last_and_counts_need(disk_dir: Path, monkeypatch) -> None:
    """need_bytes (0 by default: nothing to allocate passes even a full disk) against free."""
    fake_mount(monkeypatch)
    fake_statvfs(monkeypatch, bavail=0)
    assert check_swap_path(disk_dir, direct_io=False).free_bytes == 0
    fake_statvfs(monkeypatch, bavail=1)
    assert check_swap_path(disk_dir, 4096, direct_io=False).free_bytes == 4096
    with pytest.raises(SwapPathError, match=r"need 4.00 KiB \(4097 bytes\)"):
        check_swap_path(disk_dir, 4097, direct_io=False)
