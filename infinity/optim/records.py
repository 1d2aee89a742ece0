"""The optimizer's records: one unit's Adam states, its sub-groups and step runs, a complete
gradient handed to a step, and the step job with its life. A leaf: the parts of the
partitioned optimizer (gradients, step stream, speculation, kernel) all import from here and
never from each other's homes. A unit's transient gradient of the backward in progress is its
own record below this one (optim/backward_gradient.py).

[Note: the life of a step job]
A step job is one unit's optimizer step on the step stream (optim/step_stream.py). Its phase is
one ``JobPhase``; each transition has one verb, checked against the phases it may leave:

  EXPECTED --make_ready--> READY --stepped--> STEPPED --landed--> LANDED --reaped--> REAPED
  EXPECTED --cancel--> CANCELLED
  EXPECTED, READY, STEPPED or CANCELLED --fail--> FAILED
  REAPED or FAILED --roll_back--> ROLLED_BACK

- ``StepStream.expect`` queues a job EXPECTED: its gradients are still being computed (early
  step, speculation) or its unit is not fetched yet (deferred step); its reads may go ahead, not
  its kernels. ``StepStream.submit`` queues one READY at once.
- ``make_ready`` (training thread): the gradients are complete and the unit is fetched and held.
- ``cancel`` (training thread): no gradients came (the backward ended or failed, the engine
  closes); nothing runs. The stream drops its reads and lets it go (``dropped``: its futures
  complete, it stays CANCELLED).
- ``stepped`` (stream): its last kernel ran; the device copy is current; ``stepped_future``
  completes. The optimizer's ``wait_stepped`` waits for this (a forward reads the unit, step()).
- ``landed`` (stream): its last write landed; ``landed_future`` completes.
- ``fail`` (stream): an I/O or kernel error; both futures raise it; states may be half-written.
- ``reaped`` (training thread, ``PendingSteps.reap``): its gradient's norm is counted, what the
  gradient held goes back, and its unit is handed out for release (unless a newer job of the
  unit holds it). A FAILED job is reaped by raising its error, once.
- ``roll_back`` (speculation): a speculated step's results are dropped; the unit's step counts
  go back (see [Note: speculative step] in optim/speculation.py).

Outside the optimizer these events have one verb each (``UnitStepper`` in zero/protocols.py):
``wait_stepped(unit)`` waits for STEPPED (every unit's with None); ``reap(wait)`` reaps the
LANDED jobs (``Wait.NONE``: those already landed, ``ONE``: at least one unit's, ``ALL``: every
job's) and hands out their units, also those reaped inside ``step()`` or a roll-back, which
stay in the pending steps until then; ``drain()`` is the end (close): what never started is
cancelled, the rest reaped, failures logged. The coordinator's ``reap``/``drain`` release the
units handed out; ``Engine.flush`` fetches the units deferred steps wait for, then reaps with
``Wait.ALL``.
"""
from __future__ import annotations

import enum
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from infinity.optim.backward_gradient import BackwardGradient
from infinity.optim.device_copy import DeviceCopyWrites
from infinity.optim.held_room import HeldRoom
from infinity.planner.state_format import FP32_STATES, INT8_CHUNK, StateFormat
from infinity.storage.buffer_pool import BufferPool, Slot
from infinity.storage.host_adds import HostAdd, add_widened
from infinity.storage.manager import FlatStore
from infinity.storage.transfers import CopyEvent, DeviceCopies
from infinity.zero.protocols import SteppedUnit


class HomeGradient(enum.Enum):
    """A unit's gradient at home in the deferred schedule, from its first micro-step to its
    step (the clipping norm is summed once a cycle, at the boundary micro-step):

      NONE --kept--> KEPT --counted--> COUNTED      (a gradient arrived; at the boundary normed)
      COUNTED --uncounted--> KEPT                    (a second backward at the boundary recounts)
      any --cleared--> NONE                          (stepped, dropped, or a speculated step kept)

    A unit without one is not stepped (torch skips a parameter whose gradient is None)."""

    NONE = "none"
    KEPT = "kept"
    COUNTED = "counted"


