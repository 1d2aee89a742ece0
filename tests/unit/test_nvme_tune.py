"""The nvme-tune sweep (train/nvme_tune.py) at unit level (the CLI's integration tests,
tests/integration/test_nvme_tune_cli.py, cannot check a measured number). Here the
grid, the labels, the recommendation, the JSON and the table are checked on made-up results; the
test file (TuneFile) on a few KiB in a real directory, with the clock injected (the module's own
``time`` replaced by a fake whose ``perf_counter`` the test scripts), so every GB/s is exact; and
``sweep``'s bookkeeping with a stand-in TuneFile that hands out scripted measurements. Nothing
asserts a measured speed."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import infinity.io
from infinity.train import nvme_tune as tune
from infinity.train.nvme_tune import PointResult, TunePoint, TuneReport

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class _Clock:
    """``perf_counter`` that returns the scripted readings in turn."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def perf_counter(self) -> float:
        return self.readings.pop(0)


def _fake_time(monkeypatch, *readings: float) -> _Clock:
    clock = _Clock(*readings)
    monkeypatch.setattr(tune, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


def _result(backend: str, qd: int, threads: int, write: float, read: float, *,
            block: int = MiB, used: str | None = None) -> PointResult:
    return PointResult(TunePoint(backend, block, qd, threads),
                       backend if used is None else used, [write], [read])


def _private_dirs(path: Path) -> list[str]:
    return [p.name for p in path.iterdir() if p.name.startswith("infinity-swap-")]


# -- labels, sizes, the grid -------------------------------------------------------------------

def test_a_point_is_labelled_by_backend_block_queue_depth_and_threads_when_not_one() -> None:
    assert TunePoint("io_uring", MiB, 32).label() == "io_uring 1M qd32"
    assert TunePoint("libaio", 256 * KiB, 8, 1).label() == "libaio 256K qd8"
    assert TunePoint("threads", 4 * MiB, 4, 2).label() == "threads 4M qd4 t2"
    assert TunePoint("io_uring", GiB, 1, 8).label() == "io_uring 1G qd1 t8"


@pytest.mark.parametrize("nbytes, text", [
    (GiB, "1G"), (3 * GiB, "3G"), (2 * MiB, "2M"), (1536 * KiB, "1536K"), (256 * KiB, "256K"),
    (KiB, "1K"), (4096 + 512, "4608"), (1000, "1000"), (GiB + MiB, "1025M")])
def test_sizes_are_written_in_the_largest_whole_unit(nbytes: int, text: str) -> None:
    assert tune._short(nbytes) == text


def test_the_grid_is_every_combination_in_a_stable_order() -> None:
    assert tune.grid(["io_uring", "threads"], [MiB, 4 * MiB], [8], [1, 2]) == [
        TunePoint("io_uring", MiB, 8, 1), TunePoint("io_uring", MiB, 8, 2),
        TunePoint("io_uring", 4 * MiB, 8, 1), TunePoint("io_uring", 4 * MiB, 8, 2),
        TunePoint("threads", MiB, 8, 1), TunePoint("threads", MiB, 8, 2),
        TunePoint("threads", 4 * MiB, 8, 1), TunePoint("threads", 4 * MiB, 8, 2)]
    assert tune.grid(["mmap"], [MiB], [4], []) == []


def test_the_default_grid_is_two_backends_three_blocks_two_queue_depths_one_thread() -> None:
    assert tune.grid() == [TunePoint(b, bs, qd, 1) for b in ("io_uring", "libaio")
                           for bs in (256 * KiB, MiB, 4 * MiB) for qd in (8, 32)]


@pytest.mark.parametrize("size, chunk, expected", [
    (10, 4, [(0, 4), (4, 4), (8, 2)]), (8, 4, [(0, 4), (4, 4)]), (3, 4, [(0, 3)]), (0, 4, [])])
def test_a_pass_is_cut_into_buffer_sized_chunks_and_a_short_last_one(size, chunk, expected) -> None:
    assert tune._chunks(size, chunk) == expected


# -- the recommendation ------------------------------------------------------------------------

def test_the_best_swap_rate_wins_when_nothing_else_is_near() -> None:
    slow = _result("libaio", 4, 1, 1.0, 1.0)          # swap 0.5
    fast = _result("io_uring", 32, 4, 4.0, 4.0)       # swap 2.0
    assert tune.recommend([slow, fast]) is fast
    assert tune.recommend([fast, slow]) is fast


def test_a_point_exactly_at_the_tolerance_counts_as_near() -> None:
    """Near is ``swap >= (1 - tolerance) * best``: with tolerance 0.5 and a best of 1.0, a
    point at 0.5 is near (and cheaper, so chosen); one just below is not."""
    best = _result("io_uring", 32, 2, 2.0, 2.0)       # swap 1.0
    edge = _result("io_uring", 8, 1, 1.0, 1.0)        # swap 0.5
    assert tune.recommend([best, edge], tolerance=0.5) is edge
    below = _result("io_uring", 8, 1, 1.0, 0.999)
    assert tune.recommend([best, below], tolerance=0.5) is best


def test_the_default_tolerance_is_five_percent() -> None:
    best = _result("io_uring", 32, 2, 2.0, 2.0)       # swap 1.00
    within = _result("io_uring", 8, 1, 1.92, 1.92)    # swap 0.96
    outside = _result("io_uring", 8, 1, 1.88, 1.88)   # swap 0.94
    assert tune.recommend([best, within]) is within
    assert tune.recommend([best, outside]) is best


def test_among_near_points_fewer_threads_then_smaller_queue_depth_then_faster() -> None:
    a = _result("io_uring", 4, 2, 2.0, 2.0)           # 2 threads, qd 4
    b = _result("io_uring", 32, 1, 1.99, 1.99)        # 1 thread, qd 32
    c = _result("io_uring", 8, 1, 1.98, 1.98)         # 1 thread, qd 8
    assert tune.recommend([a, b, c]) is c
    assert tune.recommend([a, b]) is b
    slower = _result("libaio", 8, 1, 1.97, 1.97)      # same threads and qd as c, slower
    faster = _result("threads", 8, 1, 1.99, 1.99)
    assert tune.recommend([slower, c, faster]) is faster
    assert tune.recommend([c, slower]) is c


def test_points_without_a_measured_rate_are_never_recommended() -> None:
    unread = _result("io_uring", 1, 1, 5.0, 0.0)      # swap 0: never read
    unwritten = _result("io_uring", 1, 1, 0.0, 5.0)
    measured = _result("libaio", 32, 4, 1.0, 1.0)
    assert tune.recommend([unread, measured, unwritten], tolerance=1.0) is measured
    for nothing in ([], [unread], [unread, unwritten], [PointResult(TunePoint("x", MiB, 1))]):
        with pytest.raises(ValueError) as info:
            tune.recommend(nothing)
        assert str(info.value) == "no point was measured, so there is nothing to recommend"


# -- what a report says ------------------------------------------------------------------------

def test_a_point_result_as_json_rounds_rates_to_four_digits_and_keeps_every_sample() -> None:
    r = PointResult(TunePoint("io_uring", MiB, 8, 2), "io_uring", [1.234567, 3.0, 2.34567],
                    [0.5, 0.123456], [0.0, 0.25])
    swap = 1.0 / (1.0 / 2.34567 + 1.0 / ((0.5 + 0.123456) / 2))
    assert r.to_dict() == {
        "backend": "io_uring", "block_size": MiB, "queue_depth": 8, "thread_count": 2,
        "backend_used": "io_uring", "write_GBps": 2.3457, "read_GBps": 0.3117,
        "swap_GBps": round(swap, 4), "write_samples_GBps": [1.2346, 3.0, 2.3457],
        "read_samples_GBps": [0.5, 0.1235], "resident_before_read": [0.0, 0.25]}


def _report(**kw) -> TuneReport:
    results = [_result("io_uring", 32, 1, 2.0, 2.0, used=""),
               _result("libaio", 8, 1, 1.5, 3.0, block=256 * KiB),
               _result("threads", 4, 2, 0.123456, 0.5, block=4 * MiB)]
    base = dict(path="/nvme/swap", fs_type="ext4", size=16 * MiB, repeats=3,
                writes_include_fsync=False, results=results,
                skipped=["mmap 1M qd4: backend mmap is not available here"], seconds=12.345)
    return TuneReport(**{**base, **kw})


def test_the_aio_section_is_the_best_points_settings_and_the_backend_actually_used() -> None:
    report = _report()        # the first two tie at swap 1.0; io_uring's qd 32 loses to qd 8
    assert report.aio_section() == {
        "backend": "libaio", "block_size": 256 * KiB, "queue_depth": 8,
        "intra_op_parallelism": 1, "single_submit": False, "overlap_events": True}
    auto = _report(results=[_result("auto", 16, 1, 1.0, 1.0, used="io_uring")])
    assert auto.aio_section()["backend"] == "io_uring"
    unknown = _report(results=[_result("threads", 16, 3, 1.0, 1.0, block=2 * MiB, used="")])
    assert unknown.aio_section() == {
        "backend": "threads", "block_size": 2 * MiB, "queue_depth": 16,
        "intra_op_parallelism": 3, "single_submit": False, "overlap_events": True}


def test_the_report_as_json_has_every_point_the_skips_and_the_recommendation() -> None:
    report = _report(writes_include_fsync=True)
    best = report.results[1]
    assert report.to_dict() == {
        "path": "/nvme/swap", "fs_type": "ext4", "size": 16 * MiB, "repeats": 3,
        "units": "GB/s = 1e9 bytes/s, median of repeats",
        "writes_include_fsync": True,
        "reads": "cold: O_DIRECT (page cache bypassed; mmap backend excepted) after fsync + "
                 "posix_fadvise(DONTNEED)",
        "seconds": 12.35,
        "points": [r.to_dict() for r in report.results],
        "skipped": ["mmap 1M qd4: backend mmap is not available here"],
        "recommendation": {**best.to_dict(), "aio": report.aio_section()}}
    assert report.to_dict()["recommendation"]["backend_used"] == "libaio"


def test_the_table_lists_every_point_marks_the_best_and_names_the_skips() -> None:
    text = tune.describe(_report())
    assert text.split("\n") == [
        "nvme-tune /nvme/swap (ext4): 16.00 MiB file, 3 repeat(s), 12 s",
        "writes: O_DIRECT, no fsync (a device write cache may absorb them; --fsync adds one "
        "fdatasync per pass); reads: cold (fsync + fadvise DONTNEED, O_DIRECT). GB/s = 1e9 B/s, "
        "median of repeats",
        "",
        "backend    block   qd  thr  write GB/s  read GB/s  swap GB/s",
        "------------------------------------------------------------",
        "io_uring      1M   32    1       2.000      2.000      1.000",
        "libaio      256K    8    1       1.500      3.000      1.000  <- recommended",
        "threads       4M    4    2       0.123      0.500      0.099",
        "skipped: mmap 1M qd4: backend mmap is not available here",
        "",
        "recommended: libaio 256K qd8 (write 1.50 GB/s, read 3.00 GB/s; swap = 1/(1/write + "
        "1/read) within 5% of the best, fewest threads and smallest queue depth)",
        "paste into ds_config.json:"]


def test_the_table_says_when_writes_include_an_fdatasync() -> None:
    lines = tune.describe(_report(writes_include_fsync=True, skipped=[])).split("\n")
    assert lines[1] == ("writes: O_DIRECT, including one fdatasync per pass; reads: cold (fsync "
                        "+ fadvise DONTNEED, O_DIRECT). GB/s = 1e9 B/s, median of repeats")
    assert not any(line.startswith("skipped") for line in lines)


# -- the test file -----------------------------------------------------------------------------

class _Recorded:
    """infinity.io's AioEngine, recording each engine's config."""

    def __init__(self, monkeypatch) -> None:
        self.configs: list = []
        real = infinity.io.AioEngine
        configs = self.configs

        class Engine(real):
            def __init__(self, config=None) -> None:
                configs.append(config)
                super().__init__(config)

        monkeypatch.setattr(infinity.io, "AioEngine", Engine)


def test_the_test_file_is_private_preallocated_laid_out_and_removed_on_exit(disk_dir: Path,
                                                                           monkeypatch) -> None:
    engines = _Recorded(monkeypatch)
    syncs: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real_fdatasync(fd))[1])
    with tune.TuneFile(disk_dir, 3 * 4096 + 1) as tf:
        assert tf.size == 4 * 4096                          # rounded up to whole pages
        assert tf.preflight.direct_io is True and tf.preflight.path == disk_dir
        assert tf.file_path.parent.parent == disk_dir
        assert tf.file_path.parent.name.startswith("infinity-swap-")
        assert tf.file_path.name == "tune-0.bin"
        st = os.stat(tf.file_path)
        assert st.st_size == 4 * 4096 and stat.S_IMODE(st.st_mode) == 0o600
        assert tf.buf.numel() == 4 * 4096
        # the untimed layout write put the buffer's pattern in the file, then one fdatasync
        assert tf.file_path.read_bytes() == tf.buf.numpy().tobytes()
        assert len(syncs) == 1
        assert [c.backend for c in engines.configs] == ["auto"]
        assert tf._check.verify()
    assert tf.buf is None and tf._check is None
    assert list(disk_dir.iterdir()) == []


