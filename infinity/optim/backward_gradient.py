"""One unit's gradient of the backward in progress, as one object with an explicit phase: what
the collector (optim/gradients.py) holds for the unit between its first gradient and its
step, hand-over or drop, and the one ``release`` that gives it all back.

[Note: the life of a backward gradient]
A unit's state (``UnitOptimState.grad``) keeps one ``BackwardGradient`` for its whole life, in
phase NONE between backwards (one object, not one per backward: the count of gradients that
came, ``seen``, outlives a release -- a failed backward's partial gradient added into a
resident home is still this cycle's, see ``release`` -- and the step and the tests hold the
state, not the gradient). Its phase is one ``GradPhase``; each transition has one verb,
checked against the phases it may leave (a wrong one raises RuntimeError naming the unit, the
phase and the call: an engine bug, never a silent skip):

  NONE --hold--> HELD                     parts as autograd made them, bytes in the held room
                                          (early step, or a speculated one, on a CPU device)
  NONE --collect_into--> COLLECTING       a flat fp32 host buffer (a slot of the gradient pool,
                                          or a budgeted one outside it), copied/added into
  NONE --into_home--> INTO_HOME           copied/added straight into the unit's resident home
                                          (deferred schedule, one rank): nothing of its own
  NONE --on_device--> ON_DEVICE           a device buffer (several ranks on a GPU)
  COLLECTING --reduced--> REDUCED         averaged over the ranks on the host: the own shard at
                                          the buffer's front (several ranks on a CPU device)
  ON_DEVICE --reduced_to--> REDUCED       the own shard copied to a host buffer; the device
                                          buffer goes back at ``copied_out`` with the copy's event
  COLLECTING or REDUCED --send_home--> SENT   the buffer (and slot) left with its NVMe write
  any but ON_DEVICE and SENT --take--> NONE   moved out whole into a ``CompleteGradient``
  any --release--> NONE                   copies waited, slot, device buffer, held bytes back

``finished`` is what ``finish`` reads (not held parts, an unreduced device buffer or a buffer
sent home). A fresh buffer's ``written`` (the parameters copied into it, its gaps not yet
zeroed) is cleared by ``unwritten_zeroed`` (the collector's ``zero_unwritten``, when the unit's
backward is done); ``reduced``, ``reduced_to`` and ``send_home`` raise before it.

Invariants the phases carry (``check``, made at each transition into a phase): a flat host
buffer XOR held parts; a slot only with a host buffer (a slot's view); a device buffer only
ON_DEVICE, or REDUCED before its ``copied_out``; ``written`` only with a fresh buffer; nothing
held in NONE. The copies' events (``copies``) are waited for before the
buffer is read, written or given back: ``land_copies`` is that one wait, ``release`` makes it
first, ``take`` hands the events over unwaited (see [Note: gradients leave the device] in
optim/gradients.py: where each wait is, and why).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from infinity.optim.held_room import HeldRoom
from infinity.storage.buffer_pool import BufferPool, Slot
from infinity.storage.transfers import CopyEvent, DeviceCopies

if TYPE_CHECKING:
    from infinity.optim.device_gradients import DeviceGradient, DeviceGradientPool


class GradPhase(enum.Enum):
    """Where a unit's gradient of this backward is (see [Note: the life of a backward
    gradient])."""

    NONE = "none"
    HELD = "held"
    COLLECTING = "collecting"
    INTO_HOME = "into home"
    ON_DEVICE = "on device"
    REDUCED = "reduced"
    SENT = "sent"


class GradientOwners(NamedTuple):
    """Who each resource goes back to: the copies' owner (waits), the gradient slot pool, the
    device buffer pool (None: one rank, or a CPU device) and the held room. The collector's
    own, read at each call (tests swap its copies' owner)."""

    copies: DeviceCopies
    pool: BufferPool | None
    device_pool: DeviceGradientPool | None
    room: HeldRoom | None


class Taken(NamedTuple):
    """What ``take`` moves out: the values (held parts, or a flat buffer), the slot, the held
    bytes and the copies' events still landing."""

    values: torch.Tensor | dict[int, torch.Tensor] | None
    slot: Slot | None
    held_bytes: int
    landing: list[CopyEvent]


@dataclass(eq=False)
class BackwardGradient:
    """A unit's transient gradient of the backward in progress (see [Note: the life of a
    backward gradient]). Fields are read freely; they are written only by its verbs."""

    unit_name: str
    phase: GradPhase = GradPhase.NONE
    buffer: torch.Tensor | None = None    # the flat fp32 host buffer
    slot: Slot | None = None              # the gradient pool's slot ``buffer`` is a view of
    # offsets of the parameters copied into a fresh buffer (host or device; not zeroed up
    # front: what no gradient covered is zeroed when the unit is done, ``unwritten_zeroed``)
    written: set[int] | None = None
    # the events of the device-to-host copies into it not yet waited for
    copies: list[CopyEvent] = field(default_factory=list)
    device: DeviceGradient | None = None  # the device buffer (several ranks on a GPU)
    parts: dict[int, torch.Tensor] | None = None   # held parts, by entry offset
    held_bytes: int = 0                   # of ``parts``, counted in the held room
    seen: int = 0                         # gradients that came since the last forget

    # -- checks ----------------------------------------------------------------------------
    def _check(self, call: str, *allowed: GradPhase) -> None:
        if self.phase not in allowed:
            raise RuntimeError(
                f"{self.unit_name}: gradient {call} in phase {self.phase.value} (allowed in "
                f"{[a.value for a in allowed]}): the collector's calls ran out of order")

    def _zeroed(self, call: str) -> None:
        if self.written is not None:
            raise RuntimeError(f"{self.unit_name}: gradient {call} in phase {self.phase.value} "
                               "before its unwritten bytes were zeroed (it would be read "
                               "with what the buffer held before)")

    def check(self) -> None:
        """Raise if the fields disagree with the phase (the invariants of the note)."""
        p = self.phase
        bad = []
        if self.buffer is not None and self.parts is not None:
            bad.append("a flat buffer and held parts")
        if self.slot is not None and self.buffer is None:
            bad.append("a slot without a buffer")
        if self.device is not None and p not in (GradPhase.ON_DEVICE, GradPhase.REDUCED):
            bad.append("a device buffer")
        if self.written is not None and p not in (GradPhase.COLLECTING, GradPhase.ON_DEVICE):
            bad.append("parameters written without a fresh buffer")
        if p is GradPhase.NONE and (self.buffer is not None or self.parts is not None
                                    or self.held_bytes or self.copies):
            bad.append("resources held")
        if bad:
            raise RuntimeError(f"{self.unit_name}: gradient in phase {p.value} holds "
                               f"{', '.join(bad)}")

    # -- collecting ------------------------------------------------------------------------
    def hold(self) -> dict[int, torch.Tensor]:
        """NONE or HELD -> HELD: the held parts (a fresh dict at the first)."""
        self._check("hold", GradPhase.NONE, GradPhase.HELD)
        if self.parts is None:
            self.parts = {}
        self.phase = GradPhase.HELD
        self.check()
        return self.parts

    def held(self, offset: int, part: torch.Tensor, grown: int) -> None:
        """A part is held (``grown`` more bytes, already taken from the room)."""
        self._check("held", GradPhase.HELD)
        self.held_bytes += grown
        self.parts[offset] = part
        self.seen += 1

    def collect_into(self, buffer: torch.Tensor, slot: Slot | None) -> None:
        """NONE -> COLLECTING: a fresh host buffer (``slot``'s view, or budgeted)."""
        self._check("collect_into", GradPhase.NONE)
        self.buffer, self.slot, self.written = buffer, slot, set()
        self.phase = GradPhase.COLLECTING
        self.check()

    def into_home(self) -> None:
        """NONE or INTO_HOME -> INTO_HOME: gradients go straight into the resident home."""
        self._check("into_home", GradPhase.NONE, GradPhase.INTO_HOME)
        self.phase = GradPhase.INTO_HOME

    def on_device(self, device: DeviceGradient) -> None:
        """NONE -> ON_DEVICE: a device buffer taken from its pool."""
        self._check("on_device", GradPhase.NONE)
        self.device, self.written = device, set()
        self.phase = GradPhase.ON_DEVICE
        self.check()

    def first_write(self, offset: int) -> bool:
        """Whether a gradient of the parameter at ``offset`` is the first into a fresh buffer
        (copied over what the buffer held, not added); it is recorded as written."""
        self._check("first_write", GradPhase.COLLECTING, GradPhase.INTO_HOME,
                    GradPhase.ON_DEVICE)
        if self.written is None or offset in self.written:
            return False
        self.written.add(offset)
        return True

    def copied(self, event: CopyEvent | None) -> None:
        """A gradient was copied or added in (``event``: its device-to-host copy's)."""
        self._check("copied", GradPhase.COLLECTING, GradPhase.INTO_HOME, GradPhase.ON_DEVICE)
        if event is not None:
            self.copies.append(event)
        self.seen += 1

    def unwritten_zeroed(self) -> None:
        """What no gradient covered of the fresh buffer is zeroed: nothing more comes."""
        self._check("unwritten_zeroed", GradPhase.COLLECTING, GradPhase.ON_DEVICE)
        self.written = None

    # -- reduced over the ranks ------------------------------------------------------------
    def reduced(self, numel: int) -> None:
        """COLLECTING -> REDUCED: averaged in place; the own shard is the first ``numel``."""
        self._check("reduced", GradPhase.COLLECTING)
        self._zeroed("reduced")
        self.buffer = self.buffer[:numel]
        self.phase = GradPhase.REDUCED
        self.check()

    def reduced_to(self, buffer: torch.Tensor, slot: Slot | None) -> None:
        """ON_DEVICE -> REDUCED: the own shard goes to ``buffer``; the device buffer stays
        held until its copy out is issued (``copied_out``)."""
        self._check("reduced_to", GradPhase.ON_DEVICE)
        self._zeroed("reduced_to")
        self.buffer, self.slot = buffer, slot
        self.phase = GradPhase.REDUCED
        self.check()

    def copied_out(self, landing: CopyEvent, copied: CopyEvent, reads: torch.Tensor,
                   device_pool: DeviceGradientPool) -> None:
        """The shard's copy out (of ``reads``, a view of the device buffer) is issued: its
        host event is kept, the device buffer goes back to ``device_pool`` with the device
        copy's event."""
        self._check("copied_out", GradPhase.REDUCED)
        if self.device is None:
            raise RuntimeError(f"{self.unit_name}: gradient copied out with no device buffer")
        self.copies.append(landing)
        device, self.device = self.device, None
        device_pool.release(device, copied, reads)

    def finished(self) -> torch.Tensor | None:
        """The host buffer ``finish`` reads (None: the gradient is in the resident home, or
        none came): never held parts, an unreduced device buffer, or a buffer sent home."""
        self._check("finished", GradPhase.NONE, GradPhase.COLLECTING, GradPhase.INTO_HOME,
                    GradPhase.REDUCED)
        return self.buffer

    # -- leaving ---------------------------------------------------------------------------
    def land_copies(self, copies: DeviceCopies) -> None:
        """Every device-to-host copy into it is over: the one wait before the host reads it,
        writes it or gives its buffer back (see [Note: gradients leave the device] in
        optim/gradients.py). The events leave only once waited for: a wait cut short
        (Ctrl-C, a device error) leaves them to the next one."""
        if self.copies:
            copies.host_waits(self.copies)
            self.copies = []

    def hand_over_copies(self) -> list[CopyEvent]:
        """INTO_HOME (or NONE: none came): the events of the copies into the resident home move
        out unwaited, for the collector to wait before the home is read (``finish``; see
        [Note: gradients leave the device] in optim/gradients.py)."""
        self._check("hand_over_copies", GradPhase.NONE, GradPhase.INTO_HOME)
        events, self.copies = self.copies, []
        return events

    def send_home(self) -> Slot | None:
        """COLLECTING or REDUCED -> SENT: the buffer left with its NVMe write, which gives
        back the slot returned when it lands."""
        self._check("send_home", GradPhase.COLLECTING, GradPhase.REDUCED)
        self._zeroed("send_home")
        slot, self.slot, self.buffer = self.slot, None, None
        self.phase = GradPhase.SENT
        self.check()
        return slot

    def take(self, values: torch.Tensor | None = None) -> Taken:
        """-> NONE: everything moves out unwaited (the copies' events with it), for a step
        that owns it from here on; ``values`` replaces the buffer or parts (a complete
        gradient ``finish`` made). The count of gradients is forgotten."""
        self._check("take", GradPhase.NONE, GradPhase.HELD, GradPhase.COLLECTING,
                    GradPhase.INTO_HOME, GradPhase.REDUCED)
        if values is None:
            values = self.parts if self.parts is not None else self.buffer
        taken = Taken(values, self.slot, self.held_bytes, self.copies)
        self._clear()
        self.seen = 0
        return taken

    def release(self, owners: GradientOwners, *, forget: bool = False) -> None:
        """-> NONE from any phase, giving back what it holds, each once: its copies waited
        first (a copy still landing would write the next user's bytes), the device buffer
        to its pool (no copy out: a backward that failed before its reduce), the slot to its
        pool, the held bytes to the room. ``forget``: the gradients that came are stepped or
        dropped (``seen`` = 0); without, a gradient added into a resident home before a
        failed backward is still this cycle's (``drop_cycle`` zeroes it)."""
        self.land_copies(owners.copies)
        if self.device is not None:
            device, self.device = self.device, None
            owners.device_pool.release(device, None)
        if self.slot is not None:
            slot, self.slot = self.slot, None
            owners.pool.release(slot)
        if self.held_bytes:
            nbytes, self.held_bytes = self.held_bytes, 0
            owners.room.give(nbytes)
        self._clear()
        if forget:
            self.seen = 0

    def _clear(self) -> None:
        self.buffer = self.slot = self.written = self.device = self.parts = None
        self.copies = []
        self.held_bytes = 0
        self.phase = GradPhase.NONE
