"""Moving a unit's flat states between their homes and checkpoint files (checkpoint/unit_io.py),
at unit level on real stores (host tensors, HOST and NVMe FlatStores of a real TierManager on a
real disk): which pool carries
the chunks, the parts inside a window, the span rounded to a block, chunks read and written in
order with at most two in flight and every slot given back (also on an error or an early stop),
the gaps zeroed or kept, the shadow extent written, and device memory filled in pieces."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fakes import RecordingManager
from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.checkpoint import unit_io
from infinity.checkpoint.unit_io import (
    EVERYTHING,
    OWN_SLOT_BYTES,
    SLOT_TIMEOUT_S,
    ChunkPool,
    load_entries,
    parts_of,
    pieces,
    read_chunks,
    save_entries,
    span_of,
)
from infinity.io import aligned_empty
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.unit import ParamEntry


def _entry(name: str, offset: int, numel: int) -> ParamEntry:
    return ParamEntry(name, nn.Parameter(torch.zeros(numel)), torch.Size([numel]), offset,
                      numel, 0)


_Manager = RecordingManager


@pytest.fixture
def manager(disk_dir: Path):
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                    nvme_path=str(disk_dir))
    try:
        yield m
    finally:
        m.close()


class _Counting(ChunkPool):
    """A ChunkPool over a lent pool of 3 slots of 8 KiB (2048 fp32 a chunk) that records the
    most slots out at once and every acquire's timeout."""

    def __init__(self, manager: TierManager, slots: int = 3) -> None:
        self.lent = BufferPool(manager, 8192, slots, "lent")
        super().__init__(manager, [self.lent])
        self.out = self.most = 0
        self.timeouts: list[float | None] = []
        real = self.lent.acquire

        def acquire(timeout=None):
            self.timeouts.append(timeout)
            return real(timeout=timeout)

        self.lent.acquire = acquire

    def acquire(self):
        slot = super().acquire()
        self.out += 1
        self.most = max(self.most, self.out)
        return slot

    def release(self, slot) -> None:
        self.out -= 1
        super().release(slot)


def _aligned(values: torch.Tensor) -> torch.Tensor:
    """fp32 values in a page-aligned buffer (O_DIRECT writes need one)."""
    buf = aligned_empty(values.numel() * 4).view(torch.float32)
    buf.copy_(values)
    return buf


def _nvme(manager: TierManager, numel: int, values: torch.Tensor | None = None,
          doubled: bool = False):
    store = manager.create("u0.exp_avg", numel, torch.float32, Tier.NVME, doubled=doubled)
    if values is not None:
        buf = _aligned(torch.zeros(store.padded))
        buf[:values.numel()] = values
        manager.wait(store.store_async(buf))
    return store


def _read_back(manager: TierManager, store, shadow: bool = False) -> torch.Tensor:
    buf = _aligned(torch.zeros(store.padded))
    manager.wait(store.load_async(buf, shadow=shadow))
    return buf[:store.numel]


def test_a_chunk_pool_borrows_the_first_pool_with_a_whole_block_slot() -> None:
    """None and pools whose slot is under 4 KiB are passed over; exactly 4 KiB is enough; the
    first such pool is taken, not a later one; nothing of its own is allocated."""
    manager = _Manager()
    small = BufferPool(manager, 4095, 4, "small")
    block = BufferPool(manager, 4096, 1, "block")
    later = BufferPool(manager, 1 << 20, 3, "later")
    calls = len(manager.calls)
    chunks = ChunkPool(manager, [None, small, block, later])
    assert chunks.pool is block and chunks.depth == 1
    assert ChunkPool(manager, [later, block]).pool is later
    assert ChunkPool(manager, [later]).depth == 2
    assert len(manager.calls) == calls


def test_without_a_lendable_pool_a_small_pool_of_its_own_is_made_once_when_needed() -> None:
    manager = _Manager()
    chunks = ChunkPool(manager, [None])
    assert manager.calls == []                  # not before a chunk is needed
    pool = chunks.pool
    assert manager.calls == [(OWN_SLOT_BYTES, torch.uint8, f"checkpoint slot {i}")
                             for i in range(2)]
    assert OWN_SLOT_BYTES == 8 << 20
    assert (pool.slot_bytes, pool.count, pool.name) == (OWN_SLOT_BYTES, 2, "checkpoint")
    assert chunks.pool is pool and len(manager.calls) == 2 and chunks.depth == 2


