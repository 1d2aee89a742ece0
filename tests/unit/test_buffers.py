"""aligned_empty: alignment, zero-copy, budget charged and refunded when torch frees the storage."""
from __future__ import annotations

import gc

import pytest
import torch

from infinity.base.budget import BudgetExceededError, MemoryBudget
from infinity.io import aligned_empty


@pytest.mark.parametrize("nbytes", [1, 4096, 12345 * 4, 3 << 20])
def test_aligned_zeroed_and_sized(nbytes: int) -> None:
    t = aligned_empty(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    assert int(t.sum()) == 0
    t.fill_(3)  # writable, every byte
    assert int(t.sum()) == 3 * nbytes


def test_dtype_and_larger_alignment() -> None:
    t = aligned_empty(1 << 20, torch.float32, alignment=1 << 20)
    assert t.dtype == torch.float32 and t.numel() == (1 << 18)
    assert t.data_ptr() % (1 << 20) == 0
    with pytest.raises(ValueError, match="itemsize"):
        aligned_empty(6, torch.float32)
    with pytest.raises(ValueError, match="alignment"):
        aligned_empty(4096, alignment=1000)
    with pytest.raises(ValueError, match="nbytes"):
        aligned_empty(-1)


def test_zero_bytes() -> None:
    assert aligned_empty(0).numel() == 0


def test_budget_is_released_when_the_last_view_is_freed() -> None:
    budget = MemoryBudget("host", 1 << 20)
    t = aligned_empty(256 << 10, budget=budget)
    assert budget.held == 256 << 10
    view = t[4096:].view(torch.float32)  # shares the storage
    del t
    gc.collect()
    assert budget.held == 256 << 10, "a live view must keep the memory (and the reservation)"
    view.fill_(1.0)
    del view
    gc.collect()
    assert budget.held == 0


def test_budget_exceeded_raises_and_holds_nothing() -> None:
    budget = MemoryBudget("host", 1 << 20)
    keep = aligned_empty(768 << 10, budget=budget)
    with pytest.raises(BudgetExceededError):
        aligned_empty(512 << 10, budget=budget)
    assert budget.held == 768 << 10
    del keep
    gc.collect()
    assert budget.held == 0


def test_memory_is_returned_to_the_os() -> None:
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    for _ in range(20):
        t = aligned_empty(32 << 20)
        t.fill_(1)
        del t
    gc.collect()
    assert rss() - before < 32 << 20, "freed aligned buffers were not unmapped"


@pytest.mark.gpu
def test_pinned_with_cuda_and_unregistered_when_freed() -> None:
    budget = MemoryBudget("host", None)
    t = aligned_empty(8 << 20, torch.float32, budget=budget, pin=True)
    assert t.is_pinned(), "pin=True with CUDA must cudaHostRegister the buffer"
    t.fill_(2.0)
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert float(d.sum()) == 2.0 * t.numel()
    assert not aligned_empty(4096, pin=False).is_pinned()
    del t
    gc.collect()
    assert budget.held == 0


def test_an_exceeded_budget_names_the_key_that_raises_it() -> None:
    """The device budget's fix is its own key and fewer units at once, not "offload deeper"
    (the states may all be on NVMe already)."""
    with pytest.raises(BudgetExceededError, match="infinity.device_memory_budget.*prefetch"):
        MemoryBudget("device", 4096).reserve(8192, "unit embed")
    with pytest.raises(BudgetExceededError, match="infinity.host_memory_budget.*nvme"):
        MemoryBudget("host", 4096).reserve(8192, "a slot")
