"""Swap-space integrity check: page fingerprints recorded at swap-out, compared at swap-in.

Why: a swap file is an ordinary file on a shared disk. When something outside the engine writes
into it (another process, a second run pointed at the same directory, a disk that loses or
misplaces a write), the engine used to read the garbage back as parameters or optimizer states
and train on it: NaN losses, or silently wrong weights, with no word of why. ``SwapSpace`` records
a fingerprint of every page it writes and compares it when the page is read back, so the error
is raised where the bytes come in, naming the file, the extent and what to do.

[Note: swap-space integrity check]
*Where.* Every swap-in and swap-out (parameters, optimizer states, gradients, activations,
checkpoint streaming) goes through ``SwapSpace.write`` / ``SwapSpace.read``. A write records,
when it is submitted (the buffer may not change until the request is waited on, see [Note: store
buffer lifetimes] in manager.py), one 32-bit fingerprint per whole 4 KiB page it covers, in a
table per swap file indexed by page (0 = nothing recorded). A read's request verifies the pages it
brought in when ``wait()`` first sees it finished (``IORequest.check_on_wait``), before any caller
can use the bytes, and raises ``SwapCorruptionError`` (an ``OSError``, EIO) naming the file, the
extent (tag, offset, length), the range read and the first and last differing page.

*Never a false alarm.* Pages the engine has not written are not checked: fresh extents, extents
freed and handed out again (``forget`` on free), the partial last page of a write whose length is
not a multiple of 4 KiB (its bytes past the write are whatever was there), and everything written
while the check was off (the tables are cleared when the mode changes). A write that fails leaves
its new fingerprints behind, but its error has already been raised to the step. The engine never
reads a range while a write to it is in flight (it would read undefined bytes anyway).

*What is detected.* Mode ``sampled`` (the default): a hash of the first and the last 8 bytes of
each page, i.e. two cache lines a page, ~1/32 of the bytes. It catches any change of those 16
bytes: a whole file or any range of at least 4 KiB + 8 bytes overwritten with random bytes or
with another state's data (every such range covers a page's first or last word), zeros written
over data that was not zero there, a truncated or shifted copy, and a lost write when the values
changed since the previous one (optimizer states and parameters change every step). It misses
changes that lie wholly inside one page between its first and last 8 bytes (a stray write of a
few bytes to a few KiB at an unlucky place) and garbage equal to what was there (zeros over
zeros: harmless). Mode ``full``: CRC-32C of every page (SSE4.2 crc32 instruction, four pages in
parallel; the scalar slice-by-8 table elsewhere) catches any change of a page (but for a 2^-32
chance per page) at the cost of reading every byte once more through the CPU. Mode ``off``.
A non-finite check at fetch was not chosen: it is blind to finite garbage (most random fp32
words are finite numbers, and every random bf16 pattern with a normal exponent is), depends on
the dtype, and reads every byte like ``full`` does.

*Cost* (tools/bench/swap_check.py, BENCHMARKS.md "Swap-space integrity check"): a 0.49B step
writes and reads ~1.4M pages each way (5.6 GB). ``sampled`` spends 41-43 ms of CPU a step on
them (~15 ns a page; its calls keep the GIL, see ``gil_lib``): 0.15% of the step measured on the
loaded 2-core VM, ~1% of the 4 s step of a quiet one, inside the 2% bar. ``full`` spends
0.7-0.9 s of CPU a step (CRC-32C at 3.6-8 GB/s a core, memory-bound): ~3% of the loaded step and
~20% of a quiet one, too dear as the default. Host memory: 4 bytes per 4 KiB page of the swap
files (0.1%), not counted in the host budget.

The mode is the config's ``infinity.swap_check`` ("sampled", "full" or "off"), given to the swap
space when it is created; ``PageFingerprints.set_mode`` changes it (between steps, with no I/O in
flight).
"""
from __future__ import annotations

import ctypes
import errno
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from infinity.base import native_library
from infinity.base.native_info import record_in_use
from infinity.base.sizes import ALIGN_BYTES

PAGE = ALIGN_BYTES
"""A fingerprinted page: the O_DIRECT alignment, so every extent is whole pages."""
CheckMode = Literal["sampled", "full", "off"]
MODES: tuple[str, ...] = ("sampled", "full", "off")
_NATIVE_MODE = {"sampled": 1, "full": 2}
_KERNELS = {0: "auto", 1: "scalar", 2: "sse4.2"}