def test_chunk_elements_are_whole_blocks_of_a_slot() -> None:
    chunks = ChunkPool(_Manager(), [BufferPool(_Manager(), 3 * 4096 + 4000, 2, "p")])
    assert chunks.elements(torch.float32) == 3 * 1024
    assert chunks.elements(torch.bfloat16) == 3 * 2048
    assert chunks.elements(torch.float64) == 3 * 512


def test_a_slot_is_waited_for_as_long_as_the_timeout_and_given_back(manager) -> None:
    chunks = _Counting(manager, slots=2)
    slot = chunks.acquire()
    assert chunks.timeouts == [SLOT_TIMEOUT_S] and SLOT_TIMEOUT_S == 120.0
    assert chunks.lent.available == 1
    chunks.release(slot)
    assert chunks.lent.available == 2


def test_parts_of_are_the_entries_inside_the_window_in_offset_order() -> None:
    """Entries sorted by offset, cut to the window; one that only touches the window's edge
    is not a part; an empty entry is kept whole when it lies inside or on the window's
    edges, not outside."""
    a, b, e, c = _entry("a", 0, 30), _entry("b", 100, 50), _entry("e", 200, 0), \
        _entry("c", 300, 10)
    everything = parts_of([c, e, b, a])
    assert everything == [(a, 0, 30), (b, 100, 150), (e, 200, 200), (c, 300, 310)]
    assert parts_of([c, b, a], EVERYTHING) == [(a, 0, 30), (b, 100, 150), (c, 300, 310)]
    assert parts_of([b, a], (20, 120)) == [(a, 20, 30), (b, 100, 120)]
    assert parts_of([a, b], (30, 100)) == []
    assert parts_of([e], (150, 200)) == [(e, 200, 200)]
    assert parts_of([e, c], (200, 305)) == [(e, 200, 200), (c, 300, 305)]
    assert parts_of([e], (201, 400)) == [] and parts_of([e], (0, 199)) == []
    assert EVERYTHING == (0, 1 << 62)


def test_the_span_starts_on_a_block_boundary_of_the_store() -> None:
    a, b = _entry("a", 1500, 100), _entry("b", 3000, 200)
    parts = [(b, 3000, 3200), (a, 1500, 1600)]
    assert span_of(parts, torch.float32, 0) == (1024, 3200)     # 1024 fp32 a block
    assert span_of(parts, torch.bfloat16, 0) == (0, 3200)       # 2048 bf16 a block
    assert span_of(parts, torch.float32, 1000) == (0, 2200)     # store element 0 = unit 1000
    assert span_of([(b, 3000, 3200)], torch.float32, 900) == (2048, 2300)


def test_pieces_are_the_parts_cut_to_a_range() -> None:
    a, b = _entry("a", 0, 30), _entry("b", 100, 50)
    parts = [(a, 0, 30), (b, 100, 150)]
    assert list(pieces(parts, 20, 120)) == [(a, 20, 30), (b, 100, 120)]
    assert list(pieces(parts, 30, 100)) == []
    assert list(pieces(parts, 0, 200)) == parts


def test_a_host_tensor_is_read_in_one_piece() -> None:
    t = torch.arange(100.0)
    [(start, values)] = list(read_chunks(t, 10, 90, ChunkPool(_Manager(), [])))
    assert start == 10 and torch.equal(values, t[10:90])
    assert list(read_chunks(t, 5, 5, ChunkPool(_Manager(), []))) == []


def test_a_host_store_is_read_from_its_tensor(manager) -> None:
    store = manager.create("u0.param", 5000, torch.float32, Tier.HOST)
    store.tensor[:5000] = torch.arange(5000.0)
    chunks = _Counting(manager)
    [(start, values)] = list(read_chunks(store, 1024, 4000, chunks))
    assert start == 1024 and torch.equal(values, torch.arange(1024.0, 4000.0))
    assert chunks.timeouts == []                # no slot for a store in memory


