"""Which unit's all-gather is issued ahead of its use (``overlap_comm``), decided the same way
on every rank; the stage-3 coordinator (zero/coordinator.py) does the fetching and holding.

Why: with parameters sharded over ranks a unit's all-gather ran at the moment of use, on the
training thread, after the compute of the unit before it: compute stalled for every gather. A
gather issued at the previous unit's use runs on gloo's thread (or NCCL's stream) while that
unit computes, and its use only waits on the handle.

[Note: gathers issued ahead]
The coordinator issues the all-gather of the next unit n of the recorded order of the pass
(``Trace.upcoming()[0]``), when ``choose`` says so, at one of two points every rank reaches in
the same order (see [Note: collective order] in comm/collectives.py), by n's param home:
- host or device home: at the use of unit k from a hook (a module's forward pre-hook or its
  pre-backward hook), after k's own gather (at use, or waited on if it was issued ahead), so
  that n's gather runs while k computes;
- NVMe home: once k's kernels are queued -- in a forward, k's forward post-hook (after k was
  released or kept); in a backward, where k's backward is done (its last gradient, or its
  inputs' gradient: ``Coordinator._maybe_finish``), after the optimizer's
  ``on_unit_backward_done`` issued k's reduce-scatter, so that at this point every rank issues
  k's reduce-scatter, then n's gather. Only while k is the last unit used (``Trace.after``):
  a unit whose backward is done only after the next unit's pre-backward hook ran (frozen
  parameters: its inputs' gradient comes after that hook) gets none there, or the read of the
  unit after the next would be waited for before the next one computes.
At that point the coordinator makes n's own shard current (a prefetch in flight is waited for,
a read not issued is issued now, a waiting deferred step runs on it, exactly as at a use) and
issues n's all-gather with ``Unit.gather_ahead``. The choice reads only what is the same on
every rank:
- the recorded order (the hooks' calls, identical on the ranks or check_same_sequence stops the
  run), the units' sizes, kinds (sharded, persistent) and param homes (config facts), and what
  the hooks did so far (module calls in progress, units held for the backward, gathers ahead
  not yet used);
- room: the units the hooks hold (k too at its use; after its kernels, only if a hook still
  holds it) and n, against the device budget less what it holds outside the units' buffers,
  the smallest over the ranks (agreed once at construction: ``agreed_unit_room``), never the
  memory free now.
It never reads what timing decides: whether n's prefetch was issued, found a slot or landed,
whether a background step landed, which units are kept for reuse. Those only decide how long
the ahead point waits for n's shard, never whether a collective is issued. So every rank issues
the same gathers ahead at the same places in its sequence.

From the ahead gather to its use the unit is held: its buffer is not released, evicted or
reused (``Unit.release`` refuses while ``gather_event`` is set). At its use compute waits on
the handle (``Collectives.compute_waits``: on a GPU the compute stream waits on the gather's
event, never on the whole device), and a step that ran on its own shard since (the unit's
``stale``) gathers it again at use, as before. A gather ahead that no use waits on (the pass
ended, diverged from the recorded order, or raised) is dropped at the pass boundary: waited on,
then the unit is let go as any other. Gathers are issued at use instead (in the same order on
every rank) during a pass whose order is still being recorded (the first of each kind, or after
a divergence), for units that are in use already or persistent, for the first unit of each
pass, for a unit that is k itself, and, at the point after k's kernels in a backward, for a
unit a pre-backward hook of this backward fetched whose backward is not done (its ops may still
read the buffer the gather rewrites).

How NVMe homes are done: making n current waits for n's shard. From a host or device home that
is a copy at the link's rate (issued by prefetch already, or now), so it may come before k
computes. From NVMe it is a read that may not have landed, and waited for at k's use it ran
before k's compute was queued -- where the step is bound by the drives that serialized read(n)
before compute(k), the very overlap prefetch exists for (the 1T dry run with drives that keep
up went from 95.9 s to 156.6 s). Waiting only if the read landed would read timing; the home is
a config fact. So such a unit's point is after k's kernels are queued: the training thread
waits for n's read there (on a GPU while k's kernels run), then issues n's gather, which n's
use waits on as for host homes. On a CPU device compute is synchronous: the read is waited for
at k's point instead of at n's use, with only non-unit modules between (in a backward, the ops
of k after its last parameter's gradient), so nothing is slower or faster. On a GPU the gather
overlaps k's compute only if the collective stream does not wait for k's kernels:
``Collectives.all_gather_async`` makes it wait on everything the compute stream queued before
the issue (the own shard's copy, and the last reads of memory the buffer may reuse: k's own,
released just before, among them), k's kernels included, so today it starts after them, as at
use; overlapping them needs comm to wait on the copy's event only and n's buffer to take no
memory k's kernels still read. The dry run issues gathers as the engine does, on its simulated
clock (simulate/collectives.py), where compute is the training thread's own: at k's point k's
compute is over, and the step is no longer than with these gathers at use (on the 1T plans,
the same).
"""
from __future__ import annotations

