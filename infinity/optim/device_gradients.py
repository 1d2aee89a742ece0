"""The device buffers a unit's gradient is collected and reduced in when there are several
ranks and the device is a GPU: only the rank's shard then crosses PCIe.

[Note: gradients reduced on the device]
With N data-parallel ranks every rank computes the whole unit's gradient, but steps only its
shard (stages 1-3) or needs only the mean (stage 0). Copying the whole gradient to the host
and reducing it there moves N times the bytes the step needs over PCIe, runs the reduction
over gloo on host memory instead of NCCL on the device's links, and cannot work at all with an
NCCL group (NCCL takes no host tensors). So on a GPU (``reduces_on_device``) the collector
(optim/gradients.py) adds each parameter's gradient into a device flat buffer of the unit's
``collect_numel`` (copied first, added on a second gradient, the gaps zeroed at the end), and
when the unit's backward is complete reduces that buffer on the device -- reduce-scatter into
the shard region behind it at stages 1-3, all-reduce of the trainable range at stage 0 -- and
copies only the own shard (the trainable range at stage 0) to the unit's host gradient buffer
through the copies' owner (``to_host``, its event kept in ``BackwardGradient.copies``: see
[Note: gradients leave the device]).

The buffer, the collective and the copy are in the communication dtype (DeepSpeed's
``communication_data_type``; unset, the gradients' own dtype, as DeepSpeed and FSDP2's
``reduce_dtype`` default): bf16 compute reduces bf16 -- half the device buffer, half the bytes
through NCCL and over PCIe of fp32 -- with a second gradient of a parameter added in bf16 and
the ranks' sum rounded to bf16 once (the collective halves each rank's 16-bit values before
the sum, exactly: 2 ranks give ``bf16(a/2 + b/2)``, the same bits as ``bf16(a + b) / 2``).
"fp32" keeps the fp32 sums of the host path, element for element (a CPU device's host path
reduces in fp32 whatever the key says). A 16-bit shard is not widened on the GPU (that would
send fp32 over PCIe again): it lands in the back half of the bytes of its fp32 host buffer
(``narrow_staging``: the host staging of the communication dtype, no memory of its own) and is
widened in place to fp32 by whoever waits for the copy (``Widened``, the event kept in
``BackwardGradient.copies``: the training thread's ``copies_landed``, or the step stream's
``CompleteGradient.landed``), after the copy's event and never before. Until then a reader that
skipped the wait finds the buffer's second half NaN under the late copies.


Buffer lifetime: a device buffer is taken at the unit's first gradient and given back at its
reduce, with the event of its copy out (the copy's own event, not the widening's: compute
waits for the device's copy, never for a host thread) and the elements that copy reads. Those
elements are written again only after that event (``compute_waits``: on a GPU the compute
stream waits on the device, no thread blocks; elsewhere the taking thread). The collected
gradient sits at the buffer's front and the reduce-scatter's output at its back, so a
scattered unit's copy out reads the back: the next taker's gradients fill the front while it
runs (that unit's backward overlaps the copy) and its reduce waits (``before_reduce``). At
stage 0 the all-reduced values themselves are copied, from the front: the first gradient
waits. A backward that fails before its reduce gives the buffer back with the wait it did
not make still owed by the next taker. ``DEVICE_GRAD_BUFFERS`` (two) are kept, so unit k's
copy out overlaps unit k-1's gradients arriving and reduce; where the device budget has no
room for two beside a fetched unit and (stage 3) one fetched ahead, the plan keeps one
(planner/sizes.py ``derive_sizes``, counted in its device bytes, in the communication dtype,
by ``device_gradient_bytes`` from the units' padded layouts: the count ``engine_sizes``
reserves, at least what this pool allocates), and a unit's reduce (stage 0: its first
gradient) then waits on the device for the copy out before it. A tied weight keeps its unit
incomplete while later units finish, so a third unit may need a buffer while both kept ones are
collecting: it gets one beyond the pool, inside the device budget, freed at its reduce (the
caching allocator hands its memory on only after the copy out: ``to_host`` records the source
on its stream). A free kept buffer whose copy is over is preferred, then a kept one not yet
made, then the oldest free one (after its event): which buffer a unit gets is timing, what it
holds is not.

On a CPU device the host path stays (the gradient is already in host memory: no copy to save);
tests force this path there (``reduces_on_device`` patched, as zero/activation_swap.py's tests
force a GPU's copies) to run it with gloo and under late copies.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.base.budget import BudgetExceededError
from infinity.base.sizes import format_bytes
from infinity.planner.sizes import DEVICE_GRAD_BUFFERS
from infinity.storage.manager import TierManager
from infinity.storage.transfers import CopyEvent, DeviceCopies

__all__ = ["reduces_on_device", "DeviceGradient", "DeviceGradientPool", "COMM_DTYPES",
           "buffer_numels", "pool_buffer_numel", "narrow_staging", "widen_in_place", "Widened", "shard_to_host"]

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``communication_data_type`` (resolved by the planner) -> the device buffers' dtype."""
WIDEN_TAIL = 4096    # elements widened through a temporary at the end (see ``widen_in_place``)