def test_the_buffer_is_at_most_max_buffer_and_the_file_is_written_in_chunks_of_it(
        disk_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(tune, "MAX_BUFFER", 8192)
    with tune.TuneFile(disk_dir, 5 * 4096) as tf:
        assert tf.size == 5 * 4096 and tf.buf.numel() == 8192
        pattern = tf.buf.numpy().tobytes()
        assert tf.file_path.read_bytes() == pattern + pattern + pattern[:4096]
    with tune.TuneFile(disk_dir, 8192) as tf:
        assert tf.buf.numel() == 8192
    assert list(disk_dir.iterdir()) == []


def test_the_preflight_asks_the_direct_io_and_the_space_is_counted_after_the_reclaim(disk_dir: Path,
                                                                          monkeypatch) -> None:
    calls = []
    real = tune.check_swap_path
    monkeypatch.setattr(tune, "check_swap_path",
                        lambda *a, **kw: (calls.append((a, kw)), real(*a, **kw))[1])
    reclaimed = []
    monkeypatch.setattr(tune, "reclaim_stale",
                        lambda path: reclaimed.append((path, _private_dirs(disk_dir))))
    with tune.TuneFile(disk_dir, 100, direct_io=False) as tf:
        assert tf.preflight.direct_io is False
    with tune.TuneFile(disk_dir, 4096):
        pass
    assert calls == [((disk_dir, 0), {"direct_io": False}), ((disk_dir, 0), {"direct_io": True})]
    # a killed run's leftovers are reclaimed before the new private dir is made, and before the
    # free space is counted (they count as free, as the engine counts them)
    assert reclaimed == [(disk_dir, []), (disk_dir, [])]
    monkeypatch.setattr(tune, "check_free_space",
                        lambda *a, **kw: reclaimed.append("space") or 1 << 40)
    with tune.TuneFile(disk_dir, 4096):
        pass
    assert reclaimed[-2:] == [(disk_dir, []), "space"]


@pytest.mark.parametrize("size", [0, -1, -4096])
def test_a_size_that_is_not_positive_is_refused_before_any_file(disk_dir: Path, size: int) -> None:
    with pytest.raises(ValueError) as info:
        tune.TuneFile(disk_dir, size)
    assert str(info.value) == f"nvme-tune: size must be positive, got {size}"
    assert list(disk_dir.iterdir()) == []


def test_a_failure_while_laying_out_the_file_removes_the_private_dir(disk_dir: Path,
                                                                     monkeypatch) -> None:
    def refuse(config=None):
        raise OSError(5, "the engine would not start")

    monkeypatch.setattr(infinity.io, "AioEngine", refuse)
    with pytest.raises(OSError, match="the engine would not start"):
        tune.TuneFile(disk_dir, 4096)
    assert list(disk_dir.iterdir()) == []


def test_a_failure_before_the_buffer_exists_removes_the_private_dir(disk_dir: Path,
                                                                   monkeypatch) -> None:
    def refuse(fd, offset, length):
        raise OSError(28, "no space")

    monkeypatch.setattr(tune.os, "posix_fallocate", refuse)
    with pytest.raises(OSError, match="no space"):
        tune.TuneFile(disk_dir, 4096)
    assert list(disk_dir.iterdir()) == []


# -- one measurement, with the clock injected ----------------------------------------------------

def test_a_measurement_is_bytes_over_the_clocked_seconds_of_each_pass(disk_dir: Path,
                                                                     monkeypatch) -> None:
    with infinity.io.AioEngine(infinity.io.AioConfig(backend="auto")) as engine:
        auto_backend = engine.backend                          # what "auto" picks here
    with tune.TuneFile(disk_dir, 64 * KiB) as tf:
        engines = _Recorded(monkeypatch)
        _fake_time(monkeypatch, 10.0, 10.5, 20.0, 22.0)     # write 0.5 s, read 2.0 s
        point = TunePoint("threads", 8192, 3, 2)
        backend, write, read, resident = tf.measure(point)
        assert backend == "threads"
        assert write == 64 * KiB / 0.5 / 1e9 and read == 64 * KiB / 2.0 / 1e9
        assert resident == 0.0                                # fsync'd and evicted first
        [cfg] = engines.configs
        assert (cfg.backend, cfg.block_size, cfg.queue_depth, cfg.thread_count) == \
            ("threads", 8192, 3, 2)
        _fake_time(monkeypatch, 1.0, 5.0, 7.0, 7.25)
        assert tf.measure(TunePoint("auto", MiB, 8))[:3] == (
            auto_backend, 64 * KiB / 4.0 / 1e9, 64 * KiB / 0.25 / 1e9)


def test_a_write_pass_fdatasyncs_only_when_asked(disk_dir: Path, monkeypatch) -> None:
    with tune.TuneFile(disk_dir, 8192) as tf:
        syncs: list[int] = []
        real_fdatasync = os.fdatasync
        monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real_fdatasync(fd))[1])
        tf.measure(TunePoint("threads", 4096, 2))
        assert syncs == []
        tf.measure(TunePoint("threads", 4096, 2), fsync=True)
        assert len(syncs) == 1 and syncs[0] >= 0


