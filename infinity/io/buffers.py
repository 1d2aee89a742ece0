"""``aligned_empty``: page-aligned host tensors for direct I/O, counted in a memory budget.

Why not ``torch.empty``: O_DIRECT needs aligned memory and torch's CPU allocator promises only 64
bytes. The memory comes from an anonymous mapping made by the native library (huge pages advised
for large buffers, which makes each direct I/O pin fewer pages) and is wrapped zero-copy; the
mapping is unmapped, the CUDA registration dropped and the budget released when torch frees the
tensor's storage (the last view of it), not when the first tensor object goes away.
"""
from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from infinity.base.budget import MemoryBudget
from infinity.io import _lib
from infinity.base.log import get_logger

_log = get_logger("io.buffers")
_cuda_lock = threading.Lock()


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8, *, alignment: int = 4096,
                  budget: MemoryBudget | None = None, pin: bool = True) -> torch.Tensor:
    """A 1-D tensor of ``nbytes // itemsize`` elements whose data starts on an ``alignment`` boundary.

    Contents are zero (fresh anonymous pages). ``budget`` is charged ``nbytes`` now and refunded
    when the storage is freed. With ``pin`` and CUDA available, the memory is page-locked with
    cudaHostRegister (so device copies from it are asynchronous).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be a non-negative int, got {nbytes!r}")
    if alignment < 512 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: alignment must be a power of two >= 512, got {alignment}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(f"aligned_empty: nbytes={nbytes} is not a multiple of {dtype}'s "
                         f"itemsize {itemsize}")
    if budget is not None:
        budget.reserve(nbytes, f"aligned I/O buffer of {nbytes} bytes")
    try:
        ptr = ctypes.c_void_p()
        rc = _lib.lib().inf_aio_buf_alloc(nbytes, max(alignment, 4096), ctypes.byref(ptr))
        if rc < 0:
            raise MemoryError(f"aligned_empty: mapping {nbytes} bytes failed with errno {-rc}; "
                              "host memory is exhausted or a limit (ulimit -v) applies")
    except BaseException:
        if budget is not None:
            budget.release(nbytes)
        raise
    addr = ptr.value
    registered = pin and _cuda_register(addr, nbytes)
    # A ctypes array over the mapping exports the buffer; torch.frombuffer keeps it alive for as
    # long as any tensor shares the storage, and the finalizer runs once it is collected.
    holder = (ctypes.c_uint8 * max(nbytes, 1)).from_address(addr)
    fin = weakref.finalize(holder, _release, addr, nbytes, registered, budget)
    fin.atexit = False  # at exit a live tensor may still be read: leave the mapping to the OS
    if nbytes == 0:
        return torch.frombuffer(holder, dtype=torch.uint8)[:0].view(dtype)
    return torch.frombuffer(holder, dtype=torch.uint8).view(dtype)


def _cuda_register(addr: int, nbytes: int) -> bool:
    if nbytes == 0 or not torch.cuda.is_available():
        return False
    with _cuda_lock:
        err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
    if int(err) != 0:
        _log.warning("cudaHostRegister of %d bytes failed (error %s); the buffer stays pageable",
                     nbytes, int(err))
        return False
    return True


def _release(addr: int, nbytes: int, registered: bool, budget: MemoryBudget | None) -> None:
    if registered:
        try:
            torch.cuda.cudart().cudaHostUnregister(addr)
        except Exception:  # noqa: BLE001 - CUDA may be torn down at exit
            pass
    _lib.lib().inf_aio_buf_free(addr, nbytes)
    if budget is not None:
        budget.release(nbytes)
