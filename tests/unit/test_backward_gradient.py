"""A unit's gradient of one backward (optim/backward_gradient.py): its phases, the transitions
the collector makes, the illegal ones raising, and the one ``release`` giving back each kind of
resource once, its copies waited for first (see [Note: the life of a backward gradient])."""
from __future__ import annotations

import pytest
import torch

from infinity.optim.backward_gradient import BackwardGradient, GradientOwners, GradPhase


class _Log:
    """The order in which owners were called: ("wait", n), ("slot", s), ("device", b, e, reads),
    ("room", n)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []


class _Copies:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def host_waits(self, events) -> None:
        self.log.calls.append(("wait", len(list(events))))


class _Pool:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def release(self, slot) -> None:
        self.log.calls.append(("slot", slot))


class _DevicePool:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def release(self, buffer, copied, reads=None) -> None:
        self.log.calls.append(("device", buffer, copied, reads))


class _Room:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def give(self, nbytes: int) -> None:
        self.log.calls.append(("room", nbytes))


class _DeviceBuffer:
    values = torch.zeros(8)


def _owners() -> tuple[GradientOwners, _Log]:
    log = _Log()
    return GradientOwners(_Copies(log), _Pool(log), _DevicePool(log), _Room(log)), log


SLOT, EVENT, COPIED = "slot", "event", "copied"


def _held() -> BackwardGradient:
    g = BackwardGradient("block.3")
    g.hold()
    g.held(0, torch.zeros(4), 16)
    return g


def _collecting() -> BackwardGradient:
    g = BackwardGradient("block.3")
    g.collect_into(torch.zeros(8), SLOT)
    g.first_write(0)
    g.copied(EVENT)
    return g


def _into_home() -> BackwardGradient:
    g = BackwardGradient("block.3")
    g.into_home()
    g.copied(EVENT)
    return g


def _on_device() -> BackwardGradient:
    g = BackwardGradient("block.3")
    g.on_device(_DeviceBuffer())
    g.first_write(0)
    g.copied(None)
    return g


def _reducing() -> BackwardGradient:
    """Reduced on the device, its copy out not yet issued: both buffers held."""
    g = _on_device()
    g.unwritten_zeroed()
    g.reduced_to(torch.zeros(4), SLOT)
    return g


def _reduced() -> BackwardGradient:
    g = _collecting()
    g.unwritten_zeroed()
    g.reduced(4)
    return g


def _sent() -> BackwardGradient:
    g = _reduced()
    g.send_home()
    return g


def _zeroed(g: BackwardGradient) -> BackwardGradient:
    """As the collector's zero_unwritten leaves a fresh buffer before its reduce."""
    if g.phase in (GradPhase.COLLECTING, GradPhase.ON_DEVICE):
        g.unwritten_zeroed()
    return g


MAKERS = {GradPhase.NONE: lambda: BackwardGradient("block.3"), GradPhase.HELD: _held,
          GradPhase.COLLECTING: _collecting, GradPhase.INTO_HOME: _into_home,
          GradPhase.ON_DEVICE: _on_device, GradPhase.REDUCED: _reduced, GradPhase.SENT: _sent}

