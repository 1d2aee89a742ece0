"""The partitioned optimizer (optim/partitioned.py) at unit level. Here it runs over a few small real
Units and a real TierManager, driven as the coordinator and the engine drive it (gradients
parameter by parameter, the unit's backward done, ``step()``, the deferred steps on the next
fetch, ``reap``), and its updates are compared with torch.optim.AdamW on the same random data
over several steps: plain, clipped (with a loss scale), accumulated, overflowed, early-step,
with a frozen parameter and with a separate fp32 master. Around that: its sizes and stores, the
guards and their messages, the norm over ranks, the bookkeeping of a dropped backward, and the
accounting given back on close."""
from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from messages import raises_naming
from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.comm.collectives import CommCounters
from infinity.config.aio import AioConfig
from infinity.planner.engine_sizes import GRADS_HELD, held_room_bytes
from infinity.optim import pools
from infinity.optim.partitioned import PartitionedOptimizer
from infinity.optim.records import stepped_range
from infinity.planner.engine_sizes import step_slot_count
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Residency, Tier
from infinity.storage.transfers import LateCopies
from infinity.zero.protocols import Wait
from infinity.zero.unit import Unit

CPU = torch.device("cpu")
# unit 0: a, b; unit 1: c; unit 2: d; unit 3: e (and the frozen f when asked)
SHAPES = {"a": (4, 3), "b": (7,), "c": (5,), "d": (3,), "e": (6,)}
UNIT_OF = {"a": 0, "b": 0, "c": 1, "d": 2, "e": 3}
HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
TOL = dict(rtol=1e-5, atol=1e-6)



class _Comm:
    """What the optimizer asks of its collectives, for a world of ``world_size`` ranks whose
    norms' squares are ``factor`` times this rank's."""

    def __init__(self, world_size: int = 2, factor: float = 3.0) -> None:
        self.world_size, self.rank, self.factor = world_size, 0, factor
        self.counters = CommCounters()
        self.calls: list[tuple] = []

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def sum_float(self, value: float) -> float:
        return value * self.factor

    # every rank has this rank's gradient (their mean is it); each collective "takes" 1000 s
    # of comm time, which the optimizer's own timers must leave out
    def all_reduce_mean(self, tensor: torch.Tensor, tag: int | None = None) -> None:
        self.counters.comm_s += 1000.0
        self.calls.append(("all-reduce", tag, tensor.numel()))

    def any_mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask

    def all_gather(self, output: torch.Tensor, tag: int | None = None) -> None:
        self.calls.append(("all-gather", tag, output.numel()))


class _Values:
    """UnitValues giving fp32 values for the parameters named."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values

    def provides(self, name: str) -> bool:
        return name in self.values

    def fill(self, pieces) -> None:
        for name, start, out in pieces:
            flat = self.values[name].reshape(-1)
            out.copy_(flat[start:start + out.numel()].to(out.dtype))


class _CountingPool(BufferPool):
    """A staging pool counting the slots taken (a unit read from NVMe is read through one)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taken = 0

    def acquire(self, timeout: float | None = None):
        self.taken += 1
        return super().acquire(timeout)


class Rig:
    """Units over a real TierManager, the optimizer, and a torch AdamW over clones."""

    def __init__(self, *, early: bool = False, dtype: torch.dtype = torch.float32,
                 master_separate: bool = False, frozen: bool = False,
                 optimizer_tier: Tier = Tier.HOST, grad_tier: Tier = Tier.HOST,
                 param_tier: Tier = Tier.HOST, disk: Path | None = None,
                 sub_group_numel: int = 4096, speculation: str = "off",
                 values: dict | None = None, grad_dtype: torch.dtype = torch.float32,
                 two_groups: bool = False, doubled: bool = False,
                 host_budget: int | None = None, comm=None, group: dict | None = None,
                 staging: bool = False, owner=None) -> None:
        torch.manual_seed(0)
        self.dtype = dtype
        self.init = {n: torch.randn(s) for n, s in SHAPES.items()}
        if frozen:
            self.init["f"] = torch.randn(4)
        self.params = {n: nn.Parameter(v.to(dtype).clone()) for n, v in self.init.items()}
        self.names = [n for n in self.params if n != "f"]
        # the reference starts from the values the units hold (rounded to dtype)
        self.ref = {n: nn.Parameter(self.params[n].detach().float().clone()) for n in self.names}
        self.manager = TierManager(
            MemoryBudget("host", host_budget), MemoryBudget("device", None),
            nvme_path=str(disk) if disk is not None else None,
            aio_config=AioConfig(backend="auto", block_size=1 << 20, queue_depth=4))
        group_of = {n: (1 if two_groups and n in ("c", "e") else 0) for n in self.names}
        group_of["f"] = -1
        self.units = []
        for i in range(4):
            named = [(n, self.params[n], group_of[n]) for n in self.params
                     if UNIT_OF.get(n, 3) == i]
            unit = Unit(i, f"u{i}", nn.Module(), named, dtype, CPU)
            unit.adopt(self.manager, param_tier, persistent=False, doubled=doubled)
            self.units.append(unit)
        self.baseline = self.manager.tier_bytes()
        self.baseline_host = self.manager.host_budget.held
        groups = [{"params": [self.params[n] for n in self.names if group_of[n] == g], **HYPER}
                  for g in range(2 if two_groups else 1)]
        if two_groups:
            groups[1].update(lr=0.02, weight_decay=0.0)
        groups[0].update(group or {})
        self.staging = _CountingPool(self.manager, 1 << 16, 1, "staging") if staging else None
        self.opt = PartitionedOptimizer(
            self.units, groups, self.manager, optimizer_tier=optimizer_tier,
            grad_tier=grad_tier, early_step=early, sub_group_numel=sub_group_numel,
            master_separate=master_separate, staging_pool=self.staging, threads=1,
            speculation=speculation, values=_Values(values) if values is not None else None,
            grad_dtype=grad_dtype, defaults=dict(HYPER), owner=owner,
            **({"comm": comm} if comm is not None else {}))
        ref_groups = [{"params": [self.ref[n] for n in self.names if group_of[n] == g]}
                      for g in range(2 if two_groups else 1)]
        if two_groups:
            ref_groups[1].update(lr=0.02, weight_decay=0.0)
        self.adamw = torch.optim.AdamW(ref_groups, lr=HYPER["lr"], betas=HYPER["betas"],
                                       eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])

    def close(self) -> None:
        self.opt.close()
        self.manager.close()

    def grads(self, scale: float = 1.0) -> dict[str, torch.Tensor]:
        # rounded to the compute dtype first: the gradients autograd gives are in it
        return {n: (torch.randn(SHAPES[n]) * scale).to(self.dtype).float() for n in self.names}

    def backward(self, grads: dict[str, torch.Tensor], boundary: bool = True,
                 only: set[str] | None = None, loss_scale: float | None = None) -> list[bool]:
        """One backward as the coordinator runs it: units in reverse, each unit's gradients,
        then its backward done (the answers returned). Without ``loss_scale`` the backward
        begins as a caller without fp16 begins it, naming none (the gradients as they are)."""
        opt = self.opt
        if loss_scale is None:
            opt.begin_backward(boundary)
            loss_scale = 1.0
        else:
            opt.begin_backward(boundary, loss_scale)
        done = []
        for unit in reversed(self.units):
            unit.finish_fetch(self.manager, None)    # backward runs on the fetched unit
            got = False
            for entry in unit.params:
                if entry.trainable and (only is None or entry.name in only):
                    opt.on_grad(unit, entry, (grads[entry.name] * loss_scale).to(unit.dtype))
                    got = True
            if got:
                done.append(opt.on_unit_backward_done(unit))
                if done[-1]:
                    unit.release(self.manager)
            else:
                unit.release(self.manager)
        opt.end_backward()
        return done

    def step(self, call: bool = True) -> None:
        """The engine's step: ``step()`` (unless called already), then the deferred steps on
        their units' next fetch (or the early steps reaped), every unit released."""
        if call:
            self.opt.step()
        for unit in self.opt.speculator.take_rolled_back():
            unit.release(self.manager)
        for unit in self.opt.waiting_units():
            unit.finish_fetch(self.manager, None)
            assert self.opt.step_fetched(unit)
        for unit in self.opt.reap(Wait.ALL):
            unit.release(self.manager)
        for unit in self.units:
            unit.release(self.manager)

    def ref_step(self, grads: dict[str, torch.Tensor], clip: float = 0.0,
                 only: set[str] | None = None) -> float:
        for n in self.names:
            self.ref[n].grad = grads[n].clone() if only is None or n in only else None
        norm = float(torch.nn.utils.clip_grad_norm_(
            [p for p in self.ref.values() if p.grad is not None], clip if clip > 0 else math.inf))
        self.adamw.step()
        return norm

    def values(self) -> dict[str, torch.Tensor]:
        out = {}
        for unit in self.units:
            unit.finish_fetch(self.manager, None)
            for entry in unit.params:
                out[entry.name] = entry.param.detach().float().clone()
            unit.release(self.manager)
        return out

    def assert_matches(self, **tol) -> None:
        got = self.values()
        for n in self.names:
            torch.testing.assert_close(got[n], self.ref[n].detach(), **(tol or TOL), msg=n)

    def state(self, index: int):
        return self.opt._by_unit[index]


