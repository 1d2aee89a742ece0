"""The stepped parameters into a unit's device copy, from the step stream's thread.

[Note: the kernel rounds into the device copy]
With a separate fp32 master and 16-bit compute, a sub-group's step rounds the master into a
temporary (``param.to``), the kernel overwrites the stepped elements with the rounded new values,
and the temporary is copied into the unit's device copy: three passes beside the kernel's own and
an allocation (at 85M in bf16, ~0.15 s of the step stream's CPU a step). Where the step's runs
cover the whole sub-group and the gradient is one flat tensor (the kernel writes every element's
rounding), and the device copy is CPU memory, the kernel writes straight into it instead: the
same bits, no temporary, no copy. A sub-group with a parameter not stepped this cycle, or held
per-parameter gradients (which skip the gaps between parameters), keeps the temporary, whose
untouched elements are the master's own rounding.

[Note: the device copy written behind the step]
Where copies overlap compute (a GPU's streams; the late copies of the tests), the temporary goes
to the device copy through the copies' owner (storage/transfers.py): from pinned memory, on the
host-to-device stream, and the step stream waits for the copy's event before it says the unit is
stepped (``DeviceCopyWrites.land`` before ``StepJob.stepped``). The training thread reads a
unit's device copy only after ``stepped`` (``wait_stepped``: the next forward, ``step()``, a
fetch handing a deferred job over), so that wait orders every later reader, on any stream,
without a wait on the compute stream.

Before, the step thread called ``copy_`` from its pageable temporary: on a GPU that is a copy on
the thread's current stream, the default stream, which is the compute stream. The first profile
on an H200 (BENCHMARKS.md, 2026-12-04) saw each unit's 101 MB take 15 ms at 6.8 GB/s there,
146 ms of a 0.47 s step: compute queued behind it, and the step thread blocked in it between
two units' kernels. From pinned memory the same copy runs at the link's rate (about 55 GB/s,
~2 ms), beside the next sub-group's kernel.

While such a copy is in flight the device copy does not hold the new values, so the home is
written from the temporary (``flat_current`` False in ``StepStream._write_params``), never
from the device copy. A job that fails waits for its copies all the same before it is handed
back (its unit may be released, its device memory reused).

Costs, to be measured on the next GPU pass (``device_write_wait_s`` in the step stats):
- Memory. A job keeps one copy in flight while the next sub-group is stepped (``IN_FLIGHT``),
  so two sub-groups' 16-bit temporaries are alive at once. They are pinned, from torch's
  pinned-memory cache, which rounds a size up to a power of two and keeps freed blocks for
  reuse. Like autograd's temporaries they are outside the host budget.
- Waiting. A copy into the device copy does not wait for the compute queued when it is
  issued, nor queue behind the fetches that do (``write_device``, a stream of its own: [Note:
  the step's writes do not queue behind fetches] in storage/transfers.py), so ``land`` waits
  for the copies alone. Every reader of the device copy is over by then: the unit's forward
  and backward kernels were queued before its gradient's copy to the host (which starts after
  them), and the job's kernels run only once that copy has landed (an early step's first
  kernel waits for it; a deferred step is queued after every gradient landed). A unit freshly
  fetched has no reader yet, and its fetch's copy, which did wait for the compute queued
  before it (its memory's previous users), may still be in flight (a step started ahead of
  the use): the write is ordered after it (``after``: the unit's ``fill_event``). Before, with the wait, a forward
  that handed a unit's job over waited through ``stepped`` for the kernels queued before it,
  and a deferred step started ahead of its unit's use (zero/steps_ahead.py) could not land
  before the compute of the unit in use ended: the GPU idled through each copy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from infinity.storage.transfers import CopyEvent, DeviceCopies

if TYPE_CHECKING:   # records holds a DeviceCopyWrites per step job
    from infinity.optim.records import StepRun

__all__ = ["DeviceCopyWrites", "flat_rounded_by_kernel", "host_temporary",
           "kernel_writes_every_element", "IN_FLIGHT"]

IN_FLIGHT = 1
"""Device-copy writes a job keeps in flight while its next sub-group is stepped: one copy beside
one kernel. So at most two sub-groups' 16-bit temporaries are alive, against one before (a
pageable one, freed after its synchronous copy); see [Note: the device copy written behind the
step]."""


def flat_rounded_by_kernel(unit, grad, runs: list[StepRun], start: int, end: int) -> bool:
    """Whether the kernel may round the updated master straight into the unit's device copy
    over [start, end) (see [Note: the kernel rounds into the device copy])."""
    return unit.flat.device.type == "cpu" and kernel_writes_every_element(grad, runs, start, end)


def kernel_writes_every_element(grad, runs: list[StepRun], start: int, end: int) -> bool:
    """Whether the kernel's 16-bit output over [start, end) is all its own: the gradient is one
    flat tensor (held per-parameter parts skip the gaps between parameters) and the runs cover
    the range (a parameter not stepped keeps its value)."""
    if not isinstance(grad, torch.Tensor):
        return False
    at = start
    for run in runs:          # sorted by start (AdamKernel.step_runs)
        if run.end <= at:
            continue
        if run.start > at:
            return False      # a parameter that is not stepped: its value comes from the master
        at = run.end
        if at >= end:
            return True
    return at >= end


def host_temporary(values: torch.Tensor, dtype: torch.dtype, pinned: bool,
                   fill: bool = True) -> torch.Tensor:
    """``values`` in ``dtype`` (rounded) in a fresh host tensor: the temporary the kernel then
    overwrites where it steps; ``pinned``: in page-locked memory, so that a GPU copies it on the
    host-to-device stream at the link's rate (see [Note: the device copy written behind the
    step]); not ``fill``: left uninitialized, for a kernel that writes every element
    (``kernel_writes_every_element``: a pass over 6 bytes a parameter saved)."""
    if not fill:
        return torch.empty(values.shape, dtype=dtype, pin_memory=pinned)
    if not pinned:
        return values.to(dtype, copy=True)
    out = torch.empty(values.shape, dtype=dtype, pin_memory=True)
    out.copy_(values)
    return out


@dataclass
class DeviceCopyWrites:
    """The device-copy writes of one step job still in flight: each copy's event and the
    temporary it reads (kept referenced until the event, whatever the allocator does)."""

    pending: list[tuple[CopyEvent, torch.Tensor]] = field(default_factory=list)

    def write(self, copies: DeviceCopies, flat: torch.Tensor, values: torch.Tensor,
              temporary: bool, filled: CopyEvent | None = None) -> bool:
        """Put host ``values`` into ``flat`` (a slice of the device copy), after ``filled``
        (the copy that filled the device copy, ``SteppedUnit.fill_event``); ``temporary``: they
        are the job's own (``host_temporary``, pinned where ``flat`` is on a GPU), else a buffer
        that may go back to its pool before a late copy reads it, so a copy is made first.
        True when ``flat`` holds them on return (copies that do not overlap compute), False
        when they land later (see [Note: the device copy written behind the step])."""
        if not copies.overlaps_compute:
            with torch.no_grad():
                flat.copy_(values)
            return True
        if not temporary:
            values = host_temporary(values, values.dtype, pinned=flat.device.type == "cuda")
        # every reader of the device copy ran before the job's gradient landed (the Note); the
        # copy that filled it may not have landed (a step started ahead of its unit's use)
        self.pending.append((copies.write_device(flat, values, after=filled), values))
        return False

    def settle(self, keep: int = IN_FLIGHT) -> float:
        """Wait (the calling thread) until at most ``keep`` writes are in flight, the oldest
        first; the seconds it waited."""
        start = time.perf_counter()
        while len(self.pending) > keep:
            event, _ = self.pending[0]
            event.wait()
            self.pending.pop(0)
        return time.perf_counter() - start

    def land(self) -> float:
        """Block the calling thread (the step stream) until every write of the job is in the
        device copy; the next reader then needs no wait of its own. The seconds it waited."""
        return self.settle(0)
