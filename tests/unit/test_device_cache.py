"""DeviceMemoryCache: released unit memory is reused by the next fetch, within the device budget."""
import pytest
import torch

from infinity.base.budget import BudgetExceededError, MemoryBudget
from infinity.storage.device_cache import DeviceMemoryCache

MiB = 1 << 20


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
