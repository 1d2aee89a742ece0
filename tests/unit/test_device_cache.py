"""DeviceMemoryCache (storage/device_cache.py): released unit memory is reused by the next fetch,
within the device budget; which devices it serves, the budget's count through attach / detach /
warm / clear and their failures, the boundaries of ``fits`` and ``warm``, and which cached blocks go
first when room is needed -- on real CPU storages and a real MemoryBudget (a failure is an
allocator replaced by one that raises)."""
from __future__ import annotations

import threading

import numpy
import pytest
import torch

import infinity.storage.device_cache as dc
from infinity.base.budget import BudgetExceededError, MemoryBudget
from infinity.storage.device_cache import DeviceMemoryCache

MiB = 1 << 20
CPU = torch.device("cpu")


# -- reuse within the budget ---------------------------------------------------------------------

def _flat(numel: int) -> torch.Tensor:
    flat = torch.empty(numel, dtype=torch.float32)
    flat.untyped_storage().resize_(0)
    return flat


def test_memory_moves_in_and_out_and_views_follow():
    budget = MemoryBudget("device", 8 * MiB)
    cache = DeviceMemoryCache(budget, torch.device("cpu"))
    assert cache.enabled
    flat = _flat(MiB // 4)
    cache.attach(flat.untyped_storage(), MiB, "unit a")
    view = flat[1024:2048]                                  # a parameter's view
    assert flat.data_ptr() % 4096 == 0                     # aligned for direct I/O
    cache.detach(flat.untyped_storage())
    assert flat.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    cache.attach(flat.untyped_storage(), MiB, "unit a")
    flat.fill_(3.0)
    assert float(view.sum()) == 3.0 * 1024                  # the old view sees the new memory
    pointer = flat.data_ptr()
    cache.detach(flat.untyped_storage())
    assert budget.held == MiB and cache.cached_bytes == MiB and cache.in_use_bytes() == 0
    other = _flat(MiB // 4)
    cache.attach(other.untyped_storage(), MiB, "unit b")   # same size: the same memory again
    assert other.data_ptr() == pointer and (cache.hits, cache.misses) == (2, 1)
    assert budget.held == MiB and cache.cached_bytes == 0
    cache.detach(other.untyped_storage())
    cache.clear()
    assert budget.held == 0 and cache.cached_bytes == 0


def test_cached_blocks_are_evicted_when_a_new_size_needs_room():
    budget = MemoryBudget("device", 3 * MiB)
    cache = DeviceMemoryCache(budget, torch.device("cpu"))
    a, b = _flat(MiB // 4), _flat(MiB // 2)
    cache.attach(a.untyped_storage(), MiB, "a")
    cache.detach(a.untyped_storage())
    cache.attach(b.untyped_storage(), 2 * MiB, "b")        # 1 cached + 2 new fit in 3
    assert budget.held == 3 * MiB and cache.cached_bytes == MiB
    cache.detach(b.untyped_storage())
    c = _flat(3 * MiB // 4)
    cache.attach(c.untyped_storage(), 3 * MiB, "c")        # needs everything: both evicted
    assert budget.held == 3 * MiB and cache.cached_bytes == 0
    assert c.untyped_storage().nbytes() == 3 * MiB


def test_budget_is_enforced_on_memory_in_use():
    budget = MemoryBudget("device", 2 * MiB)
    cache = DeviceMemoryCache(budget, torch.device("cpu"))
    a, b = _flat(MiB // 4), _flat(MiB // 4 * 2)
    cache.attach(a.untyped_storage(), MiB, "a")
    with pytest.raises(BudgetExceededError, match="b"):
        cache.attach(b.untyped_storage(), 2 * MiB, "b")
    assert budget.held == MiB and b.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="still holds"):
        cache.attach(a.untyped_storage(), MiB, "a again")


def test_disabled_cache_resizes_and_releases():
    budget = MemoryBudget("device", 4 * MiB)
    cache = DeviceMemoryCache(budget, torch.device("cpu"))
    cache.enabled = False                                  # the CUDA behaviour, on CPU
    flat = _flat(MiB // 4)
    cache.attach(flat.untyped_storage(), MiB, "a")
    assert budget.held == MiB and flat.untyped_storage().nbytes() == MiB
    cache.detach(flat.untyped_storage())
    assert budget.held == 0 and cache.cached_bytes == 0


def test_warm_blocks_are_taken_by_the_next_attach_which_waits_for_them(monkeypatch):
    """warm (a loader's helper thread) allocates a block ahead of need within the budget; an
    attach of that size meanwhile waits for it and takes it (a hit, no second allocation)."""
    import threading

    import infinity.storage.device_cache as dc

    budget = MemoryBudget("device", 3 * MiB)
    cache = DeviceMemoryCache(budget, torch.device("cpu"))
    started, release = threading.Event(), threading.Event()
    real = dc.aligned_empty

    def slow(nbytes, **kwargs):
        started.set()
        release.wait(10)
        return real(nbytes, **kwargs)

    monkeypatch.setattr(dc, "aligned_empty", slow)
    warming = threading.Thread(target=cache.warm, args=(2 * MiB, "next unit"))
    warming.start()
    assert started.wait(10)
    assert not cache.warm(2 * MiB, "no room")              # 2 + 2 MiB > 3 MiB: refused
    flat = _flat(MiB // 2)
    attaching = threading.Thread(target=cache.attach,
                                 args=(flat.untyped_storage(), 2 * MiB, "unit"))
    attaching.start()
    attaching.join(0.2)
    assert attaching.is_alive()                            # waits for the block being made
    release.set()
    attaching.join(10)
    warming.join(10)
    assert flat.untyped_storage().nbytes() == 2 * MiB
    assert (cache.hits, cache.misses) == (1, 0) and budget.held == 2 * MiB
    cache.detach(flat.untyped_storage())
    cache.clear()
    assert budget.held == 0 and cache.cached_bytes == 0


# -- devices served, the budget's count, fits / warm boundaries, eviction order ------------------

def empty_storage() -> torch.UntypedStorage:
    flat = torch.empty(0, dtype=torch.uint8)
    return flat.untyped_storage()


def cache_of(limit: int | None) -> tuple[DeviceMemoryCache, MemoryBudget]:
    budget = MemoryBudget("device", limit)
    return DeviceMemoryCache(budget, CPU), budget


def cached(cache: DeviceMemoryCache, *sizes: int) -> None:
    """Attach then detach a storage of each size: one cached block each."""
    storages = []
    for n in sizes:
        s = empty_storage()
        cache.attach(s, n, f"block {n}")
        storages.append(s)
    for s in storages:
        cache.detach(s)


def failing_alloc(monkeypatch) -> None:
    def fail(nbytes, **kwargs):
        raise MemoryError(f"no {nbytes} bytes")
    monkeypatch.setattr(dc, "aligned_empty", fail)


def test_only_cpu_devices_are_served() -> None:
    assert DeviceMemoryCache.supported(CPU)
    assert not DeviceMemoryCache.supported(torch.device("meta"))
    assert not DeviceMemoryCache.supported(torch.device("cuda", 0))
    cache = DeviceMemoryCache(MemoryBudget("device", None), torch.device("meta"))
    assert cache.enabled is False and cache.device == torch.device("meta")
    assert (cache.cached_bytes, cache.hits, cache.misses) == (0, 0, 0)


def test_a_new_cache_counts_nothing_and_in_use_is_held_less_cached() -> None:
    cache, budget = cache_of(8 * MiB)
    budget.reserve(3 * MiB, "someone else")
    assert cache.in_use_bytes() == 3 * MiB
    cached(cache, MiB)
    assert budget.held == 4 * MiB and cache.cached_bytes == MiB and cache.in_use_bytes() == 3 * MiB


@pytest.mark.parametrize("enabled", [True, False])
def test_attaching_to_a_storage_with_memory_is_refused(enabled) -> None:
    cache, budget = cache_of(None)
    cache.enabled = enabled
    s = empty_storage()
    cache.attach(s, 4096, "unit 2")
    with pytest.raises(RuntimeError) as info:
        cache.attach(s, 4096, "unit 2")
    assert str(info.value) == ("unit 2: attaching memory to a storage that still holds 4096 "
                               "bytes (release it first)")
    assert budget.held == 4096


def test_a_failed_allocation_gives_its_reservation_back(monkeypatch) -> None:
    """Enabled: the block's allocation fails after the reservation; the reservation goes back,
    the storage stays empty and the error comes through."""
    cache, budget = cache_of(4 * MiB)
    failing_alloc(monkeypatch)
    s = empty_storage()
    with pytest.raises(MemoryError):
        cache.attach(s, MiB, "unit")
    assert budget.held == 0 and s.nbytes() == 0 and cache.misses == 1


def test_disabled_a_failed_resize_gives_its_reservation_back() -> None:
    """Disabled (the CUDA way): a storage that cannot be resized fails; nothing stays reserved."""
    cache, budget = cache_of(4 * MiB)
    cache.enabled = False
    fixed = torch.from_numpy(numpy.empty(0, dtype=numpy.uint8)).untyped_storage()   # not resizable
    with pytest.raises(RuntimeError):
        cache.attach(fixed, MiB, "unit")
    assert budget.held == 0


def test_disabled_attach_and_detach_resize_and_count() -> None:
    cache, budget = cache_of(4 * MiB)
    cache.enabled = False
    s = empty_storage()
    cache.attach(s, MiB, "unit")
    assert s.nbytes() == MiB and budget.held == MiB
    with pytest.raises(BudgetExceededError):
        cache.attach(empty_storage(), 4 * MiB, "too big")
    cache.detach(s)
    cache.detach(s)                                      # empty: nothing to release twice
    assert s.nbytes() == 0 and budget.held == 0 and cache.cached_bytes == 0
    assert not cache.warm(MiB, "next")                   # no cache, nothing warmed
    assert budget.held == 0 and (cache.hits, cache.misses) == (0, 0)


def test_detach_of_an_empty_storage_caches_nothing() -> None:
    cache, budget = cache_of(None)
    cache.detach(empty_storage())
    assert cache.cached_bytes == 0 and budget.held == 0 and cache.fits(0)
    assert cache._free == {}


def test_eviction_frees_the_largest_other_blocks_first() -> None:
    """Room for 3 MiB under 4 MiB with 1 and 2 MiB cached: freeing the 2 MiB block is enough,
    the 1 MiB block stays (smallest first would have freed both)."""
    cache, budget = cache_of(4 * MiB)
    cached(cache, MiB, 2 * MiB)
    s = empty_storage()
    cache.attach(s, 3 * MiB, "big")
    assert cache.cached_bytes == MiB and budget.held == 4 * MiB
    assert (cache.hits, cache.misses) == (0, 3)
    other = empty_storage()
    cache.attach(other, MiB, "small")                    # the kept block: a hit
    assert cache.hits == 1 and cache.cached_bytes == 0


def test_eviction_stops_once_there_is_room() -> None:
    """Each block freed is checked against the need: two 1 MiB blocks cached under 3 MiB, a
    2 MiB attach frees one of them, not both."""
    cache, budget = cache_of(3 * MiB)
    cached(cache, MiB, MiB)
    cache.attach(empty_storage(), 2 * MiB, "unit")
    assert cache.cached_bytes == MiB and budget.held == 3 * MiB


def test_unlimited_budget_never_evicts() -> None:
    cache, budget = cache_of(None)
    cached(cache, MiB, 2 * MiB)
    cache.attach(empty_storage(), 3 * MiB, "big")
    assert cache.cached_bytes == 3 * MiB and budget.held == 6 * MiB
    assert cache.fits(100 * MiB) and cache.warm(MiB, "next") and cache.cached_bytes == 4 * MiB


def test_fits_counts_cached_blocks_as_room_up_to_the_limit() -> None:
    """A cached block of the size fits even in a full budget; otherwise held - cached + n must
    be <= the limit (equal fits)."""
    cache, budget = cache_of(4 * MiB)
    cached(cache, MiB)
    budget.reserve(3 * MiB, "in use")                    # full: 3 in use + 1 cached
    assert cache.fits(MiB)
    assert not cache.fits(2 * MiB)
    budget.release(MiB)                                  # 2 in use + 1 cached
    assert cache.fits(2 * MiB) and not cache.fits(2 * MiB + 1)


def test_try_attach_changes_nothing_when_it_does_not_fit() -> None:
    cache, budget = cache_of(2 * MiB)
    s = empty_storage()
    assert not cache.try_attach(s, 3 * MiB, "too big")
    assert s.nbytes() == 0 and budget.held == 0 and cache.misses == 0
    assert cache.try_attach(s, 2 * MiB, "fits")
    assert s.nbytes() == 2 * MiB and budget.held == 2 * MiB
    budget.release(2 * MiB)
    with pytest.raises(RuntimeError, match=r"unit 3: attaching memory to a storage that still "
                                           r".*release it first"):
        cache.try_attach(s, MiB, "unit 3")             # attach's checks, with the caller's name


def test_warm_fills_the_budget_exactly_and_refuses_beyond() -> None:
    """warm reserves and caches a block; up to the limit exactly, not a byte more, and an
    attach of that size takes it."""
    cache, budget = cache_of(2 * MiB)
    assert cache.warm(MiB, "a") and cache.warm(MiB, "b")
    assert budget.held == 2 * MiB and cache.cached_bytes == 2 * MiB and cache._warming == {MiB: 0}
    assert not cache.warm(1, "c")
    assert budget.held == 2 * MiB
    s = empty_storage()
    cache.attach(s, MiB, "unit")
    assert (cache.hits, cache.misses) == (1, 0) and cache.cached_bytes == MiB


def test_a_failed_warm_gives_everything_back_and_wakes_waiters(monkeypatch) -> None:
    cache, budget = cache_of(4 * MiB)
    failing_alloc(monkeypatch)
    with pytest.raises(MemoryError):
        cache.warm(MiB, "next")
    assert budget.held == 0 and cache.cached_bytes == 0 and cache._warming == {MiB: 0}
    assert cache._free == {}


def test_an_attach_waiting_for_a_failed_warm_allocates_its_own(monkeypatch) -> None:
    """An attach that waits for a block being warmed, when the warm fails, is woken and
    allocates its own block (a miss) instead of waiting forever. The order is forced with
    events, not sleeps: the warm fails only once the attach is waiting on the condition."""
    cache, budget = cache_of(4 * MiB)
    real = dc.aligned_empty
    in_warm, go = threading.Event(), threading.Event()

    def fail_once(nbytes, **kwargs):
        if not in_warm.is_set():
            in_warm.set()
            assert go.wait(30)
            raise MemoryError("warm failed")
        return real(nbytes, **kwargs)

    monkeypatch.setattr(dc, "aligned_empty", fail_once)
    errors = []

    def warm():
        try:
            cache.warm(MiB, "next")
        except MemoryError as exc:
            errors.append(exc)

    t = threading.Thread(target=warm)
    t.start()
    assert in_warm.wait(30)
    waiting = threading.Event()
    real_wait = cache._warmed.wait

    def wait_spy(*args):
        waiting.set()
        return real_wait(*args)

    monkeypatch.setattr(cache._warmed, "wait", wait_spy)
    s = empty_storage()
    attaching = threading.Thread(target=cache.attach, args=(s, MiB, "unit"))
    attaching.start()
    assert waiting.wait(30)
    go.set()
    attaching.join(30)
    t.join(30)
    assert not attaching.is_alive() and len(errors) == 1
    assert s.nbytes() == MiB and (cache.hits, cache.misses) == (0, 1) and budget.held == MiB


def test_clear_frees_every_cached_block() -> None:
    cache, budget = cache_of(None)
    cached(cache, MiB, MiB, 2 * MiB)
    budget.reserve(MiB, "in use")
    cache.clear()
    assert budget.held == MiB and cache.cached_bytes == 0 and cache._free == {}
    assert cache.misses == 3
    cache.attach(empty_storage(), MiB, "unit")
    assert (cache.hits, cache.misses) == (0, 4)


def test_detach_works_under_another_default_device() -> None:
    """The empty storage that takes a released unit's memory is made on the cache's device,
    not torch's default one: under ``with torch.device("meta")`` (or "cuda", as models are
    often built) a default-device storage cannot exchange memory with a CPU one."""
    cache, budget = cache_of(None)
    s = empty_storage()
    cache.attach(s, MiB, "unit")
    with torch.device("meta"):
        cache.detach(s)
        assert s.nbytes() == 0 and cache.cached_bytes == MiB
        cache.attach(s, MiB, "unit")
    assert s.nbytes() == MiB and s.device == CPU and cache.hits == 1


@pytest.mark.parametrize("enabled", [True, False])
def test_a_budget_refusal_names_what_was_attached(enabled) -> None:
    cache, _ = cache_of(MiB)
    cache.enabled = enabled
    with pytest.raises(BudgetExceededError, match=r"unit 7 \(layers\.6\) needs 2\.00 MiB"):
        cache.attach(empty_storage(), 2 * MiB, "unit 7 (layers.6)")


def test_blocks_for_the_device_are_not_pinned(monkeypatch) -> None:
    """A CPU device's blocks are plain memory: ``pin=False`` (pinning -- cudaHostRegister where
    CUDA is -- is for host buffers copied to a GPU, and would lock each unit's hundreds of MiB)."""
    calls = []
    real = dc.aligned_empty

    def spy(nbytes, **kwargs):
        calls.append(kwargs)
        return real(nbytes, **kwargs)

    monkeypatch.setattr(dc, "aligned_empty", spy)
    cache, _ = cache_of(None)
    cache.attach(empty_storage(), MiB, "unit")
    assert cache.warm(MiB, "next")
    assert calls == [{"pin": False}, {"pin": False}]


class RacedBudget(MemoryBudget):
    """A budget whose room another thread takes between warm's check and its reservation:
    the check reads ``held`` as 0."""

    @property
    def held(self) -> int:
        return 0


def test_a_warm_that_loses_the_room_raises_naming_it_and_changes_nothing() -> None:
    budget = RacedBudget("device", 2 * MiB)
    budget.reserve(2 * MiB, "another thread")
    cache = DeviceMemoryCache(budget, CPU)
    with pytest.raises(BudgetExceededError, match=r"next unit needs 1\.00 MiB"):
        cache.warm(MiB, "next unit")
    assert cache.cached_bytes == 0 and cache._warming == {} and cache._free == {}


def blocking_warms(monkeypatch, count: int) -> tuple[list[threading.Event], list[threading.Event]]:
    """aligned_empty blocks in the first ``count`` calls (the warms) until released."""
    real = dc.aligned_empty
    entered = [threading.Event() for _ in range(count)]
    go = [threading.Event() for _ in range(count)]
    n = iter(range(count))
    lock = threading.Lock()

    def fake(nbytes, **kwargs):
        with lock:
            i = next(n, None)
        if i is not None:
            entered[i].set()
            assert go[i].wait(30)
        return real(nbytes, **kwargs)

    monkeypatch.setattr(dc, "aligned_empty", fake)
    return entered, go


def attach_in_thread(cache, monkeypatch, storage, nbytes):
    """Start an attach; the returned event is set when it waits for a warm or has returned,
    and the list holds one entry per wait."""
    waited_or_done, waits = threading.Event(), []
    real_wait = cache._warmed.wait

    def wait_spy(*args):
        waits.append(args)
        waited_or_done.set()
        return real_wait(*args)

    monkeypatch.setattr(cache._warmed, "wait", wait_spy)

    def run():
        try:
            cache.attach(storage, nbytes, "unit")
        finally:
            waited_or_done.set()

    t = threading.Thread(target=run)
    t.start()
    return t, waited_or_done, waits


def test_two_warms_of_one_size_are_both_waited_for(monkeypatch) -> None:
    """With two blocks of a size being warmed, the count of blocks on their way is 2: when the
    first lands and is taken, a second attach still waits for the other (a hit) instead of
    allocating a block of its own (a miss, and the warmed one left over)."""
    cache, budget = cache_of(None)
    entered, go = blocking_warms(monkeypatch, 2)
    warms = [threading.Thread(target=cache.warm, args=(MiB, f"w{i}")) for i in range(2)]
    for t in warms:
        t.start()
    assert entered[0].wait(30) and entered[1].wait(30)
    go[0].set()
    with cache._lock:                                   # the first block has landed
        assert cache._warmed.wait_for(lambda: cache._free.get(MiB), timeout=30)
    first = empty_storage()
    cache.attach(first, MiB, "unit a")                  # the landed block
    second = empty_storage()
    t, waited, waits = attach_in_thread(cache, monkeypatch, second, MiB)
    assert waited.wait(30) and waits
    go[1].set()
    t.join(30)
    for w in warms:
        w.join(30)
    assert (cache.hits, cache.misses) == (2, 0) and cache.cached_bytes == 0
    assert budget.held == 2 * MiB


def test_a_free_block_is_taken_without_waiting_for_a_warm(monkeypatch) -> None:
    """A cached block of the size is taken at once even while another of that size is being
    warmed (the wait is only for a block that is not there yet)."""
    cache, _ = cache_of(None)
    cached(cache, MiB)
    entered, go = blocking_warms(monkeypatch, 1)
    warm = threading.Thread(target=cache.warm, args=(MiB, "next"))
    warm.start()
    assert entered[0].wait(30)
    s = empty_storage()
    t, waited, waits = attach_in_thread(cache, monkeypatch, s, MiB)
    assert waited.wait(30)
    go[0].set()
    t.join(30)
    warm.join(30)
    assert waits == [] and s.nbytes() == MiB and cache.hits == 1