def _signatures() -> dict:
    vp, u32, u64, c_int = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
    return {
        "inf_check_kernel": (c_int, [c_int]),
        "inf_crc32c": (u32, [c_int, u32, vp, u64]),
        "inf_check_pages": (c_int, [c_int, c_int, vp, u64, vp]),
        "inf_check_verify": (ctypes.c_int64, [c_int, c_int, vp, u64, vp, ctypes.POINTER(u64),
                                              ctypes.POINTER(u64), ctypes.POINTER(u64)]),
    }


def lib() -> ctypes.CDLL:
    """The native library with the inf_check_* signatures declared (calls release the GIL)."""
    return native_library.declare("swap integrity check", _signatures)


_gil_lib: ctypes.PyDLL | None = None


def gil_lib() -> ctypes.PyDLL:
    """The same library through ``ctypes.PyDLL``: its calls keep the GIL. For the sampled kernel
    (~25 ns a page: 0.4 ms for a 64 MiB read), where giving the GIL up and taking it back costs
    more than the call on a busy machine (the thread may wait up to the 5 ms switch interval for
    it; measured at 0.49B: 0.07 s of CPU but 0.55 s of wall in the check calls a step)."""
    global _gil_lib
    if _gil_lib is None:
        lib()   # a library built before the component is a NativeLibraryError there
        library = ctypes.PyDLL(str(native_library.library_path()))   # the same mapping (dlopen)
        for name, (restype, argtypes) in _signatures().items():
            fn = getattr(library, name)
            fn.restype, fn.argtypes = restype, argtypes
        _gil_lib = library
    return _gil_lib


def kernel_name(kernel: int = 0) -> str:
    """The fingerprint kernel ``kernel`` (0: auto) resolves to here: "scalar" or "sse4.2"."""
    choice = native_library.check(lib().inf_check_kernel(kernel), "choosing the check kernel")
    return _KERNELS[choice]


def _ptr(buf: Any) -> int:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"the integrity check needs a host torch.Tensor, got {type(buf).__name__}")
    return buf.data_ptr()


class SwapCorruptionError(OSError):
    """Bytes read back from a swap file differ from what the engine wrote there (errno EIO).

    Attributes: ``path`` (the swap file), ``tag``, ``extent_offset`` / ``extent_nbytes`` (the
    extent in the file), ``offset`` / ``nbytes`` (the range read), ``bad_pages`` /
    ``checked_pages``, ``first_bad_offset`` / ``last_bad_offset`` (file offsets of the first and
    last differing page).
    """

    def __init__(self, *, path: str, tag: str, extent_offset: int, extent_nbytes: int,
                 offset: int, nbytes: int, bad_pages: int, checked_pages: int,
                 first_bad_offset: int, last_bad_offset: int, mode: str) -> None:
        self.path, self.tag, self.mode = path, tag, mode
        self.extent_offset, self.extent_nbytes = extent_offset, extent_nbytes
        self.offset, self.nbytes = offset, nbytes
        self.bad_pages, self.checked_pages = bad_pages, checked_pages
        self.first_bad_offset, self.last_bad_offset = first_bad_offset, last_bad_offset
        how = ("the first and last 8 bytes of each 4 KiB page" if mode == "sampled"
               else "a CRC-32C of each 4 KiB page")
        within = "" if (offset, nbytes) == (extent_offset, extent_nbytes) else \
            f"; the read covered bytes {offset}..{offset + nbytes} of the file"
        super().__init__(
            errno.EIO,
            f"swap space corrupt: swap file {path}, extent {tag!r} at offset {extent_offset}, "
            f"length {extent_nbytes} bytes (bytes {extent_offset}..{extent_offset + extent_nbytes})"
            f"{within}: {bad_pages} of {checked_pages} pages checked differ from what the engine "
            f"wrote there, from file offset {first_bad_offset} to {last_bad_offset + PAGE} "
            f"(checked: {how}). Something outside the engine wrote into the swap file (another "
            "process, a second run given the same swap directory, a disk fault); the states it "
            "held are lost and training on them would be garbage. close() the engine and resume "
            "from the last checkpoint (load_checkpoint into a new engine); keep other programs "
            "out of the swap directory")


