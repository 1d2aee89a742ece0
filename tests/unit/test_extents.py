"""Extent allocator: alignment, no overlap, reuse, coalescing, bounded growth (property tests);
the fragmentation measure the swap space reports, the allocator's repr, its alignment and the sizes
it refuses."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.storage.extents import ALIGNMENT, Extent, ExtentAllocator, round_up


FILE_SIZE = 64 * ALIGNMENT


def check_invariants(alloc: ExtentAllocator, live: list[Extent]) -> None:
    """Live extents and free ranges tile every file exactly; free ranges are fully coalesced."""
    for f, size in enumerate(alloc.file_sizes):
        pieces = [(e.offset, e.padded_nbytes, "live") for e in live if e.file_index == f]
        pieces += [(o, n, "free") for _, o, n in alloc.free_ranges(f)]
        pieces.sort()
        cursor, last_kind = 0, None
        for offset, length, kind in pieces:
            assert offset == cursor, f"file {f}: gap or overlap at {offset} (expected {cursor})"
            assert offset % ALIGNMENT == 0 and length % ALIGNMENT == 0 and length > 0
            assert not (kind == "free" and last_kind == "free"), f"file {f}: adjacent free ranges"
            cursor, last_kind = offset + length, kind
        assert cursor == size, f"file {f}: covered {cursor} of {size} bytes"
    assert alloc.allocated == sum(e.padded_nbytes for e in live)
    assert alloc.live_count == len(live)
    for e in live:
        assert e.padded_nbytes == round_up(e.nbytes) and e.nbytes > 0


# An operation is ("alloc", nbytes) or ("free", index into the live list, taken modulo its length).
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=3 * FILE_SIZE // 2)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=10_000)),
    ),
    max_size=200,
)


def run_churn(ops: list[tuple[str, int]], alloc: ExtentAllocator,
              check: bool = True) -> tuple[list[Extent], int]:
    """Apply ``ops`` the way SwapSpace does (add a file only when nothing fits); returns live, peak."""
    live: list[Extent] = []
    peak = 0
    for op, arg in ops:
        if op == "alloc":
            extent = alloc.allocate(arg)
            if extent is None:
                # Growth is allowed only when no free range can hold the request.
                assert alloc.largest_free < round_up(arg)
                alloc.add_file(max(FILE_SIZE, round_up(arg)))
                extent = alloc.allocate(arg)
            assert extent is not None
            live.append(extent)
        elif live:
            alloc.free(live.pop(arg % len(live)))
        peak = max(peak, alloc.allocated)
        if check:
            check_invariants(alloc, live)
    return live, peak


@settings(max_examples=150, deadline=None)
@given(ops_strategy)
def test_churn_keeps_invariants_and_coalesces_fully(ops: list[tuple[str, int]]) -> None:
    alloc = ExtentAllocator()
    live, _ = run_churn(ops, alloc)
    for extent in live:
        alloc.free(extent)
    check_invariants(alloc, [])
    # Everything freed: each file is one free range again.
    assert alloc.free_ranges() == [(f, 0, size) for f, size in enumerate(alloc.file_sizes)]


# Training-like churn: a few tensor sizes, allocated and freed over and over.
sizes_strategy = st.lists(st.integers(min_value=1, max_value=FILE_SIZE), min_size=1, max_size=6)
churn_strategy = st.tuples(
    sizes_strategy,
    st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=10_000)), max_size=400),
)


@settings(max_examples=100, deadline=None)
@given(churn_strategy)
def test_growth_stays_bounded_by_peak_live_bytes(case: tuple[list[int], list[tuple[bool, int]]]) -> None:
    sizes, steps = case
    ops = [("alloc", sizes[i % len(sizes)]) if is_alloc else ("free", i) for is_alloc, i in steps]
    alloc = ExtentAllocator()
    _, peak = run_churn(ops, alloc, check=False)
    # Measured worst case over 300 random churns of 2000 steps was 1.22x (peak + one file);
    # 2x leaves room for hypothesis's adversarial cases while still catching a leak of holes.
    assert alloc.capacity <= 2 * peak + FILE_SIZE, (
        f"{alloc.capacity} bytes of files for a peak of {peak} live bytes")


def test_freed_extent_is_reused_exactly() -> None:
    alloc = ExtentAllocator()
    alloc.add_file(FILE_SIZE)
    a = alloc.allocate(10_000)
    b = alloc.allocate(3 * ALIGNMENT)
    c = alloc.allocate(5)
    assert (a.offset, b.offset, c.offset) == (0, 3 * ALIGNMENT, 6 * ALIGNMENT)
    alloc.free(b)
    # Best fit: the 3-page hole, not the big tail range.
    again = alloc.allocate(2 * ALIGNMENT + 1)
    assert (again.file_index, again.offset, again.padded_nbytes) == (0, 3 * ALIGNMENT, 3 * ALIGNMENT)


def test_neighbours_coalesce_on_both_sides() -> None:
    alloc = ExtentAllocator()
    alloc.add_file(FILE_SIZE)
    a, b, c = (alloc.allocate(ALIGNMENT) for _ in range(3))
    alloc.free(a)
    alloc.free(c)  # merges with the tail range
    assert alloc.free_ranges() == [(0, 0, ALIGNMENT), (0, 2 * ALIGNMENT, FILE_SIZE - 2 * ALIGNMENT)]
    alloc.free(b)  # bridges both
    assert alloc.free_ranges() == [(0, 0, FILE_SIZE)]


def test_allocate_returns_none_when_nothing_fits_then_uses_new_file() -> None:
    alloc = ExtentAllocator()
    alloc.add_file(FILE_SIZE)
    assert alloc.allocate(FILE_SIZE + 1) is None
    index = alloc.add_file(round_up(FILE_SIZE + 1))
    extent = alloc.allocate(FILE_SIZE + 1)
    assert (extent.file_index, extent.offset) == (index, 0)


def test_double_free_and_bad_sizes_raise() -> None:
    alloc = ExtentAllocator()
    alloc.add_file(FILE_SIZE)
    extent = alloc.allocate(100)
    alloc.free(extent)
    with pytest.raises(ValueError, match="not allocated here"):
        alloc.free(extent)
    with pytest.raises(ValueError, match="positive"):
        alloc.allocate(0)
    with pytest.raises(ValueError, match="multiple of 4096"):
        alloc.add_file(FILE_SIZE + 1)


# -- fragmentation, repr, alignment and refused sizes --------------------------------------------

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
    a = ExtentAllocator()
    a.add_file(4 * PAGE)
    e = a.allocate(PAGE)
    with pytest.raises(ValueError, match="not allocated here"):
        a.free(Extent(e.file_index, e.offset, 2 * PAGE, 2 * PAGE))
    assert a.allocated == PAGE and a.live_count == 1
    a.free(e)
    assert a.allocated == 0