def test_a_measurement_rewrites_the_whole_file_and_reads_it_back(disk_dir: Path,
                                                                monkeypatch) -> None:
    monkeypatch.setattr(tune, "MAX_BUFFER", 8192)
    with tune.TuneFile(disk_dir, 3 * 8192) as tf:
        pattern = tf.buf.numpy().tobytes()
        tf.file_path.write_bytes(bytes(3 * 8192))            # as if another pass had left zeros
        order: list[str] = []
        real_drop = infinity.io.drop_cached
        monkeypatch.setattr(infinity.io, "drop_cached",
                            lambda path: (order.append(("drop", Path(path))), real_drop(path))[1])
        tf.measure(TunePoint("threads", 4096, 4), before_read=lambda: order.append("before_read"))
        assert tf.file_path.read_bytes() == pattern * 3
        assert order == ["before_read", ("drop", tf.file_path)]
        assert tf.buf.numpy().tobytes() == pattern            # the read brought the pattern back
        tf.measure(TunePoint("threads", 4096, 4), before_read=None)


def test_a_file_that_is_not_whole_buffers_is_read_with_a_short_last_request(
        disk_dir: Path, monkeypatch) -> None:
    """5 pages through a 2-page buffer: the last request of each pass is one page; reading a
    whole buffer there would run past the end of the file."""
    monkeypatch.setattr(tune, "MAX_BUFFER", 8192)
    with tune.TuneFile(disk_dir, 5 * 4096) as tf:
        pattern = tf.buf.numpy().tobytes()
        backend, write, read, resident = tf.measure(TunePoint("threads", 4096, 4))
        assert backend == "threads" and write > 0 and read > 0
        assert tf.file_path.read_bytes() == pattern * 2 + pattern[:4096]