@dataclass
class CheckStats:
    """Pages fingerprinted and time spent, since the last ``reset`` (all threads together)."""

    pages_recorded: int = 0
    """Whole pages fingerprinted as they were written."""
    pages_read: int = 0
    """Whole pages read back while the check was on."""
    pages_checked: int = 0
    """Of those, the pages compared (the rest had no fingerprint: never written, or written while
    the check was off)."""
    record_calls: int = 0
    """Writes and reads fingerprinted (calls into the native kernel)."""
    verify_calls: int = 0
    record_s: float = 0.0
    """Wall seconds in the record calls (with any wait for a core or the GIL)."""
    verify_s: float = 0.0
    record_cpu_s: float = 0.0
    """CPU seconds of the calling threads in the record calls."""
    verify_cpu_s: float = 0.0

    def reset(self) -> None:
        self.pages_recorded = self.pages_read = self.pages_checked = 0
        self.record_calls = self.verify_calls = 0
        self.record_s = self.verify_s = self.record_cpu_s = self.verify_cpu_s = 0.0


class PageFingerprints:
    """One 32-bit fingerprint per 4 KiB page of each swap file of one swap space.

    Thread-safe for what the engine does: writes and reads from several threads touch disjoint
    pages; ``set_mode`` must be called with no I/O in flight.
    """

    def __init__(self, mode: CheckMode = "sampled") -> None:
        self._tables: list[torch.Tensor] = []   # int32 per page, by file index; 0 = not recorded
        self._lock = threading.Lock()
        self.stats = CheckStats()
        self.mode: CheckMode = "off"
        self.set_mode(mode)

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def set_mode(self, mode: CheckMode) -> None:
        """Check with ``mode`` from now on; forgets every fingerprint (pages written before are
        not checked, so none is compared with a fingerprint of another mode or a stale one)."""
        if mode not in MODES:
            raise ValueError(f"swap check mode {mode!r}: choose one of {', '.join(MODES)}")
        for table in self._tables:
            table.zero_()
        self.mode = mode
        if mode != "off":
            kernel = kernel_name() if mode == "full" else "scalar"
            record_in_use("swap_check", f"{mode} ({kernel})")
        else:
            record_in_use("swap_check", "off")

    def _lib(self):
        return gil_lib() if self.mode == "sampled" else lib()

    def add_file(self, size: int) -> None:
        """A swap file of ``size`` bytes was added (its index is the next one)."""
        self._tables.append(torch.zeros(-(-size // PAGE), dtype=torch.int32))

    def forget(self, file_index: int, offset: int, nbytes: int) -> None:
        """Nothing is known of these bytes any more (an extent was freed)."""
        first = offset // PAGE
        self._tables[file_index][first:first + -(-nbytes // PAGE)].zero_()

    def record(self, file_index: int, offset: int, buf: torch.Tensor, nbytes: int) -> None:
        """``buf``'s first ``nbytes`` are being written at ``offset`` (a multiple of 4 KiB)."""
        if self.mode == "off" or nbytes <= 0:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        table = self._tables[file_index]
        first, pages = offset // PAGE, nbytes // PAGE
        if pages:
            native_library.check(self._lib().inf_check_pages(
                _NATIVE_MODE[self.mode], 0, _ptr(buf), pages, table.data_ptr() + 4 * first),
                "fingerprinting swap pages")
        if nbytes % PAGE:
            table[first + pages] = 0   # partial page: the rest of it is not ours to know
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        with self._lock:
            self.stats.pages_recorded += pages
            self.stats.record_s += dt
            self.stats.record_cpu_s += dc
            self.stats.record_calls += 1

    def verify(self, file_index: int, offset: int, buf: torch.Tensor,
               nbytes: int) -> tuple[int, int, int, int]:
        """Compare the ``nbytes`` read into ``buf`` from ``offset`` with what was recorded:
        ``(bad_pages, checked_pages, first_bad_offset, last_bad_offset)`` (offsets -1 if none)."""
        pages = nbytes // PAGE
        if self.mode == "off" or pages <= 0:
            return 0, 0, -1, -1
        t0, c0 = time.perf_counter(), time.thread_time()
        first = offset // PAGE
        table = self._tables[file_index]
        checked, lo, hi = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        bad = native_library.check(self._lib().inf_check_verify(
            _NATIVE_MODE[self.mode], 0, _ptr(buf), pages, table.data_ptr() + 4 * first,
            ctypes.byref(checked), ctypes.byref(lo), ctypes.byref(hi)), "checking swap pages")
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        with self._lock:
            self.stats.pages_read += pages
            self.stats.pages_checked += checked.value
            self.stats.verify_s += dt
            self.stats.verify_cpu_s += dc
            self.stats.verify_calls += 1
        if not bad:
            return 0, checked.value, -1, -1
        return bad, checked.value, offset + lo.value * PAGE, offset + hi.value * PAGE