@dataclass(eq=False)
class UnitOptimState:
    """The Adam states of one unit's range [lo, hi) of its trainable elements (``numel``
    elements each, in ``fmt``): the whole trainable range, or this rank's shard of it (see [Note: shards] in
    zero/unit.py). Ranges, sub-groups and step runs are in the unit's flat coordinates; a
    store's element i is the unit's element lo + i."""

    unit: SteppedUnit
    exp_avg: FlatStore
    exp_avg_sq: FlatStore
    master: FlatStore | None          # None: the parameter itself is the fp32 master
    grad_store: FlatStore | None      # deferred schedule only
    step: int = 0
    # [Note: parameters without a gradient]: steps taken by each trainable parameter (by entry
    # offset), and the parameters that received a gradient since the unit's last step
    param_steps: dict[int, int] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)
    # the transient gradient of the backward in progress, one object in phase NONE between
    # backwards (see [Note: the life of a backward gradient] in optim/backward_gradient.py)
    grad: BackwardGradient = field(default=None)  # type: ignore[assignment]  # __post_init__
    # deferred schedule: its gradient at home since its last step (see ``HomeGradient``)
    home_grad: HomeGradient = HomeGradient.NONE
    shard: tuple[int, int] | None = None   # [lo, hi); None: [0, unit.trainable_numel)
    # how m, v and the master are stored (planner/state_format.py); int8 moments have one fp32
    # scale per 2048-element block of the range, in host memory (``exp_avg_scales``...)
    fmt: StateFormat = FP32_STATES
    exp_avg_scales: FlatStore | None = None
    exp_avg_sq_scales: FlatStore | None = None

    def __post_init__(self) -> None:
        if self.grad is None:
            self.grad = BackwardGradient(self.unit.name)

    @property
    def has_grads(self) -> bool:
        """Gradients arrived since the unit's last step."""
        return self.home_grad is not HomeGradient.NONE

    @property
    def norm_counted(self) -> bool:
        """Its gradient is in the clipping norm of this cycle."""
        return self.home_grad is HomeGradient.COUNTED

    def keep_gradient(self) -> None:
        """A micro-step's gradient is at home (added to an earlier one's, if any)."""
        if self.home_grad is HomeGradient.NONE:
            self.home_grad = HomeGradient.KEPT

    def count_norm(self) -> None:
        """Its gradient is summed into this cycle's clipping norm."""
        if self.home_grad is HomeGradient.NONE:
            raise RuntimeError(f"{self.unit.name}: a gradient counted in the norm before any "
                               "arrived (the optimizer's cycle ran out of order)")
        self.home_grad = HomeGradient.COUNTED

    def uncount_norm(self) -> None:
        """The norm is summed again (a second backward at the boundary)."""
        if self.home_grad is HomeGradient.COUNTED:
            self.home_grad = HomeGradient.KEPT

    def clear_gradient(self) -> None:
        """Its gradient was stepped, dropped, or taken by a kept speculated step."""
        self.home_grad = HomeGradient.NONE

    @property
    def lo(self) -> int:
        return 0 if self.shard is None else self.shard[0]

    @property
    def hi(self) -> int:
        return self.unit.trainable_numel if self.shard is None else self.shard[1]

    @property
    def numel(self) -> int:
        """Elements of the range this rank steps (0: a shard past the trainable part)."""
        return self.hi - self.lo


@dataclass
class OptimTimers:
    """Seconds spent by the training thread in the optimizer (waiting for background steps
    included) and in gradient handling, and by the background early-step worker."""

    optimizer_s: float = 0.0
    grad_s: float = 0.0
    grad_wait_s: float = 0.0    # of grad_s: backward waiting for room for held gradients
    background_s: float = 0.0
    # of background_s: the Adam kernels, and the wait for device-copy writes to land (see
    # [Note: the device copy written behind the step] in optim/device_copy.py): what a profile
    # of the training thread cannot see of the step stream
    kernel_s: float = 0.0
    device_write_wait_s: float = 0.0

    def reset(self) -> None:
        self.optimizer_s = self.grad_s = self.grad_wait_s = self.background_s = 0.0
        self.kernel_s = self.device_write_wait_s = 0.0