def reduces_on_device(device: torch.device) -> bool:
    """Whether with several ranks a unit's gradient is reduced on ``device`` and only the own
    shard copied to the host (see [Note: gradients reduced on the device]): off a CPU device.
    Tests patch it to force the path on a CPU device."""
    return device.type != "cpu"


class _Sized(Protocol):
    flat_numel: int
    trainable_numel: int
    shard_numel: int


def buffer_numels(unit: _Sized, scatter: bool) -> tuple[int, int]:
    """(collected, shard) elements a unit's gradient takes of a device buffer: every shard of
    its flat buffer and, behind it, the reduce-scatter's output (the own shard) when the
    gradient is scattered (stages 1-3); its trainable range alone when it is all-reduced
    (stage 0). The optimizer's collector and the dry run's stepper take buffers by it."""
    return (unit.flat_numel, unit.shard_numel) if scatter else (unit.trainable_numel, 0)


def pool_buffer_numel(units: Iterable[_Sized], scatter: bool) -> int:
    """Elements of each of a pool's buffers: the most any of ``units`` takes
    (``buffer_numels``)."""
    return max(sum(buffer_numels(unit, scatter)) for unit in units)


@dataclass(eq=False)
class DeviceGradient:
    """One device buffer: ``values`` (the unit's collected gradient, in the pool's dtype, at
    the front) and ``shard`` (the reduce-scatter's output, at the back; empty at stage 0) are
    views of ``tensor``; ``copied_out`` is the event of the last copy out of it to the host not
    yet waited for, and ``copied_span`` the elements [lo, hi) of ``tensor`` that copy reads."""

    tensor: torch.Tensor
    kept: bool                       # one of the pool's; else made beyond it, freed when given back
    values: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    copied_out: CopyEvent | None = None
    copied_span: tuple[int, int] = (0, 0)


