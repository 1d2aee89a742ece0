"""storage/swap.py at unit level: the file sizes it picks, its
arguments' checks, the preflight it asks for, a larger buffer than the extent (only the extent's
bytes move), offsets at the extent's end, the requests it keeps, and its log lines -- on a real
swap space in a disk directory with small files."""
from __future__ import annotations

import errno
import logging
import os
import re
import types
from pathlib import Path

import pytest
from messages import raises_naming

from infinity.config.aio import AioConfig
from infinity.io.aio import AioEngine
from infinity.io.buffers import aligned_empty
from infinity.storage import swap as swap_mod
from infinity.storage.swap import MiB, SwapSpace, auto_file_size
from infinity.storage.swap_dir import _DIR_NAME

PAGE = 4096


@pytest.fixture(scope="module")
def aio():
    with AioEngine(AioConfig(backend="auto", block_size=MiB, queue_depth=8)) as engine:
        yield engine



def test_auto_file_size() -> None:
    """No reserve: 256 MiB files; else the reserve in as few files of at most 1 TiB as hold
    it, one size rounded up to a MiB, at least 64 MiB."""
    assert auto_file_size(0) == 256 * MiB
    assert auto_file_size(1) == 64 * MiB
    assert auto_file_size(400 * MiB + 4) == 401 * MiB       # one file: no tail lost
    assert type(auto_file_size(400 * MiB + 4)) is int    # a float size fails posix_fallocate
    assert auto_file_size(1 << 40) == 1 << 40
    assert auto_file_size((1 << 40) + 1) == (1 << 39) + MiB    # two files of one size


@pytest.mark.parametrize("bad", [True, "1", -1, 1.5])
def test_reserve_must_be_a_non_negative_int(disk_dir: Path, aio, bad) -> None:
    with raises_naming(ValueError, "reserve_bytes", "non-negative int", f"got {bad!r}"):
        SwapSpace(disk_dir, aio=aio, reserve_bytes=bad)


def test_file_size_is_parsed_and_at_least_a_page(disk_dir: Path, aio) -> None:
    # starts: the name is a literal the caller passes ("XXfile_sizeXX" would still say file_size)
    with raises_naming(ValueError, "file_size: ", "'abc'", "write e.g. 3GiB", starts=True):
        SwapSpace(disk_dir, aio=aio, file_size="abc")
    with raises_naming(ValueError, "file_size", "at least 4096 bytes", "4095"):
        SwapSpace(disk_dir, aio=aio, file_size=4095)
    with SwapSpace(disk_dir, aio=aio, file_size=4096, reserve_bytes=8192) as s:
        assert s.bytes_on_disk == 8192 and len(s.files) == 2


def test_rank_names_the_directory_and_defaults_to_0(disk_dir: Path, aio) -> None:
    with SwapSpace(disk_dir, aio=aio, rank=2) as s, SwapSpace(disk_dir, aio=aio) as t:
        assert s.rank == 2 and _DIR_NAME.match(s.path.name).group(1) == "2"
        assert t.rank == 0 and _DIR_NAME.match(t.path.name).group(1) == "0"
        assert s.preflight.path == disk_dir and s.preflight.free_bytes > 0


def test_the_reserve_is_preallocated_in_files_of_the_file_size(disk_dir: Path, aio) -> None:
    """5 MiB in files of 4 MiB: a 4 MiB file and a 1 MiB one (the rest of the reserve)."""
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=5 * MiB, file_size="4MiB") as s:
        assert [f.stat().st_size for f in s.files] == [4 * MiB, MiB]
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in s.files)


def test_preflight_probes_direct_io_unless_mmap(disk_dir: Path, aio, monkeypatch) -> None:
    """The O_DIRECT probe runs once, first, with nothing to allocate (not for the mmap
    backend); the space check after the reclaim counts the reserve and probes nothing."""
    calls = []
    real = swap_mod.check_swap_path

    def spy(path, need=0, **kw):
        calls.append((need, kw))
        return real(path, need, **kw)

    monkeypatch.setattr(swap_mod, "check_swap_path", spy)
    SwapSpace(disk_dir, aio=aio, reserve_bytes=PAGE).close()
    SwapSpace(disk_dir, aio=types.SimpleNamespace(backend="mmap", open=aio.open)).close()
    assert calls == [(0, {"direct_io": True}), (PAGE, {"direct_io": False}),
                     (0, {"direct_io": False}), (0, {"direct_io": False})]


