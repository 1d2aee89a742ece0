"""Extent allocator: what mutation testing (tools/mutation.py, issue 23) found unchecked by
test_extents.py -- the fragmentation measure the swap space reports, and the allocator's repr."""
from __future__ import annotations

import pytest

from infinity.storage.extents import ALIGNMENT, ExtentAllocator

PAGE = ALIGNMENT


def test_fragmentation_is_zero_without_free_space() -> None:
    a = ExtentAllocator()
    assert a.fragmentation() == 0.0          # no files at all
    a.add_file(2 * PAGE)
    a.allocate(2 * PAGE)
    assert a.free_bytes == 0
    assert a.fragmentation() == 0.0          # full: nothing free, nothing shredded


def test_fragmentation_is_zero_when_the_free_space_is_one_range() -> None:
    a = ExtentAllocator()
    a.add_file(4 * PAGE)
    assert a.fragmentation() == 0.0
    a.allocate(PAGE)
    assert a.fragmentation() == 0.0          # three pages free, in one range


def test_fragmentation_measures_how_shredded_the_free_space_is() -> None:
    a = ExtentAllocator()
    a.add_file(6 * PAGE)
    extents = [a.allocate(PAGE) for _ in range(6)]
    a.free(extents[0])
    a.free(extents[2])
    assert a.fragmentation() == pytest.approx(0.5)          # 2 free pages, largest 1
    a.free(extents[4])
    a.free(extents[5])
    assert a.fragmentation() == pytest.approx(1 - 2 / 4)    # 4 free pages, largest 2
    a.free(extents[3])
    assert a.fragmentation() == pytest.approx(1 - 4 / 5)    # pages 2-5 merged, page 0 apart
    a.free(extents[1])
    assert a.fragmentation() == 0.0                          # all one range again


def test_repr_names_files_capacity_and_allocation() -> None:
    a = ExtentAllocator()
    a.add_file(4 * PAGE)
    a.add_file(8 * PAGE)
    a.allocate(3 * PAGE)
    text = repr(a)
    assert text.startswith("ExtentAllocator(2 files, 48.00 KiB, 12.00 KiB allocated in 1 extents")
    assert text.endswith("2 free ranges)")
