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


@pytest.mark.parametrize("alignment", [0, -4096, 3000, 4096 + 512])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(alignment: int) -> None:
    with pytest.raises(ValueError, match=f"alignment must be a power of two, got {alignment}"):
        ExtentAllocator(alignment)


def test_byte_alignment_is_allowed_down_to_one_byte_files() -> None:
    a = ExtentAllocator(alignment=1)
    a.add_file(1)
    e = a.allocate(1)
    assert (e.offset, e.nbytes, e.padded_nbytes) == (0, 1, 1)
    assert a.allocate(1) is None


def test_extents_are_padded_to_the_allocators_own_alignment() -> None:
    a = ExtentAllocator(alignment=512)
    a.add_file(4096)
    e = a.allocate(100)
    assert e.padded_nbytes == 512
    assert a.allocate(600).offset == 512          # the next one starts right after
    assert a.allocated == 512 + 1024


def test_an_empty_file_is_refused() -> None:
    a = ExtentAllocator()
    with pytest.raises(ValueError, match="positive multiple of 4096 bytes, got 0"):
        a.add_file(0)


@pytest.mark.parametrize("nbytes", [True, 4096.0, "4096", None])
def test_sizes_that_are_not_whole_numbers_are_refused(nbytes) -> None:
    a = ExtentAllocator()
    a.add_file(4 * PAGE)
    with pytest.raises(ValueError, match="extent size must be a positive number of bytes"):
        a.allocate(nbytes)
    assert a.allocated == 0


def test_freeing_an_extent_that_only_shares_the_offset_is_refused() -> None:
    """Same file and offset but another length: an extent of another swap space."""
    from infinity.storage.extents import Extent

    a = ExtentAllocator()
    a.add_file(4 * PAGE)
    e = a.allocate(PAGE)
    with pytest.raises(ValueError, match="not allocated here"):
        a.free(Extent(e.file_index, e.offset, 2 * PAGE, 2 * PAGE))
    assert a.allocated == PAGE and a.live_count == 1
    a.free(e)
    assert a.allocated == 0