def test_an_nvme_store_is_read_in_chunks_in_order_two_in_flight(manager) -> None:
    """Chunks of a slot's whole blocks (2048 fp32), the last one short; never more than two
    slots out with three in the pool; every slot given back."""
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    chunks = _Counting(manager)
    got = [(a, v.clone()) for a, v in read_chunks(store, 1024, 9000, chunks)]
    assert [a for a, _ in got] == [1024, 3072, 5120, 7168]
    assert [v.numel() for _, v in got] == [2048, 2048, 2048, 1832]
    assert torch.equal(torch.cat([v for _, v in got]), torch.arange(1024.0, 9000.0))
    assert chunks.most == 2 and chunks.out == 0 and chunks.lent.available == 3
    one = _Counting(manager, slots=1)
    assert [a for a, _ in read_chunks(store, 0, 5000, one)] == [0, 2048, 4096]
    assert one.most == 1 and one.lent.available == 1


def test_a_read_stopped_early_gives_every_slot_back(manager) -> None:
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    chunks = _Counting(manager)
    reader = read_chunks(store, 0, 10_000, chunks)
    start, values = next(reader)
    assert start == 0 and torch.equal(values, torch.arange(2048.0))
    assert chunks.out == 2
    reader.close()
    assert chunks.out == 0 and chunks.lent.available == 3


def test_a_read_that_cannot_be_issued_gives_its_slot_back(manager, monkeypatch) -> None:
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    chunks = _Counting(manager)
    real, calls = store.load_async, []

    def load_async(buf, start, count):
        calls.append(start)
        if len(calls) == 2:
            raise OSError(5, "planted")
        return real(buf, start, count)

    monkeypatch.setattr(store, "load_async", load_async)
    with pytest.raises(OSError, match="planted"):
        list(read_chunks(store, 0, 10_000, chunks))
    assert calls == [0, 2048]
    assert chunks.out == 0 and chunks.lent.available == 3


def test_save_entries_hands_each_part_its_values_in_offset_order(manager) -> None:
    """Parts across chunk boundaries come in pieces, each the values of its own elements; a
    store whose element 0 is the unit's element ``origin``; no parts: nothing read."""
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    a, b, c = _entry("a", 1000, 1500), _entry("b", 2600, 3000), _entry("c", 9000, 500)
    got: dict[str, list[torch.Tensor]] = {}
    order = []

    def emit(part, values) -> None:
        order.append(part[0].name)
        got.setdefault(part[0].name, []).append(values.clone())

    chunks = _Counting(manager)
    save_entries(store, parts_of([c, b, a], (0, 9300)), chunks, emit)
    assert torch.equal(torch.cat(got["a"]), torch.arange(1000.0, 2500.0))
    assert torch.equal(torch.cat(got["b"]), torch.arange(2600.0, 5600.0))
    assert torch.equal(torch.cat(got["c"]), torch.arange(9000.0, 9300.0))
    assert order == ["a", "a", "b", "b", "c"] and chunks.lent.available == 3
    # the store holds the unit's elements [4096, 14096): unit element x is store element x - 4096
    got.clear()
    save_entries(store, [(_entry("d", 5000, 100), 5000, 5100)], chunks, emit, origin=4096)
    assert torch.equal(torch.cat(got["d"]), torch.arange(904.0, 1004.0))
    save_entries(None, [], chunks, emit)       # nothing to read: the source is not touched
    assert chunks.timeouts.count(SLOT_TIMEOUT_S) == len(chunks.timeouts)


def test_save_entries_of_a_host_tensor(manager) -> None:
    t = torch.arange(50.0)
    got = []
    save_entries(t, [(_entry("a", 10, 5), 10, 15), (_entry("b", 20, 5), 22, 25)],
                 ChunkPool(manager, []), lambda p, v: got.append((p[0].name, v.tolist())))
    assert got == [("a", [10.0, 11.0, 12.0, 13.0, 14.0]), ("b", [22.0, 23.0, 24.0])]


def _fill_from(values: dict[str, torch.Tensor], calls: list | None = None):
    def fill(entry, first, out) -> None:
        if calls is not None:
            calls.append((entry.name, first, out.numel()))
        out.copy_(values[entry.name][first:first + out.numel()])
    return fill


