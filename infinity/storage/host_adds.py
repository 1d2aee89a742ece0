"""Gradients copied off a GPU and added into their fp32 host homes: each add made on the host
once its copy has landed, by a thread of its own (``HostAdder``), one widening pass each
(``add_widened``). The copies' owner (storage/transfers.py) issues the copies; this module
makes the adds.

[Note: host adds off the training thread]
A gradient accumulated over micro-batches is added on the host, into its fp32 home. On the
first H200 the add was made at the host wait, and the training thread waited at each unit's
end of backward: every unit's backward hook synchronized with the GPU, then widened and added
the unit's bf16 gradient while no kernel was launched (1.48 s of a 2.4 s step, the GPU idle).
So on a GPU the adds are made by the copies' adder thread, in the order issued (so the bits are
those of the adds made one by one), each as soon as its copy has landed; the training thread
goes on queueing backward kernels, and whoever reads the destination waits for the add as for
any copy (``host_waits``). The collector waits for them only where it reads the home (see
[Note: gradients leave the device] in optim/gradients.py).
"""
from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

import torch

from infinity.storage import _add_native

if TYPE_CHECKING:   # the copies' owner imports this module
    from infinity.storage.transfers import CopyEvent

__all__ = ["HostAdd", "HostAdder", "add_widened", "ADD_CHUNK_NUMEL"]


class HostAdd:
    """A device-to-host add: ``staging`` holds the device values once ``copied`` fired, and
    the add into ``dst`` is made by the first wait, on the waiting thread (see [Note: copy
    events]); until then ``dst`` holds what it held before."""

    def __init__(self, copied: CopyEvent, dst: torch.Tensor, staging: torch.Tensor) -> None:
        self.copied = copied
        self.dst = dst
        self.staging: torch.Tensor | None = staging

    def done(self) -> bool:
        return self.staging is None

    def wait(self) -> None:
        if self.staging is None:
            return
        self.copied.wait()
        with torch.no_grad():
            add_widened(self.dst, self.staging)
        self.staging = None

    def claim(self) -> torch.Tensor | None:
        """For whoever makes the add itself (a step folding it into its kernel: [Note: the
        last adds fold into the step] in optim/boundary_steps.py): wait for the copy and hand
        over the staged values (flat); the add counts as made from here on. None when it was
        made already. Only for an add no thread makes on its own (not queued on a
        ``HostAdder``), owned by one thread."""
        if self.staging is None:
            return None
        self.copied.wait()
        staged, self.staging = self.staging.reshape(-1), None
        return staged


class HostAdder:
    """Makes device-to-host adds on a thread of its own, each as soon as its copy has landed,
    in the order given (see [Note: host adds off the training thread])."""

    def __init__(self) -> None:
        self._adds: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="copy-adds", daemon=True)
        self._thread.start()

    def add(self, host_add: HostAdd) -> CopyEvent:
        """Queue ``host_add``; the event returned fires once it is made."""
        queued = _QueuedAdd(host_add)
        self._adds.put(queued)
        return queued

    def drain(self) -> None:
        """Every add queued so far is made (an add's error stays with its own event)."""
        last = _QueuedAdd(None)
        self._adds.put(last)
        last.wait()

    def _run(self) -> None:
        while True:
            queued = self._adds.get()
            queued.run()
            del queued     # the last add would keep its staging and destination referenced


class _QueuedAdd:
    """A device-to-host add that the copies' adder thread makes as soon as its copy lands
    (``run``); a wait blocks until it has, and raises what the add raised. ``add`` None: a
    marker that says every add queued before it is made."""

    def __init__(self, add: HostAdd | None) -> None:
        self._add = add
        self._made = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            if self._add is not None:
                self._add.wait()
        except BaseException as exc:  # noqa: BLE001 - raised to whoever waits for it
            self._error = exc
        finally:
            self._add = None
            self._made.set()

    def done(self) -> bool:
        return self._made.is_set() and self._error is None

    def wait(self) -> None:
        self._made.wait()
        if self._error is not None:
            raise RuntimeError(f"a device-to-host gradient add failed: {self._error}") \
                from self._error


ADD_CHUNK_NUMEL = 1 << 18   # 1 MiB of float32: a widening add's temporary stays in the heap


def add_widened(target: torch.Tensor, grad: torch.Tensor) -> None:
    """``target += grad`` for a float32 ``target`` and a gradient of its shape in any float
    dtype, bit for bit what ``target.add_(grad.to(torch.float32))`` gives (a target in the
    gradient's own dtype, a 16-bit home, adds it as it is: no widening, no temporary).

    Contiguous float32 / bf16 / fp16 gradients go through the native add (storage/
    _add_native.py): one pass, widened in registers, shared by torch's threads. Others (a
    strided view, a float64 gradient) through torch, in chunks: a 16-bit gradient is widened
    into a float32 temporary (by ``.to`` or inside a mixed-dtype ``add_`` alike) the size of
    the parameter; above the engine's malloc mmap threshold (``infinity.malloc_mmap_threshold``,
    4 MiB) every such temporary is a fresh mapping, page-faulted and zeroed by the kernel and
    unmapped again (at 85M with bf16 compute ~55,000 page faults a step). Slices of the first
    dimension of about ``ADD_CHUNK_NUMEL`` elements keep the temporary in the heap, reused
    from slice to slice; a float32 gradient needs none and is added whole."""
    if grad.numel() > 0 and _add_native.reads(target, grad) and not _overlap(target, grad):
        _add_native.accumulate(target, grad)
        return
    if grad.dtype == target.dtype or grad.numel() <= ADD_CHUNK_NUMEL or grad.dim() == 0:
        target.add_(grad)
        return
    rows = max(1, ADD_CHUNK_NUMEL // max(1, grad[0].numel()))
    for start in range(0, grad.shape[0], rows):
        target[start:start + rows].add_(grad[start:start + rows])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes (an in-place add of a tensor into itself is
    torch's to make)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