def test_creation_and_removal_are_logged(disk_dir: Path, aio, infinity_log) -> None:
    logger = logging.getLogger("infinity")
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        s = SwapSpace(disk_dir, aio=aio, rank=1, reserve_bytes=2 * MiB, file_size="1MiB")
        path, fs = s.path, s.preflight.fs_type
        s.close()
        SwapSpace(disk_dir, aio=types.SimpleNamespace(open=aio.open)).close()   # no backend
    finally:
        logger.setLevel(old)
    lines = [r.getMessage() for r in infinity_log.records
             if r.name.startswith("infinity.storage.swap")]
    assert f"swap space {path} (rank 1, backend {aio.backend}, {fs}): 2.00 MiB preallocated in " \
           "2 files" in lines
    assert f"removed swap dir {path}: 2.00 MiB in 2 files" in lines
    assert any(re.fullmatch(r"swap space .* \(rank 0, backend \?, .*\): 0 B preallocated in 0 "
                            r"files", line) for line in lines)


def test_repr_open_and_closed(disk_dir: Path, aio) -> None:
    s = SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size="1MiB")
    s.allocate(3 * PAGE)
    assert repr(s) == f"SwapSpace({s.path}, 12.00 KiB of 1.00 MiB in 1 files)"
    s.close()
    assert repr(s) == f"SwapSpace({s.path}, closed)"


def test_auto_growth_takes_a_quarter_of_the_space(disk_dir: Path, aio, monkeypatch) -> None:
    """An auto-sized space grows by max(the extent, a quarter of its capacity rounded up to a
    MiB, the least file size): with 5 MiB held, a 1 MiB extent gets a 2 MiB file."""
    monkeypatch.setattr(swap_mod, "AUTO_DEFAULT_FILE", MiB)
    monkeypatch.setattr(swap_mod, "AUTO_MIN_FILE", MiB)
    with SwapSpace(disk_dir, aio=aio) as s:
        s.allocate(5 * MiB, tag="big")
        s.allocate(MiB, tag="next")
        assert [f.stat().st_size for f in s.files] == [5 * MiB, 2 * MiB]


@pytest.mark.parametrize("code,hint", [
    (errno.EIO, "check the swap path"),
    (errno.ENOSPC, "the disk is full; free space or choose a larger nvme_path"),
    (errno.EDQUOT, "the disk is full; free space or choose a larger nvme_path")])
def test_a_failed_preallocation_says_why(disk_dir: Path, aio, monkeypatch, code, hint) -> None:
    def fail(fd, off, size):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(swap_mod.os, "posix_fallocate", fail)
    with SwapSpace(disk_dir, aio=aio, file_size="1MiB") as s:
        with pytest.raises(OSError) as info:
            s.allocate(PAGE, tag="x")
        path = s.path / "swap-0.bin"
        msg = (f"preallocating 1048576 bytes (1.00 MiB) for swap file {path} failed: "
               f"{os.strerror(code)}; {hint}")
        assert str(info.value) == f"[Errno {code}] {msg}"
        del info
        assert not path.exists()


def test_a_reserve_beyond_the_largest_file_allowed_is_made_of_smaller_files(
        disk_dir: Path, aio, monkeypatch) -> None:
    """One file holds the reserve ("auto"); where a file that large is refused (EFBIG: ulimit -f,
    ext4 of 1 KiB blocks) the reserve is made of smaller ones, as the four files of 16 GiB at
    most it was made of before; a limit below the least file size says what to do."""
    real = os.posix_fallocate
    limit = [3 * swap_mod.AUTO_MIN_FILE]

    def limited(fd, off, size):
        if off + size > limit[0]:
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        return real(fd, off, size)

    monkeypatch.setattr(swap_mod.os, "posix_fallocate", limited)
    reserve = 5 * swap_mod.AUTO_MIN_FILE
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=reserve) as s:
        sizes = [f.stat().st_size for f in s.files]
        assert sum(sizes) == reserve and max(sizes) <= limit[0], sizes
        # growth past the reserve keeps to the size that worked (it asked for a quarter of the
        # space again, and failed mid-run on the same limit)
        for i in range(15):      # to a space whose quarter is past the limit
            s.allocate(swap_mod.AUTO_MIN_FILE, tag=f"more{i}")
        assert max(f.stat().st_size for f in s.files) <= limit[0]
    limit[0] = swap_mod.AUTO_MIN_FILE // 2
    with pytest.raises(OSError, match=r"a file size limit \(ulimit -f\) or the filesystem's "
                                      r"largest file"):
        SwapSpace(disk_dir, aio=aio, reserve_bytes=reserve)


def test_a_swap_file_is_never_one_that_is_already_there(disk_dir: Path, aio) -> None:
    """The swap file is created with O_EXCL: a file already at its name (planted in the space's
    private directory) is refused, not adopted and overwritten -- and not deleted either: the
    engine never removes a file it did not create (the cleanup of a failed preallocation once
    unlinked whatever was at the name)."""
    with SwapSpace(disk_dir, aio=aio, file_size="1MiB") as s:
        (s.path / "swap-0.bin").write_bytes(b"not ours")
        with raises_naming(OSError, "[Errno 17]", "preallocating", "File exists",
                           "; check the swap path", ends=True):
            s.allocate(PAGE, tag="x")
        assert s.files == []
        assert (s.path / "swap-0.bin").read_bytes() == b"not ours"