def test_load_entries_writes_parts_and_zeroes_the_gaps_of_an_nvme_store(manager) -> None:
    """Each chunk zeroed, its pieces filled from the entry's own elements, written; the gaps
    between entries come back zero though the store held ones; slots all given back; the
    blocks outside the span are not written."""
    store = _nvme(manager, 10_000, torch.ones(10_000))
    a, b = _entry("a", 1100, 1400), _entry("b", 2600, 3000)
    values = {"a": torch.arange(1400.0) + 1, "b": torch.arange(3000.0) + 10_000}
    chunks = _Counting(manager)
    calls: list = []
    load_entries(store, parts_of([b, a]), chunks, _fill_from(values, calls))
    expected = torch.ones(10_000)
    expected[1024:6144] = 0                 # the span, in whole blocks
    expected[1100:2500] = values["a"]
    expected[2600:5600] = values["b"]
    assert torch.equal(_read_back(manager, store), expected)
    assert calls == [("a", 0, 1400), ("b", 0, 472), ("b", 472, 2048), ("b", 2520, 480)]
    assert chunks.most == 2 and chunks.out == 0 and chunks.lent.available == 3


def test_load_entries_with_merge_keeps_the_values_between_parts(manager) -> None:
    store = _nvme(manager, 6000, torch.full((6000,), 7.0))
    a = _entry("a", 3000, 100)
    load_entries(store, [(a, 3000, 3100)], _Counting(manager), _fill_from({"a": torch.zeros(100)}),
                 merge=True)
    expected = torch.full((6000,), 7.0)
    expected[3000:3100] = 0
    assert torch.equal(_read_back(manager, store), expected)


def test_load_entries_at_an_origin_and_into_the_shadow_extent(manager) -> None:
    """A doubled store gets the values in both extents with ``both_extents``, in its current
    one only without; unit element x is store element x - origin."""
    a = _entry("a", 5000, 100)
    fill = _fill_from({"a": torch.arange(100.0) + 1})
    both = _nvme(manager, 2048, torch.ones(2048), doubled=True)
    manager.wait(both.store_async(_aligned(torch.full((2048,), 3.0)), shadow=True))
    load_entries(both, [(a, 5000, 5100)], _Counting(manager), fill, both_extents=True,
                 origin=4096)
    expected = torch.zeros(2048)
    expected[904:1004] = torch.arange(100.0) + 1
    assert torch.equal(_read_back(manager, both)[:1004], expected[:1004])
    assert torch.equal(_read_back(manager, both, shadow=True)[:1004], expected[:1004])
    one = manager.create("u1.exp_avg", 2048, torch.float32, Tier.NVME, doubled=True)
    manager.wait(one.store_async(_aligned(torch.full((2048,), 3.0)), shadow=True))
    load_entries(one, [(a, 5000, 5100)], _Counting(manager), fill, origin=4096)
    assert torch.equal(_read_back(manager, one)[:1004], expected[:1004])
    assert torch.equal(_read_back(manager, one, shadow=True), torch.full((2048,), 3.0))
    single = _nvme(manager, 2048)
    load_entries(single, [(a, 5000, 5100)], _Counting(manager), fill, both_extents=True,
                 origin=4096)                   # not doubled: its one extent only
    assert torch.equal(_read_back(manager, single)[:1004], expected[:1004])


def test_a_fill_that_fails_gives_every_slot_back(manager) -> None:
    store = _nvme(manager, 10_000)
    chunks = _Counting(manager)
    seen = []

    def fill(entry, first, out) -> None:
        seen.append(first)
        if len(seen) == 3:
            raise ValueError("planted")
        out.fill_(1.0)

    with pytest.raises(ValueError, match="planted"):
        load_entries(store, [(_entry("a", 0, 10_000), 0, 10_000)], chunks, fill)
    assert seen == [0, 2048, 4096]
    assert chunks.out == 0 and chunks.lent.available == 3
    load_entries(store, [], chunks, fill)      # nothing to write: nothing asked
    assert seen == [0, 2048, 4096]