@pytest.mark.parametrize("pages, expected", [(1, 0.3333), (2, 0.6667), (3, 1.0), (50, 1.0)])
def test_the_cached_fraction_before_a_read_is_pages_over_the_file_at_most_one(
        disk_dir: Path, monkeypatch, pages: int, expected: float) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    with tune.TuneFile(disk_dir, 3 * page) as tf:
        seen = []
        monkeypatch.setattr(infinity.io, "resident_pages",
                            lambda path: (seen.append(Path(path)), pages)[1])
        assert tf.measure(TunePoint("threads", 4096, 1))[3] == expected
        assert seen == [tf.file_path]


def test_data_that_does_not_come_back_is_an_error_naming_the_file_and_the_point(
        disk_dir: Path, monkeypatch) -> None:
    with tune.TuneFile(disk_dir, 8192) as tf:
        real_drop = infinity.io.drop_cached

        def corrupt_then_drop(path) -> None:                 # the disk loses the written data
            Path(path).write_bytes(bytes(8192))
            real_drop(path)

        monkeypatch.setattr(infinity.io, "drop_cached", corrupt_then_drop)
        with pytest.raises(OSError) as info:
            tf.measure(TunePoint("threads", 4096, 2, 3))
        assert str(info.value) == (
            f"nvme-tune: the data read back from {tf.file_path} with threads 4K qd2 t3 differs "
            "from what was written; the disk or the I/O engine is corrupting data")