class DeviceGradientPool:
    """The device buffers of [Note: gradients reduced on the device]: ``count`` kept buffers
    of ``numel`` elements of ``dtype`` (the communication dtype) each (made at first use, in
    the device budget), and buffers beyond them while more units are incomplete at once."""

    def __init__(self, manager: TierManager, copies: DeviceCopies, numel: int,
                 count: int = DEVICE_GRAD_BUFFERS, dtype: torch.dtype = torch.float32) -> None:
        if count < 1:
            raise ValueError(f"device gradient buffers: count must be >= 1, got {count}")
        if dtype not in COMM_DTYPES.values():
            raise ValueError(f"device gradient buffers: dtype {dtype} is none of "
                             f"{', '.join(map(str, COMM_DTYPES.values()))}")
        self.manager = manager
        self.copies = copies
        self.numel = numel
        self.count = count
        self.dtype = dtype
        self.made = 0                                # kept buffers made so far
        self.extra = 0                               # beyond the pool, in use now
        self._free: list[DeviceGradient] = []        # given back, oldest first

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def acquire(self, values_numel: int, shard_numel: int, what: str) -> DeviceGradient:
        """A buffer for a unit's gradient (``values_numel`` collected, ``shard_numel`` for the
        reduce-scatter's output), written only after its last copy out (see the note)."""
        if values_numel + shard_numel > self.numel:
            raise ValueError(f"{what}: a device gradient of {values_numel} + {shard_numel} "
                             f"elements does not fit the pool's {self.numel}-element buffers")
        buffer = next((b for b in self._free if b.copied_out is None or b.copied_out.done()),
                      None)
        if buffer is None and self.made < self.count:
            buffer = self._make(kept=True, what=what)
        if buffer is None and self._free:
            buffer = self._free[0]
        if buffer is None:
            buffer = self._make(kept=False, what=what)
        else:
            if buffer in self._free:
                self._free.remove(buffer)
            # the copy of its last shard to the host reads ``copied_span``: the first
            # gradients write the front (``values``) only after it where they overlap it;
            # otherwise the reduce waits for it (``before_reduce``), the backward in between
            # overlapping the copy
            if buffer.copied_out is not None and buffer.copied_span[0] < values_numel:
                self._wait_copy_out(buffer)
        buffer.values = buffer.tensor[:values_numel]
        buffer.shard = buffer.tensor[self.numel - shard_numel:self.numel]
        return buffer

    def before_reduce(self, buffer: DeviceGradient) -> None:
        """The reduce is about to write ``buffer`` (the shard at its back, or the values in
        place at stage 0): compute waits for a copy out of it still reading."""
        if buffer.copied_out is not None:
            self._wait_copy_out(buffer)

    def _wait_copy_out(self, buffer: DeviceGradient) -> None:
        self.copies.compute_waits(buffer.copied_out)
        buffer.copied_out, buffer.copied_span = None, (0, 0)

    def _make(self, kept: bool, what: str) -> DeviceGradient:
        try:
            tensor = self.manager.device_empty(self.numel, self.dtype, self.manager.device,
                                               what=f"{what} (device gradient buffer)")
        except BudgetExceededError as exc:
            raise BudgetExceededError(
                f"{what}: its gradient needs a device buffer of {format_bytes(self.nbytes)} "
                f"while all {self.count} kept ones (and {self.extra} more) hold units still "
                "collecting gradients (a tied weight keeps its unit incomplete until its last "
                "use); raise infinity.device_memory_budget by "
                f"{format_bytes(self.nbytes)}, or tie fewer weights across units: {exc}") from exc
        if kept:
            self.made += 1
        else:
            self.extra += 1
        return DeviceGradient(tensor, kept)

    def release(self, buffer: DeviceGradient, copied_out: CopyEvent | None,
                reads: torch.Tensor | None = None) -> None:
        """``buffer`` is free once ``copied_out`` (the copy of its shard to the host, which
        reads ``reads``, a view of the buffer) is over: a kept one waits in the pool, one
        beyond it is freed now (its memory is handed on by the allocator only after the
        copy). None: no new copy reads it (a backward that failed before its reduce); a copy
        from before that the reduce did not wait for is still waited for by the next taker."""
        buffer.values = buffer.shard = None
        if not buffer.kept:
            self.extra -= 1
            self.manager.device_budget.release(self.nbytes)
            return
        if copied_out is not None:
            if reads is None:
                raise ValueError("device gradient buffer given back with a copy out but not "
                                 "the view it reads: pass reads=")
            lo = reads.storage_offset() - buffer.tensor.storage_offset()
            if reads.untyped_storage().data_ptr() != buffer.tensor.untyped_storage().data_ptr() \
                    or lo < 0 or lo + reads.numel() > self.numel:
                raise ValueError(f"device gradient buffer: the copy out reads {reads.numel()} "
                                 f"elements at offset {lo}, not a view of the buffer's "
                                 f"{self.numel}")
            buffer.copied_out, buffer.copied_span = copied_out, (lo, lo + reads.numel())
        self._free.append(buffer)

    def close(self) -> None:
        """Free the kept buffers (their copies are over: the optimizer lands every copy
        before it closes)."""
        for buffer in self._free:
            if buffer.copied_out is not None:
                buffer.copied_out.wait()
        self.manager.device_budget.release(self.made * self.nbytes)
        self._free.clear()
        self.made = 0