def test_load_entries_into_host_memory_fills_the_parts_in_place(manager) -> None:
    """A host tensor and a HOST store are filled through views, without slots; their gaps
    keep their values (a host home is not rewritten whole)."""
    t = torch.full((50,), 9.0)
    a, b = _entry("a", 110, 5), _entry("b", 120, 10)
    calls: list = []
    load_entries(t, [(a, 110, 115), (b, 122, 130)], _Counting(manager),
                 _fill_from({"a": torch.arange(5.0), "b": torch.arange(10.0)}, calls), origin=100)
    expected = torch.full((50,), 9.0)
    expected[10:15] = torch.arange(5.0)
    expected[22:30] = torch.arange(2.0, 10.0)
    assert torch.equal(t, expected)
    assert calls == [("a", 0, 5), ("b", 2, 8)]
    store = manager.create("u0.param", 3000, torch.float32, Tier.HOST)
    chunks = _Counting(manager)
    load_entries(store, [(_entry("c", 2000, 10), 2000, 2010)], chunks,
                 _fill_from({"c": torch.ones(10)}))
    assert store.tensor[2000:2010].eq(1).all() and store.tensor[:2000].eq(0).all()
    assert chunks.timeouts == []


def test_device_memory_is_filled_through_host_pieces(monkeypatch) -> None:
    """A tensor not on the CPU (a meta tensor here: no GPU needed) gets each part through host
    pieces of DEVICE_PIECE_BYTES: the fill asked for each piece's first element and size."""
    monkeypatch.setattr(unit_io, "DEVICE_PIECE_BYTES", 16)     # 4 fp32 a piece
    target = torch.empty(40, device="meta")
    a, b = _entry("a", 0, 10), _entry("b", 20, 6)
    calls: list = []

    def fill(entry, first, piece) -> None:
        assert piece.device.type == "cpu" and piece.dtype == torch.float32
        calls.append((entry.name, first, piece.numel()))

    load_entries(target, [(a, 0, 10), (b, 21, 26)], ChunkPool(_Manager(), []), fill)
    assert calls == [("a", 0, 4), ("a", 4, 4), ("a", 8, 2), ("b", 1, 4), ("b", 5, 1)]


# -- device memory, and the edges of windows, spans and chunks --------------------------