@pytest.fixture
def rig():
    made: list[Rig] = []

    def make(**kw) -> Rig:
        made.append(Rig(**kw))
        return made[-1]
    yield make
    for r in made:
        r.close()


class Owner:
    """The engine as the optimizer's owner (optim/protocols.py), recording its calls: a
    torch-style ``step()`` runs the step (``run``) as the engine's would."""

    def __init__(self, opt, order: list[int] | None = None, run: bool = True) -> None:
        self.opt, self.order, self.run, self.calls = opt, order or [], run, []

    def zero_grad(self, set_to_none: bool) -> None:
        self.calls.append(("zero_grad", set_to_none))

    def step_from_optimizer(self) -> None:
        self.calls.append("step")
        if self.run:
            self.opt.run_step()

    def forward_order(self) -> list[int]:
        return list(self.order)


# -- updates against torch.optim.AdamW ----------------------------------------------------
def test_deferred_steps_match_adamw_and_queue_in_forward_order(rig) -> None:
    """Three deferred steps with weight decay in two param groups: the same parameters as
    AdamW's; each backward's units stay releasable, ``step()`` queues every unit (in the next
    forward's order, units it does not name last) and each runs when its unit is fetched."""
    r = rig(two_groups=True)
    assert r.opt.waiting_units() == []
    r.opt.owner = Owner(r.opt, order=[2, 0])
    for k in range(3):
        g = r.grads()
        assert r.backward(g) == [True] * 4
        r.opt.step()
        assert r.opt.waiting_units() == [r.units[i] for i in (2, 0, 1, 3)]
        assert not r.opt.overflow
        r.step(call=False)
        r.ref_step(g)
        assert r.opt.last_grad_norm == pytest.approx(
            math.sqrt(sum(float((v ** 2).sum()) for v in g.values())), rel=1e-6)
    r.assert_matches()
    assert r.opt.waiting_units() == [] and r.state(0).step == 3


def test_the_default_forward_order_is_the_units_order(rig) -> None:
    r = rig()
    assert r.opt.forward_order() == []
    r.backward(r.grads())
    r.opt.step()
    assert r.opt.waiting_units() == r.units


def test_clipping_acts_on_the_unscaled_norm_as_torch_clips(rig) -> None:
    """Gradients scaled by a loss scale of 8 and a norm far above the clip: the update is
    AdamW's after clip_grad_norm_, and the norm reported is the unscaled one."""
    r = rig()
    r.opt.clip_norm = 0.5
    for _ in range(2):
        g = r.grads(scale=3.0)
        r.backward(g, loss_scale=8.0)
        r.step()
        norm = r.ref_step(g, clip=0.5)
        assert r.opt.last_grad_norm == pytest.approx(norm, rel=1e-6) and norm > 0.5
    r.assert_matches()


def test_clipping_above_the_norm_leaves_the_update_alone(rig) -> None:
    r = rig()
    r.opt.clip_norm = 1e6
    g = r.grads()
    r.backward(g, loss_scale=4.0)
    r.step()
    r.ref_step(g)
    r.assert_matches()


def test_grad_scale_for_clipping(rig) -> None:
    """The kernel's divisor: the loss scale, times (norm + 1e-6) / clip when the unscaled norm
    exceeds the clip (not when it equals it); the norm is recorded."""
    opt = rig().opt
    opt.grad_scale = 2.0
    opt.gradients.sq_norm = 100.0                # scaled norm 10: unscaled 5
    assert opt.grad_scale_for_clipping() == 2.0 and opt.last_grad_norm == 5.0
    opt.clip_norm = 5.0
    assert opt.grad_scale_for_clipping() == 2.0
    opt.clip_norm = 2.0
    assert opt.grad_scale_for_clipping() == pytest.approx(2.0 * (5.0 + 1e-6) / 2.0, rel=1e-15)
    assert opt.grad_scale_for_clipping() != 5.0
    opt.clip_norm = 6.0
    assert opt.grad_scale_for_clipping() == 2.0


@pytest.mark.parametrize("last", [None, {"a", "b", "c", "d"}])
def test_accumulated_gradients_are_summed_and_normed_whole(rig, last) -> None:
    """Two micro-steps then a step: AdamW on the sum, clipped by the norm of the sum; a unit
    whose gradients all came in the first micro-step (``last``: the units of the second) has
    its norm counted at the step, from its home."""
    r = rig()
    r.opt.clip_norm = 0.1
    g1, g2 = r.grads(), r.grads()
    r.backward(g1, boundary=False)
    assert r.opt.holds_cycle_gradients()
    r.backward(g2, boundary=True, only=last)
    r.step()
    total = {n: g1[n] + (g2[n] if last is None or n in last else 0) for n in g1}
    norm = r.ref_step(total, clip=0.1)
    assert r.opt.last_grad_norm == pytest.approx(norm, rel=1e-6)
    r.assert_matches()
    assert not r.opt.holds_cycle_gradients()


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_gradient_that_is_not_finite_skips_the_step(rig, bad, infinity_log) -> None:
    """An inf (a NaN) in one gradient: ``overflow``, the norm inf (nan, as torch's
    clip_grad_norm_ gives it: it said inf), nothing queued, nothing changed, the gradients
    dropped, and a warning says so (an fp32 skip was said by nothing but the periodic line's
    count); the next step is AdamW's first (the skipped one not counted)."""
    r = rig()
    before = r.values()
    g = r.grads()
    g["c"][1] = bad
    r.backward(g)
    r.opt.step()
    assert r.opt.overflow
    assert (math.isnan(r.opt.last_grad_norm) if math.isnan(bad) else r.opt.last_grad_norm == bad)
    said = [rec.getMessage() for rec in infinity_log.records]
    assert sum("step skipped: the gradient norm is not finite" in m for m in said) == 1, said
    assert r.opt.waiting_units() == [] and not r.opt.holds_cycle_gradients()
    r.step(call=False)
    after = r.values()
    for n in r.names:
        assert torch.equal(after[n], before[n]), n
    g = r.grads()
    r.backward(g)
    r.step()
    assert not r.opt.overflow
    r.ref_step(g)
    r.assert_matches()
    assert r.state(1).step == 1


def test_parameters_without_a_gradient_and_frozen_ones_are_not_stepped(rig) -> None:
    """A frozen parameter never moves; a parameter that got no gradient this step is skipped
    as torch skips it (no decay, its step count behind)."""
    r = rig(frozen=True)
    f0 = r.values()["f"]
    for only in (None, {"a", "c", "e"}, None):
        g = r.grads()
        r.backward(g, only=only)
        r.step()
        r.ref_step(g, only=only)
    r.assert_matches()
    assert torch.equal(r.values()["f"], f0)


def test_early_steps_match_adamw_and_report_the_norm(rig) -> None:
    """Early schedule: each unit steps as its backward is done (not releasable then),
    ``step()`` waits and reports the norm of the unscaled gradients."""
    r = rig(early=True)
    assert r.opt.early_step and r.opt.holds_grads and r.opt.grad_pool is None
    assert r.state(0).grad_store is None and r.opt.step_pool is None
    for only in (None, {"a", "c", "d", "e"}, None):     # b without a gradient once
        g = r.grads()
        assert r.backward(g, loss_scale=4.0, only=only) == [False] * 4
        for job in r.opt.steps.jobs:                     # every write landed: step() reaps
            job.landed_future.result()
        r.opt.step()
        norm = r.ref_step(g, only=only)
        assert r.opt.last_grad_norm == pytest.approx(norm, rel=1e-6)
        # the units step() reaped come with the next reap, with the rest
        assert sorted(u.index for u in r.opt.reap(Wait.ALL)) == [0, 1, 2, 3]
        for unit in r.units:
            unit.release(r.manager)
    r.assert_matches()