# each verb and the phases it may leave (everything else raises)
CALLS = {
    "hold": (lambda g: g.hold(), {GradPhase.NONE, GradPhase.HELD}),
    "held": (lambda g: g.held(8, torch.zeros(2), 8), {GradPhase.HELD}),
    "collect_into": (lambda g: g.collect_into(torch.zeros(8), None), {GradPhase.NONE}),
    "into_home": (lambda g: g.into_home(), {GradPhase.NONE, GradPhase.INTO_HOME}),
    "on_device": (lambda g: g.on_device(_DeviceBuffer()), {GradPhase.NONE}),
    "first_write": (lambda g: g.first_write(4), {GradPhase.COLLECTING, GradPhase.INTO_HOME,
                                                  GradPhase.ON_DEVICE}),
    "copied": (lambda g: g.copied(EVENT), {GradPhase.COLLECTING, GradPhase.INTO_HOME,
                                           GradPhase.ON_DEVICE}),
    "unwritten_zeroed": (lambda g: g.unwritten_zeroed(), {GradPhase.COLLECTING,
                                                          GradPhase.ON_DEVICE}),
    "reduced": (lambda g: _zeroed(g).reduced(4), {GradPhase.COLLECTING}),
    "reduced_to": (lambda g: _zeroed(g).reduced_to(torch.zeros(4), None),
                   {GradPhase.ON_DEVICE}),
    "send_home": (lambda g: _zeroed(g).send_home(), {GradPhase.COLLECTING, GradPhase.REDUCED}),
    "finished": (lambda g: g.finished(), {GradPhase.NONE, GradPhase.COLLECTING,
                                          GradPhase.INTO_HOME, GradPhase.REDUCED}),
    "take": (lambda g: g.take(), {GradPhase.NONE, GradPhase.HELD, GradPhase.COLLECTING,
                                  GradPhase.INTO_HOME, GradPhase.REDUCED}),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("phase", list(GradPhase), ids=lambda p: p.value)
def test_each_verb_leaves_only_its_phases(call: str, phase: GradPhase) -> None:
    """A verb from a phase it may not leave raises, naming the unit, the phase and the call
    (an engine bug); from one it may, it goes through and the fields agree with the phase."""
    gradient = MAKERS[phase]()
    assert gradient.phase is phase
    verb, allowed = CALLS[call]
    if phase in allowed:
        verb(gradient)
        gradient.check()
        return
    with pytest.raises(RuntimeError) as raised:
        verb(gradient)
    message = str(raised.value)
    assert "block.3" in message and phase.value in message and call in message
    assert gradient.phase is phase                 # nothing moved


def test_the_collector_s_paths_through_the_phases() -> None:
    """Early step (held; a flat buffer), deferred into a resident home, through a slot sent
    home, several ranks on the host and on a device: the phases each path passes."""
    owners, log = _owners()
    held = _held()                                      # early step, CPU device
    assert held.hold() is held.parts and held.phase is GradPhase.HELD
    taken = held.take()
    assert taken.held_bytes == 16 and list(taken.values) == [0] and taken.slot is None
    assert held.phase is GradPhase.NONE and held.seen == 0 and held.held_bytes == 0

    home = _into_home()                                 # deferred, resident home
    assert home.first_write(0) is False                 # added into the home, never copied
    home.land_copies(owners.copies)
    assert log.calls == [("wait", 1)] and home.copies == []
    home.release(owners, forget=True)
    assert home.phase is GradPhase.NONE and home.seen == 0

    sent = _collecting()                                # deferred, NVMe home through a slot
    assert sent.first_write(0) is False and sent.first_write(4) is True
    assert sent.written == {0, 4}
    sent.unwritten_zeroed()
    assert sent.send_home() == SLOT and sent.phase is GradPhase.SENT
    assert sent.buffer is None and sent.slot is None

    host = _collecting()                                # several ranks on a CPU device
    buffer = host.buffer
    host.unwritten_zeroed()
    host.reduced(4)
    assert host.phase is GradPhase.REDUCED and host.buffer.data_ptr() == buffer.data_ptr()
    assert host.buffer.numel() == 4 and host.slot == SLOT

    device = _reducing()                                # several ranks on a GPU
    buffer = device.device
    assert device.phase is GradPhase.REDUCED and device.written is None
    shard = torch.zeros(4)
    device.copied_out(EVENT, COPIED, shard, owners.device_pool)
    assert device.device is None and device.copies == [EVENT]
    assert log.calls[-1] == ("device", buffer, COPIED, shard)
    device.check()
    with pytest.raises(RuntimeError, match="block.3: gradient copied out with no device"):
        device.copied_out(EVENT, COPIED, shard, owners.device_pool)


@pytest.mark.parametrize("phase, call", [
    (GradPhase.COLLECTING, lambda g: g.reduced(4)),
    (GradPhase.ON_DEVICE, lambda g: g.reduced_to(torch.zeros(4), None)),
    (GradPhase.COLLECTING, lambda g: g.send_home())], ids=["reduced", "reduced_to", "send_home"])
def test_a_fresh_buffer_read_before_its_gaps_are_zeroed_raises(phase: GradPhase, call) -> None:
    """Reduced or sent home with parameters still ``written``: what the buffer held before
    would be read (the collector's zero_unwritten comes first)."""
    gradient = MAKERS[phase]()
    with pytest.raises(RuntimeError, match="block.3: gradient .* before its unwritten"):
        call(gradient)
    assert gradient.phase is phase and gradient.written == {0}


def test_take_hands_everything_over_unwaited() -> None:
    gradient = _collecting()
    buffer, events = gradient.buffer, list(gradient.copies)
    taken = gradient.take()
    assert taken.values is buffer and taken.slot == SLOT and taken.landing == events
    assert gradient.phase is GradPhase.NONE and gradient.copies == [] and gradient.seen == 0
    done = torch.ones(4)
    assert _reduced().take(done).values is done        # a complete gradient finish made


@pytest.mark.parametrize("phase", list(GradPhase), ids=lambda p: p.value)
def test_release_gives_back_each_resource_once_after_the_copies(phase: GradPhase) -> None:
    """From any phase: the copies waited for first, then each resource back to its owner
    once; a second release gives nothing; the count of gradients stays unless forgotten."""
    owners, log = _owners()
    gradient = MAKERS[phase]()
    seen, copies = gradient.seen, len(gradient.copies)
    device, slot, held = gradient.device, gradient.slot, gradient.held_bytes
    gradient.release(owners)
    want = ([("wait", copies)] if copies else []) + \
        ([("device", device, None, None)] if device is not None else []) + \
        ([("slot", slot)] if slot is not None else []) + ([("room", held)] if held else [])
    assert log.calls == want
    assert gradient.phase is GradPhase.NONE and gradient.seen == seen
    assert (gradient.buffer, gradient.slot, gradient.device, gradient.parts,
            gradient.written, gradient.copies, gradient.held_bytes) == \
        (None, None, None, None, None, [], 0)
    gradient.release(owners, forget=True)
    assert log.calls == want and gradient.seen == 0


def test_release_of_a_reduce_cut_short_gives_both_buffers_back() -> None:
    """Reduced on the device, the copy out not issued (it raised): the device buffer goes
    back with no event, the host slot too."""
    owners, log = _owners()
    gradient = _reducing()
    device = gradient.device
    gradient.release(owners)
    assert log.calls == [("device", device, None, None), ("slot", SLOT)]


def test_a_wait_cut_short_keeps_the_copies_and_gives_nothing_back() -> None:
    owners, log = _owners()
    gradient = _collecting()

    def interrupted(events) -> None:
        raise KeyboardInterrupt
    owners.copies.host_waits = interrupted
    with pytest.raises(KeyboardInterrupt):
        gradient.release(owners)
    assert gradient.copies == [EVENT] and gradient.slot == SLOT and log.calls == []


def test_check_names_what_disagrees_with_the_phase() -> None:
    gradient = _collecting()
    gradient.parts = {}
    with pytest.raises(RuntimeError, match="block.3: gradient in phase collecting holds a flat "
                                           "buffer and held parts"):
        gradient.check()
    orphan = BackwardGradient("block.3")
    orphan.slot = SLOT
    with pytest.raises(RuntimeError, match="a slot without a buffer"):
        orphan.check()
