"""Host-to-device copies on their own stream (storage/transfers.py ``CudaCopies``; skipped
visibly without CUDA, run by tools/gpu_check.sh where a GPU is lent): a copy from pinned host
memory lands before compute that waits on its event reads it, the compute stream never waits
for the whole device, and the source goes back only after the copy is over."""
from __future__ import annotations

import threading

import pytest
import torch

from infinity.storage.transfers import CudaCopies, device_copies

pytestmark = pytest.mark.gpu


def test_a_copy_is_read_after_its_event_and_its_source_released_after_it() -> None:
    device = torch.device("cuda")
    copies = device_copies(device)
    assert isinstance(copies, CudaCopies)
    n = 64 << 20                                   # 256 MiB: long enough to still be running
    src = torch.arange(n, dtype=torch.float32).pin_memory()
    dst = torch.empty(n, dtype=torch.float32, device=device)
    released = threading.Event()
    event = copies.to_device(dst, src)
    copies.release_after(event, released.set)
    copies.compute_waits(event)
    total = dst.sum(dtype=torch.float64)           # on the compute stream, after the copy
    assert total.item() == float(n) * (n - 1) / 2
    copies.drain()
    assert released.is_set() and event.done()


def test_compute_does_not_wait_for_the_device_while_a_copy_runs() -> None:
    """The copy stream is not the compute stream: a kernel queued on the compute stream after a
    copy began (and not waiting on it) may finish first."""
    device = torch.device("cuda")
    copies = CudaCopies(device)
    src = torch.ones(128 << 20, dtype=torch.float32).pin_memory()   # 512 MiB
    dst = torch.empty_like(src, device=device)
    x = torch.ones(16, device=device)
    event = copies.to_device(dst, src)
    y = x * 2                                       # independent of the copy
    done_first = torch.cuda.Event()
    done_first.record()
    done_first.synchronize()
    assert y.sum().item() == 32.0
    assert copies.h2d != torch.cuda.current_stream(device)
    event.wait()
    copies.drain()