class StepRun(NamedTuple):
    """A contiguous range [start, end) of one param group's parameters stepped together, all
    taking step ``step`` (from 1)."""

    group_index: int
    start: int
    end: int
    step: int


@dataclass(frozen=True)
class SubGroup:
    """An aligned chunk [start, end) of one unit's trainable range, stepped at once."""

    state: UnitOptimState
    start: int
    end: int


def sub_groups(state: UnitOptimState, numel: int) -> list[SubGroup]:
    """The state's range cut in chunks of ``numel`` elements (int8 moments: of a multiple of
    4096, so each chunk's codes start on a block edge and a 4 KiB boundary)."""
    lo, hi = state.lo, state.hi
    if state.fmt.moments == "int8":
        numel = max(INT8_CHUNK, numel // INT8_CHUNK * INT8_CHUNK)
    return [SubGroup(state, a, min(a + numel, hi)) for a in range(lo, hi, numel)]


def stepped_range(unit: SteppedUnit, sharded: bool) -> tuple[int, int]:
    """[lo, hi) of the unit's trainable range this rank steps: its shard of it (see [Note:
    shards] in zero/unit.py; empty past the trainable part), or all of it."""
    n = unit.trainable_numel
    if not sharded:
        return 0, n
    lo = min(unit.shard_start, n)
    return lo, min(unit.shard_start + unit.shard_numel, n)


def clipped_addends(addends: list[tuple[int, torch.Tensor]], x: int,
                    y: int) -> list[tuple[int, torch.Tensor]]:
    """The parts of ``addends`` (unit element, values) inside [x, y), as (offset from x,
    values)."""
    out = []
    for at, values in addends:
        lo, hi = max(x, at), min(y, at + values.numel())
        if lo < hi:
            out.append((lo - x, values[lo - at:hi - at]))
    return out


def add_addends(target: torch.Tensor, origin: int,
                addends: list[tuple[int, torch.Tensor]]) -> None:
    """Make the adds of ``addends`` (unit element, values) into ``target``, unit elements
    [origin, origin + numel), in order; parts outside it are not its."""
    for offset, part in clipped_addends(addends, origin, origin + target.numel()):
        add_widened(target[offset:offset + part.numel()], part)


def run_pieces(unit: SteppedUnit, runs: list["StepRun"], grad, start: int, end: int):
    """(run, x, y, gradient of [x, y)) for each step run's part of [start, end), a piece at a
    time (``grad_pieces``; the gradient indexed from ``start``): what a kernel steps."""
    for run in runs:
        a, b = max(run.start, start), min(run.end, end)
        if a < b:
            for x, y, g in grad_pieces(unit, grad, start, a, b):
                yield run, x, y, g


def grad_pieces(unit: SteppedUnit, grad: torch.Tensor | dict[int, torch.Tensor], origin: int,
                a: int, b: int):
    """(x, y, gradient of elements [x, y)) covering [a, b) of the unit: one piece of a flat
    gradient indexed from ``origin``, or per parameter from held parts (a parameter without a
    gradient steps with zeros, as in a zeroed flat buffer; the gaps between parameters, zero
    everywhere, are skipped)."""
    if isinstance(grad, torch.Tensor):
        yield a, b, grad[a - origin:b - origin]
        return
    for entry in unit.trainable_entries():
        x, y = max(a, entry.offset), min(b, entry.offset + entry.numel)
        if x >= y:
            continue
        part = grad.get(entry.offset)
        yield x, y, (torch.zeros(y - x) if part is None
                     else part[x - entry.offset:y - entry.offset])


def gather_gradient(unit: SteppedUnit, grad: torch.Tensor | dict[int, torch.Tensor],
                    origin: int, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
    """Elements [a, b) of the unit's gradient (``grad_pieces``' pieces) written into ``out``'s
    first b - a elements as one flat range, zeros in the gaps between parameters; returns that
    view. For a kernel or a write that needs a range whole where the gradient is held per
    parameter (a 16-bit part widens exactly into an fp32 ``out``). Only what no piece covers is
    zeroed (zeroing the whole range first was a memset of every stepped element: 1.9 GB a step
    for the int8 step of a 0.49B model): from each piece's end (``a`` before the first) to the
    next piece's start, and from the last piece's end to ``b``. That covers every element
    outside the pieces in any order of pieces: for such an element p, take the last piece (in
    order) ending at or before p; the span after it reaches the next piece's start, beyond p, or
    ``b``; with no such piece the span from ``a`` to the first piece's start holds p."""
    flat = out[:b - a]
    pieces = list(grad_pieces(unit, grad, origin, a, b))
    end = a
    for x, y, _ in pieces:
        if x > end:
            flat[end - a:x - a].zero_()
        end = y
    flat[end - a:].zero_()
    for x, y, g in pieces:
        flat[x - a:y - a].copy_(g)
    return flat


@dataclass(eq=False)
class CompleteGradient:
    """A unit's complete gradient, handed over to its early step: held parts or a flat host
    buffer, and the slot (of ``pool``) or held-room bytes (of ``room``) it holds. The step owns
    it from then on (the unit's state starts collecting the next backward's gradient) and gives
    it back after its last kernel.

    A flat buffer may still be landing: ``landing`` are the events of the device-to-host copies
    into it (of ``copies``) that nobody has waited for, handed over with it so that the step
    stream, not the training thread, waits for them (``landed``) before its first read, and
    ``give_back`` before the slot goes back (see [Note: gradients leave the device] in
    optim/gradients.py)."""

    values: torch.Tensor | dict[int, torch.Tensor]
    slot: Slot | None = None
    held_bytes: int = 0
    pool: BufferPool | None = None
    room: HeldRoom | None = None
    origin: int = 0      # the unit element a flat buffer's first element is (a shard's lo)
    copies: DeviceCopies | None = None
    landing: list[CopyEvent] = field(default_factory=list)
    # a resident gradient home stepped from in the last micro-batch's backward (see [Note:
    # the last micro-batch steps early] in optim/boundary_steps.py): at zero when given back,
    # so that the next cycle accumulates from zero; ``zeroed`` are the unit ranges the kernels
    # left at zero as they stepped (``zeroed_by_step``), the rest is zeroed by ``give_back``
    zero_at_give_back: bool = False
    zeroed: list[tuple[int, int]] = field(default_factory=list)
    # such a home's adds still to make, claimed from ``landing`` by ``landed`` to fold into the
    # step's kernel: (unit element, staged values), in the order they add (see [Note: the last
    # adds fold into the step] in optim/boundary_steps.py)
    addends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    on_give_back: Callable[[], None] | None = None

    def landed(self) -> None:
        """Block the calling thread (the step stream's) until every copy into the gradient is
        over (an add is made here, and a 16-bit reduced shard widened to fp32: see [Note:
        gradients reduced on the device] in optim/device_gradients.py); the wait before
        anything reads it. Once: later calls
        return at once."""
        if self.landing:
            if self.copies is None:
                raise RuntimeError(f"a gradient with {len(self.landing)} copies landing and no "
                                   "copies' owner to wait for them")
            if self.zero_at_give_back:
                self._claim_adds()
            # cleared once waited for: a wait cut short leaves them to ``give_back``'s, so
            # the slot never goes back under a copy still landing
            self.copies.host_waits(self.landing)
            self.landing = []

    def _claim_adds(self) -> None:
        """Take the adds into the home that no thread makes on its own (``HostAdd.claim``) as
        ``addends``, in order. Another such add that cannot be claimed (a part outside the
        home, a dtype the kernel does not read) is made where it stands, the adds claimed
        before it made first. An add the adder thread makes (or a copy) is made whenever its
        copy lands, so it must come before every claimed one (the collector never defers a
        unit's add after giving one to the adder: ``GradientCollector._folding_now``): after
        one, the order could not be kept, and the step is refused rather than wrong."""
        home = self.values
        lo, hi = home.data_ptr(), home.data_ptr() + home.numel() * home.element_size()
        while self.landing:
            event = self.landing[0]
            if not isinstance(event, HostAdd):
                if self.addends:
                    raise RuntimeError(
                        f"a gradient home (unit elements from {self.origin}) has an add made "
                        f"by the adder thread after {len(self.addends)} adds left to its step: "
                        "their order cannot be kept (the collector defers a unit's adds only "
                        "before any goes to the adder)")
                self.copies.host_waits([event])
            elif _claimable(event, home.dtype, lo, hi):
                staged = event.claim()
                if staged is not None:
                    at = (event.dst.data_ptr() - lo) // home.element_size() + self.origin
                    self.addends.append((at, staged))
            else:
                self._make_claimed()
                self.copies.host_waits([event])
            self.landing.pop(0)

    def _make_claimed(self) -> None:
        """Make the claimed adds into the home now, in order."""
        add_addends(self.values, self.origin, self.addends)
        self.addends = []

    def of(self, start: int, end: int) -> torch.Tensor | dict[int, torch.Tensor]:
        """Elements [start, end) of the unit: the flat buffer's slice, or all held parts
        (``grad_pieces`` cuts them)."""
        if isinstance(self.values, dict):
            return self.values
        return self.values[start - self.origin:end - self.origin]

    def zeroed_by_step(self, start: int, end: int) -> None:
        """The step's kernel left elements [start, end) of the unit at zero: ``give_back``
        does not zero them again."""
        self.zeroed.append((start, end))

    def free_parts_before(self, first: int | None) -> None:
        """Free the held parts that end at unit element ``first`` or before (None: all), the
        step's sub-groups still to come starting there: as the step goes and not at its end. A
        Llama layer's gradient at width 2048 is ~200 MB, and with two units' gradients waiting
        for their steps (the stream behind the backward) holding each whole until its last
        kernel made peak memory depend on how far behind it fell."""
        done = [offset for offset, part in self.values.items()
                if first is None or offset + part.numel() <= first]
        for offset in done:
            self.free_part(offset)

    def free_part(self, offset: int) -> None:
        """Free one held part (its sub-groups have been stepped)."""
        part = self.values.pop(offset)
        nbytes = min(part.numel() * part.element_size(), self.held_bytes)
        self.held_bytes -= nbytes
        if self.room is not None:
            self.room.give(nbytes)

    def give_back(self) -> None:
        """Give back what it holds (once; later calls do nothing), after its copies landed: a
        copy still landing would write into the slot's next user's bytes."""
        self.landed()
        self.addends = []      # a step that failed before its kernel: its gradient is dropped
        if self.on_give_back is not None:
            self.on_give_back()
            self.on_give_back = None
        if self.zero_at_give_back and isinstance(self.values, torch.Tensor):
            at = self.origin       # what no kernel zeroed (all of it after a step that failed)
            for start, end in sorted(self.zeroed) + [(self.origin + self.values.numel(),) * 2]:
                if start > at:
                    self.values[at - self.origin:start - self.origin].zero_()
                at = max(at, end)
            self.zeroed = []
        if self.slot is not None:
            self.pool.release(self.slot)
            self.slot = None
        if self.room is not None:
            self.room.give(self.held_bytes)
        self.held_bytes = 0
        self.values = {}


_FOLDED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what the kernel adds


def _claimable(add: HostAdd, dtype: torch.dtype, lo: int, hi: int) -> bool:
    """Whether ``add`` goes into the home [lo, hi) (bytes) of ``dtype`` as one contiguous
    part, from staging the kernel reads (an add already made is claimable: nothing to take)."""
    dst, staging = add.dst, add.staging
    return dst.dtype == dtype and dst.is_contiguous() and lo <= dst.data_ptr() and \
        dst.data_ptr() + dst.numel() * dst.element_size() <= hi and \
        (staging is None or staging.dtype in _FOLDED_DTYPES)


class JobPhase(enum.Enum):
    """Where a step job is in its life (see [Note: the life of a step job])."""

    EXPECTED = "expected"
    READY = "ready"
    STEPPED = "stepped"
    LANDED = "landed"
    REAPED = "reaped"
    CANCELLED = "cancelled"
    FAILED = "failed"
    ROLLED_BACK = "rolled back"


_QUEUED = (JobPhase.EXPECTED, JobPhase.READY)


@dataclass(eq=False)
class StepJob:
    """One unit's step in the stream (see [Note: the life of a step job])."""

    state: UnitOptimState
    groups: deque
    left: int                      # sub-groups not yet retired
    early: bool                    # gradient handed over (early step); else from its home
    phase: JobPhase = JobPhase.READY
    grad_scale: float = 1.0
    hyper: list[dict] | None = None   # per param group, fixed when the step was asked for
    gradient: CompleteGradient | None = None   # early step: handed over with the job
    # results go to the shadow extents (see [Note: speculative step] in optim/speculation.py)
    speculative: bool = False
    # the parameters (entry offsets) that got a gradient, None: all (see [Note: parameters
    # without a gradient] in optim/partitioned.py), and the runs the kernel steps (set when
    # the unit's step count advances for this job, at its first kernel)
    params: frozenset[int] | None = None
    runs: list[StepRun] | None = None
    # the squares of the gradient this job's kernels normed (early steps, speculated held
    # gradients), taken into the step's norm once (``take_sq_norm``)
    sq_norm: float = 0.0
    # a speculated step writes its gradient home (for a redo), or a roll-back rebuilds it
    gradient_home: bool = False
    error: BaseException | None = None    # the first error of its kernels or writes
    # its device-copy writes still in flight, landed before ``stepped`` (see [Note: the
    # device copy written behind the step] in optim/device_copy.py)
    device_writes: DeviceCopyWrites = field(default_factory=DeviceCopyWrites)
    stepped_future: Future = field(default_factory=Future)
    landed_future: Future = field(default_factory=Future)

    def _move(self, to: JobPhase, *allowed: JobPhase) -> None:
        if self.phase not in allowed:
            raise RuntimeError(f"step job of {self.state.unit.name}: {self.phase.value} -> "
                               f"{to.value} (allowed from {[a.value for a in allowed]})")
        self.phase = to

    # -- transitions (see [Note: the life of a step job]) ----------------------------------
    def make_ready(self) -> None:
        if self.phase is not JobPhase.FAILED:   # failed while expected: reap raises it
            self._move(JobPhase.READY, JobPhase.EXPECTED)

    def cancel(self) -> bool:
        """EXPECTED -> CANCELLED; False (nothing done) from any other phase."""
        if self.phase is not JobPhase.EXPECTED:
            return False
        self.phase = JobPhase.CANCELLED
        return True

    def stepped(self) -> None:
        self._move(JobPhase.STEPPED, JobPhase.READY)
        self.stepped_future.set_result(None)

    def landed(self) -> None:
        self._move(JobPhase.LANDED, JobPhase.STEPPED)
        self.landed_future.set_result(None)

    def dropped(self) -> None:
        """A cancelled job leaves the stream: its waiters go on (nothing ran)."""
        self._move(JobPhase.CANCELLED, JobPhase.CANCELLED)
        self.stepped_future.set_result(None)
        self.landed_future.set_result(None)

    def fail(self, error: BaseException) -> None:
        self._move(JobPhase.FAILED, JobPhase.EXPECTED, JobPhase.READY, JobPhase.STEPPED,
                   JobPhase.CANCELLED)
        self.error = self.error or error
        if not self.stepped_future.done():
            self.stepped_future.set_exception(self.error)
        self.landed_future.set_exception(self.error)

    def reaped(self) -> None:
        self._move(JobPhase.REAPED, JobPhase.LANDED)

    def roll_back(self) -> None:
        self._move(JobPhase.ROLLED_BACK, JobPhase.REAPED, JobPhase.FAILED)

    # -- questions -------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Its gradients are complete (READY or later, not cancelled)."""
        return self.phase not in (JobPhase.EXPECTED, JobPhase.CANCELLED)

    @property
    def cancelled(self) -> bool:
        return self.phase is JobPhase.CANCELLED

    @property
    def counted(self) -> bool:
        """The unit's step count advanced for this job (and was not given back)."""
        return self.runs is not None and self.phase is not JobPhase.ROLLED_BACK

    def take_sq_norm(self) -> float:
        """The squares its kernels summed, once (its kernels have run); 0 after."""
        sq, self.sq_norm = self.sq_norm, 0.0
        return sq
