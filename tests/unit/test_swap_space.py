"""SwapSpace: round trips through real swap files, growth, reclaim, cleanup, and I/O faults."""
from __future__ import annotations

import errno
import gc
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from infinity.io import _lib
from infinity.io.aio import AioEngine
from infinity.io.buffers import aligned_empty
from infinity.config.aio import AioConfig
from infinity.storage import preflight, swap as swap_mod
from infinity.storage.preflight import SwapPathError
from infinity.storage.swap import SwapSpace
from infinity.storage.swap_dir import MARKER_NAME, Marker, Owner

MiB = 1 << 20


@pytest.fixture(scope="module")
def aio():
    with AioEngine(AioConfig(backend="auto", block_size=MiB, queue_depth=8)) as engine:
        yield engine


def random_buffer(nbytes: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(-(-nbytes // 4096) * 4096)
    gen = torch.Generator().manual_seed(seed)
    buf[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return buf


def test_round_trip_reuse_and_cleanup(disk_dir: Path, aio: AioEngine) -> None:
    space = SwapSpace(disk_dir, aio=aio, reserve_bytes=4 * MiB, file_size=2 * MiB)
    private = space.path
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
    assert space.bytes_on_disk == 4 * MiB and len(space.files) == 2
    sizes = [1, 4096, 5000, MiB + 3, 3 * MiB]  # the last one needs a new file
    extents, buffers = [], []
    for i, n in enumerate(sizes):
        extents.append(space.allocate(n, tag=f"t{i}"))
        buffers.append(random_buffer(n, i))
    assert len(space.files) == 3 and space.files[2].stat().st_size == 3 * MiB
    reqs = [space.write(e, b[:e.nbytes]) for e, b in zip(extents, buffers)]
    assert [r.wait() for r in reqs] == sizes
    for e, b in zip(extents, buffers):
        out = aligned_empty(e.padded_nbytes)
        space.read(e, out).wait()
        assert torch.equal(out[:e.nbytes], b[:e.nbytes]), f"extent {e} read back differently"
    assert space.bytes_allocated == sum(e.padded_nbytes for e in extents)
    # A freed extent's bytes are handed out again without growing.
    space.free(extents[3])
    again = space.allocate(MiB, tag="again")
    assert (again.file_index, again.offset) == (extents[3].file_index, extents[3].offset)
    assert len(space.files) == 3
    marker = json.loads((private / MARKER_NAME).read_text())
    assert marker["files"] == ["swap-0.bin", "swap-1.bin", "swap-2.bin"]
    space.close()
    assert not private.exists() and os.listdir(disk_dir) == []
    space.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        space.allocate(10)


def test_sub_range_io_with_offset(disk_dir: Path, aio: AioEngine) -> None:
    with SwapSpace(disk_dir, aio=aio) as space:
        e = space.allocate(3 * 4096 + 100)
        whole = random_buffer(e.nbytes, 7)
        space.write(e, whole[:e.nbytes]).wait()
        part = random_buffer(4096, 8)
        space.write(e, part, offset=4096).wait()
        out = aligned_empty(e.padded_nbytes)
        space.read(e, out).wait()
        expect = whole[:e.nbytes].clone()
        expect[4096:8192] = part
        assert torch.equal(out[:e.nbytes], expect)
        with pytest.raises(ValueError, match="multiple of 4096"):
            space.read(e, out, offset=100)
        with pytest.raises(ValueError, match="the extent 12288 from offset 4096"):
            space.write(e, aligned_empty(8 * 4096), offset=4096, nbytes=8 * 4096)
        space.free(e)
        with pytest.raises(ValueError, match="not allocated in this swap space"):
            space.read(e, out)


def test_mmap_backend_space(disk_dir: Path) -> None:
    with AioEngine(AioConfig(backend="mmap")) as engine, SwapSpace(disk_dir, aio=engine) as space:
        e = space.allocate(10_000)
        b = random_buffer(10_000, 3)
        space.write(e, b[:10_000]).wait()
        out = aligned_empty(e.padded_nbytes)
        space.read(e, out).wait()
        assert torch.equal(out[:10_000], b[:10_000])


def test_reserve_beyond_free_space_fails_before_creating_anything(disk_dir: Path, aio) -> None:
    too_much = preflight.free_bytes(disk_dir) + (1 << 40)
    with pytest.raises(SwapPathError, match=rf"need .* \({too_much} bytes\) but only"):
        SwapSpace(disk_dir, aio=aio, reserve_bytes=too_much)
    assert os.listdir(disk_dir) == []


def test_growth_beyond_free_space_names_both_sizes(disk_dir: Path, aio, monkeypatch) -> None:
    with SwapSpace(disk_dir, aio=aio, file_size=MiB) as space:
        space.allocate(MiB)
        monkeypatch.setattr(preflight, "free_bytes", lambda path: 3 * MiB)
        with pytest.raises(SwapPathError, match=r"swap file 1 \(for extent 'big'\).*need 4.00 MiB "
                                                r"\(4194304 bytes\) but only 3.00 MiB"):
            space.allocate(4 * MiB, tag="big")
        assert len(space.files) == 1


def test_auto_growth_short_of_room_takes_only_what_the_extent_needs(disk_dir: Path, aio,
                                                                    monkeypatch) -> None:
    """An "auto" space grows by large files (at least 64 MiB); with less free than that, a small
    extent (an activation) gets a file of its own size instead of an error for 64 MiB."""
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB) as space:
        space.allocate(space.bytes_on_disk)             # the first (64 MiB) file is full
        monkeypatch.setattr(preflight, "free_bytes", lambda path: 35 * MiB)
        space.allocate(16 * 1024, tag="small")
        assert len(space.files) == 2 and space.files[1].stat().st_size == 16 * 1024


def test_fallocate_enospc_names_the_file_and_removes_it(disk_dir: Path, aio, monkeypatch) -> None:
    with SwapSpace(disk_dir, aio=aio, file_size=MiB) as space:
        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(swap_mod.os, "posix_fallocate", full)
        with pytest.raises(OSError) as info:
            space.allocate(MiB)
        assert info.value.errno == errno.ENOSPC
        assert f"{space.path}/swap-0.bin failed" in str(info.value) and "disk is full" in str(info.value)
        assert sorted(os.listdir(space.path)) == [MARKER_NAME]
        monkeypatch.undo()
        e = space.allocate(MiB)  # works again once there is room, under a fresh name
        assert space.files == [space.path / "swap-1.bin"] and e.file_index == 0


class _NativeFaults:
    """The native library, except that finished requests report ``-code`` (as the kernel would)."""

    def __init__(self, real, *, result_code: int = 0, submit_code: int = 0) -> None:
        self._real, self._result_code, self._submit_code = real, result_code, submit_code

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def inf_aio_submit(self, *args):
        return -self._submit_code if self._submit_code else self._real.inf_aio_submit(*args)

    def inf_aio_req_result(self, handle, err_offset):
        res = self._real.inf_aio_req_result(handle, err_offset)
        return res if res == -errno.EBUSY or not self._result_code else -self._result_code


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_io_error_in_a_run_surfaces_naming_the_file(disk_dir: Path, aio, monkeypatch, code) -> None:
    with SwapSpace(disk_dir, aio=aio) as space:
        e = space.allocate(2 * MiB, tag="layers.3.exp_avg")
        buf = random_buffer(2 * MiB, 1)
        real = _lib.lib()
        monkeypatch.setattr(_lib, "lib", lambda: _NativeFaults(real, result_code=code))
        req = space.write(e, buf)
        with pytest.raises(OSError) as info:
            req.wait(timeout=30)  # a fault must not hang
        assert info.value.errno == code
        assert str(space.files[0]) in str(info.value) and os.strerror(code) in str(info.value)

        monkeypatch.setattr(_lib, "lib", lambda: _NativeFaults(real, submit_code=code))
        with pytest.raises(OSError) as info:
            space.read(e, buf)
        assert info.value.errno == code
        assert str(space.files[0]) in str(info.value) and "'layers.3.exp_avg'" in str(info.value)
        monkeypatch.undo()


def test_dead_runs_directory_is_reclaimed_at_start(disk_dir: Path, aio) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    me = Owner.of_this_process(0)
    stale = disk_dir / "infinity-swap-r0-p1-000000"
    stale.mkdir(mode=0o700)
    (stale / MARKER_NAME).write_text(Marker(owner=Owner(proc.pid, me.boot_id, 1, 0, me.hostname),
                                            files=["swap-0.bin"]).to_json())
    with open(stale / "swap-0.bin", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 3 * MiB)
    with SwapSpace(disk_dir, aio=aio) as space:
        assert not stale.exists() and space.path.exists()


# A child process's stand-in for the I/O engine: the swap space's files are opened and closed
# through it, so the child needs neither torch nor the native library.
_STUB_AIO = textwrap.dedent("""
    from infinity.storage.swap import SwapSpace

    class File:
        def __init__(self, path): self.path = path
        def close(self): pass

    class Engine:
        backend = "threads"
        def open(self, path, mode): return File(path)
    """)


def test_unclosed_space_is_removed_by_gc_and_at_exit(disk_dir: Path, aio) -> None:
    space = SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB)
    private = space.path
    del space
    gc.collect()
    assert not private.exists()
    # At interpreter exit (no close, no gc): a stub engine keeps the child free of torch's import.
    script = _STUB_AIO + textwrap.dedent(f"""
        space = SwapSpace({str(disk_dir)!r}, aio=Engine(), reserve_bytes=1 << 20)
        print(space.path, flush=True)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(disk_dir))
    assert os.listdir(disk_dir) == []


def test_a_swap_directory_removed_from_outside_says_so_at_the_next_growth(
        disk_dir: Path, aio) -> None:
    """Its next file found no directory: a bare FileNotFoundError from a free-space check."""
    import shutil

    space = SwapSpace(disk_dir, aio=aio, reserve_bytes=MiB, file_size=MiB)
    try:
        shutil.rmtree(space.path)
        with pytest.raises(FileNotFoundError, match="was removed from outside the engine.*"
                                                    "extent 'grown' has nowhere to go"):
            space.allocate(2 * MiB, tag="grown")
    finally:
        space.close()


def test_a_forked_child_exiting_leaves_the_parents_space(disk_dir: Path) -> None:
    """A process that forks (a data-loading helper, a subprocess started by fork) and whose
    child exits normally: the child's exit ran the space's finalizer, which removed the
    parent's swap directory under its running engine. Only the owner's exit removes it."""
    script = _STUB_AIO + textwrap.dedent(f"""
        import os, sys

        space = SwapSpace({str(disk_dir)!r}, aio=Engine(), reserve_bytes=1 << 20)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)                 # the child's interpreter exit runs the finalizers
        os.waitpid(pid, 0)
        print(sorted(os.listdir(space.path)), flush=True)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "swap-0.bin" in out.stdout, out.stdout + out.stderr
    assert os.listdir(disk_dir) == []      # the owner's own exit removed it


def test_a_close_interrupted_part_way_is_finished_at_exit(disk_dir: Path) -> None:
    """A second Ctrl-C while close() unlinks the swap files: the directory (gigabytes in a real
    run) used to stay for good, since the removal marked itself done before it started and the
    finalizer runs once. Now the next removal finishes it, and interpreter exit does."""
    script = _STUB_AIO + textwrap.dedent(f"""
        import os

        space = SwapSpace({str(disk_dir)!r}, aio=Engine(), reserve_bytes=1 << 20, file_size=1 << 18)
        print(space.path, flush=True)
        real_unlink, calls = os.unlink, [0]

        def unlink(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
            return real_unlink(*args, **kwargs)

        os.unlink = unlink
        try:
            space.close()
        except KeyboardInterrupt:
            print("interrupted", sorted(os.listdir(space.path)), flush=True)
        os.unlink = real_unlink
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith(str(disk_dir)) and lines[1].startswith("interrupted ['"), lines
    assert os.listdir(disk_dir) == [], os.listdir(disk_dir)
