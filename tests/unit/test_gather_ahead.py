"""The rule that picks a unit's gather to issue ahead (zero/gather_ahead.py ``AheadGathers``)
and the late gathers that prove its waits (comm/ahead.py ``LateGathers``), without ranks: the
two-rank runs are tests/distributed/test_gather_ahead_ranks.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infinity.comm.ahead import LateGathers, WorkGather
from infinity.storage.tiers import Tier
from infinity.zero.gather_ahead import AheadGathers
from infinity.zero.pass_state import UnitStatus


def _units(n: int = 4, nbytes: int = 100, home: Tier = Tier.HOST) -> list:
    return [SimpleNamespace(index=i, nbytes=nbytes, params_sharded=True, persistent=False,
                            gathered_ahead=False, param_home=home) for i in range(n)]


def test_the_next_unit_of_the_recorded_order_is_chosen() -> None:
    units = _units()
    rule = AheadGathers(units, enabled=True, room=None)
    statuses = [UnitStatus() for _ in units]
    assert rule.choose(0, [1, 2], statuses, backward=False) == 1
    assert rule.choose(0, [], statuses, backward=False) is None          # order being learned
    assert rule.choose(1, [1, 2], statuses, backward=False) is None      # the same unit again
    statuses[1].users = 1
    assert rule.choose(0, [1, 2], statuses, backward=False) is None      # in use: gathered
    statuses[1].users = 0
    units[1].persistent = True
    assert rule.choose(0, [1, 2], statuses, backward=False) is None      # never gathered
    assert AheadGathers(units, enabled=False, room=None).choose(
        0, [2], statuses, backward=False) is None


def test_a_unit_homed_on_nvme_is_gathered_ahead_only_after_the_unit_before_it() -> None:
    """Its shard comes from a read that may not have landed: made current at the use of the
    unit before it, that read would run before that unit's compute instead of beside it (the
    1T dry run with fast drives: 95.9 s -> 156.6 s). So it is chosen only at the point after
    that unit's kernels are queued (``after``), and a host or device home only at the use."""
    statuses = [UnitStatus() for _ in range(4)]
    for home, at_use, after in ((Tier.NVME, None, 1), (Tier.HOST, 1, None),
                                (Tier.DEVICE, 1, None)):
        rule = AheadGathers(_units(home=home), enabled=True, room=None)
        for backward in (False, True):
            assert rule.choose(0, [1, 2], statuses, backward=backward) == at_use, home
            assert rule.choose(0, [1, 2], statuses, backward=backward, after=True) == after, home
    # mixed homes: decided per unit, from the unit's home only
    units = _units()
    units[1].param_home = Tier.NVME
    rule = AheadGathers(units, enabled=True, room=None)
    assert rule.choose(0, [1, 2], statuses, backward=False) is None
    assert rule.choose(0, [1, 2], statuses, backward=False, after=True) == 1
    assert rule.choose(1, [2, 3], statuses, backward=False) == 2
    assert rule.choose(1, [2, 3], statuses, backward=False, after=True) is None
    # the rules of the use hold after too: not the same unit, not one in use, not persistent,
    # not one a pre-backward hook of this backward fetched (its ops may still read it)
    rule = AheadGathers(_units(home=Tier.NVME), enabled=True, room=None)
    assert rule.choose(1, [1, 2], statuses, backward=False, after=True) is None
    statuses[1].users = 1
    assert rule.choose(0, [1, 2], statuses, backward=False, after=True) is None
    statuses[1] = UnitStatus()
    statuses[1].fetched_for_backward()
    assert rule.choose(0, [1, 2], statuses, backward=False, after=True) == 1
    assert rule.choose(0, [1, 2], statuses, backward=True, after=True) is None
    rule.units[2].persistent = True
    assert rule.choose(1, [2], [UnitStatus() for _ in range(4)], backward=False,
                       after=True) is None


def test_after_its_kernels_the_unit_before_counts_in_the_room_only_if_held() -> None:
    """At the point after unit 0's kernels were queued its buffer is let go (forward post-hook,
    backward done) unless a hook still holds it: room for the next unit and one held unit."""
    units = _units(home=Tier.NVME)
    statuses = [UnitStatus() for _ in units]
    rule = AheadGathers(units, enabled=True, room=200)
    statuses[3].users = 1
    assert rule.choose(0, [1], statuses, backward=False, after=True) == 1
    statuses[0].users = 1           # a module call of unit 0 still in progress (nested)
    assert rule.choose(0, [1], statuses, backward=False, after=True) is None