class _OnDevice(torch.Tensor):
    """A host tensor that says it is on a GPU: the device paths (host copies made in pieces of
    DEVICE_PIECE_BYTES) run and their values can be checked without a GPU."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def _all_back(pool: BufferPool, slots: list) -> None:
    """Every slot of ``pool`` is free and is one of its own (a ``release(None)`` would count
    as free too, and hand out None later)."""
    got = [pool.try_acquire() for _ in range(pool.count)]
    assert sorted(id(s) for s in got) == sorted(id(s) for s in slots)
    for s in got:
        pool.release(s)


def _slots(pool: BufferPool) -> list:
    slots = [pool.try_acquire() for _ in range(pool.count)]
    for s in slots:
        pool.release(s)
    return slots


class _Waits:
    """The tier manager seen through a ChunkPool, recording what is waited for."""

    def __init__(self, manager: TierManager) -> None:
        self._manager, self.waited = manager, []

    def wait(self, *requests) -> None:
        self.waited += [r for r in requests]
        self._manager.wait(*requests)


def test_device_memory_is_read_in_pieces_and_host_memory_whole(monkeypatch) -> None:
    """A device tensor is copied to the host DEVICE_PIECE_BYTES at a time (the last piece
    short); a host tensor in one piece whatever that size; an element larger than a piece
    is a piece of one."""
    monkeypatch.setattr(unit_io, "DEVICE_PIECE_BYTES", 16)      # 4 fp32 a piece
    chunks = ChunkPool(_Manager(), [])
    dev = torch.arange(20.0).as_subclass(_OnDevice)
    got = [(a, _plain(v).clone()) for a, v in read_chunks(dev, 3, 13, chunks)]
    assert [a for a, _ in got] == [3, 7, 11]
    assert [v.tolist() for _, v in got] == [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12]]
    host = torch.arange(20.0)
    [(a, v)] = list(read_chunks(host, 3, 13, chunks))
    assert a == 3 and torch.equal(v, host[3:13])
    monkeypatch.setattr(unit_io, "DEVICE_PIECE_BYTES", 4)
    wide = torch.arange(3, dtype=torch.float64).as_subclass(_OnDevice)
    assert [a for a, _ in read_chunks(wide, 0, 3, chunks)] == [0, 1, 2]


def test_device_memory_is_filled_in_pieces_of_its_dtype(monkeypatch) -> None:
    """The host pieces have the tensor's dtype, and their values land at their place; an
    element larger than a piece is filled one at a time; a host tensor is filled through one
    view per part whatever the piece size."""
    monkeypatch.setattr(unit_io, "DEVICE_PIECE_BYTES", 4)      # 2 bf16, half an fp64
    target = torch.zeros(12, dtype=torch.bfloat16).as_subclass(_OnDevice)
    a = _entry("a", 2, 5)
    dtypes, calls = [], []

    def fill(entry, first, piece) -> None:
        dtypes.append(piece.dtype)
        calls.append((first, piece.numel()))
        piece.copy_(torch.arange(first, first + piece.numel()) + 1)

    load_entries(target, [(a, 2, 7)], ChunkPool(_Manager(), []), fill)
    assert calls == [(0, 2), (2, 2), (4, 1)] and set(dtypes) == {torch.bfloat16}
    assert _plain(target).tolist() == [0, 0, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0]
    calls.clear()
    wide = torch.zeros(4, dtype=torch.float64).as_subclass(_OnDevice)
    load_entries(wide, [(_entry("w", 0, 3), 0, 3)], ChunkPool(_Manager(), []), fill)
    assert calls == [(0, 1), (1, 1), (2, 1)]
    calls.clear()
    host = torch.zeros(12)
    load_entries(host, [(a, 2, 7)], ChunkPool(_Manager(), []), fill)
    assert calls == [(0, 5)] and host[2:7].tolist() == [1, 2, 3, 4, 5]


def test_an_nvme_read_waits_for_each_chunk_and_counts_what_it_reads(manager) -> None:
    """Each chunk's request is waited for before its values are handed out; the bytes read
    are the chunks' (whole blocks), not the store's rest from each chunk on."""
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    chunks = _Counting(manager)
    chunks.manager = waits = _Waits(manager)
    issued = []
    real = store.load_async

    def load_async(buf, start, count):
        issued.append(real(buf, start, count))
        return issued[-1]

    store.load_async = load_async
    before = manager.counters.nvme_read_bytes
    for _ in read_chunks(store, 1024, 9000, chunks):
        assert waits.waited == issued[:len(waits.waited)] and len(waits.waited) >= 1
    assert waits.waited == issued and len(issued) == 4
    assert manager.counters.nvme_read_bytes - before == 4 * 8192


def test_slots_go_back_as_themselves(manager, monkeypatch) -> None:
    """After a read, a read stopped by an error, a load and a load stopped by an error, the
    pool holds its own slots again."""
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    chunks = _Counting(manager)
    slots = _slots(chunks.lent)
    list(read_chunks(store, 0, 10_000, chunks))
    _all_back(chunks.lent, slots)
    real, calls = store.load_async, []

    def failing(buf, start, count):
        calls.append(start)
        if len(calls) == 2:
            raise OSError(5, "planted")
        return real(buf, start, count)

    monkeypatch.setattr(store, "load_async", failing)
    with pytest.raises(OSError):
        list(read_chunks(store, 0, 10_000, chunks))
    _all_back(chunks.lent, slots)
    monkeypatch.setattr(store, "load_async", real)
    whole = [(_entry("a", 0, 10_000), 0, 10_000)]
    load_entries(store, whole, chunks, lambda e, first, out: out.fill_(1.0))

    def fail_third(entry, first, out) -> None:
        if first >= 4096:
            raise ValueError("planted")

    _all_back(chunks.lent, slots)
    with pytest.raises(ValueError):
        load_entries(store, whole, chunks, fail_third)
    _all_back(chunks.lent, slots)


def test_a_merged_load_reads_only_its_chunks(manager) -> None:
    store = _nvme(manager, 10_000, torch.full((10_000,), 7.0))
    before = manager.counters.nvme_read_bytes
    load_entries(store, [(_entry("a", 1100, 3000), 1100, 4100)], _Counting(manager),
                 _fill_from({"a": torch.zeros(3000)}), merge=True)
    # the span [1024, 4100) in chunks of 2048: [1024, 3072) and [3072, 4100) -> 2 blocks
    assert manager.counters.nvme_read_bytes - before == (2048 + 2048) * 4
    expected = torch.full((10_000,), 7.0)
    expected[1100:4100] = 0
    assert torch.equal(_read_back(manager, store), expected)


def test_bf16_stores_are_cut_in_their_own_blocks_and_chunks(manager) -> None:
    """2048 bf16 elements a 4 KiB block, 4096 a chunk of an 8 KiB slot: a span from unit
    element 3000 starts at 2048 (fp32 blocks would make it 2048 + 1024, off a bf16 block)."""
    store = manager.create("u0.params", 12_000, torch.bfloat16, Tier.NVME)
    values = torch.arange(12_000.0).to(torch.bfloat16)
    buf = aligned_empty(store.nbytes).view(torch.bfloat16)
    buf[:12_000] = values
    manager.wait(store.store_async(buf))
    chunks = _Counting(manager)
    assert [a for a, _ in read_chunks(store, 0, 12_000, chunks)] == [0, 4096, 8192]
    got = []
    part = (_entry("p", 3500, 5000), 3500, 8500)
    save_entries(store, [part], chunks, lambda p, v: got.append(v.clone()))
    assert torch.equal(torch.cat(got), values[3500:8500]) and len(got) == 2
    writes = []
    real_store = store.store_async

    def store_async(buf, start, count, shadow=False):
        writes.append((start, count))
        return real_store(buf, start, count, shadow=shadow)

    store.store_async = store_async
    load_entries(store, [part], chunks,
                 lambda e, first, out: out.copy_(torch.full((out.numel(),), -1.0)))
    assert writes == [(2048, 4096), (6144, 2356)]     # bf16 chunks of 4096, from a bf16 block
    back = aligned_empty(store.nbytes).view(torch.bfloat16)
    manager.wait(store.load_async(back))
    assert back[3500:8500].eq(-1).all() and back[2048:3500].eq(0).all()
    assert torch.equal(back[:2048], values[:2048])


def test_a_part_ending_at_a_chunk_boundary_is_not_handed_an_empty_piece(manager) -> None:
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    pieces_seen = []
    save_entries(store, [(_entry("a", 100, 1948), 100, 2048), (_entry("b", 4096, 10), 4096, 4106)],
                 _Counting(manager), lambda p, v: pieces_seen.append((p[0].name, v.numel())))
    assert pieces_seen == [("a", 1948), ("b", 10)]


def test_a_load_at_an_origin_over_several_chunks(manager) -> None:
    """Each chunk is filled with the parts inside its own range of the unit (unit element x is
    store element x - origin), not with parts of the chunks before it."""
    store = _nvme(manager, 8000, torch.ones(8000))
    a, b = _entry("a", 5000, 1000), _entry("b", 8500, 3000)
    values = {"a": torch.arange(1000.0) + 1, "b": torch.arange(3000.0) + 5000}
    load_entries(store, [(a, 5000, 6000), (b, 8500, 11_500)], _Counting(manager),
                 _fill_from(values), origin=4096)
    out = _read_back(manager, store)
    assert torch.equal(out[904:1904], values["a"]) and torch.equal(out[4404:7404], values["b"])
    assert out[:904].eq(0).all() and out[1904:4404].eq(0).all()


def test_a_read_stopped_early_waits_for_the_reads_in_flight(manager) -> None:
    """Stopped after its first chunk, a read still waits for the chunk read in flight before
    its slot goes back to the pool (a slot handed out while the disk still writes into it
    would corrupt the next user's data)."""
    store = _nvme(manager, 10_000, torch.arange(10_000.0))
    chunks = _Counting(manager)
    chunks.manager = waits = _Waits(manager)
    issued = []
    real = store.load_async

    def load_async(buf, start, count):
        issued.append(real(buf, start, count))
        return issued[-1]

    store.load_async = load_async
    reader = read_chunks(store, 0, 10_000, chunks)
    next(reader)
    assert len(issued) == 2 and waits.waited == issued[:1]
    reader.close()
    assert waits.waited == issued and chunks.out == 0
