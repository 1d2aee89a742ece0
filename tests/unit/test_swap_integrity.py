"""Swap-space integrity check: bytes changed in a swap file behind the engine's back are reported
when read back (file, extent, range), and nothing the engine wrote itself ever is."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from infinity.base import native_library
from infinity.io.aio import AioEngine
from infinity.io.buffers import aligned_empty
from infinity.config.aio import AioConfig
from infinity.storage import integrity
from infinity.storage.integrity import PAGE, PageFingerprints, SwapCorruptionError
from infinity.storage.manager import TierManager
from infinity.storage.swap import SwapSpace

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_native_check_c_program(tmp_path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build native/test/test_check.c")
    lib = native_library.library_path()
    exe = tmp_path / "test_check"
    subprocess.run([cc, "-O1", "-Wall", "-Werror", "-I", str(ROOT / "native/include"),
                    str(ROOT / "native/test/test_check.c"), str(lib), f"-Wl,-rpath,{lib.parent}",
                    "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_check: ok" in run.stdout


def test_crc32c_known_answer_on_every_kernel() -> None:
    lib = integrity.lib()
    data = b"123456789"
    assert lib.inf_crc32c(0, 0, data, len(data)) == 0xE3069283
    assert lib.inf_crc32c(1, 0, data, len(data)) == 0xE3069283     # the scalar reference
    assert integrity.kernel_name() in ("scalar", "sse4.2")


@pytest.fixture(scope="module")
def aio():
    with AioEngine(AioConfig(backend="auto", block_size=MiB, queue_depth=8)) as engine:
        yield engine


@pytest.fixture(params=["sampled", "full"])
def space(request, disk_dir: Path, aio: AioEngine):
    with SwapSpace(disk_dir, aio=aio, reserve_bytes=4 * MiB, file_size=4 * MiB,
                   check_mode=request.param) as s:
        assert s.integrity.mode == request.param
        yield s


def random_buffer(nbytes: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(-(-nbytes // PAGE) * PAGE)
    gen = torch.Generator().manual_seed(seed)
    buf[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return buf


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Another process's write: buffered, through its own descriptor, then fsync'd."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_back(space: SwapSpace, extent, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
    out = aligned_empty(extent.padded_nbytes)
    space.read(extent, out, offset, nbytes).wait()
    return out


def test_clean_round_trips_pass_and_are_checked(space: SwapSpace) -> None:
    extents = [space.allocate(n, tag=f"s{i}") for i, n in enumerate([PAGE, 5 * PAGE + 100, MiB])]
    bufs = [random_buffer(e.padded_nbytes, i) for i, e in enumerate(extents)]
    for e, b in zip(extents, bufs):
        space.write(e, b).wait()
    space.integrity.stats.reset()
    for e, b in zip(extents, bufs):
        assert torch.equal(read_back(space, e), b)
    pages = sum(e.padded_nbytes for e in extents) // PAGE
    st = space.integrity.stats
    assert st.pages_read == st.pages_checked == pages   # every page was compared


def test_random_bytes_over_a_range_name_the_file_and_extent(space: SwapSpace) -> None:
    a = space.allocate(64 * PAGE, tag="unit0.exp_avg")
    b = space.allocate(64 * PAGE, tag="unit0.exp_avg_sq")
    for e, seed in ((a, 1), (b, 2)):
        space.write(e, random_buffer(e.padded_nbytes, seed)).wait()
    path = space.files[b.file_index]
    start = b.offset + 3 * PAGE + 100      # unaligned, 10 KB: covers pages 3..5 of b
    overwrite(path, start, os.urandom(10_000))
    read_back(space, a)                    # the neighbour is intact
    with pytest.raises(SwapCorruptionError) as info:
        read_back(space, b)
    err = info.value
    assert err.errno == errno.EIO and isinstance(err, OSError)
    assert err.path == str(path) and err.tag == "unit0.exp_avg_sq"
    assert (err.extent_offset, err.extent_nbytes) == (b.offset, 64 * PAGE)
    assert err.bad_pages == 3 and err.checked_pages == 64
    assert (err.first_bad_offset, err.last_bad_offset) == (b.offset + 3 * PAGE, b.offset + 5 * PAGE)
    msg = str(err)
    assert str(path) in msg and "'unit0.exp_avg_sq'" in msg and f"offset {b.offset}" in msg
    assert f"length {64 * PAGE}" in msg and "last checkpoint" in msg
    # the request keeps its error: every wait raises it
    out = aligned_empty(b.padded_nbytes)
    req = space.read(b, out)
    for _ in range(2):
        with pytest.raises(SwapCorruptionError):
            req.wait()
    # a partial read of the clean part of the extent passes; one over the garbage does not
    read_back(space, b, 8 * PAGE, 16 * PAGE)
    with pytest.raises(SwapCorruptionError) as info:
        read_back(space, b, 4 * PAGE, 4 * PAGE)
    assert (info.value.offset, info.value.nbytes) == (b.offset + 4 * PAGE, 4 * PAGE)
    assert "the read covered bytes" in str(info.value)


def test_whole_file_garbage_and_zeros(space: SwapSpace) -> None:
    e = space.allocate(256 * PAGE, tag="params")
    space.write(e, random_buffer(e.padded_nbytes, 3)).wait()
    path = space.files[e.file_index]
    overwrite(path, 0, os.urandom(path.stat().st_size))
    with pytest.raises(SwapCorruptionError) as info:
        read_back(space, e)
    assert info.value.bad_pages == 256
    space.write(e, random_buffer(e.padded_nbytes, 4)).wait()   # written again: clean again
    read_back(space, e)
    overwrite(path, e.offset + 17 * PAGE, bytes(2 * PAGE))      # zeros over two pages
    with pytest.raises(SwapCorruptionError) as info:
        read_back(space, e)
    assert info.value.bad_pages == 2


def test_mid_page_bytes_only_the_full_check_sees(space: SwapSpace) -> None:
    """[Note: swap-space integrity check]: the sampled check reads the first and last 8 bytes of
    each page; bytes strictly between them are seen by the full check only."""
    e = space.allocate(8 * PAGE, tag="m")
    space.write(e, random_buffer(e.padded_nbytes, 5)).wait()
    overwrite(space.files[e.file_index], e.offset + 2 * PAGE + 1000, os.urandom(64))
    if space.integrity.mode == "full":
        with pytest.raises(SwapCorruptionError):
            read_back(space, e)
    else:
        read_back(space, e)


def test_never_written_freed_and_partial_pages_are_not_checked(space: SwapSpace) -> None:
    path = space.files[0]
    overwrite(path, 0, os.urandom(path.stat().st_size))    # garbage everywhere before any write
    fresh = space.allocate(16 * PAGE, tag="fresh")
    read_back(space, fresh)                                # never written: nothing to compare
    space.write(fresh, random_buffer(fresh.padded_nbytes, 6)).wait()
    space.free(fresh)
    again = space.allocate(16 * PAGE, tag="again")         # the same bytes, handed out again
    assert (again.file_index, again.offset) == (fresh.file_index, fresh.offset)
    overwrite(path, again.offset, os.urandom(16 * PAGE))
    read_back(space, again)                                # the old tenant's fingerprints are gone
    # a write of 2.5 pages: the third page's tail was not written, so that page is not checked
    tail = space.allocate(3 * PAGE, tag="tail")
    buf = random_buffer(3 * PAGE, 7)
    space.write(tail, buf, 0, 2 * PAGE + 2048).wait()
    overwrite(path, tail.offset + 3 * PAGE - 8, os.urandom(8))
    read_back(space, tail)
    overwrite(path, tail.offset + PAGE - 8, os.urandom(8))
    with pytest.raises(SwapCorruptionError):
        read_back(space, tail)


def test_a_sub_range_write_updates_only_its_pages(space: SwapSpace) -> None:
    e = space.allocate(32 * PAGE, tag="sub")
    space.write(e, random_buffer(e.padded_nbytes, 8)).wait()
    space.write(e, random_buffer(8 * PAGE, 9), 8 * PAGE, 8 * PAGE).wait()
    read_back(space, e)
    read_back(space, e, 12 * PAGE, 4 * PAGE)


def test_mode_changes_forget_every_fingerprint(space: SwapSpace) -> None:
    mode = space.integrity.mode
    e = space.allocate(8 * PAGE, tag="x")
    space.write(e, random_buffer(e.padded_nbytes, 10)).wait()
    space.integrity.set_mode("off")
    space.write(e, random_buffer(e.padded_nbytes, 11)).wait()   # not recorded
    overwrite(space.files[0], e.offset, os.urandom(PAGE))
    read_back(space, e)                                         # off: nothing checked
    space.integrity.set_mode(mode)
    read_back(space, e)         # no stale fingerprint of the first write is compared
    space.write(e, random_buffer(e.padded_nbytes, 12)).wait()
    overwrite(space.files[0], e.offset, os.urandom(PAGE))
    with pytest.raises(SwapCorruptionError):
        read_back(space, e)


def test_flat_store_path_reports_corruption(disk_dir: Path) -> None:
    """Through the tier manager, as every model state goes (FlatStore.load_async)."""
    from infinity.base.budget import MemoryBudget
    from infinity.storage.tiers import Tier

    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                          nvme_path=str(disk_dir))
    try:
        store = manager.create("unit3.exp_avg", 10_000, torch.float32, Tier.NVME)
        values = aligned_empty(store.nbytes).view(torch.float32)
        values.copy_(torch.linspace(-1, 1, values.numel()))
        manager.wait(store.store_async(values))
        out = aligned_empty(store.nbytes).view(torch.float32)
        manager.wait(store.load_async(out))
        assert torch.equal(out, values)
        layout = manager.swap.layout()
        (tag, path, offset, padded), = layout
        assert tag == "unit3.exp_avg" and padded == store.nbytes
        overwrite(path, offset + PAGE + 4000, os.urandom(5000))
        with pytest.raises(SwapCorruptionError, match="unit3.exp_avg"):
            manager.wait(store.load_async(out))
    finally:
        manager.close()


def test_the_mode_is_a_config_key_and_validated() -> None:
    from infinity.config import ConfigError, InfinityConfig

    assert InfinityConfig.load({}).infinity.swap_check == "sampled"
    assert InfinityConfig.load({"infinity": {"swap_check": "full"}}).infinity.swap_check == "full"
    with pytest.raises(ConfigError, match="infinity.swap_check = 'crc'"):
        InfinityConfig.load({"infinity": {"swap_check": "crc"}})
    with pytest.raises(ValueError, match="choose one of"):
        PageFingerprints("xxhash")
