"""Copies on their own streams (storage/transfers.py ``CudaCopies``; skipped visibly without
CUDA, run by tools/gpu_check.sh where a GPU is lent): a copy from pinned host memory lands
before compute that waits on its event reads it, the compute stream never waits for the whole
device, and the source goes back only after the copy is over; a gradient's copy to pinned host
memory (or its add into it) runs on the device-to-host stream after the compute that wrote it,
and the host reads it whole after ``host_waits``, bit for bit what the immediate copies give; a
step's write does not queue behind a fetch that waits for compute."""
from __future__ import annotations

import threading

import pytest
import torch

from infinity.storage.transfers import CudaCopies, ImmediateCopies, device_copies

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


def test_a_step_s_write_does_not_queue_behind_a_fetch_waiting_for_compute() -> None:
    """A step's write (``write_device``) runs on its own stream: issued after a fetch that waits
    for a long kernel queued before it, it lands before that kernel ends; ordered after the
    fetch into its own memory (``after``), it lands after that fetch's values."""
    device = torch.device("cuda")
    copies = CudaCopies(device)
    assert copies.writes not in (copies.h2d, copies.d2h, torch.cuda.current_stream(device))
    # every allocation before the kernel: a device or pinned allocation issued between two
    # streams' work is an implicit synchronization in CUDA, which would hold the write back
    fetched = torch.empty(1 << 20, device=device)
    other = torch.empty(1 << 20, device=device)
    ones, twos, threes = (torch.full((1 << 20,), v).pin_memory() for v in (1.0, 2.0, 3.0))
    torch.cuda.synchronize(device)
    torch.cuda._sleep(2_000_000_000)                # a kernel that spins ~1 s on the compute stream
    fetch = copies.to_device(fetched, ones)         # after that compute
    write = copies.write_device(other, twos)
    write.wait()
    assert not fetch.done(), "the write waited for the fetch behind the compute"
    assert other.eq(2.0).all().item()
    after = copies.write_device(fetched, threes, after=fetch)
    after.wait()
    assert fetch.done() and fetched.eq(3.0).all().item()
    copies.drain()


def test_a_deferred_add_is_made_by_no_thread_until_claimed_or_waited() -> None:
    """``to_host(add=True, deferred=True)``: the copy lands in staging and no thread adds it
    (the adder thread makes the others): a step claims the staged values to fold into its
    kernel, or the first wait makes the add, with the immediate copies' bits."""
    from infinity.storage.host_adds import HostAdd
    device = torch.device("cuda")
    copies = CudaCopies(device)
    src = torch.randn(1 << 20, device=device, dtype=torch.bfloat16)
    home = torch.ones(1 << 20).pin_memory()
    claimed = copies.to_host(home, src, add=True, deferred=True)
    assert isinstance(claimed, HostAdd)
    copies.drain()                                   # the adder has nothing of it
    assert home.eq(1.0).all().item() and not claimed.done()
    staged = claimed.claim()
    assert torch.equal(staged, src.cpu()) and claimed.done() and home.eq(1.0).all().item()
    waited = copies.to_host(home, src, add=True, deferred=True)
    copies.host_waits([waited])
    want = torch.ones(1 << 20)
    ImmediateCopies().to_host(want, src.cpu(), add=True)
    assert torch.equal(home, want)
    copies.drain()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_copy_to_the_host_is_read_after_host_waits_and_gives_the_immediate_bits(dtype) -> None:
    device = torch.device("cuda")
    copies = CudaCopies(device)
    n = 32 << 20
    gen = torch.Generator(device=device).manual_seed(1)
    first = torch.randn(n, device=device, generator=gen).to(dtype)
    second = (torch.randn(n, device=device, generator=gen) * 2).to(dtype)   # compute, queued
    fresh = torch.empty(n, dtype=torch.float32).pin_memory()
    home = torch.ones(n, dtype=torch.float32).pin_memory()
    events = [copies.to_host(fresh, first), copies.to_host(fresh, second, add=True),
              copies.to_host(home, second, add=True)]
    del first, second            # kept alive for the copies by record_stream
    assert copies.d2h != torch.cuda.current_stream(device)
    copies.host_waits(events)
    assert all(e.done() for e in events)
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, device=device, generator=gen).to(dtype).cpu()
    b = (torch.randn(n, device=device, generator=gen) * 2).to(dtype).cpu()
    immediate = ImmediateCopies()
    want_fresh, want_home = torch.empty(n), torch.ones(n)
    immediate.to_host(want_fresh, a)
    immediate.to_host(want_fresh, b, add=True)
    immediate.to_host(want_home, b, add=True)
    assert torch.equal(fresh, want_fresh) and torch.equal(home, want_home)
    copies.drain()