def test_an_early_backward_does_not_wait_for_the_gradient_copies_the_step_does(
        rig, monkeypatch) -> None:
    """Gradients copied to host buffers (as off a CPU device) by late copies held at a gate:
    the backward (each unit's take, and its end) returns with every copy still landing -- a
    wait on the training thread would raise here, not hang -- and the step stream is the one
    that waits: no kernel runs until the gate opens (one that did would read the NaN of a copy
    not landed), then the updates are AdamW's."""
    monkeypatch.setattr(pools, "gradients_held", lambda device: False)
    r = rig(early=True)
    assert not r.opt.holds_grads and r.opt.grad_pool.count == GRADS_HELD == 2
    copies, gate = LateCopies(seed=5), threading.Event()
    copies._jobs.put(gate.wait)
    r.opt.gradients.copies = r.opt.grad_pool._copies = copies   # the units' fetches stay at once
    issued, waits, training = [], copies.host_waits, threading.current_thread()
    stream_waits = threading.Event()
    to_host = copies.to_host
    copies.to_host = lambda dst, src, **kw: issued.append(to_host(dst, src, **kw)) or issued[-1]

    def host_waits(events) -> None:
        events = list(events)
        if not gate.is_set() and not all(e.done() for e in events):
            if threading.current_thread() is training:
                raise AssertionError(f"the training thread waited for {len(events)} copies")
            stream_waits.set()
        waits(events)
    copies.host_waits = host_waits
    g = r.grads()
    only = {"d", "e"}             # two units: one gradient slot each, no wait for a slot
    try:
        assert r.backward(g, only=only) == [False, False]
        assert len(issued) == 2 and not any(e.done() for e in issued)   # still landing
        for job in r.opt.steps.jobs:      # (a stream that did not wait would step them)
            job.stepped_future.add_done_callback(lambda f: stream_waits.set())
        stream_waits.wait()       # the stream holds at the first unit's copies
        assert not any(job.stepped_future.done() for job in r.opt.steps.jobs)
    finally:
        gate.set()                # (a failed check must not leave the stream at the gate)
    r.step()
    r.ref_step(g, only=only)
    r.assert_matches()
    assert copies.poisoned == copies.lost == 0 and r.opt.grad_pool.available == 2


def test_expected_early_steps_are_made_ready_or_cancelled(rig) -> None:
    """Units expected before their gradients: those that get them step (the expected job made
    ready, expected again next time), the one that gets none is cancelled and unchanged."""
    r = rig(early=True)
    opt = r.opt
    before = r.values()
    for k in range(2):
        for unit in r.units:
            opt.expect_backward(unit)
            opt.expect_backward(unit)           # once only
        assert opt.stream_stats()["expected"] == 4 * (k + 1)
        g = r.grads()
        r.backward(g, only={"a", "c", "d"})
        r.step()
        r.ref_step(g, only={"a", "c", "d"})
    r.assert_matches()
    assert torch.equal(r.values()["e"], before["e"])


def test_deferred_steps_expect_nothing_without_speculation(rig) -> None:
    """Not before a backward, not after one (a forward between backward and step)."""
    r = rig()
    for unit in r.units:
        r.opt.expect_backward(unit)
    r.backward(r.grads())
    for unit in r.units:
        r.opt.expect_backward(unit)
    assert r.opt.stream_stats() == {"expected": 0, "read_early": 0, "preempted": 0,
                                    "cancelled": 0}


def test_a_separate_master_is_seeded_from_the_units_and_stepped(rig) -> None:
    """bf16 compute: the fp32 master starts as the units' bf16 values and follows AdamW in
    fp32; the units get its rounding. The units stay released through the seeding."""
    r = rig(dtype=torch.bfloat16, master_separate=True)
    assert all(u.residency == Residency.RELEASED for u in r.units)
    st = r.state(0)
    a = r.params["a"]
    assert st.master.home is Tier.HOST and st.master.dtype == torch.float32
    assert st.master.name == "u0.master" and st.master.numel == r.units[0].trainable_numel
    r.units[0].finish_fetch(r.manager, None)
    off = r.units[0].params[0].offset
    torch.testing.assert_close(st.master.tensor[off:off + 12], a.detach().float().reshape(-1),
                               rtol=0, atol=0)
    r.units[0].release(r.manager)
    g = r.grads()
    r.backward(g)
    r.step()
    r.ref_step(g)
    entry = r.units[0].params[0]
    torch.testing.assert_close(st.master.tensor[entry.offset:entry.offset + 12],
                               r.ref["a"].detach().reshape(-1), **TOL)
    r.assert_matches(rtol=1e-2, atol=1e-2)


def test_a_master_from_values_takes_them_in_fp32_when_all_are_given(rig) -> None:
    """Values providing every parameter of a unit's range: its master is them, unrounded;
    a unit with one parameter not provided is seeded from the unit (bf16-rounded)."""
    torch.manual_seed(0)
    exact = {n: torch.randn(SHAPES[n]) for n in ("a", "c")}
    r = rig(dtype=torch.bfloat16, master_separate=True, values=exact)
    c = r.units[1].params[0]
    torch.testing.assert_close(r.state(1).master.tensor[c.offset:c.offset + 5], exact["c"],
                               rtol=0, atol=0)
    a = r.units[0].params[0]            # b is not provided: from the unit
    assert a.name == "a"
    torch.testing.assert_close(r.state(0).master.tensor[a.offset:a.offset + 12],
                               r.init["a"].to(torch.bfloat16).float().reshape(-1), rtol=0, atol=0)


