"""The dry run's collectives: ``comm.collectives.Collectives`` on the simulated clock, rank 0 of
``world_size``, each collective a transfer on the network lane ("collectives" row).

Why: the dry run runs the engine's own ``Unit`` and ``Coordinator``, which call the collectives
through this interface, so that the step it predicts pays for the network where the engine's
does. A collective called at use (``all_gather``, ``reduce_scatter``) holds the training
thread until its end, as the engine's does. With ``overlap_comm`` the coordinator issues a
unit's all-gather ahead, at the use of the unit before it, or (NVMe homes) once that unit's
compute is queued (see [Note: gathers issued ahead] in zero/gather_ahead.py):
``all_gather_async`` queues it on the lane at once and returns a handle that fires at its end
on the clock, so a gather issued at a use runs while that unit computes (one issued after it
runs after it: compute here is the training thread's own, as on a CPU); compute
that reads the unit waits on the handle (``compute_waits``: the training thread's clock moves
to the gather's end, a wait labelled with it on the "compute waits" row). The lane serves the
calls in issue order, as gloo and NCCL run the calls of one group: a reduce-scatter issued
while a gather ahead is in flight starts after it.

A gather ahead that needs several calls in the engine (a buffer above the
``allgather_bucket_size``) runs whole at its issue there (``Collectives.all_gather_async``);
here too, from the same bucket (``engine.ranks.collective_bucket_bytes``).
"""
from __future__ import annotations

import torch

from infinity.comm.collectives import CommCounters, gather_split
from infinity.simulate.clock import WAIT, Lane, SimClock
from infinity.storage.transfers import DONE, CopyEvent

__all__ = ["COLLECTIVES", "SimCollectives", "SimGather"]

COLLECTIVES = "collectives"
"""The network's row: all-gathers (at use or ahead) and reduce-scatters."""


class SimGather:
    """An all-gather issued ahead that is over at ``end`` on ``clock``; waiting for it moves the
    training thread's clock there (a wait on the "compute waits" row, labelled ``what``; like a
    collective at use, not counted as I/O wait)."""

    def __init__(self, clock: SimClock, end: float, what: str) -> None:
        self.clock, self.end, self.what = clock, end, what

    def done(self) -> bool:
        return self.clock.now >= self.end

    def wait(self) -> None:
        if self.end > self.clock.now:
            self.clock.record(WAIT, self.clock.now, self.end, f"waits for {self.what}")
            self.clock.now = self.end



class SimCollectives:
    """Rank 0 of ``world_size``: collectives take the ring's (N-1)/N of their bytes over the
    network lane at ``rate_Bps``; the training thread waits for each called at use, and for a
    gather issued ahead only where compute waits on its handle. ``gather_bucket_bytes``: the
    engine's all-gather bucket (a gather ahead above it runs at its issue)."""

    def __init__(self, world_size: int, clock: SimClock, rate_Bps: float, *,
                 gather_bucket_bytes: int = 1 << 62) -> None:
        if world_size < 1 or rate_Bps < 0:
            raise ValueError(f"simulated collectives over {world_size} ranks at {rate_Bps} B/s: "
                             "expected at least 1 rank and a rate >= 0")
        self.world_size = world_size
        self.rank = 0
        self.clock = clock
        self.gather_bucket_bytes = max(1, gather_bucket_bytes)
        # the network: gathers at use and ahead, reduce-scatters, in issue order; a gather
        # ahead overlaps the compute of the unit before the one it gathers
        self.lane = Lane(clock, rate_Bps, COLLECTIVES)
        self.counters = CommCounters()
        self.issued_ahead = 0    # all-gathers issued ahead (``all_gather_async``)
        # the units' names by index (a gather's tag): the timeline labels gathers ahead with
        # them (set by the dry run once the units are built)
        self.unit_names: list[str] = []

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def _schedule(self, nbytes: int, what: str) -> tuple[float, float]:
        """Queue a collective of a ``nbytes`` buffer on the lane: (the bytes that cross, its
        end)."""
        moved = int(nbytes * (self.world_size - 1) / self.world_size)
        end = self.lane.schedule(moved, what=f"{what} {moved / 2**20:.1f} MiB")
        self.counters.sent_bytes += moved
        self.counters.received_bytes += moved
        self.counters.calls += 1
        return moved, end

    def _move(self, nbytes: int, what: str) -> None:
        """A collective at use: the training thread waits for its end."""
        before = self.clock.now
        _, end = self._schedule(nbytes, what)
        self.clock.record(WAIT, before, end, f"waits for the {what}")
        self.clock.now = max(self.clock.now, end)
        self.counters.comm_s += self.clock.now - before

    def all_gather(self, output: torch.Tensor, tag: int | None = None) -> None:
        if self.active:
            self._move(output.numel() * output.element_size(), "all-gather")

    def all_gather_async(self, output: torch.Tensor, tag: int | None = None) -> CopyEvent:
        """``all_gather`` issued now and left in flight: the handle fires at its end on the
        clock (the engine's ``Collectives.all_gather_async``, with its bucket rule)."""
        if not self.active:
            return DONE
        shard, chunk = gather_split(output, self.world_size, self.gather_bucket_bytes)
        if shard > chunk:
            self.all_gather(output, tag=tag)      # several calls in the engine: whole, now
            return DONE
        name = self.unit_names[tag] if tag is not None and 0 <= tag < len(self.unit_names) \
            else f"unit {tag}"
        _, end = self._schedule(output.numel() * output.element_size(), f"all-gather ahead {name}")
        self.issued_ahead += 1
        return SimGather(self.clock, end, f"the all-gather of {name} issued ahead")

    def compute_waits(self, handle: CopyEvent) -> None:
        """Compute that reads a gather issued ahead starts at its end (the wait counts as
        collective time, as the engine's)."""
        before = self.clock.now
        handle.wait()
        self.counters.comm_s += self.clock.now - before

    def all_gather_objects(self, value):
        """Every rank's ``value`` (the simulated ranks are alike: this one's, ``world_size``
        times); no time (a few bytes, once at construction)."""
        return [value] * self.world_size

    def reduce_scatter(self, nbytes: int) -> None:
        if self.active:
            self._move(nbytes, "reduce-scatter")
