"""malloc_tuning: the pinned threshold really sends allocations above it to their own mappings."""
import ctypes
import ctypes.util

import pytest
import torch

from infinity.malloc_tuning import set_mmap_threshold, trim


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mapped_bytes() -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc without mallinfo2 (< 2.33)")
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2().hblkhd


def test_allocations_above_the_threshold_are_mapped() -> None:
    assert set_mmap_threshold(8 << 20)
    before = _mapped_bytes()
    block = torch.empty(3 << 20, dtype=torch.uint8)    # below 8 MiB: from the heap
    assert _mapped_bytes() - before < 3 << 20
    del block
    assert set_mmap_threshold(1 << 20)
    before = _mapped_bytes()
    block = torch.empty(3 << 20, dtype=torch.uint8)    # above 1 MiB: its own mapping
    assert _mapped_bytes() - before >= 3 << 20
    del block
    trim()
    assert set_mmap_threshold(4 << 20)                  # the engine's default, for later tests


def test_out_of_range_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="32 MiB"):
        set_mmap_threshold(64 << 20)
    with pytest.raises(ValueError, match="malloc_mmap_threshold"):
        set_mmap_threshold(0)