def test_a_master_of_units_at_home_on_nvme_is_read_through_the_staging_pool(rig,
                                                                          disk_dir) -> None:
    """Seeding (and reloading) the master of a unit whose parameters live on NVMe fetches it
    through the staging pool the optimizer was given, one slot per fetch (the pool sized
    for them, pinned on a GPU), and the master holds the unit's values."""
    r = rig(dtype=torch.bfloat16, master_separate=True, param_tier=Tier.NVME, disk=disk_dir,
            staging=True)
    assert r.staging.taken == len(r.units) and r.staging.available == r.staging.count
    unit = r.units[2]
    assert unit.residency != Residency.FETCHED
    r.opt.reload_master(unit)
    assert r.staging.taken == len(r.units) + 1
    (e,) = unit.params
    master = r.state(2).master.tensor[e.offset:e.offset + e.numel]
    torch.testing.assert_close(master, r.init["d"].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_reload_master_takes_values_changed_by_hand(rig) -> None:
    """A fetched unit's parameters set by hand: ``reload_master`` makes the master match (and
    leaves the unit fetched); a unit with no optimizer state is left alone."""
    r = rig(dtype=torch.bfloat16, master_separate=True)
    unit = r.units[1]
    unit.finish_fetch(r.manager, None)
    with torch.no_grad():
        r.params["c"].fill_(0.5)
    r.opt.reload_master(unit)
    unit.write_home(r.manager)
    assert unit.residency == Residency.FETCHED
    e = unit.params[0]
    assert torch.equal(r.state(1).master.tensor[e.offset:e.offset + 5], torch.full((5,), 0.5))
    unit.release(r.manager)
    with torch.no_grad():                    # a released unit is fetched for it, and let go
        r.state(1).master.tensor.zero_()
    r.opt.reload_master(unit)
    assert unit.residency == Residency.RELEASED
    assert torch.equal(r.state(1).master.tensor[e.offset:e.offset + 5], torch.full((5,), 0.5))
    r.opt.reload_master(Unit(9, "frozen", nn.Module(), [("z", nn.Parameter(torch.zeros(2)), -1)],
                             torch.bfloat16, CPU))


def test_nvme_states_and_master_match_adamw(rig, disk_dir) -> None:
    """Adam states, master and gradients on NVMe, parameters too: the same updates, through
    the step pool (and a gradient buffer); the master seeded through the disk."""
    r = rig(dtype=torch.bfloat16, master_separate=True, optimizer_tier=Tier.NVME,
            grad_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, sub_group_numel=2048)
    opt = r.opt
    assert opt.step_pool is not None and opt.grad_pool is not None
    assert opt.step_pool.slot_bytes == 2048 * 4
    assert opt.step_pool.count == step_slot_count(Tier.NVME, Tier.NVME, Tier.NVME, True, False)
    assert opt.grad_pool.slot_bytes == 1024 * 4 and opt.grad_pool.count == GRADS_HELD
    assert all(u.residency == Residency.RELEASED for u in r.units)
    st = r.state(0)
    buf = r.manager.host_empty(st.master.padded, torch.float32, what="test")
    r.manager.wait(st.master.load_async(buf))
    a = r.units[0].params[0]
    torch.testing.assert_close(buf[a.offset:a.offset + 12],
                               r.init["a"].to(torch.bfloat16).float().reshape(-1), rtol=0, atol=0)
    for _ in range(2):
        g = r.grads()
        r.backward(g)
        r.step()
        r.ref_step(g)
    r.manager.wait(st.master.load_async(buf))
    torch.testing.assert_close(buf[a.offset:a.offset + 12], r.ref["a"].detach().reshape(-1),
                               **TOL)
    r.assert_matches(rtol=1e-2, atol=1e-2)


def test_a_speculated_step_is_kept_without_clipping_and_redone_with(rig, disk_dir) -> None:
    """speculation "on" (NVMe, doubled stores): the units step during the backward (not
    releasable), and the step keeps it; with clipping acting it is rolled back and the
    deferred step runs with the clipped gradient. Both are AdamW's."""
    r = rig(optimizer_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, speculation="on",
            doubled=True)
    opt = r.opt
    assert opt.speculation == "on" and opt.holds_grads
    opt.expect_backward(r.units[3])       # a forward before the backward that speculates
    assert opt.stream_stats()["expected"] == 1
    g = r.grads()
    opt.timers.grad_s = 5.0
    t0 = time.perf_counter()
    assert r.backward(g) == [False] * 4
    assert 5.0 < opt.timers.grad_s <= 5.0 + time.perf_counter() - t0
    assert opt.speculation_pending and opt.holds_cycle_gradients()
    r.step()
    r.ref_step(g)
    assert not opt.speculation_pending and opt.speculation_pays
    opt.clip_norm = 0.1
    g = r.grads()
    r.backward(g)
    r.step()
    r.ref_step(g, clip=0.1)
    assert opt.speculation_pays is False
    assert opt.speculation_stats["committed"] == 1
    r.assert_matches()
    opt.speculation_pays = True
    assert opt.speculator.pays is True


def test_speculation_is_off_in_the_early_schedule(rig, disk_dir) -> None:
    r = rig(early=True, optimizer_tier=Tier.NVME, disk=disk_dir, speculation="on")
    assert r.opt.speculation == "off"
    assert r.state(0).exp_avg.doubled is False


@pytest.mark.parametrize("asked", ["on", "off"])
def test_a_param_group_with_its_own_state_format_turns_speculation_off(
        rig, disk_dir, infinity_log, asked: str) -> None:
    """A speculated step's redo reads fp32 states: a param group storing its Adam states in
    another format turns speculation off (no doubled NVMe stores), said in the log once it
    was asked for; with speculation off already nothing is said."""
    with infinity_log.at_level(logging.INFO, logger="infinity"):
        r = rig(optimizer_tier=Tier.NVME, disk=disk_dir, speculation=asked,
                group={"optimizer_moments": "bf16"})
    assert r.opt.speculation == "off"
    assert r.state(0).exp_avg.doubled is False and r.state(0).exp_avg.dtype == torch.bfloat16
    said = [rec.getMessage() for rec in infinity_log.records
            if "speculative step off" in rec.getMessage().lower()]
    if asked == "on":
        assert len(said) == 1 and said[0].startswith("speculative step off")
        assert "param group stores its Adam states in a format" in said[0]
    else:
        assert said == []


# -- sizes and stores ----------------------------------------------------------------------
def test_stores_and_pools_on_host(rig) -> None:
    """Deferred on HOST: m, v and a gradient store per trainable unit, each of the unit's
    trainable range, fp32 in the optimizer tier; no master, no pools; the sub-group the
    largest range rounded up to 2048 elements; the held room one unit's gradient."""
    r = rig(frozen=True)
    opt = r.opt
    assert [s.unit for s in opt.states] == r.units
    for s in opt.states:
        n = s.unit.trainable_numel
        assert (s.lo, s.hi, s.shard) == (0, n, None)
        for store, what in ((s.exp_avg, "exp_avg"), (s.exp_avg_sq, "exp_avg_sq"),
                            (s.grad_store, "grad")):
            assert (store.name, store.numel, store.dtype, store.home) == (
                f"{s.unit.name}.{what}", n, torch.float32, Tier.HOST)
        assert s.master is None
    assert opt.grad_pool is None and opt.step_pool is None
    assert opt.sub_group_numel == 2048
    assert opt.held_room.capacity == held_room_bytes(max(u.trainable_numel for u in r.units))
    assert not opt.holds_grads and opt.speculation == "off"
    assert (opt.clip_norm, opt.last_grad_norm, opt.loss_scale, opt.overflow) == (
        0.0, None, 1.0, False)
    assert opt.step_failure is None and opt.owner is None
    assert opt.kernel.adamw_mode is True and opt.kernel.threads == 1
    assert opt.defaults == HYPER


def test_a_separate_master_of_fp32_compute_is_kept_seeded_and_stepped(rig) -> None:
    """``master_separate`` with fp32 compute (the compute copy is not the parameter itself, a
    GPU's): each unit keeps an fp32 master of its trainable range, seeded from the parameters
    and stepped as AdamW steps them."""
    r = rig(master_separate=True)
    for s in r.opt.states:
        n = s.unit.trainable_numel
        assert s.master is not None and (s.master.numel, s.master.dtype) == (n, torch.float32)
        r.units[s.unit.index].finish_fetch(r.manager, None)
        torch.testing.assert_close(s.master.tensor[:n], s.unit.flat[:n].float(), rtol=0, atol=0)
        r.units[s.unit.index].release(r.manager)
    g = r.grads()
    r.backward(g)
    r.step()
    r.ref_step(g)
    r.assert_matches()
    for s in r.opt.states:
        n = s.unit.trainable_numel
        r.units[s.unit.index].finish_fetch(r.manager, None)
        torch.testing.assert_close(s.master.tensor[:n], s.unit.flat[:n].float(), rtol=0, atol=0)
        r.units[s.unit.index].release(r.manager)


def _one_unit(manager: TierManager, numel: int) -> tuple[Unit, nn.Parameter]:
    param = nn.Parameter(torch.randn(numel))
    unit = Unit(0, "u0", nn.Module(), [("w", param, 0)], torch.float32, CPU)
    unit.adopt(manager, Tier.HOST, persistent=False)
    return unit, param


def test_a_param_group_asking_for_int8_moments_gets_them_in_sub_groups_of_the_plan() -> None:
    """A unit of 20,000 elements whose group asks for int8 moments stores int8 codes and their
    scales, checked against the sub-group the optimizer sized (int8 needs whole 4096s)."""
    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    unit, param = _one_unit(manager, 20_000)
    opt = PartitionedOptimizer([unit], [{"params": [param], "optimizer_moments": "int8",
                                         **HYPER}], manager,
                               optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, early_step=False,
                               sub_group_numel=8192, master_separate=False, staging_pool=None,
                               threads=1, defaults=dict(HYPER))
    try:
        (state,) = opt.states
        assert state.fmt.moments == "int8" and opt.sub_group_numel == 8192
        assert state.exp_avg.dtype != torch.float32 and state.exp_avg_scales is not None
    finally:
        opt.close()
        manager.close()


def test_the_sub_group_is_rounded_to_2048_and_capped_by_the_largest_range(rig) -> None:
    assert rig(sub_group_numel=1).opt.sub_group_numel == 2048
    assert rig(sub_group_numel=0).opt.sub_group_numel == 2048
    assert rig(sub_group_numel=10 ** 6).opt.sub_group_numel == 2048   # ranges of 1024


@pytest.mark.parametrize("asked,made", [(2048, 2048), (2049, 4096), (4097, 6144),
                                        (9000, 10240), (10 ** 6, 20480)])
def test_a_sub_group_is_rounded_up_to_whole_2048s_below_the_largest_range(asked: int,
                                                                       made: int) -> None:
    """One unit of 20,000 elements: the sub-group asked for is rounded up to a multiple of
    2048 (never down: a sub-group just past a multiple gets the next one), capped by the
    range rounded the same way."""
    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    param = nn.Parameter(torch.randn(20_000))
    unit = Unit(0, "u0", nn.Module(), [("w", param, 0)], torch.float32, CPU)
    unit.adopt(manager, Tier.HOST, persistent=False)
    opt = PartitionedOptimizer([unit], [{"params": [param], **HYPER}], manager,
                               optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, early_step=False,
                               sub_group_numel=asked, master_separate=False, staging_pool=None,
                               threads=1, defaults=dict(HYPER))
    try:
        assert opt.sub_group_numel == made
    finally:
        opt.close()


def test_a_16_bit_gradient_home_and_its_guard(rig, disk_dir) -> None:
    """A bf16 gradient home: on HOST with one rank it is made (and the step matches AdamW up
    to the gradient's rounding); with an NVMe gradient tier or several ranks it is refused."""
    r = rig(grad_dtype=torch.bfloat16)
    assert r.state(0).grad_store.dtype == torch.bfloat16
    g = {n: v.to(torch.bfloat16).float() for n, v in r.grads().items()}
    r.backward(g)
    r.step()
    r.ref_step(g)
    r.assert_matches()
    units = r.units
    with raises_naming(ValueError, "torch.bfloat16 gradient home", "grad_tier HOST and one rank",
                       "got nvme with 1 ranks",
                       "(see [Note: the gradient home in the compute dtype])", ends=True):
        PartitionedOptimizer(units, [{"params": [r.params["a"]]}], r.manager,
                             optimizer_tier=Tier.HOST, grad_tier=Tier.NVME, early_step=False,
                             sub_group_numel=2048, master_separate=False, staging_pool=None,
                             grad_dtype=torch.bfloat16)
    with raises_naming(ValueError, "torch.float16 gradient home", "grad_tier HOST and one rank",
                       "got host with 2 ranks",
                       "(see [Note: the gradient home in the compute dtype])", ends=True):
        PartitionedOptimizer(units, [{"params": [r.params["a"]]}], r.manager,
                             optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, early_step=False,
                             sub_group_numel=2048, master_separate=False, staging_pool=None,
                             grad_dtype=torch.float16, comm=_Comm())


def _sharded_units(comm: _Comm) -> list[Unit]:
    named = [("w", nn.Parameter(torch.zeros(3000)), 0)]
    u0 = Unit(0, "s0", nn.Module(), named, torch.float32, CPU, comm=comm, shards=2)
    u1 = Unit(1, "s1", nn.Module(), [("x", nn.Parameter(torch.zeros(100)), 0),
                                     ("y", nn.Parameter(torch.zeros(5000)), -1)],
              torch.float32, CPU, comm=comm, shards=2)
    return [u0, u1]


def test_state_range_is_the_shard_of_the_trainable_part() -> None:
    """Sharded: this rank's shard, cut at the trainable part's end (empty past it)."""
    comm = _Comm()
    u0, u1 = _sharded_units(comm)
    assert (u0.trainable_numel, u0.shard_numel) == (3072, 2048)
    assert stepped_range(u0, False) == (0, 3072)
    assert stepped_range(u0, True) == (0, 2048)
    comm.rank = 1
    v0, v1 = _sharded_units(comm)
    assert stepped_range(v0, True) == (2048, 3072)
    assert v1.shard_start > v1.trainable_numel
    assert stepped_range(v1, True) == (1024, 1024)
    assert stepped_range(v1, False) == (0, 1024)


def test_several_ranks_shard_the_states_and_never_hold_or_speculate() -> None:
    """Two ranks, sharded states: each unit's stores are its shard (at least one element),
    the sub-group capped by the largest shard, a gradient buffer of the whole flat unit, no
    speculation, no held gradients."""
    comm = _Comm()
    comm.rank = 1
    units = _sharded_units(comm)
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    try:
        for u in units:
            u.adopt(m, Tier.HOST, persistent=False)
        opt = PartitionedOptimizer(
            units, [{"params": [units[0].params[0].param, units[1].params[0].param]}], m,
            optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, early_step=False,
            sub_group_numel=10 ** 6, master_separate=False, staging_pool=None,
            speculation="on", comm=comm, shard_states=True)
        s0, s1 = opt.states
        assert (s0.lo, s0.hi, s0.shard) == (2048, 3072, (2048, 3072))
        assert s0.exp_avg.numel == 1024 and s0.grad_store.numel == 1024
        assert (s1.lo, s1.hi, s1.shard) == (1024, 1024, (1024, 1024)) and s1.exp_avg.numel == 1
        assert opt.sub_group_numel == 2048
        assert opt.speculation == "off" and not opt.holds_grads
        assert [u.flat_numel for u in units] == [4096, 8192]
        assert opt.grad_pool.slot_bytes == 8192 * 4 and opt.grad_pool.count == GRADS_HELD
        assert opt.gradients.scatter
        # the norm: every rank's squares summed (sharded), or their mean (stage 0)
        assert opt._global_sq_norm(2.0) == 6.0
        opt.gradients.scatter = False
        assert opt._global_sq_norm(2.0) == 3.0
        opt.close()
        stage0 = PartitionedOptimizer(
            units, [{"params": [units[0].params[0].param, units[1].params[0].param]}], m,
            optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, early_step=True,
            sub_group_numel=10 ** 6, master_separate=False, staging_pool=None, comm=comm,
            shard_states=False)
        assert stage0.states[0].shard is None and stage0.states[0].exp_avg.numel == 3072
        assert stage0.grad_pool.slot_bytes == 3072 * 4 and not stage0.holds_grads
        assert stage0.sub_group_numel == 4096
        stage0.close()
    finally:
        m.close()


def test_device_gradient_buffers_are_the_plans_count_and_dtype(monkeypatch) -> None:
    """With several ranks on a device that reduces gradients there (forced here on the CPU),
    the device gradient buffers are as many, and in the communication dtype, as the run
    plan's pools say."""
    from dataclasses import replace

    from infinity.optim import device_gradients
    monkeypatch.setattr(device_gradients, "reduces_on_device", lambda device: True)
    comm = _Comm()
    units = _sharded_units(comm)
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    try:
        for u in units:
            u.adopt(m, Tier.HOST, persistent=False)
        planned = pools.plan_pools(units, m, sub_group_numel=4096, optimizer_tier=Tier.HOST,
                                   grad_tier=Tier.HOST, early_step=False, master_separate=False,
                                   speculative=False, comm=comm, shard_states=True)
        count = planned.device_grad_buffers + 1       # not the default
        opt = PartitionedOptimizer(
            units, [{"params": [units[0].params[0].param, units[1].params[0].param]}], m,
            optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, early_step=False,
            sub_group_numel=4096, master_separate=False, staging_pool=None, comm=comm,
            shard_states=True,
            pools=replace(planned, device_grad_buffers=count, device_grad_dtype="bf16"))
        pool = opt.gradients.device_pool
        assert pool is not None and (pool.count, pool.dtype) == (count, torch.bfloat16)
        opt.close()
    finally:
        m.close()


def test_states_are_not_sharded_with_one_rank(rig) -> None:
    comm = _Comm(world_size=1)
    units = _sharded_units(comm)
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    try:
        for u in units:
            u.adopt(m, Tier.HOST, persistent=False)
        opt = PartitionedOptimizer(
            units, [{"params": [units[0].params[0].param]}], m, optimizer_tier=Tier.HOST,
            grad_tier=Tier.HOST, early_step=False, sub_group_numel=4096,
            master_separate=False, staging_pool=None, comm=comm, shard_states=True)
        assert opt.states[0].shard is None and opt.grad_pool is None
        assert opt._global_sq_norm(2.0) == 6.0 / 1
        opt.close()
    finally:
        m.close()


# -- guards, dropped backwards, the torch API ----------------------------------------------
def test_a_second_step_before_the_deferred_ones_ran_is_refused(rig) -> None:
    r = rig()
    r.backward(r.grads())
    r.opt.step()
    r.backward(r.grads())
    with raises_naming(RuntimeError, "deferred step of 4 unit(s) (u0, u1, u2) has not run yet",
                       "step through Engine.step", "steps them first", ends=True):
        r.opt.step()


def test_step_refuses_a_closure_and_routes_a_users_call_through_the_engine(rig) -> None:
    r = rig()
    with raises_naming(ValueError, "PartitionedOptimizer.step", "closure"):
        r.opt.step(closure=lambda: 0.0)
    owner = r.opt.owner = Owner(r.opt, run=False)
    r.backward(r.grads())
    r.opt.overflow = True
    assert r.opt.step() is None
    assert owner.calls == ["step"] and r.opt.waiting_units() == [] and r.opt.overflow
    r.opt.run_step()                         # the engine's step runs the step itself
    assert owner.calls == ["step"] and len(r.opt.waiting_units()) == 4 and not r.opt.overflow


class _EngineOwner(Owner):
    """An owner whose step runs the optimizer's through ``owner_step``, as Engine._step does."""

    def step_from_optimizer(self) -> None:
        self.calls.append("step")
        self.opt.owner_step()


def test_the_engines_step_runs_torchs_hooks_and_a_users_step_reaches_the_engine(rig) -> None:
    """The engine's own step (``owner_step``) runs the step once, inside torch's step hooks,
    without coming back to the engine; a user's ``step()`` after it goes to the engine again
    (which comes back through ``owner_step``), every time. Either way the hooks run once a
    step, as around a torch optimizer's step."""
    owner = _EngineOwner(None, order=[1])
    r = rig(owner=owner)
    owner.opt = r.opt
    hooks: list[str] = []
    r.opt.register_step_pre_hook(lambda opt, args, kwargs: hooks.append("pre"))
    r.opt.register_step_post_hook(lambda opt, args, kwargs: hooks.append("post"))
    for users in (False, True, True):
        g = r.grads()
        r.backward(g)
        owner.calls.clear()
        hooks.clear()
        if users:
            r.opt.step()
        else:
            r.opt.owner_step()
        assert hooks == ["pre", "post"]
        assert owner.calls == (["step"] if users else [])
        assert r.opt.waiting_units()[0] is r.units[1]      # the owner's forward order
        r.step(call=False)
        r.ref_step(g)
    r.assert_matches()


def test_state_dict_and_load_state_dict_are_refused(rig) -> None:
    opt = rig().opt
    why = ("Adam states", "may not fit in memory as one dict",
           "engine.save_checkpoint(dir) / engine.load_checkpoint(dir)")
    with raises_naming(RuntimeError, "optimizer.state_dict()", *why, starts=True):
        opt.state_dict()
    with raises_naming(RuntimeError, "optimizer.load_state_dict()", *why, starts=True):
        opt.load_state_dict({})


def test_add_param_group_is_refused_after_construction(rig) -> None:
    opt = rig(two_groups=True).opt
    assert len(opt.param_groups) == 2        # given at construction: taken
    # the message is six literals: a phrase spans each seam (an "XX"-wrapped one breaks it)
    with raises_naming(ValueError, "optimizer.add_param_group() after infinity.initialize",
                       "lays out the optimizer states", "so the new group would never be stepped",
                       "Give every group to infinity.initialize (model_parameters=[...])",
                       "later, save_checkpoint", "load_checkpoint with load_optimizer_states=False",
                       starts=True, ends=True):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert len(opt.param_groups) == 2


def test_zero_grad_calls_the_engines(rig) -> None:
    opt = rig().opt
    opt.zero_grad()                            # no engine: nothing
    owner = opt.owner = Owner(opt)
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    assert owner.calls == [("zero_grad", True), ("zero_grad", False)]


def test_a_backward_that_raised_drops_the_cycles_gradients(rig, infinity_log) -> None:
    """``abandon_backward``: the gradients so far are dropped (nothing queued, nothing
    changed), with a warning counting the units; the next cycle is AdamW's first step."""
    r = rig()
    before = r.values()
    g = r.grads()
    opt = r.opt
    opt.begin_backward(True)
    for unit in r.units[2:]:
        for e in unit.params:
            opt.on_grad(unit, e, g[e.name])
    opt.on_unit_backward_done(r.units[3])
    assert opt.holds_cycle_gradients()
    with infinity_log.at_level(logging.WARNING, logger="infinity"):
        opt.abandon_backward()
    assert [rec.getMessage() for rec in infinity_log.records] == [
        "backward raised: the gradients of 2 unit(s) collected since the last optimizer step "
        "are dropped"]
    assert not opt.holds_cycle_gradients() and not opt.speculator.speculating
    r.step()
    assert r.values().keys() == before.keys()
    assert all(torch.equal(r.values()[n], before[n]) for n in r.names)
    g = r.grads()
    r.backward(g)
    r.step()
    r.ref_step(g)
    r.assert_matches()


def test_a_backward_that_raised_names_its_error_cut_to_300_characters(rig, infinity_log) -> None:
    """Called while the backward's error is handled, the warning names the error's type and
    the start of its message (300 characters: a long one is cut)."""
    r = rig()
    opt = r.opt
    g = r.grads()
    opt.begin_backward(True)
    unit = r.units[1]
    for e in unit.params:
        opt.on_grad(unit, e, g[e.name])
    error = RuntimeError("out of memory: " + "0123456789" * 40)
    with infinity_log.at_level(logging.WARNING, logger="infinity"):
        try:
            raise error
        except RuntimeError:
            opt.abandon_backward()
    (said,) = [rec.getMessage() for rec in infinity_log.records]
    assert said.startswith(f"backward raised (RuntimeError: {str(error)[:300]}): the gradients "
                           "of 1 unit(s)"), said


def test_an_early_backward_that_raised_says_stepped_units_keep_their_update(
        rig, infinity_log) -> None:
    r = rig(early=True)
    g = r.grads()
    opt = r.opt
    opt.begin_backward(True)
    unit = r.units[3]
    unit.finish_fetch(r.manager, None)
    opt.expect_backward(r.units[2])
    for e in unit.params:
        opt.on_grad(unit, e, g[e.name])
    assert opt.on_unit_backward_done(unit) is False
    with infinity_log.at_level(logging.WARNING, logger="infinity"):
        opt.abandon_backward()
    assert [rec.getMessage() for rec in infinity_log.records] == [
        "backward raised: the gradients of 0 unit(s) collected since the last optimizer step "
        "are dropped; units already stepped in this backward keep their update"]
    opt.expect_backward(r.units[2])            # the cancelled one is expected anew
    assert opt.stream_stats()["expected"] == 2
    opt.cancel_expected()
    r.step()
    r.ref_step(g, only={"e"})
    got = r.values()
    torch.testing.assert_close(got["e"], r.ref["e"].detach(), **TOL)


def test_zero_grad_between_backward_and_step_discards_the_gradients(rig, infinity_log) -> None:
    r = rig()
    before = r.values()
    r.backward(r.grads(), only={"a", "c"})
    assert r.opt.holds_cycle_gradients()
    with infinity_log.at_level(logging.INFO, logger="infinity"):
        r.opt.discard_cycle_gradients()
    assert "zero_grad(): the gradients of 2 unit(s) collected since the last step are " \
        "discarded" in [rec.getMessage() for rec in infinity_log.records]
    assert not r.opt.holds_cycle_gradients()
    r.step()
    assert all(torch.equal(r.values()[n], before[n]) for n in r.names)


def test_step_fetched_without_a_waiting_step_does_nothing(rig) -> None:
    r = rig()
    unit = r.units[0]
    unit.finish_fetch(r.manager, None)
    assert r.opt.step_fetched(unit) is False
    r.backward(r.grads())
    r.opt.step()
    unit.finish_fetch(r.manager, None)
    r.opt.timers.optimizer_s = 5.0         # added to, as the step's own seconds are
    t0, w0 = r.opt.timers.optimizer_s, time.perf_counter()
    assert r.opt.step_fetched(unit) is True and r.opt.step_fetched(unit) is False
    assert t0 < r.opt.timers.optimizer_s <= t0 + time.perf_counter() - w0
    r.opt.wait_stepped(unit)
    assert r.opt.reap(Wait.ALL) == [unit]


def test_a_deferred_step_at_a_fetch_waits_for_the_fetch_s_copy_first(rig) -> None:
    """The step run at a fetch writes the device buffer from the step stream's thread, which
    the fetch's copy event orders nothing on (compute waits on it through its own stream): the
    submitting thread waits for the event before the step is made ready; a fetch with no
    waiting step waits for nothing (the training thread keeps running ahead of the device)."""
    r = rig()
    order: list[str] = []

    class Event:
        def done(self) -> bool:
            return False

        def wait(self) -> None:
            order.append("copy over")

    unit = r.units[0]
    unit.finish_fetch(r.manager, None)
    unit.fetch_event = Event()
    assert r.opt.step_fetched(unit) is False and order == []     # no step: no wait
    r.backward(r.grads())
    r.opt.step()
    unit.finish_fetch(r.manager, None)
    unit.fetch_event = Event()
    make_ready = r.opt._stream.make_ready

    def ready(job):
        order.append("step ready")
        return make_ready(job)

    r.opt._stream.make_ready = ready
    assert r.opt.step_fetched(unit) is True
    assert order == ["copy over", "step ready"], order
    r.opt.wait_stepped(unit)
    assert r.opt.reap(Wait.ALL) == [unit]


def test_drain_cancels_waiting_steps_and_hands_back_stepping_units(rig) -> None:
    r = rig()
    before = r.values()
    r.backward(r.grads())
    r.opt.step()
    unit = r.units[1]
    unit.finish_fetch(r.manager, None)
    r.opt.step_fetched(unit)
    assert r.opt.drain() == [unit]
    assert r.opt.waiting_units() == []
    after = r.values()
    assert not torch.equal(after["c"], before["c"])
    assert all(torch.equal(after[n], before[n]) for n in ("a", "b", "d", "e"))


def test_the_timers_count_the_gradients_and_the_step(rig) -> None:
    """The seconds counted lie between 0 and the wall time of the calls."""
    for early in (False, True):
        r = rig(early=early)
        g = r.grads()
        r.opt.timers.grad_s = 5.0            # added to, unit by unit
        t0 = time.perf_counter()
        r.backward(g)
        wall = time.perf_counter() - t0
        assert 5.0 < r.opt.timers.grad_s <= 5.0 + wall
        t0 = time.perf_counter()
        r.opt.step()
        wall = time.perf_counter() - t0
        assert 0.0 < r.opt.timers.optimizer_s <= wall
    assert r.opt.hyperparameters()[0]["lr"] == HYPER["lr"]


def test_close_frees_every_store_even_with_steps_waiting(rig) -> None:
    """Closing with deferred steps still queued: every state store freed, the host memory the
    optimizer's stores held given back."""
    r = rig(dtype=torch.bfloat16, master_separate=True)
    assert r.manager.tier_bytes()["host"] > r.baseline["host"]
    r.backward(r.grads())
    r.opt.step()

    def streams() -> int:
        return sum(t.name == "infinity-step-stream" and t.is_alive()
                   for t in threading.enumerate())
    running = streams()
    r.opt.close()
    assert streams() == running - 1          # the step stream stopped
    assert r.manager.tier_bytes() == r.baseline
    for s in r.opt.states:
        for store in (s.exp_avg, s.exp_avg_sq, s.master, s.grad_store):
            assert not store.resident


def test_an_optimizer_of_frozen_units_only_holds_nothing(rig) -> None:
    """No unit trains: no states, no pools, a room of 0 bytes, the smallest sub-group."""
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    try:
        frozen = nn.Parameter(torch.zeros(3))
        unit = Unit(0, "f", nn.Module(), [("f", frozen, -1)], torch.float32, CPU)
        unit.adopt(m, Tier.HOST, persistent=False)
        opt = PartitionedOptimizer([unit], [{"params": [frozen]}], m, optimizer_tier=Tier.NVME,
                                   grad_tier=Tier.NVME, early_step=False, sub_group_numel=10,
                                   master_separate=True, staging_pool=None)
        assert opt.states == [] and opt.grad_pool is None and opt.step_pool is None
        assert opt.held_room.capacity == 0 and opt.sub_group_numel == 2048
        opt.close()
    finally:
        m.close()


def test_step_pools_for_each_nvme_home(rig, disk_dir) -> None:
    """The step stream's pool exists when any state streams from NVMe: the parameters only
    (two staging slots), the gradients only (with a gradient buffer); the pools are named."""
    params = rig(param_tier=Tier.NVME, disk=disk_dir).opt
    assert params.step_pool.count == step_slot_count(Tier.HOST, Tier.NVME, Tier.HOST, False,
                                                     False) == 2
    assert params.step_pool.name == "optimizer" and params.grad_pool is None
    grads = rig(grad_tier=Tier.NVME, disk=disk_dir).opt
    assert grads.step_pool.count == 3 and grads.step_pool.slot_bytes == 2048 * 4
    assert grads.grad_pool.name == "gradient"


def test_speculation_doubles_every_nvme_state(rig, disk_dir) -> None:
    r = rig(dtype=torch.bfloat16, master_separate=True, optimizer_tier=Tier.NVME,
            param_tier=Tier.NVME, disk=disk_dir, speculation="auto", doubled=True)
    st = r.state(0)
    assert st.master.doubled and st.exp_avg.doubled and st.exp_avg_sq.doubled
    assert r.opt.speculation == "auto" and r.opt.holds_grads


def test_an_nvme_master_from_values_is_written_through_the_disk(rig, disk_dir) -> None:
    """Values for every parameter of unit 1 and not of unit 0: unit 1's NVMe master is the
    values unrounded, unit 0's the unit's bf16 values."""
    torch.manual_seed(0)
    exact = {"c": torch.randn(SHAPES["c"]), "a": torch.randn(SHAPES["a"])}
    r = rig(dtype=torch.bfloat16, master_separate=True, optimizer_tier=Tier.NVME,
            disk=disk_dir, values=exact)
    for index, name, want in ((1, "c", exact["c"]),
                              (0, "a", r.init["a"].to(torch.bfloat16).float())):
        master = r.state(index).master
        buf = r.manager.host_empty(master.padded, torch.float32, what="test")
        r.manager.wait(master.load_async(buf))
        e = r.units[index].params[0]
        assert e.name == name
        torch.testing.assert_close(buf[e.offset:e.offset + e.numel], want.reshape(-1),
                                   rtol=0, atol=0)
        assert not buf[r.units[index].trainable_numel:].any()


def _speculated(rig, disk_dir) -> Rig:
    r = rig(optimizer_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, speculation="on",
            doubled=True)
    r.before = r.values()
    assert r.backward(r.grads()) == [False] * 4 and r.opt.speculation_pending
    return r


def _unchanged_after_a_clean_step(r: Rig) -> None:
    """The rolled-back units given back, no step queued, every parameter as before; the next
    cycle is AdamW's first step."""
    assert sorted(u.index for u in r.opt.take_rolled_back()) == [0, 1, 2, 3]
    for u in r.opt.reap(Wait.ALL):
        u.release(r.manager)
    for u in r.units:
        u.release(r.manager)
    assert not r.opt.speculation_pending and not r.opt.holds_cycle_gradients()
    got = r.values()
    assert all(torch.equal(got[n], r.before[n]) for n in r.names)
    g = r.grads()
    r.backward(g)
    r.step()
    r.ref_step(g)
    r.assert_matches()


def test_zero_grad_rolls_a_speculated_step_back(rig, disk_dir, infinity_log) -> None:
    r = _speculated(rig, disk_dir)
    with infinity_log.at_level(logging.DEBUG, logger="infinity"):
        r.opt.discard_cycle_gradients()
    assert "speculative step of 4 unit(s) rolled back (zero_grad() discarded the gradients)" in \
        [rec.getMessage() for rec in infinity_log.records]
    assert r.opt.speculation_stats["rolled_back"] == 1
    _unchanged_after_a_clean_step(r)


def test_a_backward_that_raised_rolls_a_speculated_step_back(rig, disk_dir,
                                                            infinity_log) -> None:
    r = _speculated(rig, disk_dir)
    with infinity_log.at_level(logging.DEBUG, logger="infinity"):
        r.opt.abandon_backward()
    assert "speculative step of 4 unit(s) rolled back (the backward raised)" in \
        [rec.getMessage() for rec in infinity_log.records]
    assert r.opt.speculation_stats["rolled_back"] == 1
    _unchanged_after_a_clean_step(r)


def _hold_kernels(opt: PartitionedOptimizer) -> threading.Event:
    """Make ``opt``'s step kernels wait until the returned event is set (the order of events
    is then the test's; the long limit only ends a hang)."""
    gate, real = threading.Event(), opt.kernel.run

    def held_run(*args, **kwargs):
        if not gate.wait(600.0):
            raise TimeoutError("the test never let the held kernels run")
        return real(*args, **kwargs)

    opt.kernel.run = held_run
    return gate


def test_a_unit_whose_step_has_not_run_its_kernels_is_not_expected(rig) -> None:
    """Early schedule, the kernels held back: a unit whose step waits for its kernels is not
    expected again (its reads would overtake that step), another unit is; once the kernels
    ran (the job not yet reaped) the unit may be expected again."""
    r = rig(early=True)
    opt, gate = r.opt, _hold_kernels(r.opt)
    g = r.grads()
    opt.begin_backward(True)
    unit = r.units[3]
    unit.finish_fetch(r.manager, None)
    try:
        opt.expect_backward(unit)                # made ready when its gradients are in
        assert opt.stream_stats()["expected"] == 1
        for e in unit.params:
            opt.on_grad(unit, e, g[e.name])
        assert opt.on_unit_backward_done(unit) is False
        opt.expect_backward(unit)
        assert opt.stream_stats()["expected"] == 1
        opt.expect_backward(r.units[2])
        assert opt.stream_stats()["expected"] == 2
    finally:
        gate.set()      # a failure above must not leave the stream held
    opt.wait_stepped(unit)
    opt.expect_backward(unit)
    assert opt.stream_stats()["expected"] == 3
    opt.end_backward()
    r.step()
    r.ref_step(g, only={"e"})
    torch.testing.assert_close(r.values()["e"], r.ref["e"].detach(), **TOL)


def test_a_unit_whose_deferred_step_waits_is_not_expected(rig, disk_dir) -> None:
    """Speculation planned, clipping acting: the speculated steps are redone as deferred
    ones waiting for their units; a forward expecting the next backward's units must not
    read ahead the states of a unit whose step waits."""
    r = rig(optimizer_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, speculation="on",
            doubled=True)
    r.opt.clip_norm = 1e-3
    r.backward(r.grads())
    r.opt.step()
    assert len(r.opt.waiting_units()) == 4
    before = r.opt.stream_stats()["expected"]
    r.opt.expect_backward(r.units[3])
    assert r.opt.stream_stats()["expected"] == before


@pytest.mark.parametrize("values", [None, {"a": torch.ones(4, 3), "b": torch.ones(7)}])
def test_the_master_init_buffer_is_named_in_a_host_budget_error(rig, disk_dir, values) -> None:
    """An NVMe master is seeded through a host buffer counted in the host budget (from the
    units or from values): too small a budget names it."""
    from infinity.base.budget import BudgetExceededError
    with pytest.raises(BudgetExceededError, match=r"master init needs 4\.00 KiB of host memory"):
        rig(dtype=torch.bfloat16, master_separate=True, optimizer_tier=Tier.NVME,
            grad_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, host_budget=1024,
            values=values)


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.NVME])
def test_a_sharded_master_is_seeded_from_the_own_shard(tier, disk_dir) -> None:
    """Rank 1 of 2: the master holds elements [2048, 3072) of the unit, from its values."""
    comm = _Comm()
    comm.rank = 1
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3000).to(torch.bfloat16))
    unit = Unit(0, "s0", nn.Module(), [("w", w, 0)], torch.bfloat16, CPU, comm=comm, shards=2,
                params_sharded=True)
    # this rank's shard of ``past`` lies past its trainable part: a master of nothing
    x = nn.Parameter(torch.randn(100).to(torch.bfloat16))
    past = Unit(1, "s1", nn.Module(), [("x", x, 0),
                                       ("y", nn.Parameter(torch.zeros(5000, dtype=torch.bfloat16)),
                                        -1)], torch.bfloat16, CPU, comm=comm, shards=2)
    want = w.detach().float()[2048:3000].clone()
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                    nvme_path=str(disk_dir),
                    aio_config=AioConfig(backend="auto", block_size=1 << 20, queue_depth=4))
    try:
        unit.adopt(m, Tier.HOST, persistent=False)
        past.adopt(m, Tier.HOST, persistent=False)
        opt = PartitionedOptimizer([unit, past], [{"params": [w, x]}], m, optimizer_tier=tier,
                                   grad_tier=Tier.HOST, early_step=False, sub_group_numel=2048,
                                   master_separate=True, staging_pool=None, comm=comm,
                                   shard_states=True)
        master = opt.states[0].master
        buf = m.host_empty(master.padded, torch.float32, what="test")
        if master.resident:
            buf.copy_(master.tensor)
        else:
            m.wait(master.load_async(buf))
        assert torch.equal(buf[:952], want) and not buf[952:].any()
        assert unit.residency == Residency.RELEASED
        assert (opt.states[1].lo, opt.states[1].hi, opt.states[1].master.numel) == (1024, 1024, 1)
        assert comm.calls == []          # the own shard only: no collective at construction
        opt.close()
    finally:
        m.close()


