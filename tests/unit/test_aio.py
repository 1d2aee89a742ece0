"""AioEngine round trips, tails, concurrency, end of file, and the page cache, on every backend."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import infinity
from infinity.io import (AioConfig, AioEngine, aligned_empty, backend_available, resident_pages,
                         wait_all)

BACKENDS = ["io_uring", "libaio", "threads", "mmap"]
DIRECT_BACKENDS = ["io_uring", "libaio", "threads"]
BLOCK = 64 << 10


def make_engine(backend: str, **kw) -> AioEngine:
    if not backend_available(backend):
        pytest.skip(f"aio backend {backend} is not available on this machine (kernel refuses it)")
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("queue_depth", 8)
    return AioEngine(AioConfig(backend=backend, **kw))


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = aligned_empty(n)
    out.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return out


@pytest.fixture(params=BACKENDS)
def engine(request):
    eng = make_engine(request.param)
    yield eng
    eng.close()


# Sizes: one block, not a multiple of the block, a 512-multiple that is not a 4096-multiple, and
# unaligned tails (1 byte, 1000 bytes after whole blocks).
SIZES = [4096, BLOCK, 3 * BLOCK + 4096, 5 * 512, 1, 1000, 2 * BLOCK + 1000, 777777]


@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_random_data(engine: AioEngine, disk_dir, nbytes: int) -> None:
    data = random_bytes(nbytes, seed=nbytes)
    back = aligned_empty(nbytes)
    with engine.open(disk_dir / "rt.dat", "rw", create=True) as f:
        assert engine.write(data, f, 0).wait() == nbytes
        assert f.size == nbytes, "a tail write must leave the file exactly nbytes long"
        assert engine.read(back, f, 0).wait() == nbytes
    assert torch.equal(back, data)


def test_round_trip_float_tensor_at_offset(engine: AioEngine, disk_dir) -> None:
    n = 100_003  # float32: 400012 bytes, an unaligned tail
    src = aligned_empty(n * 4, torch.float32)
    src.copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    dst = aligned_empty(n * 4, torch.float32)
    offset = 3 * BLOCK + 512
    with engine.open(disk_dir / "f32.dat", "rw", create=True) as f:
        engine.write(src, f, offset).wait()
        assert f.size == offset + n * 4
        engine.read(dst, f, offset).wait()
    assert torch.equal(src, dst)


def test_partial_nbytes_reads_only_what_is_asked(engine: AioEngine, disk_dir) -> None:
    data = random_bytes(3 * BLOCK, seed=1)
    back = aligned_empty(3 * BLOCK)
    back.fill_(7)
    with engine.open(disk_dir / "part.dat", "rw", create=True) as f:
        engine.write(data, f, 0).wait()
        assert engine.read(back, f, BLOCK, nbytes=1000).wait() == 1000
    assert torch.equal(back[:1000], data[BLOCK:BLOCK + 1000])
    assert bool((back[1000:] == 7).all()), "bytes past nbytes must not be touched"


def test_tail_write_keeps_following_bytes(engine: AioEngine, disk_dir) -> None:
    """An unaligned write inside a preallocated file changes only its own bytes."""
    base = random_bytes(4 * BLOCK, seed=2)
    patch = random_bytes(4096 + 700, seed=3)
    back = aligned_empty(4 * BLOCK)
    with engine.open(disk_dir / "rmw.dat", "rw", create=True) as f:
        engine.write(base, f, 0).wait()
        engine.write(patch, f, BLOCK).wait()
        assert f.size == 4 * BLOCK
        engine.read(back, f, 0).wait()
    expect = base.clone()
    expect[BLOCK:BLOCK + patch.numel()] = patch
    assert torch.equal(back, expect)


def test_many_concurrent_requests_from_several_threads(engine: AioEngine, disk_dir) -> None:
    piece, per_thread, nthreads = 16 << 10, 64, 4
    total = piece * per_thread * nthreads
    data = random_bytes(total, seed=4)
    back = aligned_empty(total)
    errors: list[BaseException] = []
    with engine.open(disk_dir / "conc.dat", "rw", create=True) as f:
        def writer(t: int) -> None:
            try:
                reqs = []
                for i in range(per_thread):
                    off = (i * nthreads + t) * piece
                    reqs.append(engine.write(data[off:off + piece], f, off))
                assert wait_all(reqs) == [piece] * per_thread
                reqs = [engine.read(back[(i * nthreads + t) * piece:][:piece], f,
                                    (i * nthreads + t) * piece) for i in range(per_thread)]
                wait_all(reqs)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert torch.equal(back, data)
    assert engine.in_flight == 0


def test_read_past_end_is_an_error_unless_allowed(engine: AioEngine, disk_dir) -> None:
    data = random_bytes(BLOCK + 1000, seed=5)
    back = aligned_empty(2 * BLOCK)
    with engine.open(disk_dir / "eof.dat", "rw", create=True) as f:
        engine.write(data, f, 0).wait()
        with pytest.raises(OSError, match="read past end of file") as info:
            engine.read(back, f, 0).wait()
        assert str(f.path) in str(info.value) and str(2 * BLOCK) in str(info.value)
        assert engine.read(back, f, 0, allow_short=True).wait() == BLOCK + 1000
        assert torch.equal(back[:BLOCK + 1000], data)
        assert engine.read(back, f, 4 * BLOCK, nbytes=4096, allow_short=True).wait() == 0
        with pytest.raises(OSError, match="read past end of file"):
            engine.read(back, f, 4 * BLOCK, nbytes=4096).wait()


def test_wait_all_raises_first_error_after_all_finished(engine: AioEngine, disk_dir) -> None:
    data = random_bytes(4 * BLOCK, seed=6)
    bufs = [aligned_empty(BLOCK) for _ in range(4)]
    with engine.open(disk_dir / "wa.dat", "rw", create=True) as f:
        engine.write(data, f, 0).wait()
        reqs = [engine.read(bufs[0], f, 0), engine.read(bufs[1], f, 8 * BLOCK),
                engine.read(bufs[2], f, 2 * BLOCK), engine.read(bufs[3], f, 3 * BLOCK)]
        with pytest.raises(OSError, match=f"offset {8 * BLOCK}"):
            wait_all(reqs)
        assert all(r.done() for r in reqs)
    assert torch.equal(bufs[3], data[3 * BLOCK:])


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
def test_direct_io_leaves_no_pages_in_the_page_cache(backend: str, disk_dir) -> None:
    size = 2 * BLOCK + 1000
    data = random_bytes(size, seed=7)
    back = aligned_empty(size)
    with make_engine(backend) as eng, eng.open(disk_dir / "direct.dat", "rw", create=True) as f:
        assert f.direct
        eng.write(data, f, 0).wait()
        eng.read(back, f, 0).wait()
        assert resident_pages(f.path) == 0, "a direct write/read went through the page cache"
    assert torch.equal(back, data)


def test_the_page_cache_check_sees_buffered_io(disk_dir) -> None:
    """The mmap backend uses the page cache: the residency check must notice (so it can fail)."""
    with make_engine("mmap") as eng, eng.open(disk_dir / "buffered.dat", "rw", create=True) as f:
        assert not f.direct
        eng.write(random_bytes(BLOCK, seed=8), f, 0).wait()
        assert resident_pages(f.path) > 0


def test_closing_waits_for_requests_in_flight(disk_dir) -> None:
    eng = make_engine("threads" if not backend_available("io_uring") else "io_uring")
    data = random_bytes(8 * BLOCK, seed=9)
    f = eng.open(disk_dir / "close.dat", "rw", create=True)
    reqs = [eng.write(data[i * BLOCK:(i + 1) * BLOCK], f, i * BLOCK) for i in range(8)]
    eng.close()
    assert all(r.done() for r in reqs)
    assert [r.wait() for r in reqs] == [BLOCK] * 8
    with pytest.raises(RuntimeError, match="closed"):
        eng.write(data, f, 0)
    eng.close()  # idempotent
    f.close()


def test_requests_not_waited_for_are_collected(disk_dir) -> None:
    """The engine keeps buffers alive until requests finish, then lets them go without a wait()."""
    with make_engine("threads") as eng, eng.open(disk_dir / "sweep.dat", "rw", create=True) as f:
        buf = aligned_empty(4096)
        reqs = [eng.write(buf, f, 0) for _ in range(3000)]
        wait_all(reqs[-10:])
        del reqs
        eng._sweep()
        assert eng.in_flight < 50


def test_auto_reports_the_backend_in_use(disk_dir) -> None:
    with AioEngine(AioConfig(backend="auto")) as eng:
        expected = "io_uring" if backend_available("io_uring") else (
            "libaio" if backend_available("libaio") else "threads")
        assert eng.backend == expected
        assert infinity.native_info()["in_use"]["io_backend"] == expected


def test_mmap_backend_works_on_tmpfs() -> None:
    shm = "/dev/shm"
    if not os.path.isdir(shm) or infinity.io.filesystem_of(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    path = os.path.join(shm, f"infinity-aio-test-{os.getpid()}.dat")
    data = random_bytes(BLOCK + 1000, seed=10)
    back = aligned_empty(BLOCK + 1000)
    try:
        with make_engine("mmap") as eng, eng.open(path, "rw", create=True) as f:
            eng.write(data, f, 0).wait()
            eng.read(back, f, 0).wait()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    assert torch.equal(back, data)


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
@pytest.mark.parametrize("knobs", [
    {"single_submit": True},
    {"overlap_events": False},
    {"thread_count": 3, "queue_depth": 2},
    {"queue_depth": 1, "block_size": 4096},
], ids=["single_submit", "no_overlap", "3_lanes", "qd1"])
def test_round_trip_with_each_knob(backend: str, knobs: dict, disk_dir) -> None:
    n = 9 * BLOCK + 1000
    data = random_bytes(n, seed=11)
    back = aligned_empty(n)
    with make_engine(backend, **knobs) as eng, eng.open(disk_dir / "knobs.dat", "rw", create=True) as f:
        reqs = [eng.write(data[:4 * BLOCK], f, 0), eng.write(data[4 * BLOCK:], f, 4 * BLOCK)]
        assert wait_all(reqs) == [4 * BLOCK, n - 4 * BLOCK]
        assert eng.read(back, f, 0).wait() == n
    assert torch.equal(back, data)


def test_closing_a_file_waits_for_its_requests(engine: AioEngine, disk_dir) -> None:
    data = random_bytes(8 * BLOCK, seed=12)
    f = engine.open(disk_dir / "fclose.dat", "rw", create=True)
    reqs = [engine.write(data[i * BLOCK:(i + 1) * BLOCK], f, i * BLOCK) for i in range(8)]
    f.close()
    assert all(r.done() for r in reqs) and f.closed
    assert wait_all(reqs) == [BLOCK] * 8


def test_a_forked_child_gets_a_clear_error(disk_dir) -> None:
    with make_engine("threads") as eng, eng.open(disk_dir / "fork.dat", "rw", create=True) as f:
        pid = os.fork()
        if pid == 0:  # child: must raise, not hang on lanes that do not exist here
            code = 1
            try:
                eng.write(aligned_empty(4096), f, 0)
            except RuntimeError as exc:
                code = 0 if "fork" in str(exc) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert eng.write(aligned_empty(4096), f, 0).wait() == 4096
