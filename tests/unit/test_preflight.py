"""Preflight of a swap path: each bad path is a clear SwapPathError naming path, cause and remedy."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infinity.storage import preflight
from infinity.io.files import mount_of
from infinity.storage.preflight import SwapPathError, check_swap_path


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
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(preflight.os, "open", open_without_direct)
    with pytest.raises(SwapPathError) as info:
        check_swap_path(disk_dir)
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
