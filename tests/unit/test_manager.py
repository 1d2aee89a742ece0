"""storage/manager.py at unit level: FlatStore in each home (HOST,
DEVICE, NVME, doubled), its ranges, counters and frees, and TierManager's budgets, lazy swap
space and I/O engine, waits and close -- on real budgets, a real swap space in a disk directory
and real requests (a failing request is a small object whose wait raises)."""
from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch
from messages import raises_naming

from infinity.base.budget import BudgetExceededError, MemoryBudget
from infinity.config.aio import AioConfig
from infinity.io.buffers import aligned_empty
from infinity.storage import manager as manager_mod
from infinity.storage.manager import DONE, FlatStore, TierCounters, TierManager, padded_numel
from infinity.storage.tiers import Tier

MiB = 1 << 20



@pytest.fixture
def nvme(disk_dir: Path):
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                    nvme_path=str(disk_dir), aio_config=AioConfig(backend="auto", block_size=MiB,
                                                                   queue_depth=4))
    try:
        yield m
    finally:
        m.close()


def plain(host: int | None = None, device: int | None = None) -> TierManager:
    return TierManager(MemoryBudget("host", host), MemoryBudget("device", device))


def test_padded_numel_rounds_bytes_up_to_4_kib() -> None:
    assert [padded_numel(n, torch.float32) for n in (0, 1, 1024, 1025)] == [0, 1024, 1024, 2048]
    assert padded_numel(1, torch.bfloat16) == 2048 and padded_numel(1, torch.float64) == 512


def test_counters_reset_to_zero() -> None:
    c = TierCounters(1, 2, 3, 4, 5.0)
    c.reset()
    assert c == TierCounters()


def test_done_request_is_done_and_waits_for_nothing() -> None:
    assert DONE.done() is True and DONE.wait() == 0 and DONE.wait(1.0) == 0


def test_a_host_store_is_zeroed_padded_and_counted() -> None:
    m = plain()
    s = m.create("u0.exp_avg", 1000, torch.float32, Tier.HOST, doubled=True)
    assert (s.name, s.numel, s.dtype, s.home) == ("u0.exp_avg", 1000, torch.float32, Tier.HOST)
    assert (s.padded, s.itemsize, s.nbytes) == (1024, 4, 4096)
    assert s.resident and not s.doubled                # doubled is for NVMe stores only
    assert s.tensor.shape == (1024,) and not s.tensor.any()
    assert m.host_budget.held == 4096 and m.tier_bytes() == {"device": 0, "host": 4096, "nvme": 0}
    with raises_naming(RuntimeError, "u0.exp_avg", "no shadow extent"):
        s.flip()
    s.free()
    assert not s.resident and m.device_budget.held == 0


def test_a_device_store_reserves_the_device_budget_until_freed() -> None:
    m = plain(device=8192)
    s = m.create("u1.param", 1500, torch.bfloat16, Tier.DEVICE)
    assert s.padded == 2048 and s.nbytes == 4096 and not s.tensor.any()
    assert m.device_budget.held == 4096 and m.host_budget.held == 0
    s.free()
    assert m.device_budget.held == 0
    s.free()                                           # freed once only
    assert m.device_budget.held == 0
    with raises_naming(BudgetExceededError, "u2.param", "12.00 KiB", "device"):
        m.create("u2.param", 3000, torch.float32, Tier.DEVICE)


def test_host_empty_is_aligned_named_and_counted() -> None:
    m = plain(host=8192)
    t = m.host_empty(1000, torch.float32, what="slot 3")
    assert t.shape == (1000,) and t.dtype == torch.float32 and t.data_ptr() % 4096 == 0
    assert m.host_budget.held == 4000
    with raises_naming(BudgetExceededError, "slot 4", "8.00 KiB", "host"):
        m.host_empty(2048, torch.float32, what="slot 4")
    empty = m.host_empty(0, torch.bfloat16, what="nothing")
    assert empty.shape == (0,) and empty.dtype == torch.bfloat16 and m.host_budget.held == 4000
    del t
    assert m.host_budget.held == 0                     # refunded when the storage is freed


