"""malloc_tuning: the pinned threshold really decides which allocations get their own mapping.

Each case runs in a fresh interpreter: in a long test process the heap may already hold a free
chunk big enough to serve the allocation, which glibc prefers to a new mapping whatever the
threshold."""
import subprocess
import sys

import pytest

from infinity.base.malloc_tuning import set_mmap_threshold

PROBE = """
import ctypes, ctypes.util, sys
from infinity.base.malloc_tuning import set_mmap_threshold, trim
class M(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
if not hasattr(libc, "mallinfo2"):
    print("skip"); sys.exit(0)
libc.mallinfo2.restype = M
assert set_mmap_threshold(int(sys.argv[1]))
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblkhd
block = libc.malloc(12 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(ctypes.c_void_p(block))
trim()
"""


def _mapped_by_a_12mib_malloc(threshold: int) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    if out == "skip":
        pytest.skip("glibc without mallinfo2 (< 2.33)")
    return int(out)


def test_allocations_above_the_threshold_are_mapped_and_below_are_not() -> None:
    assert _mapped_by_a_12mib_malloc(1 << 20) >= 12 << 20
    assert _mapped_by_a_12mib_malloc(16 << 20) == 0


def test_out_of_range_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="32 MiB"):
        set_mmap_threshold(64 << 20)
    with pytest.raises(ValueError, match="malloc_mmap_threshold"):
        set_mmap_threshold(0)