def test_reap_waits_as_asked(rig) -> None:
    """A unit's early step held back in its kernels: ``reap()`` hands out nothing (nothing
    landed), ``reap(Wait.ALL)`` waits for the step to land and hands the unit out."""
    r = rig(early=True)
    opt, gate = r.opt, _hold_kernels(r.opt)
    g = r.grads()
    opt.begin_backward(True)
    unit = r.units[3]
    unit.finish_fetch(r.manager, None)
    try:
        for e in unit.params:
            opt.on_grad(unit, e, g[e.name])
        assert opt.on_unit_backward_done(unit) is False
        assert opt.reap() == []
        (job,) = opt.steps.jobs
        landed = job.landed_future.result

        def open_then_wait(timeout=None):     # the gate opens once reap waits
            gate.set()
            return landed(timeout)

        job.landed_future.result = open_then_wait
        assert opt.reap(Wait.ALL) == [unit]
    finally:
        gate.set()
    opt.end_backward()


def test_an_overflow_rolls_a_speculated_step_back(rig, disk_dir, infinity_log) -> None:
    """A speculated step whose gradients were not finite: skipped (rolled back for an
    overflow, never kept), the parameters as before; the next step is AdamW's first."""
    r = rig(optimizer_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, speculation="on",
            doubled=True)
    r.before = r.values()
    g = r.grads()
    g["a"][0, 0] = math.nan
    assert r.backward(g) == [False] * 4 and r.opt.speculation_pending
    with infinity_log.at_level(logging.DEBUG, logger="infinity"):
        r.opt.step()
    assert r.opt.overflow and r.opt.waiting_units() == []
    # a checkpoint saves this (false, not null: a null is not restored, and a resumed run
    # would take speculation to pay again)
    assert r.opt.speculation_pays is False
    assert "speculative step of 4 unit(s) rolled back (an overflow)" in \
        [rec.getMessage() for rec in infinity_log.records]
    _unchanged_after_a_clean_step(r)