def narrow_staging(wide: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The host staging a 16-bit shard of ``wide``'s (a contiguous fp32 host buffer's) length
    lands in: the back half of ``wide``'s own bytes, viewed as ``dtype`` (see [Note: gradients
    reduced on the device]; ``widen_in_place`` makes fp32 of it there)."""
    n = wide.numel()
    if wide.dtype != torch.float32 or dtype.itemsize != 2 or not wide.is_contiguous():
        raise ValueError(f"a staging of {dtype} in a {wide.dtype} buffer: the shard lands in "
                         "the back half of a contiguous fp32 buffer only as a 16-bit dtype")
    return wide.view(torch.uint8)[2 * n:].view(dtype)


def widen_in_place(wide: torch.Tensor, dtype: torch.dtype) -> None:
    """``wide[i] = float(narrow_staging(wide, dtype)[i])`` for every i: the 16-bit values the
    back half of ``wide``'s bytes holds, widened into the whole buffer (exact: fp32 holds every
    bf16 and fp16 value). From the front, in chunks of at most half of what is left: chunk
    [a, a + c) writes bytes [4a, 4a + 4c), which end at or before 2n + 2a, where the values
    still unread begin, so no value is overwritten before it is read; the last few through a
    temporary."""
    n = wide.numel()
    narrow = narrow_staging(wide, dtype)
    start = 0
    with torch.no_grad():
        while n - start > WIDEN_TAIL:
            count = (n - start) // 2
            wide[start:start + count].copy_(narrow[start:start + count])
            start += count
        if start < n:
            wide[start:].copy_(narrow[start:].clone())


class Widened:
    """The event of a 16-bit shard's copy into ``narrow_staging(wide)``: the first wait waits
    for ``copied`` and then widens the shard in place, on the waiting thread (see [Note:
    gradients reduced on the device]); until then ``wide`` holds no gradient."""

    def __init__(self, copied: CopyEvent, wide: torch.Tensor, dtype: torch.dtype) -> None:
        self.copied = copied
        self.wide: torch.Tensor | None = wide
        self.dtype = dtype

    def done(self) -> bool:
        return self.wide is None

    def wait(self) -> None:
        if self.wide is None:
            return
        self.copied.wait()
        # forgotten before the widen: one cut short (Ctrl-C) has overwritten narrow values it
        # cannot read again, so a later wait must not widen twice (the backward that was cut
        # short drops this gradient; its buffer's bytes mean nothing after it)
        wide, self.wide = self.wide, None
        widen_in_place(wide, self.dtype)


def shard_to_host(copies: DeviceCopies, host: torch.Tensor,
                  reduced: torch.Tensor) -> tuple[CopyEvent, CopyEvent]:
    """Copy the reduced shard ``reduced`` (device, the communication dtype) to the fp32 host
    buffer ``host``: as it is in fp32, else into ``host``'s back half, widened at the wait.
    Returns (the event whoever reads ``host`` waits for, the copy's own event: after it the
    device buffer may be written again)."""
    if reduced.dtype == host.dtype:
        copied = copies.to_host(host, reduced)
        return copied, copied
    copied = copies.to_host(narrow_staging(host, reduced.dtype), reduced)
    return Widened(copied, host, reduced.dtype), copied