def test_allocate_without_a_tag_and_tag_of(disk_dir: Path, aio) -> None:
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size="1MiB") as s:
        e = s.allocate(PAGE)
        f = s.allocate(PAGE, tag="f")
        assert s.tag_of(e) == "" and s.tag_of(f) == "f"
        assert [t for t, *_ in s.layout()] == ["", "f"]
        s.free(f)
        assert s.tag_of(f) == ""


def test_only_the_extents_bytes_move_from_a_larger_buffer(disk_dir: Path, aio) -> None:
    """A buffer larger than the extent (a larger slot) writes and reads only the extent's bytes:
    the neighbour extent and the buffer's tail are untouched."""
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size="1MiB", check_mode="off") as s:
        a, b = s.allocate(PAGE, tag="a"), s.allocate(PAGE, tag="b")
        assert (a.file_index, a.offset + PAGE) == (b.file_index, b.offset)
        ones = aligned_empty(PAGE)
        ones.fill_(1)
        s.write(b, ones).wait()
        big = aligned_empty(2 * PAGE)
        big.fill_(7)
        s.write(a, big).wait()
        out = aligned_empty(PAGE)
        s.read(b, out).wait()
        assert bool((out == 1).all())
        back = aligned_empty(2 * PAGE)
        back.fill_(9)
        s.read(a, back).wait()
        assert bool((back[:PAGE] == 7).all()) and bool((back[PAGE:] == 9).all())


def test_offsets_and_sizes_are_checked_by_op(disk_dir: Path, aio) -> None:
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size="1MiB") as s:
        e = s.allocate(2 * PAGE, tag="e")
        buf = aligned_empty(2 * PAGE)
        with raises_naming(ValueError, "read of extent 'e'", "offset 8192", "multiple of 4096",
                           "8192 bytes"):
            s.read(e, buf, 2 * PAGE)
        with raises_naming(ValueError, "write of extent 'e'", "offset 8192", "multiple of 4096",
                           "8192 bytes"):
            s.write(e, buf, 2 * PAGE)
        s.free(e)
        with raises_naming(ValueError, "read of", "not allocated in this swap space",
                           "(freed already, or from another space)", ends=True):
            s.read(e, buf)


def test_a_submission_error_names_the_file_and_extent(disk_dir: Path, aio, monkeypatch) -> None:
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size="1MiB") as s:
        e = s.allocate(PAGE, tag="q")

        def refuse(*args, **kw):
            raise OSError(errno.EINVAL, "bad request")

        monkeypatch.setattr(s, "aio", types.SimpleNamespace(write=refuse, read=refuse))
        with raises_naming(OSError, "[Errno 22]", "write of 4096 bytes", f"offset {e.offset}",
                           str(s.files[0]), "(extent 'q'): bad request", ends=True):
            s.write(e, aligned_empty(PAGE))


def test_finished_requests_are_pruned(disk_dir: Path, aio) -> None:
    """The list of requests in flight is pruned of finished ones when it reaches 512."""
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size="1MiB", check_mode="off") as s:
        e = s.allocate(PAGE, tag="p")
        buf = aligned_empty(PAGE)
        for _ in range(511):
            s.read(e, buf).wait()
        assert len(s._res.pending) == 511
        last = s.read(e, buf)
        last.wait()
        assert s._res.pending in ([], [last])


def test_corruption_is_logged_as_an_error_with_the_sampled_method(disk_dir: Path, aio,
                                                                 infinity_log) -> None:
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size="1MiB") as s:
        e = s.allocate(PAGE, tag="c")
        data = aligned_empty(PAGE)
        data.fill_(3)
        s.write(e, data).wait()
        fd = os.open(s.files[0], os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff" * 8, e.offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        from infinity.storage.integrity import SwapCorruptionError

        with pytest.raises(SwapCorruptionError, match="checked: the first and last 8 bytes"):
            s.read(e, aligned_empty(PAGE)).wait()
    errors = [r.getMessage() for r in infinity_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("swap space corrupt: swap file ")
    assert "checked: the first and last 8 bytes" in errors[0]


def test_release_registers_the_exit_cleanup_when_interrupted(disk_dir: Path, aio,
                                                            monkeypatch) -> None:
    registered = []
    monkeypatch.setattr(swap_mod.atexit, "register", registered.append)
    s = SwapSpace(disk_dir, aio=aio)
    res = s._res
    real = res._release

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(res, "_release", interrupted)
    with pytest.raises(KeyboardInterrupt):
        res.release()
    assert registered == [res._release_at_exit]
    res._release_at_exit()                      # an error at exit is swallowed
    monkeypatch.setattr(res, "_release", real)
    res._release_at_exit()
    assert not s.path.exists()