def test_values_need_only_the_parameters_of_the_range(rig, disk_dir) -> None:
    """Whether the master comes from the values asks only about the parameters inside the
    state's range: a frozen parameter starting where the trainable range ends, or (sharded)
    a parameter ending where the own shard begins, need not be provided."""
    torch.manual_seed(1)
    exact_e = torch.randn(SHAPES["e"])
    r = rig(dtype=torch.bfloat16, master_separate=True, frozen=True, values={"e": exact_e})
    unit = r.units[3]
    e, f = unit.params
    assert (e.name, f.name, f.offset) == ("e", "f", unit.trainable_numel)
    assert torch.equal(r.state(3).master.tensor[:6], exact_e)

    comm = _Comm()
    comm.rank = 1
    p1 = nn.Parameter(torch.zeros(2048, dtype=torch.bfloat16))
    p2 = nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    sharded = Unit(0, "s", nn.Module(), [("p1", p1, 0), ("p2", p2, 0)], torch.bfloat16, CPU,
                   comm=comm, shards=2)
    assert [p.offset for p in sharded.params] == [0, 2048] and sharded.shard_start == 2048
    exact_p2 = torch.randn(1000)
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    try:
        sharded.adopt(m, Tier.HOST, persistent=False)
        opt = PartitionedOptimizer([sharded], [{"params": [p1, p2]}], m,
                                   optimizer_tier=Tier.HOST, grad_tier=Tier.HOST,
                                   early_step=False, sub_group_numel=2048, master_separate=True,
                                   staging_pool=None, comm=comm, shard_states=True,
                                   values=_Values({"p2": exact_p2}))
        assert torch.equal(opt.states[0].master.tensor[:1000], exact_p2)
        opt.close()
    finally:
        m.close()