def test_host_empty_logs_what_and_size(infinity_log) -> None:
    import logging

    from infinity.base.log import get_logger

    logger = get_logger()
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        m = plain()
        keep = m.host_empty(1024, torch.float32, what="slot 9")
        m.host_empty(1024, torch.float32, what="slot 10")
    finally:
        logger.setLevel(old)
    lines = [r.getMessage() for r in infinity_log.records if "host allocation" in r.getMessage()]
    assert lines == ["host allocation: slot 9, 4.00 KiB (held 0 B)",
                     "host allocation: slot 10, 4.00 KiB (held 4.00 KiB)"]
    del keep


def test_device_empty_reserves_its_bytes() -> None:
    m = plain(device=4096)
    t = m.device_empty(512, torch.float64, torch.device("cpu"), what="staging")
    assert t.shape == (512,) and t.dtype == torch.float64 and m.device_budget.held == 4096
    with raises_naming(BudgetExceededError, "more", "4 B"):
        m.device_empty(1, torch.float32, torch.device("cpu"), what="more")


def test_host_ranges_are_checked_and_copied() -> None:
    """Loads and stores of a resident store copy [start, start+count) and return DONE; a range
    must start on a 4 KiB boundary and lie inside the padded size."""
    m = plain()
    s = m.create("h", 3000, torch.float32, Tier.HOST)     # padded 3072: 3 blocks of 1024
    src = torch.arange(2048, dtype=torch.float32)
    assert s.store_async(src, 1024, 2048) is DONE
    assert torch.equal(s.tensor[1024:3072], src) and not s.tensor[:1024].any()
    out = torch.zeros(3072)
    assert s.load_async(out, 1024) is DONE             # count: to the end
    assert torch.equal(out[:2048], src)
    assert s.store_async(s.tensor[2048:], 2048) is DONE   # its own memory: no copy
    assert torch.equal(s.tensor[1024:3072], src)
    for start, count in ((512, 10), (-1024, 10), (2048, 1025), (3072, 1)):
        with raises_naming(ValueError, "h: ", f"[{start}, {start + count})",
                           "4096-byte boundary", "3072 elements"):
            s.load_async(out, start, count)
    s.load_async(out, 2048, 1024)                       # the last block exactly
    with raises_naming(RuntimeError, "h: ", "no shadow extent", "not a doubled NVMe store"):
        s.load_async(out, shadow=True)
    with raises_naming(RuntimeError, "h: ", "speculative write", "doubled NVMe store"):
        s.store_async(src, shadow=True)


def test_nvme_store_round_trips_ranges_and_counts_bytes(nvme: TierManager) -> None:
    s = nvme.create("u3.exp_avg_sq", 3000, torch.float32, Tier.NVME)
    assert not s.resident and not s.doubled and s.padded == 3072
    with raises_naming(RuntimeError, "u3.exp_avg_sq", "NVME", "no resident tensor"):
        s.tensor
    (tag, _, _, padded), = nvme.swap.layout()
    assert (tag, padded) == ("u3.exp_avg_sq", 3 * 4096)
    data = aligned_empty(3 * 4096).view(torch.float32)
    data.copy_(torch.arange(3072, dtype=torch.float32))
    nvme.wait(s.store_async(data))
    part = aligned_empty(4096).view(torch.float32)
    nvme.wait(s.store_async(part.fill_(-1), 1024, 1000))   # 1000 elements: one block written
    assert nvme.counters.nvme_write_bytes == 4 * 4096
    out = aligned_empty(2 * 4096).view(torch.float32)
    nvme.wait(s.load_async(out, 1024))
    assert nvme.counters.nvme_read_bytes == 2 * 4096
    assert torch.equal(out[:1024], torch.full((1024,), -1.0))
    assert torch.equal(out[1024:], torch.arange(2048, 3072, dtype=torch.float32))
    assert nvme.tier_bytes()["nvme"] == 3 * 4096
    assert nvme.describe() == "device 0 B, host 0 B, nvme 12.00 KiB"
    s.free()
    s.free()
    assert nvme.swap.bytes_allocated == 0