from collections.abc import Callable

from infinity.storage.tiers import Tier
from infinity.zero.pass_state import UnitStatus
from infinity.zero.unit import Unit


def agreed_unit_room(units: list[Unit], manager, comm) -> int | None:
    """Device bytes the non-persistent units' buffers may hold at once, the smallest over the
    ranks (None: no rank's device budget has a limit): the budget less what it holds outside
    those buffers (persistent units, device stores: all made at construction, before this).
    Agreed so that the room rule gives the same answer on every rank (a budget derived from a
    GPU's free memory differs between them); every rank calls it at construction."""
    limit = manager.device_budget.limit
    room = None
    if limit is not None:
        attached = sum(u.flat.untyped_storage().nbytes() for u in units if not u.persistent)
        room = limit - (manager.device_cache.in_use_bytes() - attached)
    rooms = comm.all_gather_objects(room) if comm.active else [room]
    known = [x for x in rooms if x is not None]
    return min(known) if known else None


class AheadGathers:
    """The rule of [Note: gathers issued ahead] for ``units``; ``room``: the device bytes for
    non-persistent units' buffers agreed over the ranks (``agreed_unit_room``; None:
    unlimited); ``enabled``: ``overlap_comm``."""

    def __init__(self, units: list[Unit], enabled: bool, room: int | None) -> None:
        self.units = units
        self.enabled = enabled and any(u.params_sharded for u in units)
        self.room = room
        self.issued = 0      # gathers issued ahead
        self.issued_after = 0   # of those, NVMe-homed units' (issued after a unit's kernels)
        self.dropped = 0     # of those, let go unused (the pass ended first)

    @classmethod
    def for_run(cls, units: list[Unit], manager, comm, overlap_comm: bool) -> AheadGathers:
        """The rule of a run: on with ``overlap_comm`` and sharded parameters over ranks (then
        the room is agreed here, a collective every rank makes at construction)."""
        on = overlap_comm and comm is not None and comm.active and \
            any(u.params_sharded for u in units)
        return cls(units, on, agreed_unit_room(units, manager, comm) if on else None)

    def choose(self, current: int, upcoming: list[int], statuses: list[UnitStatus],
               backward: bool, after: bool = False) -> int | None:
        """The unit whose gather to issue now (None: none). At ``current``'s use (``after``
        False) a unit whose home keeps up; once ``current``'s kernels are queued (``after``:
        its forward post-hook, or its backward done: counted in the room only if the hooks
        still hold it) an NVMe-homed unit. ``upcoming``: the recorded order from here;
        ``backward``: a backward pass is running (its fetched units are held)."""
        if not self.enabled or not upcoming:
            return None
        uid = upcoming[0]
        unit, status = self.units[uid], statuses[uid]
        if uid == current or not unit.params_sharded or unit.persistent or \
                unit.gathered_ahead or status.users > 0 or self.home_keeps_up(unit) == after:
            return None
        if after and backward and status.backward_may_read:
            return None     # fetched by an earlier pre-backward hook, its ops may still read it
        if self.room is not None and \
                self.held_bytes(None if after else current, statuses, backward) + \
                unit.nbytes > self.room:
            return None
        return uid

    @staticmethod
    def home_keeps_up(unit: Unit) -> bool:
        """Whether ``unit``'s own shard may be made current at the use of the unit before it,
        before that unit's kernels are queued, without waiting on storage: its param home is
        on the host or the device (a copy at the link's rate), not NVMe. An NVMe-homed unit's
        shard comes from a read that may not have landed: made current there, that read would
        run before the compute of the unit before it (the 1T dry run with drives that keep up
        went from 95.9 s to 156.6 s), so its gather is issued ahead only once that unit's
        kernels are queued (``after``). The home is a config fact (``offload_param``,
        ``offload_optimizer``), the same on every rank."""
        return unit.param_home is not Tier.NVME

    def held_bytes(self, current: int | None, statuses: list[UnitStatus],
                   backward: bool) -> int:
        """Device bytes of the non-persistent units the hooks hold now (the same on every
        rank): ``current``, those in a module call or pinned, those gathered ahead, and in a
        backward those its pre-backward hooks fetched whose backward is not done."""
        return sum(u.nbytes for u, s in zip(self.units, statuses) if not u.persistent and (
            u.index == current or s.users > 0 or u.gathered_ahead
            or (backward and s.backward_may_read)))

    def gather_next(self, current: int, upcoming: list[int], statuses: list[UnitStatus],
                    backward: bool, make_current: Callable[[int], None]) -> None:
        """At ``current``'s use: issue the gather of the unit ``choose`` picks, after
        ``make_current`` fetched it with its own shard current (the coordinator's fetch, as at
        a use); the unit is held until its use waits on the gather."""
        uid = self.choose(current, upcoming, statuses, backward)
        if uid is None:
            return
        # the current unit's module call has not counted itself yet: a step of its landing
        # while the next one is fetched (a reap) must not let it go
        statuses[current].users += 1
        try:
            make_current(uid)
        finally:
            statuses[current].users -= 1
        self._issue(uid, statuses)

    def gather_after(self, done: int, upcoming: list[int], statuses: list[UnitStatus],
                     backward: bool, make_current: Callable[[int], None]) -> None:
        """Once ``done``'s kernels are queued (its forward post-hook, after its release; its
        backward done, after its reduce-scatter was issued): issue the gather of the
        NVMe-homed unit ``choose`` picks, after ``make_current`` waited for its read (on a GPU
        ``done``'s kernels run meanwhile); held until its use waits on the gather."""
        uid = self.choose(done, upcoming, statuses, backward, after=True)
        if uid is not None:
            make_current(uid)
            self._issue(uid, statuses)

    def _issue(self, uid: int, statuses: list[UnitStatus]) -> None:
        self.units[uid].gather_ahead()
        statuses[uid].stale = False
        self.issued += 1
        if not self.home_keeps_up(self.units[uid]):
            self.issued_after += 1

    def drop(self, statuses: list[UnitStatus], let_go: Callable[[int], None]) -> None:
        """Gathers issued ahead that no use waited on (a pass ended, diverged from its recorded
        order, or raised): wait for each, then ``let_go`` its unit (released or kept) unless
        something holds it. Called at pass boundaries, the same on every rank; issues no
        collective. A gather that failed (its wait raised) does not stop the others from being
        dropped and their units let go (a caller unwinding a failed pass must find none left in
        flight): the first failure is raised after the loop, the others noted on it."""
        errors: list[tuple[str, BaseException]] = []
        for unit in self.units:
            if not unit.gathered_ahead:
                continue
            try:
                unit.drop_gather()      # clears the handle first: the unit is no longer held
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                errors.append((unit.name, exc))
            self.dropped += 1
            if not statuses[unit.index].held:
                let_go(unit.index)
        if errors:
            name, first = errors[0]
            first.add_note(f"while dropping the all-gather issued ahead for unit {name}"
                           + "".join(f"; unit {n} failed too: {e!r}" for n, e in errors[1:]))
            raise first