def test_a_forward_between_backward_and_step_leaves_no_stale_reads(rig, disk_dir) -> None:
    """The model read between a speculated backward and the step (the speculation voided),
    and that forward expected the next backward's units: the step drops those expected reads
    (of the states it is about to change), so the next cycle still matches AdamW."""
    r = rig(optimizer_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, speculation="on",
            doubled=True)
    opt = r.opt
    g1 = r.grads()
    assert r.backward(g1) == [False] * 4
    opt.void_speculation()
    for u in opt.take_rolled_back() + opt.reap(Wait.ALL):
        u.release(r.manager)
    for unit in r.units[2:]:
        opt.expect_backward(unit)
    r.step()
    r.ref_step(g1)
    g2 = r.grads()
    assert r.backward(g2) == [False] * 4
    r.step()
    r.ref_step(g2)
    r.assert_matches()


def test_two_ranks_at_stage_0_step_the_averaged_gradient(rig, monkeypatch) -> None:
    """Stage 0 over two ranks that computed the same gradients: each unit's gradient averaged
    (one all-reduce of its trainable range), the norm their mean, the update the single-rank
    AdamW's (clipped); the collectives' seconds (1000 each, on the optimizer's clock) are not
    counted as the optimizer's."""
    from types import SimpleNamespace

    from infinity.optim import partitioned
    comm = _Comm(world_size=2, factor=2.0)
    monkeypatch.setattr(partitioned, "time", SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + comm.counters.comm_s))
    r = rig(comm=comm)
    r.opt.clip_norm = 1.0
    assert r.opt.grad_pool is not None and not r.opt.holds_grads
    for _ in range(2):
        g = r.grads()
        comm.calls.clear()
        r.opt.timers.grad_s = 5.0
        t0 = time.perf_counter()
        r.backward(g)
        wall = time.perf_counter() - t0
        assert [c[:2] for c in comm.calls] == [("all-reduce", i) for i in (3, 2, 1, 0)]
        assert 5.0 < r.opt.timers.grad_s <= 5.0 + wall
        r.step()
        norm = r.ref_step(g, clip=1.0)
        assert r.opt.last_grad_norm == pytest.approx(norm, rel=1e-6)
        r.opt.timers.reset()
    r.assert_matches()


