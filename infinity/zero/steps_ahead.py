"""Which units' deferred steps start before their use: on a GPU's copies, every unit whose
device copy is already on its way.

[Note: the deferred step runs ahead of the forward]
The deferred schedule steps a unit when the next forward fetches it (see [Note: the deferred step
lands at the next fetch] in optim/step_stream.py), and the forward waits for that unit's kernels.
Started only at the use, each unit's CPU Adam runs while the device has nothing queued: the
forward and the optimizer take turns, unit by unit. The dry run of the 0.49B model at 32 x 1024
tokens, 4 micro-batches a step on an H200 (tools/bench/gpu_profile.py's "accumulate" setup)
showed the first forward of every step waiting ~7.6 ms a unit for it, 65 ms of a 1.19 s step,
with the prefetched copies running beside that wait instead of beside compute.

Where copies overlap compute (a GPU's streams; the late copies of the tests; the dry run's
lanes), a step does not need its unit's device copy before it writes it: the kernel reads the
separate fp32 master on the host, and the 16-bit result goes to the device copy through the
same copies' owner, whose host-to-device copies run in the order issued (one stream; the late
copies' one thread; the dry run's lane). So once a unit's fetch has issued its copy to the device
(a prefetch's, ``Unit.advance_fetch`` or ``Unit._copy_home``) or the unit is fetched (kept for
reuse), the step's writes land after the fetched values, and its step may start at once: at each
use the coordinator starts the waiting steps of every such unit, the one prefetched for the next
use among them, and that unit's use waits for its kernels as any stepping unit's does. The
unit is held from then on (``UnitStatus.stepping``), so neither a release nor a cancelled
prefetch gives its device memory back while the step writes it. A fetch that needs the room of
such a prefetch waits for its step to land (the coordinator's backpressure), then cancels it.

Not ahead, as before:
- a CPU device (its copies are immediate: the kernel rounds into the fetched buffer, and compute
  and the Adam share the cores, so nothing would overlap);
- a unit without a separate master (the optimizer says so: ``step_ahead`` returns False);
- parameters sharded over ranks: the step must write the own shard before the gather sends it
  (see [Note: gathers issued ahead] in zero/gather_ahead.py), which a step running beside the
  prefetch could not promise;
- persistent units, stepped by the engine's own ``step_waiting_units``.
"""
from __future__ import annotations

from infinity.base.interrupts import deferred_interrupts
from infinity.storage.tiers import Residency
from infinity.zero.pass_state import UnitStatus
from infinity.zero.protocols import UnitStepper
from infinity.zero.unit import Unit

__all__ = ["start_steps_ahead", "device_copy_issued"]


def device_copy_issued(unit: Unit) -> bool:
    """The unit is fetched, or a prefetch has issued its copy to the device: a write issued on
    the same copies from now on lands after the fetched values."""
    return unit.residency == Residency.FETCHED or (
        unit.residency == Residency.FETCHING and unit.copy_event is not None)


def start_steps_ahead(stepper: UnitStepper, statuses: list[UnitStatus], copies) -> int:
    """Start the waiting deferred steps that may run before their unit's use (see the Note);
    the number started."""
    if not copies.overlaps_compute:
        return 0
    started = 0
    for unit in stepper.waiting_units():
        status = statuses[unit.index]
        if status.stepping or unit.persistent or unit.shards > 1 or \
                not device_copy_issued(unit):
            continue
        # held before its job can run (see the Note); a Ctrl-C waits until the unit's status
        # and the optimizer's jobs agree (held with a job, or neither)
        with deferred_interrupts("starting a step ahead"):
            status.stepping = True
            if stepper.step_ahead(unit):
                started += 1
            else:
                status.stepping = False
    return started