def test_a_doubled_store_writes_its_shadow_and_flips(nvme: TierManager) -> None:
    s = nvme.create("u4.param", 1024, torch.float32, Tier.NVME, doubled=True)
    assert s.doubled
    assert sorted(t for t, *_ in nvme.swap.layout()) == ["u4.param", "u4.param.shadow"]
    old, new = aligned_empty(4096).view(torch.float32), aligned_empty(4096).view(torch.float32)
    old.fill_(1.0)
    new.fill_(2.0)
    nvme.wait(s.store_async(old), s.store_async(new, shadow=True))
    out = aligned_empty(4096).view(torch.float32)
    nvme.wait(s.load_async(out))
    assert float(out[0]) == 1.0
    nvme.wait(s.load_async(out, shadow=True))
    assert float(out[0]) == 2.0
    s.flip()
    nvme.wait(s.load_async(out))
    assert float(out[0]) == 2.0
    nvme.wait(s.load_async(out, shadow=True))
    assert float(out[0]) == 1.0
    s.free()
    assert nvme.swap.bytes_allocated == 0 and nvme.swap.layout() == []


def test_the_swap_space_is_made_once_with_the_managers_settings(disk_dir: Path) -> None:
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                    nvme_path=str(disk_dir), swap_check="full", rank=3,
                    aio_config=AioConfig(backend="mmap"))
    m.nvme_reserve_bytes = 2 * MiB
    try:
        assert m.device_cache.budget is m.device_budget and m.device_cache.device == m.device
        swap = m.swap
        assert m.swap is swap and m.aio is swap.aio and m.aio is m.aio
        assert m.aio.backend == "mmap"
        assert swap.rank == 3 and swap.integrity.mode == "full"
        assert swap.bytes_on_disk >= 2 * MiB and swap.nvme_path == disk_dir
    finally:
        m.close()
    assert swap.closed and m._swap is None and m._aio is None
    m.close()                                          # a second close does nothing


def test_no_nvme_path_is_a_clear_error() -> None:
    with raises_naming(ValueError, "NVMe", "no nvme_path",
                       "set zero_optimization.offload_*.nvme_path"):
        plain().create("x", 10, torch.float32, Tier.NVME)


def test_close_gives_the_cached_device_memory_back() -> None:
    m = plain(device=8 * MiB)
    s = torch.empty(0, dtype=torch.uint8).untyped_storage()
    m.device_cache.attach(s, MiB, "unit")
    m.device_cache.detach(s)
    assert m.device_budget.held == MiB
    m.close()
    assert m.device_budget.held == 0 and m.device_cache.cached_bytes == 0


class Failing:
    def __init__(self, code: int) -> None:
        self.code, self.waited = code, 0

    def wait(self, timeout=None):
        self.waited += 1
        raise OSError(self.code, "failed")


class Done:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self, timeout=None):
        self.waited += 1
        return 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def perf_counter(self) -> float:
        self.now += 1.5
        return self.now


def test_wait_waits_for_all_and_raises_the_first_error(monkeypatch) -> None:
    """Every request is waited on (None and DONE skipped) before the first OSError is raised;
    the time counts as I/O wait, once per call; a call with nothing to wait for adds none."""
    monkeypatch.setattr(manager_mod, "time", FakeClock())
    m = plain()
    a, b, c = Done(), Failing(errno.EIO), Failing(errno.ENOSPC)
    with raises_naming(OSError, f"[Errno {errno.EIO}]", "failed"):
        m.wait(None, a, DONE, b, c)
    assert (a.waited, b.waited, c.waited) == (1, 1, 1)
    assert m.counters.io_wait_s == 1.5
    m.wait(Done(), Done())
    assert m.counters.io_wait_s == 3.0
    m.wait(None, DONE)
    m.wait()
    assert m.counters.io_wait_s == 3.0


def test_only_the_main_threads_waits_count(monkeypatch) -> None:
    monkeypatch.setattr(manager_mod, "time", FakeClock())
    m = plain()
    t = threading.Thread(target=m.wait, args=(Done(),))
    t.start()
    t.join()
    assert m.counters.io_wait_s == 0.0
    with m.waiting():
        pass
    assert m.counters.io_wait_s == 1.5


def test_a_failing_block_still_counts_its_wait(monkeypatch) -> None:
    monkeypatch.setattr(manager_mod, "time", FakeClock())
    m = plain()
    with pytest.raises(KeyError):
        with m.waiting():
            raise KeyError("x")
    assert m.counters.io_wait_s == 1.5


def test_named_budget_reserves_under_its_own_name() -> None:
    budget = MemoryBudget("host", 100)
    named = manager_mod._NamedBudget(budget, "slot 1")
    named.reserve(60, "ignored")
    assert budget.held == 60
    with raises_naming(BudgetExceededError, "slot 1", "needs"):
        named.reserve(60, "ignored")
    named.release(60)
    assert budget.held == 0