def test_a_backward_that_does_not_speculate_expects_nothing(rig, disk_dir) -> None:
    """Speculation "on", but a micro-step before the boundary does not speculate: its units'
    states are not read ahead (the forward before it, which plans the boundary's, may)."""
    r = rig(optimizer_tier=Tier.NVME, param_tier=Tier.NVME, disk=disk_dir, speculation="on",
            doubled=True)
    r.opt.begin_backward(False)
    r.opt.expect_backward(r.units[3])
    assert r.opt.stream_stats()["expected"] == 0
    r.opt.end_backward()
    r.opt.expect_backward(r.units[3])
    assert r.opt.stream_stats()["expected"] == 1
    r.opt.cancel_expected()


def test_held_gradients_past_the_room_wait_for_the_running_steps(rig) -> None:
    """Early schedule with a held-gradient room of 0 bytes: every unit's gradients go past
    it, so each take asks whether a background step is still running (and waits for it to
    give room back); the updates are AdamW's."""
    r = rig(early=True)
    r.opt.held_room.capacity = 0
    g = r.grads()
    assert r.backward(g) == [False] * 4
    r.step()
    r.ref_step(g)
    r.assert_matches()


def test_an_early_step_streams_no_gradient_from_nvme(rig, disk_dir) -> None:
    """Early schedule with an NVMe gradient tier: gradients never go home, so the step pool
    holds the one slot of nothing streamed, not a gradient slot per sub-group."""
    opt = rig(early=True, grad_tier=Tier.NVME, disk=disk_dir).opt
    assert opt.step_pool.count == step_slot_count(Tier.HOST, Tier.HOST, Tier.NVME, False,
                                                  True) == 1
