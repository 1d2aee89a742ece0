"""Prefetch and reuse decisions on recorded traces (pure functions, no engine)."""
from infinity.zero.prefetch import PrefetchLimits, Trace, choose_prefetch, reuse_distance

SIZES = {0: 10, 1: 100, 2: 100, 3: 100, 4: 10}


def test_reuse_distance_counts_the_elements_run_before_the_next_use() -> None:
    order = [4, 3, 2, 1, 0]
    assert reuse_distance(4, order, SIZES.get) == 0          # needed next: distance 0, not "never"
    assert reuse_distance(2, order, SIZES.get) == 110
    assert reuse_distance(0, order, SIZES.get) == 310
    assert reuse_distance(7, order, SIZES.get) is None       # not used again


def test_trace_relearns_from_the_point_of_divergence() -> None:
    trace = Trace()
    trace.start_pass()
    for unit in (0, 1, 2, 3):
        trace.observe(unit)
    trace.start_pass()
    assert trace.upcoming() == [0, 1, 2, 3]
    assert trace.observe(0) and trace.observe(1)
    assert not trace.observe(3)                              # the model took another path
    assert trace.relearns == 1 and trace.order == [0, 1, 3] and trace.upcoming() == []


def test_after_a_unit_only_while_it_is_the_last_one_fetched() -> None:
    """The point after unit k's kernels gathers the unit right after k, never one further: a
    unit with frozen parameters is done only after the next unit's pre-backward hook, and
    gathering the one after that would wait for its read before the next unit computes."""
    trace = Trace()
    trace.start_pass()
    for unit in (3, 2, 1, 0):
        trace.observe(unit)
    assert trace.after(0) == []                              # still being recorded
    trace.start_pass()
    trace.observe(3)
    assert trace.after(3) == [2, 1, 0]
    trace.observe(2)                                         # 2's hook ran before 3 was done
    assert trace.after(3) == [] and trace.after(2) == [1, 0]
    trace.observe(1)
    trace.observe(0)
    assert trace.after(0) == []                              # the pass's last unit


def test_choose_prefetch_stays_in_order_within_the_budgets() -> None:
    limits = PrefetchLimits(bucket_numel=150, max_live_numel=400, max_units_ahead=4)
    released = {1, 2, 3}
    chosen = choose_prefetch([1, 2, 3], SIZES.get, released.__contains__, 0, limits)
    assert chosen == [1]                                     # 1 + 2 would pass the 150 bucket
    chosen = choose_prefetch([4, 1, 2], SIZES.get, released.__contains__, 0, limits)
    assert chosen == [1]                                     # 4 is already fetched: skipped
    chosen = choose_prefetch([1, 2], SIZES.get, released.__contains__, 350, limits)
    assert chosen == [1]                                     # the first one always goes


def _coordinator_over_fake_units(residencies: list, next_forward: list[int]):
    """A coordinator over units of 100 elements (and bytes) in a device budget of 300 bytes,
    with the given residencies (the non-released ones reserved in the budget) and the next
    forward's order; returns it, the units, and the indices of units released or cancelled, in
    order."""
    from types import SimpleNamespace

    import torch

    from infinity.base.budget import MemoryBudget
    from infinity.storage.device_cache import DeviceMemoryCache
    from infinity.storage.tiers import Residency
    from infinity.zero.coordinator import Coordinator
    from infinity.zero.pass_state import PassPhase

    budget = MemoryBudget("device", 300)
    manager = SimpleNamespace(device_budget=budget,
                              device_cache=DeviceMemoryCache(budget, torch.device("cpu")))
    gone: list[int] = []

    class FakeUnit(SimpleNamespace):
        def release(self, _manager) -> None:
            budget.release(self.nbytes)
            self.residency = Residency.RELEASED
            gone.append(self.index)

        def cancel_fetch(self, manager, _pool) -> None:
            self.release(manager)

    units = [FakeUnit(index=i, numel=100, nbytes=100, persistent=False, residency=residency,
                      trainable_entries=lambda: [])
             for i, residency in enumerate(residencies)]
    coordinator = Coordinator(units, [], manager, None, PrefetchLimits(100, 400, 1000))
    budget.reserve(100 * sum(u.residency is not Residency.RELEASED for u in units), "units")
    coordinator._phase = PassPhase.IDLE
    coordinator.traces["train_fwd"].order = next_forward
    return coordinator, units, gone


def test_kept_units_are_evicted_needed_last_first() -> None:
    """A unit needed right next (distance 0) is the last to go, not taken for "never used"."""
    from infinity.storage.tiers import Residency

    fetched, released = Residency.FETCHED, Residency.RELEASED
    coordinator, _, gone = _coordinator_over_fake_units(
        [fetched, fetched, fetched, released], next_forward=[0, 3, 1, 2])   # 0 first, 2 last
    coordinator._room.kept = {0, 1, 2}
    coordinator._room.evict_kept(200)                        # room for 2 units: evict 2, then 1
    assert gone == [2, 1] and coordinator._room.kept == {0}


def test_units_in_flight_count_against_the_bucket_so_repeated_calls_do_not_run_ahead() -> None:
    """The hooks ask for prefetches at every unit: what is already fetched or in flight ahead of
    use must count, or each call pushes the frontier one unit further (in a 18-layer model it
    ran six layers ahead of the backward, filling the device pool)."""
    limits = PrefetchLimits(bucket_numel=150, max_live_numel=10_000, max_units_ahead=4)
    released = {1, 2, 3}
    order = [1, 2, 3]
    assert choose_prefetch(order, SIZES.get, released.__contains__, 0, limits) == [1]
    released.discard(1)             # 1 is in flight now
    for _ in range(3):              # more hooks fire before 1 is used: nothing more starts
        assert choose_prefetch(order, SIZES.get, released.__contains__, 100, limits) == []
    # once 1 is in use the next call looks from 2 on, and 2 goes
    assert choose_prefetch(order[1:], SIZES.get, released.__contains__, 100, limits) == [2]