def test_create_passes_the_store_its_arguments() -> None:
    m = plain()
    s = m.create("n", 5, torch.float16, Tier.HOST)
    assert isinstance(s, FlatStore) and s.manager is m and s.padded == 2048 and s.nbytes == 4096


def test_a_store_made_directly_is_single_unless_asked(nvme: TierManager) -> None:
    s = FlatStore(nvme, "direct", 10, torch.float32, Tier.NVME)
    assert not s.doubled and [t for t, *_ in nvme.swap.layout()] == ["direct"]
    s.free()


def test_ranges_and_bytes_follow_the_stores_dtype(nvme: TierManager) -> None:
    """A 2-byte dtype: 2048 elements a 4 KiB block (a range starting at 1024 is refused) and
    2 bytes an element counted; reads add up."""
    h = nvme.create("h16", 4096, torch.bfloat16, Tier.HOST)
    assert h.itemsize == 2 and nvme.host_budget.held == 8192
    out = torch.zeros(4096, dtype=torch.bfloat16)
    with raises_naming(ValueError, "h16: ", "[1024, 2048)", "4096-byte boundary",
                       "4096 elements"):
        h.load_async(out, 1024, 1024)
    assert h.load_async(out, 2048, 2048) is DONE
    s = nvme.create("n64", 1024, torch.float64, Tier.NVME)
    assert s.itemsize == 8 and s.padded == 1024
    buf = aligned_empty(8192).view(torch.float64)
    buf.copy_(torch.arange(1024, dtype=torch.float64))
    nvme.wait(s.store_async(buf))
    back = aligned_empty(8192).view(torch.float64)
    nvme.wait(s.load_async(back, 512))
    nvme.wait(s.load_async(back))
    assert torch.equal(back, buf)
    assert (nvme.counters.nvme_write_bytes, nvme.counters.nvme_read_bytes) == (8192, 12288)
    s.free()
    h.free()


def test_a_host_store_over_budget_names_the_store() -> None:
    with raises_naming(BudgetExceededError, "u5.exp_avg", "8.00 KiB", "host"):
        plain(host=4096).create("u5.exp_avg", 2000, torch.float32, Tier.HOST)


def test_host_empty_counts_the_dtypes_bytes_and_pins() -> None:
    m = plain()
    t = m.host_empty(1000, torch.bfloat16, what="bf16 slot")
    assert t.dtype == torch.bfloat16 and t.shape == (1000,) and m.host_budget.held == 2000
    del t
    assert m.host_budget.held == 0


def test_host_buffers_are_asked_pinned(monkeypatch) -> None:
    """Host tensors are page-locked where CUDA is (``pin=True``: host-to-GPU copies from them are
    asynchronous); checked through a spy, as this machine may have no CUDA."""
    import infinity.io as io_pkg

    calls = []
    real = io_pkg.aligned_empty

    def spy(nbytes, **kwargs):
        calls.append(kwargs.get("pin", True))          # aligned_empty's default is True
        return real(nbytes, **kwargs)

    monkeypatch.setattr(io_pkg, "aligned_empty", spy)
    plain().host_empty(10, torch.float32, what="x")
    assert calls == [True]


def test_device_tensors_go_to_the_managers_device_not_the_default() -> None:
    """Under another default device (``with torch.device("meta")``, or "cuda" as models are
    often built) device tensors and DEVICE stores are still made on the manager's device."""
    m = plain()
    with torch.device("meta"):
        t = m.device_empty(10, torch.float32, torch.device("cpu"), what="staging")
        s = m.create("d", 10, torch.float32, Tier.DEVICE)
    assert t.device.type == "cpu" and s.tensor.device.type == "cpu"
    assert not s.tensor.any()


def test_no_swap_space_is_preallocated_without_a_reserve(disk_dir: Path) -> None:
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                    nvme_path=str(disk_dir))
    try:
        assert m.nvme_reserve_bytes == 0 and m.swap.bytes_on_disk == 0
    finally:
        m.close()


def test_a_freed_doubled_store_has_no_shadow_left(nvme: TierManager) -> None:
    s = nvme.create("dd", 10, torch.float32, Tier.NVME, doubled=True)
    s.free()
    assert not s.doubled
    with raises_naming(RuntimeError, "dd ", "no shadow extent"):
        s.flip()