# -- the read-back check -----------------------------------------------------------------------

def _tiles(buf: torch.Tensor, tile: int) -> torch.Tensor:
    return buf.view(-1, tile)


def test_the_check_stamps_every_tile_with_its_index_and_samples_every_16th_and_the_last() -> None:
    buf = torch.empty(35 * 64 * KiB, dtype=torch.uint8)
    check = tune._Check(buf)
    rows = _tiles(buf, 64 * KiB)
    for k in range(35):
        assert int(rows[k, :8].view(torch.int64)) == k
    assert not torch.equal(rows[0, 8:], torch.zeros_like(rows[0, 8:]))
    assert torch.equal(rows[1, 8:], rows[34, 8:])              # one pattern after the stamp
    assert check.verify()
    check.clear()
    sampled = {0, 16, 32, 34}
    for k in range(35):
        zero = bool((rows[k] == 0).all())
        assert zero == (k in sampled), k
    assert not check.verify()


@pytest.mark.parametrize("row", [0, 16, 32, 34])
def test_the_check_fails_when_any_sampled_tile_differs(row: int) -> None:
    buf = torch.empty(35 * 64 * KiB, dtype=torch.uint8)
    check = tune._Check(buf)
    rows = _tiles(buf, 64 * KiB)
    rows[row, 9] ^= 1
    assert not check.verify()