def test_kept_units_do_not_count_as_in_flight() -> None:
    """A unit kept for reuse is ready, and nothing is in flight for it: the units behind it are
    still prefetched within the bucket (the first units of the backward are the last of the
    forward, kept)."""
    limits = PrefetchLimits(bucket_numel=150, max_live_numel=10_000, max_units_ahead=4)
    released = {2, 3}
    kept = {4, 1}
    chosen = choose_prefetch([4, 1, 2, 3], SIZES.get, released.__contains__, 110, limits,
                             is_kept=kept.__contains__)
    assert chosen == [2]            # 2 fits the bucket, 2 + 3 would not
    chosen = choose_prefetch([4, 1, 2, 3], SIZES.get, released.__contains__, 110, limits)
    assert chosen == []             # counted as in flight, 4 + 1 fill the bucket


def test_a_needed_unit_cancels_the_prefetches_holding_its_room_needed_last_first() -> None:
    """Prefetches of an order that changed hold the device room the unit needed now must have:
    they are cancelled, the one needed last first, and only as many as the room needs."""
    from infinity.storage.tiers import Residency

    # 0 in use, 1 and 2 prefetched for the old order; the new order needs 3 now, 2 last
    coordinator, units, gone = _coordinator_over_fake_units(
        [Residency.FETCHED, Residency.FETCHING, Residency.FETCHING, Residency.RELEASED],
        next_forward=[3, 1, 2])
    coordinator._room.cancel_prefetches(100, False, coordinator._status,
                                        coordinator._cancel_prefetch)     # room for 3
    assert gone == [2] and units[1].residency is Residency.FETCHING
    assert coordinator.fetch_stats["prefetches_cancelled"] == 1


def test_a_prefetch_whose_step_runs_ahead_is_never_cancelled() -> None:
    """A step started ahead writes the prefetched unit's device memory (zero/steps_ahead.py):
    the room comes from the other prefetch even though it is needed sooner."""
    from infinity.storage.tiers import Residency

    coordinator, units, gone = _coordinator_over_fake_units(
        [Residency.FETCHED, Residency.FETCHING, Residency.FETCHING, Residency.RELEASED],
        next_forward=[3, 1, 2])
    coordinator._status[2].stepping = True
    coordinator._room.cancel_prefetches(100, False, coordinator._status,
                                        coordinator._cancel_prefetch)
    assert gone == [1] and units[2].residency is Residency.FETCHING


AHEAD_CASES = [1, 2, 3, 5]


def test_choose_prefetch_takes_exactly_max_units_ahead() -> None:
    """With room for everything, exactly ``max_units_ahead`` units go, the next ones in order:
    not one fewer, not one more."""
    upcoming = list(range(1, 9))
    for ahead in AHEAD_CASES:
        limits = PrefetchLimits(bucket_numel=10_000, max_live_numel=10_000, max_units_ahead=ahead)
        chosen = choose_prefetch(upcoming, lambda u: 10, lambda u: True, 0, limits)
        assert chosen == upcoming[:ahead], ahead


def _coordinator_over_released_units(count: int, ahead: int):
    """A coordinator over ``count`` released units of 10 elements, budgets with room for all,
    ``max_units_ahead`` = ``ahead``; returns it and the list of units whose fetch it starts."""
    from types import SimpleNamespace

    import torch

    from infinity.base.budget import MemoryBudget
    from infinity.storage.device_cache import DeviceMemoryCache
    from infinity.storage.tiers import Residency
    from infinity.zero.coordinator import Coordinator

    budget = MemoryBudget("device", 1 << 20)
    manager = SimpleNamespace(device_budget=budget,
                              device_cache=DeviceMemoryCache(budget, torch.device("cpu")))
    started: list[int] = []

    class FakeUnit(SimpleNamespace):
        def start_fetch(self, _manager, _pool) -> bool:
            self.residency = Residency.FETCHING
            started.append(self.index)
            return True

    units = [FakeUnit(index=i, numel=10, nbytes=10, persistent=False,
                      residency=Residency.RELEASED, trainable_entries=lambda: [])
             for i in range(count)]
    coordinator = Coordinator(units, [], manager, None,
                              PrefetchLimits(10_000, 10_000, max_units_ahead=ahead))
    return coordinator, started


def test_the_coordinator_fetches_exactly_max_units_ahead() -> None:
    """Mid-forward, the next ``max_units_ahead`` units of the trace are fetched; at the end of
    the forward, the first ``max_units_ahead`` of the backward: exactly that many each time."""
    for ahead in AHEAD_CASES:
        coordinator, started = _coordinator_over_released_units(10, ahead)
        forward = coordinator.traces["train_fwd"]
        forward.order, forward.complete, forward.position = list(range(10)), True, 1
        coordinator._prefetch(forward)
        assert started == list(range(1, 1 + ahead)), ahead

        coordinator, started = _coordinator_over_released_units(10, ahead)
        forward = coordinator.traces["train_fwd"]
        forward.order, forward.complete, forward.position = list(range(10)), True, 10
        coordinator.traces["bwd"].order = list(range(9, -1, -1))
        coordinator._prefetch(forward)
        assert started == list(range(9, 9 - ahead, -1)), ahead
