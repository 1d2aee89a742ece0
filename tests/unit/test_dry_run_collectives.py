"""The dry run's collectives (simulate/collectives.py) on the simulated clock: a
collective at use holds the training thread for its time; an all-gather issued ahead
(``overlap_comm``) runs on the network lane while the thread computes, and compute waits on its
handle only for what is left (the wait shows on the "compute waits" row, named); the lane serves
calls in issue order; a gather above the engine's bucket runs whole at its issue, as the
engine's; one rank moves nothing."""
from __future__ import annotations

import pytest
import torch

from infinity.simulate.clock import WAIT, SimClock
from infinity.simulate.collectives import COLLECTIVES, SimCollectives

META = torch.device("meta")


def _comm(world: int = 4, rate: float = 1e9, **kwargs) -> tuple[SimClock, SimCollectives]:
    clock = SimClock(spans=[])
    comm = SimCollectives(world, clock, rate, **kwargs)
    comm.unit_names = ["model.embed_tokens", "model.layers.0"]
    return clock, comm


def _flat(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 2, dtype=torch.bfloat16, device=META)


def test_a_gather_at_use_holds_the_thread_for_its_time() -> None:
    clock, comm = _comm()
    comm.all_gather(_flat(4_000_000), tag=1)        # 3/4 of 4e6 bytes cross: 3 ms
    assert clock.now == pytest.approx(3e-3) and comm.counters.comm_s == pytest.approx(3e-3)
    assert comm.counters.sent_bytes == 3_000_000
    assert (WAIT, "waits for the all-gather") in {(row, what) for row, *_, what in clock.spans}


def test_a_gather_issued_ahead_overlaps_compute_and_compute_waits_for_the_rest() -> None:
    clock, comm = _comm()
    handle = comm.all_gather_async(_flat(4_000_000), tag=1)
    assert clock.now == 0.0 and not handle.done() and comm.issued_ahead == 1
    clock.compute(2e-3, "forward model.embed_tokens")     # the gather runs meanwhile
    comm.compute_waits(handle)
    assert clock.now == pytest.approx(3e-3) and handle.done()
    assert comm.counters.comm_s == pytest.approx(1e-3)     # only the part not hidden
    rows = {(row, what) for row, *_, what in clock.spans}
    assert (COLLECTIVES, "all-gather ahead model.layers.0 2.9 MiB") in rows
    assert (WAIT, "waits for the all-gather of model.layers.0 issued ahead") in rows


def test_calls_are_served_in_issue_order() -> None:
    clock, comm = _comm()
    comm.all_gather_async(_flat(4_000_000), tag=1)       # on the lane until 3 ms
    comm.reduce_scatter(4_000_000)                        # queued behind it: 3 to 6 ms
    assert clock.now == pytest.approx(6e-3)


def test_a_gather_above_the_bucket_runs_whole_at_its_issue() -> None:
    clock, comm = _comm(gather_bucket_bytes=1_000_000)
    handle = comm.all_gather_async(_flat(4_000_000), tag=1)
    assert handle.done() and clock.now == pytest.approx(3e-3) and comm.issued_ahead == 0


def test_one_rank_moves_nothing() -> None:
    clock, comm = _comm(world=1)
    handle = comm.all_gather_async(_flat(4_000_000), tag=0)
    comm.compute_waits(handle)
    comm.all_gather(_flat(4_000_000))
    assert handle.done() and clock.now == 0.0 and clock.spans == []
    assert comm.all_gather_objects(5) == [5]


def test_bad_ranks_or_rates_are_refused_with_their_values() -> None:
    with pytest.raises(ValueError, match="0 ranks at 1.0 B/s"):
        SimCollectives(0, SimClock(), 1.0)
    with pytest.raises(ValueError, match="2 ranks at -1.0 B/s"):
        SimCollectives(2, SimClock(), -1.0)