def test_room_counts_what_the_hooks_hold_never_what_is_free_now() -> None:
    units = _units()
    statuses = [UnitStatus() for _ in units]
    # the current unit and the next one fit in 200 bytes; a third held unit does not
    assert AheadGathers(units, enabled=True, room=200).choose(
        0, [1], statuses, backward=False) == 1
    statuses[3].users = 1
    assert AheadGathers(units, enabled=True, room=200).choose(
        0, [1], statuses, backward=False) is None
    statuses[3].users = 0
    statuses[2].fetched_for_backward()      # a unit the backward may still read
    assert AheadGathers(units, enabled=True, room=200).choose(
        0, [1], statuses, backward=False) == 1
    assert AheadGathers(units, enabled=True, room=200).choose(
        0, [1], statuses, backward=True) is None
    units[2].gathered_ahead, statuses[2] = True, UnitStatus()
    assert AheadGathers(units, enabled=True, room=200).choose(
        0, [1], statuses, backward=False) is None


class _Work:
    """A collective that already ran: copies ``gathered`` into ``out`` at once."""

    def __init__(self, out: torch.Tensor, gathered: torch.Tensor) -> None:
        out.copy_(gathered)

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def _late_gather(late: LateGathers, output: torch.Tensor, gathered: torch.Tensor):
    return late.all_gather(output, (0, 4), lambda out, own: WorkGather(
        _Work(out, gathered), lambda exc: exc))


def test_late_gathers_land_only_after_the_wait() -> None:
    late = LateGathers(seed=3)
    gathered = torch.arange(8, dtype=torch.float32)
    output = torch.zeros(8)
    output[:4] = gathered[:4]               # the own shard
    handle = _late_gather(late, output, gathered)
    assert torch.equal(output[:4], gathered[:4])
    assert torch.isnan(output[4:]).all()    # read without the wait: NaN, every time
    assert not handle.done()
    handle.wait()
    assert handle.done() and torch.equal(output, gathered)
    assert (late.issued, late.landed, late.lost) == (1, 1, 0)


def test_a_late_gather_into_memory_given_back_is_lost() -> None:
    late = LateGathers(seed=3)
    gathered = torch.arange(8, dtype=torch.float32)
    output = torch.zeros(8)
    handle = _late_gather(late, output, gathered)
    output.untyped_storage().resize_(0)     # released before its gather landed
    handle.wait()
    assert (late.landed, late.lost) == (0, 1)


class _DroppedUnit(SimpleNamespace):
    """A unit with a gather issued ahead whose wait raises ``fails`` (None: it lands)."""

    def drop_gather(self) -> None:
        self.gathered_ahead = False
        if self.fails is not None:
            raise self.fails


def test_a_failing_drop_drops_every_gather_then_raises_the_first() -> None:
    first, second = RuntimeError("gather 1 lost a rank"), RuntimeError("gather 3 lost a rank")
    units = [_DroppedUnit(index=i, name=f"u{i}", nbytes=100, params_sharded=True,
                          persistent=False, gathered_ahead=i > 0, param_home=Tier.HOST,
                          fails={1: first, 3: second}.get(i)) for i in range(4)]
    rule = AheadGathers(units, enabled=True, room=None)
    let_go: list[int] = []
    with pytest.raises(RuntimeError) as raised:
        rule.drop([UnitStatus() for _ in units], let_go.append)
    assert raised.value is first
    assert any("u3" in note and "gather 3 lost a rank" in note for note in raised.value.__notes__)
    assert not any(u.gathered_ahead for u in units)
    assert let_go == [1, 2, 3] and rule.dropped == 3


def test_abandon_pass_lets_the_pass_go_when_a_drop_fails() -> None:
    from infinity.zero.coordinator import Coordinator

    failure = RuntimeError("a gather issued ahead failed")

    def drop(statuses, let_go) -> None:
        raise failure
    released: list[int] = []
    reaped: list[bool] = []
    coordinator = SimpleNamespace(
        _call_inputs={}, _status=[UnitStatus() for _ in range(3)], units=_units(3),
        reset_backward_state=lambda: None, ahead=SimpleNamespace(drop=drop),
        reap=lambda: reaped.append(True), _release_or_keep=released.append)
    coordinator._status[1].users = 1      # a module call the failed pass left counted
    with pytest.raises(RuntimeError) as raised:
        Coordinator.abandon_pass(coordinator)
    assert raised.value is failure
    assert reaped == [True] and released == [0, 1, 2]
    assert all(s.users == 0 for s in coordinator._status)
