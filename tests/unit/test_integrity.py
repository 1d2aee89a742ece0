"""storage/integrity.py's fingerprint table at unit level: record and
verify page by page on host buffers (no swap file, no I/O), the partial last page, forget, a mode
change, the statistics (with a fake clock), the error's message and the library it calls."""
from __future__ import annotations

import ctypes
import errno
import types

import pytest
import torch

import infinity
from infinity.base import native_library
from infinity.io.buffers import aligned_empty
from infinity.storage import integrity
from infinity.storage.integrity import PAGE, CheckStats, PageFingerprints, SwapCorruptionError

MODES = ["sampled", "full"]


def pages_of(n: int, seed: int) -> torch.Tensor:
    """``n`` pages of random bytes, every page's first and last 8 bytes included."""
    buf = aligned_empty(n * PAGE)
    buf.copy_(torch.randint(0, 256, (n * PAGE,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    return buf


def table(mode: str, pages: int = 16) -> PageFingerprints:
    fp = PageFingerprints(mode)
    fp.add_file(pages * PAGE)
    return fp


def garbled(buf: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """A copy of ``buf`` with the first and last byte of each of ``pages`` changed (both
    checks see it)."""
    out = buf.clone()
    for p in pages:
        out[p * PAGE] ^= 0xFF
        out[(p + 1) * PAGE - 1] ^= 0xFF
    return out


@pytest.mark.parametrize("mode", MODES)
def test_verify_reports_the_changed_pages_as_file_offsets(mode) -> None:
    """The tuple verify returns: bad and checked counts, and the file offsets of the first and
    last bad page (offset-relative page numbers turned into file offsets)."""
    fp = table(mode)
    buf = pages_of(8, 1)
    fp.record(0, 4 * PAGE, buf, 8 * PAGE)
    assert fp.verify(0, 4 * PAGE, buf, 8 * PAGE) == (0, 8, -1, -1)
    assert fp.verify(0, 4 * PAGE, garbled(buf, [2, 5]), 8 * PAGE) == \
        (2, 8, 6 * PAGE, 9 * PAGE)


@pytest.mark.parametrize("mode", MODES)
def test_forget_clears_exactly_the_pages_it_covers(mode) -> None:
    """forget(offset, nbytes) clears ceil(nbytes / PAGE) pages from offset, no fewer, no more
    (a slice end of ``first - pages`` cleared nothing, or most of the table from offset 0)."""
    fp = table(mode)
    buf = pages_of(8, 2)
    fp.record(0, 0, buf, 8 * PAGE)
    fp.forget(0, 2 * PAGE, 2 * PAGE - 100)      # pages 2 and 3 (the second one partly)
    bad = garbled(buf, list(range(8)))
    assert fp.verify(0, 0, bad, 8 * PAGE) == (6, 6, 0, 7 * PAGE)


@pytest.mark.parametrize("mode", MODES)
def test_a_partial_write_clears_its_last_page_only(mode) -> None:
    """A write of 1 page + 100 bytes at page 2 records page 2 and clears page 3 (its tail is not
    the engine's to know); the pages around it keep their fingerprints."""
    fp = table(mode)
    buf = pages_of(4, 3)
    fp.record(0, 0, buf, 4 * PAGE)
    fp.record(0, 2 * PAGE, buf[2 * PAGE:], PAGE + 100)
    assert fp.verify(0, 0, garbled(buf, [0, 1, 2, 3]), 4 * PAGE) == (3, 3, 0, 2 * PAGE)


@pytest.mark.parametrize("mode", MODES)
def test_a_whole_page_write_keeps_the_next_page(mode) -> None:
    """A write of whole pages touches no page after it (``nbytes / PAGE`` for ``%`` cleared the
    next page, or indexed past the table at its end)."""
    fp = table(mode, pages=2)
    buf = pages_of(2, 4)
    fp.record(0, 0, buf, 2 * PAGE)
    fp.record(0, 0, buf, PAGE)
    assert fp.verify(0, 0, garbled(buf, [1]), 2 * PAGE) == (1, 2, PAGE, PAGE)
    fp.record(0, PAGE, buf[PAGE:], PAGE)           # the table's last page
    assert fp.verify(0, 0, buf, 2 * PAGE) == (0, 2, -1, -1)


@pytest.mark.parametrize("mode", MODES)
def test_a_one_byte_write_clears_its_page(mode) -> None:
    """Even a 1-byte write makes its page unknown (``nbytes <= 1`` skipped it, and a stale
    fingerprint was then compared with bytes the engine itself wrote)."""
    fp = table(mode)
    buf = pages_of(1, 5)
    fp.record(0, 0, buf, PAGE)
    fp.record(0, 0, buf, 1)
    assert fp.verify(0, 0, garbled(buf, [0]), PAGE) == (0, 0, -1, -1)


def test_off_and_empty_calls_do_nothing() -> None:
    """Off: nothing recorded or compared, and no call into the library (there is no native
    mode "off"); a record of 0 bytes or a verify of less than a page is not counted."""
    fp = table("off")
    buf = pages_of(2, 6)
    fp.record(0, 0, buf, 2 * PAGE)
    assert fp.verify(0, 0, buf, 2 * PAGE) == (0, 0, -1, -1)
    assert fp.stats == CheckStats()
    assert not fp.active and PageFingerprints("full").active
    fp.set_mode("sampled")
    fp.record(0, 0, buf, 0)
    assert fp.verify(0, 0, buf, PAGE - 1) == (0, 0, -1, -1)
    assert fp.stats == CheckStats()


class FakeTime:
    """perf_counter and thread_time stepping by 1.0 and 0.25 a call: exact durations."""

    def __init__(self) -> None:
        self.wall, self.cpu = 100.0, 10.0

    def perf_counter(self) -> float:
        self.wall += 1.0
        return self.wall

    def thread_time(self) -> float:
        self.cpu += 0.25
        return self.cpu


@pytest.mark.parametrize("mode", MODES)
def test_stats_add_up_over_calls(mode, monkeypatch) -> None:
    """Each counter and duration adds up over calls (``=`` or ``-=`` for ``+=``, a sum for a
    difference); reset() zeroes every field."""
    monkeypatch.setattr(integrity, "time", FakeTime())
    fp = table(mode)
    buf = pages_of(4, 7)
    fp.record(0, 0, buf, 4 * PAGE)
    fp.record(0, 4 * PAGE, buf, 2 * PAGE + 5)
    fp.verify(0, 0, buf, 4 * PAGE)
    fp.verify(0, 4 * PAGE, buf, 3 * PAGE)
    assert fp.stats == CheckStats(pages_recorded=6, pages_read=7, pages_checked=6,
                                  record_calls=2, verify_calls=2, record_s=2.0, verify_s=2.0,
                                  record_cpu_s=0.5, verify_cpu_s=0.5)
    fp.stats.reset()
    assert fp.stats == CheckStats()


def test_a_mode_change_forgets_and_is_recorded_in_native_info() -> None:
    """set_mode clears every table and tells native_info what runs: "sampled (scalar)",
    "full (<the auto kernel>)" or "off"; a bad mode lists the modes."""
    fp = table("full")
    buf = pages_of(2, 8)
    fp.record(0, 0, buf, 2 * PAGE)
    assert infinity.native_info()["in_use"]["swap_check"] == f"full ({integrity.kernel_name()})"
    fp.set_mode("sampled")
    assert fp.mode == "sampled"
    assert infinity.native_info()["in_use"]["swap_check"] == "sampled (scalar)"
    assert fp.verify(0, 0, garbled(buf, [0, 1]), 2 * PAGE) == (0, 0, -1, -1)
    fp.set_mode("off")
    assert infinity.native_info()["in_use"]["swap_check"] == "off"
    with pytest.raises(ValueError) as info:
        fp.set_mode("crc")
    assert str(info.value) == "swap check mode 'crc': choose one of sampled, full, off"
    assert PageFingerprints().mode == "sampled"


def test_sampled_keeps_the_gil_and_full_gives_it_up() -> None:
    """[gil_lib]: the sampled kernel goes through the PyDLL mapping (cheaper than releasing the
    GIL), the full one through the CDLL (it reads every byte and lets other threads run)."""
    assert isinstance(integrity.gil_lib(), ctypes.PyDLL)
    assert integrity.gil_lib() is integrity.gil_lib()
    assert PageFingerprints("sampled")._lib() is integrity.gil_lib()
    assert PageFingerprints("full")._lib() is integrity.lib()
    assert integrity.gil_lib().inf_crc32c(1, 0, b"123456789", 9) == 0xE3069283


class Spy:
    """The library with every call's arguments kept, or a return value forced."""

    def __init__(self, real, ret: int | None = None) -> None:
        self.real, self.ret, self.calls = real, ret, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return self.ret if self.ret is not None else getattr(self.real, name)(*args)
        return call


@pytest.mark.parametrize("mode", MODES)
def test_calls_use_the_auto_kernel(mode, monkeypatch) -> None:
    """Record and verify ask for kernel 0 ("auto": the one native_info reports), not a fixed
    one; the table pointer is offset by 4 bytes a page."""
    fp = table(mode)
    spy = Spy(fp._lib())
    monkeypatch.setattr(fp, "_lib", lambda: spy)
    buf = pages_of(2, 9)
    fp.record(0, 3 * PAGE, buf, 2 * PAGE)
    fp.verify(0, 3 * PAGE, buf, 2 * PAGE)
    base = fp._tables[0].data_ptr()
    assert [(name, args[:2], args[3:5]) for name, args in spy.calls] == [
        ("inf_check_pages", (integrity._NATIVE_MODE[mode], 0), (2, base + 12)),
        ("inf_check_verify", (integrity._NATIVE_MODE[mode], 0), (2, base + 12))]


def test_native_errors_name_what_failed(monkeypatch) -> None:
    """A negative errno from the kernel is an OSError naming the step."""
    fp = table("sampled")
    monkeypatch.setattr(fp, "_lib", lambda: Spy(None, ret=-errno.EINVAL))
    buf = pages_of(1, 10)
    with pytest.raises(OSError) as info:
        fp.record(0, 0, buf, PAGE)
    assert str(info.value) == "[Errno 22] fingerprinting swap pages: Invalid argument"
    with pytest.raises(OSError) as info:
        fp.verify(0, 0, buf, PAGE)
    assert str(info.value) == "[Errno 22] checking swap pages: Invalid argument"
    with pytest.raises(OSError) as info:
        integrity.kernel_name(99)
    assert str(info.value) == "[Errno 22] choosing the check kernel: Invalid argument"
    with pytest.raises(TypeError) as info:
        fp.record(0, 0, bytearray(PAGE), PAGE)
    assert str(info.value) == "the integrity check needs a host torch.Tensor, got bytearray"


def test_the_default_kernel_is_the_best_available() -> None:
    """kernel_name() is "auto" resolved: sse4.2 where the CPU has it, scalar otherwise."""
    with open("/proc/cpuinfo") as f:
        sse42 = " sse4_2" in f.read()
    assert integrity.kernel_name() == integrity.kernel_name(0)
    assert integrity.kernel_name() == ("sse4.2" if sse42 else "scalar")
    assert integrity.kernel_name(1) == "scalar"


def test_an_old_library_is_named_by_the_component(monkeypatch) -> None:
    """A library built before the check exists: the error names the component to rebuild."""
    monkeypatch.setattr(native_library, "lib", lambda: types.SimpleNamespace())
    monkeypatch.setattr(native_library, "_declared_components", set())
    with pytest.raises(native_library.NativeLibraryError, match="before the swap integrity "
                       "check component; rebuild it"):
        integrity.lib()


@pytest.mark.parametrize("mode", MODES)
def test_tables_do_not_depend_on_the_default_dtype(mode) -> None:
    """The tables are int32 whatever torch's default dtype: with float64 tables the native
    side's 4-byte entries and Python's element indexing (forget, the partial page) disagree,
    and forget cleared the wrong pages."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        fp = table(mode)
    finally:
        torch.set_default_dtype(old)
    buf = pages_of(8, 11)
    fp.record(0, 0, buf, 8 * PAGE)
    fp.forget(0, 4 * PAGE, 2 * PAGE)
    assert fp.verify(0, 0, garbled(buf, list(range(8))), 8 * PAGE) == (6, 6, 0, 7 * PAGE)


@pytest.mark.parametrize("mode,how", [
    ("sampled", "the first and last 8 bytes of each 4 KiB page"),
    ("full", "a CRC-32C of each 4 KiB page")])
def test_the_error_message_in_full(mode, how) -> None:
    """The whole message of SwapCorruptionError: the file, the extent and its byte range, the
    range read when it is not the extent, the pages and the differing range, what was checked,
    and what to do."""
    kw = dict(path="/swap/f0", tag="u1.exp_avg", extent_offset=8192, extent_nbytes=40960,
              bad_pages=2, checked_pages=10, first_bad_offset=12288, last_bad_offset=20480,
              mode=mode)
    tail = (f"2 of 10 pages checked differ from what the engine wrote there, from file offset "
            f"12288 to 24576 (checked: {how}). Something outside the engine wrote into the swap "
            "file (another process, a second run given the same swap directory, a disk fault); "
            "the states it held are lost and training on them would be garbage. close() the "
            "engine and resume from the last checkpoint (load_checkpoint into a new engine); "
            "keep other programs out of the swap directory")
    head = ("swap space corrupt: swap file /swap/f0, extent 'u1.exp_avg' at offset 8192, length "
            "40960 bytes (bytes 8192..49152)")
    whole = SwapCorruptionError(offset=8192, nbytes=40960, **kw)
    assert str(whole) == f"[Errno 5] {head}: {tail}"
    part = SwapCorruptionError(offset=12288, nbytes=8192, **kw)
    assert str(part) == f"[Errno 5] {head}; the read covered bytes 12288..20480 of the file: {tail}"
    assert (part.errno, part.mode, part.offset, part.nbytes) == (errno.EIO, mode, 12288, 8192)