def test_a_tile_read_from_the_wrong_offset_is_caught_by_its_stamp() -> None:
    buf = torch.empty(17 * 64 * KiB, dtype=torch.uint8)
    check = tune._Check(buf)
    rows = _tiles(buf, 64 * KiB)
    rows[16].copy_(rows[15])                                   # tile 15's data where 16 belongs
    assert not check.verify()


def test_a_buffer_that_is_not_whole_64k_tiles_uses_4k_tiles() -> None:
    buf = torch.empty(19 * 4096, dtype=torch.uint8)
    check = tune._Check(buf)
    rows = _tiles(buf, 4096)
    assert [int(rows[k, :8].view(torch.int64)) for k in range(19)] == list(range(19))
    check.clear()
    assert [bool((rows[k] == 0).all()) for k in range(19)] == \
        [k in (0, 16, 18) for k in range(19)]
    assert not check.verify()


# -- the sweep's bookkeeping, with scripted measurements -------------------------------------------

class _Scripted:
    """Stands in for TuneFile in ``sweep``: each measure call takes the next scripted
    (backend, write, read, resident) of its point and calls ``before_read`` as the real one does."""

    def __init__(self, monkeypatch, script: dict[TunePoint, list[tuple]]) -> None:
        self.script = {p: list(v) for p, v in script.items()}
        self.made: list[tuple] = []
        self.measured: list[tuple] = []
        self.closed = 0
        outer = self

        class File:
            def __init__(self, path, size, *, direct_io=True) -> None:
                outer.made.append((path, size, direct_io))
                self.size = -(-size // 4096) * 4096
                self.preflight = SimpleNamespace(fs_type="xfs")

            def measure(self, point, *, fsync=False, before_read=None):
                outer.measured.append((point, fsync, before_read is None))
                if before_read:
                    before_read()
                return outer.script[point].pop(0)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                outer.closed += 1

        monkeypatch.setattr(tune, "TuneFile", File)


def test_repeats_go_round_the_grid_and_each_point_keeps_its_samples(monkeypatch) -> None:
    monkeypatch.setattr(infinity.io, "backend_available", lambda name: True)
    a, b = TunePoint("io_uring", MiB, 8), TunePoint("libaio", MiB, 32)
    fake = _Scripted(monkeypatch, {a: [("io_uring", 1.0, 2.0, 0.0), ("io_uring", 3.0, 4.0, 0.5)],
                                   b: [("libaio", 5.0, 6.0, 0.25), ("libaio", 7.0, 8.0, 0.0)]})
    _fake_time(monkeypatch, 100.0, 107.5)
    progress: list[tuple] = []
    report = tune.sweep("/some/disk", [a, b], size=5000, repeats=2, fsync=True,
                        progress=lambda *args: progress.append(args))
    assert fake.made == [("/some/disk", 5000, True)] and fake.closed == 1
    assert fake.measured == [(a, True, False), (b, True, False), (a, True, False),
                             (b, True, False)]
    assert progress == [
        (0, 4, a, "write"), (0, 4, a, "read"), (1, 4, a, "done"),
        (1, 4, b, "write"), (1, 4, b, "read"), (2, 4, b, "done"),
        (2, 4, a, "write"), (2, 4, a, "read"), (3, 4, a, "done"),
        (3, 4, b, "write"), (3, 4, b, "read"), (4, 4, b, "done")]
    assert [r.point for r in report.results] == [a, b]
    ra, rb = report.results
    assert (ra.backend_used, ra.write_samples, ra.read_samples, ra.resident_before_read) == \
        ("io_uring", [1.0, 3.0], [2.0, 4.0], [0.0, 0.5])
    assert (rb.backend_used, rb.write_samples, rb.read_samples, rb.resident_before_read) == \
        ("libaio", [5.0, 7.0], [6.0, 8.0], [0.25, 0.0])
    assert (report.path, report.fs_type, report.size, report.repeats) == \
        ("/some/disk", "xfs", 8192, 2)
    assert report.writes_include_fsync is True and report.skipped == []
    assert report.seconds == 7.5


def test_without_progress_the_sweep_measures_without_a_read_callback(monkeypatch) -> None:
    p = TunePoint("auto", MiB, 8)        # "auto" is never asked about: it is always there
    monkeypatch.setattr(infinity.io, "backend_available",
                        lambda name: pytest.fail(f"asked about {name}"))
    fake = _Scripted(monkeypatch, {p: [("io_uring", 1.0, 1.0, 0.0)]})
    report = tune.sweep(Path("/d"), [p])
    assert fake.measured == [(p, False, True)]
    assert fake.made == [(Path("/d"), tune.DEFAULT_SIZE, True)]
    assert report.path == "/d" and report.repeats == 1 and report.writes_include_fsync is False
    assert report.results[0].backend_used == "io_uring"


def test_only_mmap_points_skip_the_direct_io_probe(monkeypatch) -> None:
    monkeypatch.setattr(infinity.io, "backend_available", lambda name: True)
    m, t = TunePoint("mmap", MiB, 4), TunePoint("threads", MiB, 4)
    fake = _Scripted(monkeypatch, {m: [("mmap", 1.0, 1.0, 0.0)] * 2,
                                   t: [("threads", 1.0, 1.0, 0.0)]})
    tune.sweep("/d", [m], size=MiB)
    tune.sweep("/d", [m, t], size=MiB)
    assert [made[2] for made in fake.made] == [False, True]


def test_unavailable_backends_are_skipped_with_a_reason_and_none_left_is_an_error(
        monkeypatch) -> None:
    monkeypatch.setattr(infinity.io, "backend_available", lambda name: name == "threads")
    lib, thr = TunePoint("libaio", MiB, 4, 2), TunePoint("threads", MiB, 4)
    fake = _Scripted(monkeypatch, {thr: [("threads", 1.0, 1.0, 0.0)]})
    report = tune.sweep("/d", [lib, thr], size=MiB)
    assert [r.point for r in report.results] == [thr]
    assert report.skipped == ["libaio 1M qd4 t2: backend libaio is not available here"]
    uring = TunePoint("io_uring", 4 * MiB, 8)
    with pytest.raises(ValueError) as info:
        tune.sweep("/d", [lib, uring], size=MiB)
    assert str(info.value) == (
        "nvme-tune: no requested backend is available here: libaio 1M qd4 t2: backend libaio is "
        "not available here; io_uring 4M qd8: backend io_uring is not available here")
    assert len(fake.made) == 1


def test_an_empty_grid_or_no_repeat_is_refused(monkeypatch) -> None:
    fake = _Scripted(monkeypatch, {})
    with pytest.raises(ValueError) as info:
        tune.sweep("/d", [])
    assert str(info.value) == ("nvme-tune: the grid is empty; give at least one value for every "
                               "knob")
    for repeats in (0, -2):
        with pytest.raises(ValueError) as info:
            tune.sweep("/d", [TunePoint("threads", MiB, 4)], repeats=repeats)
        assert str(info.value) == f"nvme-tune: repeats must be >= 1, got {repeats}"
    assert fake.made == []


def test_a_real_small_sweep_measures_every_point_and_leaves_nothing(disk_dir: Path) -> None:
    points = tune.grid(["threads", "mmap"], [4096, 8192], [2])
    phases: list[tuple] = []
    report = tune.sweep(disk_dir, points, size=16 * KiB, repeats=2,
                        progress=lambda d, t, p, ph: phases.append((d, t, p.label(), ph)))
    assert [r.point for r in report.results] == points
    for r in report.results:
        assert r.backend_used == r.point.backend
        assert len(r.write_samples) == len(r.read_samples) == 2
        assert all(x > 0 for x in r.write_samples + r.read_samples)
    assert report.size == 16 * KiB and report.fs_type and report.seconds > 0
    assert len(phases) == 3 * 8 and phases[-1] == (8, 8, "mmap 8K qd2", "done")
    assert report.best in report.results
    assert list(disk_dir.iterdir()) == []


@pytest.mark.parametrize("name, said", [("", "is a directory"),
                                        ("none/sweep.png", "does not exist"),
                                        ("sweep.xyz", "cannot write a .xyz file")])
def test_a_plot_path_that_cannot_be_written_is_refused_before_the_sweep(
        tmp_path: Path, capsys, monkeypatch, name: str, said: str) -> None:
    """It was tried after the sweep (minutes), and a directory given came out as DIR.png."""
    pytest.importorskip("matplotlib")
    from infinity import cli
    from infinity.train import nvme_tune

    def no_sweep(*args, **kwargs):
        raise AssertionError("the sweep ran before the --plot path was checked")

    monkeypatch.setattr(nvme_tune, "sweep", no_sweep)
    target = tmp_path / name if name else tmp_path
    assert cli.main(["nvme-tune", "--path", str(tmp_path), "--plot", str(target)]) == 2
    assert said in capsys.readouterr().err


def test_an_mmap_sweep_runs_where_the_file_system_has_no_o_direct(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The preflight's advice on a file system without O_DIRECT is the "mmap" backend: a sweep
    of mmap points wrote its untimed layout with O_DIRECT anyway and failed with the same
    advice. Simulated: every O_DIRECT open under the directory fails as the kernel's does."""
    import errno

    real_open = os.open

    def no_direct(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_DIRECT and str(path).startswith(str(tmp_path)):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", no_direct)
    point = TunePoint(backend="mmap", block_size=1 << 20, queue_depth=8, thread_count=1)
    report = tune.sweep(tmp_path, [point], size=8 << 20)
    assert [r.backend_used for r in report.results] == ["mmap"]
    assert report.results[0].write_samples and report.results[0].read_samples
    assert os.listdir(tmp_path) == []
