"""The step stream (optim/step_stream.py) at unit level: small real units, the real Adam kernel, real host stores and a small "disk"
store whose reads and writes happen only when they are waited for (a buffer used before its read
was waited for, or reused before its write was waited for, shows in the values). The resulting
states are checked against a float64 Adam (fakes.reference_adam_f64: fp32 Adam within
rtol 1e-5, atol 1e-6); the order of reads, kernels and writes against what the stream promises
its callers (read ahead, writes behind, a state read only after its last write, a ready job never
behind an expected one); errors and cleanup on a failure mid-stream.

Most tests run the stream's loop in the test thread: the rig starts the stream and shuts its
thread down at once (nothing queued), then queues jobs and runs ``_run`` by hand, so the order
the log records does not depend on timing. Two tests use the stream's own thread."""
from __future__ import annotations

import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fakes import failing_on_call, reference_adam_f64
from messages import raises_naming
from infinity.base.budget import MemoryBudget
from infinity.optim.held_room import HeldRoom
from infinity.optim.kernel import AdamKernel
from infinity.optim.adam_formats import dequantize_blockwise, quantization_map
from infinity.optim.device_copy import IN_FLIGHT, DeviceCopyWrites, flat_rounded_by_kernel
from infinity.optim.records import (
    CompleteGradient, JobPhase, OptimTimers, StepRun, UnitOptimState)
from infinity.optim.state_formats import build_state
from infinity.optim import step_stream
from infinity.optim.step_stream import READ_AHEAD, WRITES_BEHIND, StepStream
from infinity.planner.state_format import QBLOCK, StateFormat
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.storage.transfers import LateCopies, _LateEvent
from infinity.zero.unit import Unit

SUB = 1024                      # sub-group numel (4 KiB of fp32)
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-5, atol=1e-6)


class _Request:
    """A disk request: its copy happens when it is waited for (once); ``error`` raises then."""

    def __init__(self, log: list, what: tuple, action, error: BaseException | None = None):
        self.log, self.what, self.action, self.error = log, what, action, error
        self.waited = False

    def wait(self, timeout=None) -> int:
        if not self.waited:
            self.waited = True
            if self.error is not None:
                self.log.append(("failed",) + self.what)
                raise self.error
            self.action()
            self.log.append(("done",) + self.what)
        return 0


class DiskStore:
    """A store on "NVMe" (not resident): ``data`` and ``shadow`` are its two extents."""

    resident = False

    def __init__(self, name: str, values: torch.Tensor, log: list) -> None:
        self.name, self.log = name, log
        self.data = values.clone()
        self.shadow = torch.zeros_like(self.data)
        self.dtype = values.dtype
        self.errors: dict[tuple[str, int], BaseException] = {}   # (read/write, start) -> error

    def load_async(self, buf, start=0, count=None, shadow=False):
        self.log.append(("read", self.name, start, count))
        src = self.shadow if shadow else self.data
        return _Request(self.log, ("read", self.name, start),
                        lambda: buf[:count].copy_(src[start:start + count]),
                        self.errors.get(("read", start)))

    def store_async(self, buf, start=0, count=None, shadow=False):
        self.log.append(("write", self.name, start, count, shadow))
        self.sources = getattr(self, "sources", []) + [buf.data_ptr()]
        dst = self.shadow if shadow else self.data
        return _Request(self.log, ("write", self.name, start),
                        lambda: dst[start:start + count].copy_(buf[:count]),
                        self.errors.get(("write", start)))


class LoggingKernel(AdamKernel):
    def __init__(self, groups, log: list) -> None:
        super().__init__(groups, adamw_mode=True, threads=1)
        self.log = log
        self.before_run = None     # called with (state, start) before each kernel

    def run(self, state, start, end, *args, **kwargs):
        if self.before_run is not None:
            self.before_run(state, start)
        self.log.append(("kernel", state.unit.name, start, end))
        return super().run(state, start, end, *args, **kwargs)


class Rig:
    """A stream whose thread has been shut down (``run`` runs its loop here), a pool of
    ``slots``, one param group (``groups``) and a log of every read, write, kernel and job
    event."""

    def __init__(self, slots: int | None = 12, threaded: bool = False) -> None:
        self.log: list = []
        self.manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
        self.pool = BufferPool(self.manager, SUB * 4, slots, "optimizer") if slots else None
        self.groups = [dict(HYPER)]
        self.kernel = LoggingKernel(lambda: self.groups, self.log)
        self.timers = OptimTimers()
        self.stream = StepStream(self.kernel, self.manager, self.pool, SUB, self.timers)
        if not threaded:
            self.stream.shutdown()

    def run(self) -> None:
        step_stream._run_while_held(weakref.ref(self.stream), self.stream._wake)

    def unit(self, name: str, sizes: list[int], dtype=torch.float32, aligned=True,
             param_home: str = "disk", seed: int = 0) -> tuple[Unit, torch.Tensor]:
        """A unit of parameters ``sizes`` (param group 0) and its fp32 starting values."""
        g = torch.Generator().manual_seed(seed)
        params = [(f"w{i}", nn.Parameter(torch.randn(n, generator=g)), 0)
                  for i, n in enumerate(sizes)]
        unit = Unit(len(self.log), name, nn.Module(), params, dtype, torch.device("cpu"))
        if aligned:
            unit.flat = self.manager.host_empty(unit.flat_numel, dtype, "flat")
        else:
            unit.flat = torch.zeros(unit.flat_numel + 8, dtype=dtype)[8:]
        unit.flat.zero_()
        values = torch.zeros(unit.trainable_numel)
        for e in unit.params:
            values[e.offset:e.offset + e.numel] = e.param.detach()
        unit.flat[:unit.trainable_numel].copy_(values)
        if param_home == "disk":
            unit.param_store = DiskStore(f"{name}.p", unit.flat.detach().clone(), self.log)
        elif param_home == "host":
            unit.param_store = self.manager.create(f"{name}.p", unit.numel, dtype, Tier.HOST)
        return unit, values

    def state(self, unit: Unit, values: torch.Tensor, disk=True, master=False,
              grad: torch.Tensor | None = None, grad_disk=True) -> UnitOptimState:
        n = unit.trainable_numel

        def store(what, init):
            if disk:
                return DiskStore(f"{unit.name}.{what}", init, self.log)
            s = self.manager.create(f"{unit.name}.{what}", n, torch.float32, Tier.HOST)
            s.tensor[:n].copy_(init)
            return s
        zeros = torch.zeros(n)
        grad_store = None
        if grad is not None:
            grad_store = DiskStore(f"{unit.name}.g", grad, self.log) if grad_disk else \
                self.manager.create(f"{unit.name}.g", n, torch.float32, Tier.HOST)
            if not grad_disk:
                grad_store.tensor[:n].copy_(grad)
        return UnitOptimState(unit, store("m", zeros), store("v", zeros),
                              store("master", values) if master else None, grad_store)

    def events(self, kind: str) -> list:
        return [e for e in self.log if e[0] == kind]

    def watch(self, job, name: str):
        job.stepped_future.add_done_callback(lambda f: self.log.append(("stepped", name)))
        job.landed_future.add_done_callback(lambda f: self.log.append(("landed", name)))
        return job


def tensor_of(store, n: int) -> torch.Tensor:
    return store.data[:n] if isinstance(store, DiskStore) else store.tensor[:n]


def grad_of(values: torch.Tensor, seed: int = 1) -> torch.Tensor:
    g = torch.randn(values.numel(), generator=torch.Generator().manual_seed(seed))
    g[values == 0] = 0          # the padding between and after parameters gets no gradient
    return g


def check_adam(state: UnitOptimState, values, grads: list, n: int | None = None,
               params_home: bool = True, **over) -> None:
    """m, v, the master (or device copy) and the param home after ``grads`` steps from
    ``values`` equal the float64 Adam's over the parameters' elements."""
    h = dict(lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
             adamw_mode=True, bias_correction=True, grad_scale=1.0)
    h.update(over)
    unit = state.unit
    for e in unit.trainable_entries():
        s = slice(e.offset, e.offset + e.numel)
        p, m, v = reference_adam_f64(values[s], [g[s] for g in grads], **h)
        close(tensor_of(state.exp_avg, unit.trainable_numel)[s], m)
        close(tensor_of(state.exp_avg_sq, unit.trainable_numel)[s], v)
        if state.master is not None:
            close(tensor_of(state.master, unit.trainable_numel)[s], p)
            assert torch.equal(unit.flat[s],
                               tensor_of(state.master, unit.trainable_numel)[s].to(unit.dtype))
        else:
            close(unit.flat[s], p)
        if params_home and unit.param_store is not None:
            assert torch.equal(tensor_of(unit.param_store, unit.numel)[s], unit.flat[s])


# -- values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("aligned", [True, False])
def test_an_early_step_on_disk_states_equals_adam_and_gives_everything_back(aligned) -> None:
    """Three sub-groups of m, v and the parameters on "NVMe": every state written home equals
    Adam's; the parameters go home straight from a page-aligned device copy, else through a slot;
    the gradient's slot goes back once, the pool is whole again, the gradient's squares are the
    job's norm, and the step is counted once."""
    rig = Rig()
    unit, values = rig.unit("u", [3000], aligned=aligned)
    state = rig.state(unit, values)
    g = grad_of(values)
    gpool = BufferPool(rig.manager, unit.trainable_numel * 4, 1, "gradient")
    slot = gpool.acquire()
    slot.view(torch.float32, unit.trainable_numel).copy_(g)
    gradient = CompleteGradient(slot.view(torch.float32, unit.trainable_numel), slot=slot,
                                pool=gpool)
    job = rig.watch(rig.stream.submit(state, early=True, gradient=gradient), "u")
    at_stepped: list = []
    job.stepped_future.add_done_callback(lambda f: at_stepped.append(gpool.available))
    rig.run()
    check_adam(state, values, [g])
    assert job.phase is JobPhase.LANDED and job.runs is not None and state.step == 1
    assert job.sq_norm == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)
    assert gpool.available == 1 and gradient.slot is None
    assert rig.pool.available == 12
    direct = [ptr == unit.flat[a:].data_ptr()
              for ptr, a in zip(unit.param_store.sources, (0, 1024, 2048))]
    assert direct == [aligned] * 3
    assert [e[1:4] for e in rig.events("kernel")] == [("u", 0, 1024), ("u", 1024, 2048),
                                                      ("u", 2048, 3072)]
    assert rig.log.index(("stepped", "u")) < rig.log.index(("landed", "u")) == len(rig.log) - 1
    assert at_stepped == [1]            # given back after the last kernel, not at the landing


def test_resident_states_without_a_pool_equal_adam_and_the_param_home_is_copied() -> None:
    """Host stores (no pool at all): m and v are updated in place, the parameters copied to a
    host param home; two steps in a row (the second at step 2) and a grad_scale divide."""
    rig = Rig(slots=None)
    unit, values = rig.unit("u", [1500, 700], param_home="host")
    state = rig.state(unit, values, disk=False)
    g1, g2 = grad_of(values, 1), grad_of(values, 2)
    first = rig.stream.submit(state, early=True, grad_scale=4.0,
                              gradient=CompleteGradient(g1 * 4))
    first.stepped_future.add_done_callback(lambda f: rig.stream.submit(
        state, early=True, grad_scale=4.0, gradient=CompleteGradient(g2 * 4)))
    rig.run()
    check_adam(state, values, [g1, g2])
    assert state.step == 2 and state.param_steps == {0: 2, 1504: 2}


def test_an_early_step_waits_for_its_gradient_s_copies_before_its_first_kernel() -> None:
    """The gradient comes with copies from the device still landing (late copies held at a
    gate that only a wait opens): the stream waits for them (logged "landed") before its first
    kernel, once, and steps the landed values (a kernel before the wait would read NaN)."""
    rig = Rig()
    unit, values = rig.unit("u", [3000])
    state = rig.state(unit, values)
    g = grad_of(values)
    copies, gate = LateCopies(seed=1), threading.Event()
    copies._jobs.put(gate.wait)
    buffer = torch.empty(unit.trainable_numel)
    landing = [copies.to_host(buffer[:1500], g[:1500]),
               copies.to_host(buffer[1500:], g[1500:])]
    waits = copies.host_waits

    def open_then_wait(events) -> None:
        events = list(events)
        rig.log.append(("landed", len(events)))
        gate.set()
        waits(events)
    copies.host_waits = open_then_wait
    assert torch.isnan(buffer).all()
    gradient = CompleteGradient(buffer, copies=copies, landing=landing)
    rig.stream.submit(state, early=True, gradient=gradient)
    rig.run()
    check_adam(state, values, [g])
    assert [e for e in rig.log if e[0] == "landed"] == [("landed", 2)]
    assert rig.log.index(("landed", 2)) < rig.log.index(rig.events("kernel")[0])
    assert copies.poisoned == copies.lost == 0


def test_no_param_store_means_no_parameter_write() -> None:
    rig = Rig()
    unit, values = rig.unit("u", [1000], param_home="none")
    state = rig.state(unit, values)
    g = grad_of(values)
    rig.stream.submit(state, early=True, gradient=CompleteGradient(g))
    rig.run()
    check_adam(state, values, [g])
    assert {e[1] for e in rig.events("write")} == {"u.m", "u.v"}


@pytest.mark.parametrize("held", [False, True])
def test_a_separate_master_rounds_into_the_16_bit_device_copy(held) -> None:
    """bf16 compute with an fp32 master on disk: the master written home is Adam's, the device
    copy and the param home its bf16 rounding -- with a flat gradient (the kernel rounds into
    the device copy) and with held parts (through a temporary)."""
    rig = Rig()
    unit, values = rig.unit("u", [1000, 2000], dtype=torch.bfloat16)
    state = rig.state(unit, values, master=True)
    unit.flat[:unit.trainable_numel].copy_(values.to(torch.bfloat16))
    g = grad_of(values)
    grad = {e.offset: g[e.offset:e.offset + e.numel].clone() for e in unit.params} if held \
        else g
    rig.stream.submit(state, early=True, gradient=CompleteGradient(grad))
    rig.run()
    check_adam(state, values, [g])


@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("held", [False, True])
def test_a_device_copy_written_by_a_late_copy_is_current_when_its_unit_is_stepped(
        held, planted, monkeypatch) -> None:
    """Copies that overlap compute (a GPU's; here the late copies, whose destination reads NaN
    until the copy lands): the stepped parameters go to the device copy by a copy, and the job
    is stepped only once it has landed, so the training thread, which reads a device copy only
    after ``stepped``, needs no wait of its own. The param home is written from the temporary,
    never from the device copy. No copy lands before something waits for one (a gate), so the
    planted fault, no wait before ``stepped``, is seen every time: NaN at ``stepped``."""
    rig = Rig()
    copies = _gated_late_copies(rig, monkeypatch)
    if planted:
        monkeypatch.setattr(DeviceCopyWrites, "land", lambda self: 0.0)
    unit, values = rig.unit("u", [1000, 2000], dtype=torch.bfloat16)
    state = rig.state(unit, values, master=True)
    n = unit.trainable_numel
    g = grad_of(values)
    grad = {e.offset: g[e.offset:e.offset + e.numel].clone() for e in unit.params} if held \
        else g
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(grad))
    at_stepped: list = []
    job.stepped_future.add_done_callback(lambda f: at_stepped.append(unit.flat[:n].clone()))
    try:
        rig.run()
    finally:
        copies.drain()
    assert copies.copies >= 1 and not job.error
    if planted:
        assert at_stepped[0].isnan().any()
        return
    assert torch.equal(at_stepped[0], state.master.data[:n].to(torch.bfloat16))
    check_adam(state, values, [g])
    # the step stream's own time, which a profile of the training thread does not see
    assert rig.timers.kernel_s > 0 and rig.timers.device_write_wait_s > 0
    # a real disk reads its source when the write is issued, here only at its wait
    lo = unit.flat.data_ptr()
    hi = lo + unit.flat.numel() * unit.flat.element_size()
    assert unit.param_store.sources and not any(lo <= p < hi for p in unit.param_store.sources)


def _gated_late_copies(rig: Rig, monkeypatch) -> LateCopies:
    """Late copies for ``rig`` that land none before something waits for one (a gate the
    first wait opens): a missing wait is seen every time, not by the luck of a slow thread."""
    copies = rig.manager.copies = LateCopies(seed=3)
    gate = threading.Event()
    copies._jobs.put(gate.wait)
    wait = _LateEvent.wait

    def opens(event) -> None:
        gate.set()
        wait(event)
    monkeypatch.setattr(_LateEvent, "wait", opens)
    return copies


def test_device_copy_writes_in_flight_are_bounded_and_a_failed_job_lands_them(
        monkeypatch) -> None:
    """A unit of several sub-groups under late copies: at each kernel at most ``IN_FLIGHT``
    writes of its job are in flight (two sub-groups' temporaries alive, not the unit's); and a
    job whose kernel fails waits for the writes it issued before it is failed and its unit
    handed back: no copy then still writes the device copy (it would race the next user of
    that memory)."""
    rig = Rig()
    copies = _gated_late_copies(rig, monkeypatch)
    unit, values = rig.unit("u", [SUB * 3, SUB * 2], dtype=torch.bfloat16)
    state = rig.state(unit, values, master=True)
    in_flight: list[int] = []
    job = None

    def before_run(st, start) -> None:
        in_flight.append(len(job.device_writes.pending))
        if start >= 4 * SUB:
            raise RuntimeError("planted kernel failure")
    rig.kernel.before_run = before_run
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(grad_of(values)))
    at_fail: list = []
    job.landed_future.add_done_callback(lambda f: at_fail.append(
        (len(job.device_writes.pending), unit.flat[:4 * SUB].isnan().any().item())))
    try:
        rig.run()
    finally:
        copies.drain()
    assert in_flight == [0] + [IN_FLIGHT] * 4 and copies.copies == 4
    assert isinstance(job.error, RuntimeError) and at_fail == [(0, False)]


def test_a_parameter_without_gradient_keeps_its_master_value_in_the_device_copy() -> None:
    """``params`` leaves one parameter out: it is not stepped (master, m, v unchanged) and its
    device-copy elements are its master's rounding, not what the device copy held before."""
    rig = Rig()
    unit, values = rig.unit("u", [1000, 1000], dtype=torch.bfloat16)
    state = rig.state(unit, values, master=True)
    unit.flat.fill_(7.0)          # stale: the master is the truth
    g = grad_of(values)
    rig.stream.submit(state, early=True, gradient=CompleteGradient(g), params=frozenset({0}))
    rig.run()
    second = slice(1008, 2008)
    assert torch.equal(state.master.data[second], values[second])
    assert torch.equal(unit.flat[second], values[second].to(torch.bfloat16))
    assert not state.exp_avg.data[second].any() and state.param_steps == {0: 1}
    p, m, _ = reference_adam_f64(values[:1000], [g[:1000]], lr=1e-2, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.01, adamw_mode=True,
                                 bias_correction=True, grad_scale=1.0)
    close(state.master.data[:1000], p)
    assert torch.equal(unit.flat[:1000], state.master.data[:1000].to(torch.bfloat16))


@pytest.mark.parametrize("grad_disk", [True, False])
def test_a_deferred_step_reads_the_gradient_home_and_zeroes_a_resident_one(grad_disk) -> None:
    """The deferred schedule (early=False): the gradient comes from the unit's gradient home
    (read through a slot from disk, never written back), and a host home is zeroed after its
    sub-group's step (the next backward accumulates into it); no norm in the kernel."""
    rig = Rig()
    unit, values = rig.unit("u", [2500])
    g = grad_of(values)
    state = rig.state(unit, values, grad=g, grad_disk=grad_disk)
    job = rig.stream.submit(state, early=False, grad_scale=2.0)
    rig.run()
    check_adam(state, values, [g], grad_scale=2.0)
    assert job.sq_norm == 0.0
    if grad_disk:
        assert torch.equal(state.grad_store.data, g)
        assert ("read", "u.g", 0, 1024) in rig.log
        assert not [e for e in rig.events("write") if e[1] == "u.g"]
    else:
        assert not state.grad_store.tensor.any()


def test_hyperparameters_fixed_when_asked_deferred_at_expect_early_at_ready() -> None:
    """A deferred step's learning rate is the one when its step was asked for (``expect``: a
    scheduler moves it before the step runs); an early step's is the one when its gradients are
    complete (``make_ready``)."""
    rig = Rig()
    ua, va = rig.unit("a", [1000], seed=1)
    ub, vb = rig.unit("b", [1000], seed=2)
    ga, gb = grad_of(va, 3), grad_of(vb, 4)
    sa = rig.state(ua, va, grad=ga)
    sb = rig.state(ub, vb)
    deferred = rig.stream.expect(sa, early=False)
    early = rig.stream.expect(sb, early=True)
    rig.groups[0]["lr"] = 0.05
    rig.stream.make_ready(deferred)
    rig.stream.make_ready(early, CompleteGradient(gb))
    rig.run()
    check_adam(sa, va, [ga], lr=1e-2)
    check_adam(sb, vb, [gb], lr=0.05)
    assert rig.stream.stats["expected"] == 2


def test_make_ready_overrides_only_what_it_is_given() -> None:
    """``grad_scale`` and ``params`` given at make_ready replace the queued ones; None keeps
    them."""
    rig = Rig()
    ua, va = rig.unit("a", [1000, 1000], seed=1)
    ub, vb = rig.unit("b", [1000, 1000], seed=2)
    sa, sb = rig.state(ua, va), rig.state(ub, vb)
    ga, gb = grad_of(va, 3), grad_of(vb, 4)
    ja = rig.stream.expect(sa, grad_scale=3.0)
    jb = rig.stream.expect(sb, grad_scale=3.0, params=frozenset({0}))
    rig.stream.make_ready(ja, CompleteGradient(ga * 2), grad_scale=2.0,
                          params=frozenset({1008}))
    rig.stream.make_ready(jb, CompleteGradient(gb * 3))
    rig.run()
    assert sa.param_steps == {1008: 1} and sb.param_steps == {0: 1}
    pa, _, _ = reference_adam_f64(va[1008:2008], [ga[1008:2008]], lr=1e-2, beta1=0.9,
                                  beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                                  bias_correction=True, grad_scale=1.0)
    close(ua.flat[1008:2008], pa)
    assert torch.equal(ua.flat[:1000], va[:1000])
    p, _, _ = reference_adam_f64(vb[:1000], [gb[:1000]], lr=1e-2, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.01, adamw_mode=True,
                                 bias_correction=True, grad_scale=1.0)
    close(ub.flat[:1000], p)
    assert torch.equal(ub.flat[1008:2008], vb[1008:2008])


def _held_at_each_kernel(rig: Rig, sizes: list[int], **unit_kwargs) -> list[tuple[int, int]]:
    """Step one unit of ``sizes`` from held gradient parts (an early step) and return (the
    sub-group's start, the room's held bytes) at each kernel; checks the values against Adam
    and that every part is given back at the end."""
    unit, values = rig.unit("u", sizes, **unit_kwargs)
    state = rig.state(unit, values)
    g = grad_of(values)
    room = HeldRoom(1 << 20)
    nbytes = sum(sizes) * 4
    room.take(nbytes, lambda: False)
    parts = {e.offset: g[e.offset:e.offset + e.numel].clone() for e in unit.params}
    held_at_kernel: list[tuple[int, int]] = []
    rig.kernel.before_run = lambda st, start: held_at_kernel.append((start, room.held))
    rig.stream.submit(state, early=True, gradient=CompleteGradient(parts, held_bytes=nbytes,
                                                                   room=room))
    rig.run()
    check_adam(state, values, [g])
    assert room.held == 0
    return held_at_kernel


def test_held_gradient_parts_are_freed_as_their_sub_groups_are_stepped() -> None:
    """Held parts: a part no sub-group still to step covers goes back to the room before the
    job ends (the first parameter's part after its sub-groups, before the second's kernels);
    all are back at the end."""
    assert _held_at_each_kernel(Rig(), [2048, 2048]) == \
        [(0, 16384), (1024, 16384), (2048, 8192), (3072, 8192)]


def test_held_gradient_parts_wait_for_the_next_sub_group_when_none_is_read_ahead() -> None:
    """Two slots (one sub-group's reads at a time): after a sub-group is stepped no later one of
    its job is loaded, so the parts still to be stepped are those from its next pending
    sub-group on: only the stepped parameter's part is freed, and every later sub-group steps
    its own gradient (a part freed too early would step with zeros)."""
    assert _held_at_each_kernel(Rig(slots=2), [1024, 1024, 1024], param_home="none") == \
        [(0, 12288), (1024, 8192), (2048, 4096)]


# -- int8 moments ---------------------------------------------------------------------------

def test_int8_moments_on_disk_are_stepped_with_their_own_blocks_scales() -> None:
    """int8 m and v on "NVMe" (uint8 codes read and written through slots), their scales in
    host memory, two 4096-element sub-groups: a first step moves the parameters as fp32 Adam
    does (it starts from zero moments, so the stored codes do not enter the update), each
    sub-group's kernel sets the scales of its own two 2048-element blocks to the block's
    absmax of m = (1 - beta1) g and v = (1 - beta2) g^2, and the codes stored decode to those
    moments within the widest step of the 8-bit map (relative to the block's absmax)."""
    rig = Rig()
    unit, values = rig.unit("u", [8192], param_home="none")
    n = unit.trainable_numel
    state = build_state(rig.manager, unit, (0, n), [StateFormat("int8", "fp32")], 4096,
                        optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, grad_dtype=torch.float32,
                        early_step=True, master_separate=False, doubled=False, sharded=False)
    state.exp_avg = DiskStore("u.m", state.exp_avg.tensor[:n].clone(), rig.log)
    state.exp_avg_sq = DiskStore("u.v", state.exp_avg_sq.tensor[:n].clone(), rig.log)
    g = grad_of(values)
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(g))
    rig.run()
    assert job.phase is JobPhase.LANDED and job.error is None
    assert [e[2:4] for e in rig.events("kernel")] == [(0, 4096), (4096, 8192)]
    p, m, v = reference_adam_f64(values, [g], lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                                 weight_decay=0.01, adamw_mode=True, bias_correction=True,
                                 grad_scale=1.0)
    close(unit.flat[:n], p)
    blocks = n // QBLOCK
    for store, scales, moment, signed in ((state.exp_avg, state.exp_avg_scales, m, True),
                                          (state.exp_avg_sq, state.exp_avg_sq_scales, v, False)):
        absmax = moment.view(blocks, QBLOCK).abs().amax(dim=1)
        close(scales.tensor[:blocks], absmax)
        assert store.data.dtype == torch.uint8
        decoded = dequantize_blockwise(store.data, scales.tensor[:blocks], signed).double()
        step = float(quantization_map(signed).double().sort().values.diff().max())
        error = (decoded - moment).abs().view(blocks, QBLOCK).amax(dim=1)
        assert (error <= step * absmax).all()
    assert rig.pool.available == 12


def test_a_bf16_master_is_the_bf16_parameter_stepped_in_place() -> None:
    """bf16 moments and a bf16 master (the parameter itself, no fp32 master store), three
    sub-groups: one step moves the device copy as fp32 Adam does within bf16 rounding (the
    kernel rounds stochastically: under one bf16 step, 2^-7 relative), m and v are stored in
    bf16 within the same bound, and the parameters written home are the device copy's."""
    rig = Rig()
    unit, _ = rig.unit("u", [3000], dtype=torch.bfloat16)
    n = unit.trainable_numel
    values = unit.flat[:n].float()
    state = build_state(rig.manager, unit, (0, n), [StateFormat("bf16", "bf16")], SUB,
                        optimizer_tier=Tier.HOST, grad_tier=Tier.HOST, grad_dtype=torch.float32,
                        early_step=True, master_separate=False, doubled=False, sharded=False)
    assert state.master is None
    g = grad_of(values)
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(g))
    rig.run()
    assert job.phase is JobPhase.LANDED and job.error is None
    p, m, v = reference_adam_f64(values, [g], lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                                 weight_decay=0.01, adamw_mode=True, bias_correction=True,
                                 grad_scale=1.0)
    s = slice(0, 3000)
    for actual, expected in ((unit.flat[s], p[s]), (state.exp_avg.tensor[s], m[s]),
                             (state.exp_avg_sq.tensor[s], v[s])):
        assert actual.dtype == torch.bfloat16
        torch.testing.assert_close(actual.double(), expected, rtol=2 ** -7, atol=1e-12)
    assert torch.equal(unit.param_store.data[:n], unit.flat[:n])


# -- the order of reads, kernels and writes --------------------------------------------------

def test_reads_run_ahead_and_writes_retire_behind_within_their_windows() -> None:
    """Six units of one sub-group: the kernel of unit k runs with the reads of at most
    READ_AHEAD more issued (k+1, k+2, never k+3), only after its own reads landed; its writes
    land after the kernel of k+WRITES_BEHIND and before that of k+WRITES_BEHIND+1; each job is
    stepped after its kernel and lands after its last write."""
    rig = Rig(slots=20)
    units = [rig.unit(f"u{k}", [1024], seed=k) for k in range(6)]
    states = [rig.state(u, v) for u, v in units]
    grads = [grad_of(v, 10 + k) for k, (_, v) in enumerate(units)]
    for k, (state, g) in enumerate(zip(states, grads)):
        rig.watch(rig.stream.submit(state, early=True, gradient=CompleteGradient(g)), f"u{k}")
    rig.run()
    for state, (_, v), g in zip(states, units, grads):
        check_adam(state, v, [g])
    log = rig.log
    kernels = [log.index(("kernel", f"u{k}", 0, SUB)) for k in range(6)]
    for k, at in enumerate(kernels):
        issued = {int(e[1][1]) for e in log[:at] if e[0] == "read" and e[1].endswith(".m")}
        assert issued == set(range(min(k + READ_AHEAD, 5) + 1))
        assert log.index(("done", "read", f"u{k}.m", 0)) < at
        assert log.index(("done", "read", f"u{k}.v", 0)) < at
        landed = log.index(("done", "write", f"u{k}.m", 0))
        if k + WRITES_BEHIND < 6:
            assert kernels[k + WRITES_BEHIND] < landed
        if k + WRITES_BEHIND + 1 < 6:
            assert landed < kernels[k + WRITES_BEHIND + 1]
        last_write = max(i for i, e in enumerate(log) if e[0] == "done" and e[1] == "write"
                         and e[2].startswith(f"u{k}."))
        assert at < log.index(("stepped", f"u{k}")) < last_write < log.index(("landed", f"u{k}"))


def test_a_small_pool_steps_what_is_loaded_before_reading_more() -> None:
    """Two slots for m and v on disk: only one sub-group is read at a time (no deadlock on the
    stream's own slots), and the values are Adam's all the same."""
    rig = Rig(slots=2)
    unit, values = rig.unit("u", [3072], param_home="none")
    state = rig.state(unit, values)
    g = grad_of(values)
    rig.stream.submit(state, early=True, gradient=CompleteGradient(g))
    rig.run()
    check_adam(state, values, [g])
    order = [(e[0], e[2]) for e in rig.log if e[0] in ("read", "kernel") and
             (e[0] == "kernel" or e[1] == "u.m")]
    assert order == [("read", 0), ("kernel", 0), ("read", 1024), ("kernel", 1024),
                     ("read", 2048), ("kernel", 2048)]
    assert rig.pool.available == 2


def test_a_state_is_read_again_only_after_its_last_write_landed() -> None:
    """The unit's next step queued once the first has stepped (as the optimizer does: not
    while a job of the unit has kernels to run), its writes still in flight: each read of the
    second comes after the write of the same range by the first has landed (else it reads the
    old values)."""
    rig = Rig()
    unit, values = rig.unit("u", [2048])
    state = rig.state(unit, values)
    g1, g2 = grad_of(values, 1), grad_of(values, 2)
    first = rig.stream.submit(state, early=True, gradient=CompleteGradient(g1))
    first.stepped_future.add_done_callback(lambda f: rig.stream.submit(
        state, early=True, gradient=CompleteGradient(g2)))
    rig.run()
    check_adam(state, values, [g1, g2])
    for name in ("u.m", "u.v"):
        for start in (0, 1024):
            reads = [i for i, e in enumerate(rig.log) if e == ("read", name, start, 1024)]
            landed = rig.log.index(("done", "write", name, start))
            assert len(reads) == 2 and reads[0] < landed < reads[1]


def test_the_next_unit_is_read_while_the_last_writes_of_the_previous_go_out() -> None:
    """One stream over units: the first read of unit b is issued before unit a's last write
    landed (the stream does not drain at a unit's end); both equal Adam's."""
    rig = Rig()
    ua, va = rig.unit("a", [2048], seed=1)
    ub, vb = rig.unit("b", [2048], seed=2)
    sa, sb = rig.state(ua, va), rig.state(ub, vb)
    ga, gb = grad_of(va, 3), grad_of(vb, 4)
    rig.stream.submit(sa, early=True, gradient=CompleteGradient(ga))
    rig.stream.submit(sb, early=True, gradient=CompleteGradient(gb))
    rig.run()
    check_adam(sa, va, [ga])
    check_adam(sb, vb, [gb])
    first_b = rig.log.index(("read", "b.m", 0, 1024))
    last_a = max(i for i, e in enumerate(rig.log) if e[:3] == ("done", "write", "a.m"))
    assert first_b < last_a


# -- expected steps ---------------------------------------------------------------------------

def test_an_expected_step_is_read_ahead_but_not_stepped_until_ready() -> None:
    """``expect``: its sub-groups are read while it waits (counted read_early), no kernel runs
    and the step count stays; ``make_ready`` lets it step to Adam's values."""
    rig = Rig()
    unit, values = rig.unit("u", [3072])
    state = rig.state(unit, values)
    g = grad_of(values)
    job = rig.stream.expect(state)
    assert job.phase is JobPhase.EXPECTED and job.hyper is None
    rig.stream._pull_incoming()
    assert rig.stream._advance()
    assert {e[2] for e in rig.events("read") if e[1] == "u.m"} == {0, 1024, 2048}
    assert not rig.events("kernel") and state.step == 0
    assert rig.stream.stats == {"expected": 1, "read_early": 3, "preempted": 0, "cancelled": 0}
    rig.stream.make_ready(job, CompleteGradient(g))
    rig.run()
    check_adam(state, values, [g])
    assert job.phase is JobPhase.LANDED


def test_a_cancelled_expected_step_drops_its_reads_and_completes() -> None:
    """``cancel``: its reads are waited out and their slots go back, its futures complete,
    nothing is stepped or written; cancelling a job that is not expected does nothing."""
    rig = Rig()
    unit, values = rig.unit("u", [2048])
    state = rig.state(unit, values)
    job = rig.stream.expect(state)
    rig.stream._pull_incoming()
    rig.stream._advance()
    assert rig.pool.available == 12 - 4
    rig.stream.cancel(job)
    rig.run()
    assert job.phase is JobPhase.CANCELLED and job.landed_future.done()
    assert job.stepped_future.done() and not job.groups
    assert rig.pool.available == 12 and state.step == 0
    assert not rig.events("kernel") and not rig.events("write")
    assert all(("done", "read", "u.m", s) in rig.log for s in (0, 1024))
    assert rig.stream.stats["cancelled"] == 1
    done = rig.stream.submit(state, early=True, gradient=CompleteGradient(torch.zeros(2048)))
    rig.run()
    rig.stream.cancel(done)
    assert done.phase is JobPhase.LANDED


def test_a_ready_step_preempts_expected_reads_and_steps_first() -> None:
    """An expected job holds the read-ahead window; a ready one arriving then gives up the
    newest expected read (counted preempted), is stepped before any expected kernel, and the
    expected one, ready later, re-reads what it gave up and still equals Adam's."""
    rig = Rig()
    ue, ve = rig.unit("e", [4096], seed=1)
    ur, vr = rig.unit("r", [2048], seed=2)
    se, sr = rig.state(ue, ve), rig.state(ur, vr)
    ge, gr = grad_of(ve, 3), grad_of(vr, 4)
    expected = rig.stream.expect(se)
    rig.stream._pull_incoming()
    rig.stream._advance()
    assert [e[2] for e in rig.events("read") if e[1] == "e.m"] == [0, 1024, 2048]
    ready = rig.stream.submit(sr, early=True, gradient=CompleteGradient(gr))
    rig.kernel.before_run = lambda st, start: (
        rig.stream.make_ready(expected, CompleteGradient(ge))
        if st is sr and start == 1024 else None)
    rig.run()
    check_adam(se, ve, [ge])
    check_adam(sr, vr, [gr])
    assert rig.stream.stats["preempted"] == 2         # e's two newest reads, one for each r
    kernels = [e[1] for e in rig.events("kernel")]
    assert kernels == ["r", "r", "e", "e", "e", "e"]
    # the newest expected read is given up each time (2048, then 1024: read again in order),
    # so the expected job's sub-groups are still stepped in ascending order
    assert [e[2] for e in rig.events("read") if e[1] == "e.m"] == [0, 1024, 2048, 1024, 2048,
                                                                    3072]
    assert [e[2] for e in rig.events("kernel") if e[1] == "e"] == [0, 1024, 2048, 3072]
    assert ready.phase is expected.phase is JobPhase.LANDED
    assert rig.pool.available == 12


def test_a_ready_step_takes_the_slots_of_expected_reads_inside_the_window() -> None:
    """Four slots, all held by an expected job's two sub-groups read ahead (the read-ahead
    window not full): a ready job's read gives up the newest of them for its slots (one
    preemption frees the two it needs), is stepped first, and the expected job, ready later,
    reads the given-up sub-group again; both equal Adam's and every slot comes back."""
    rig = Rig(slots=4)
    ue, ve = rig.unit("e", [2048], param_home="none", seed=1)
    ur, vr = rig.unit("r", [1024], param_home="none", seed=2)
    se, sr = rig.state(ue, ve), rig.state(ur, vr)
    ge, gr = grad_of(ve, 3), grad_of(vr, 4)
    expected = rig.stream.expect(se)
    rig.stream._pull_incoming()
    rig.stream._advance()
    assert [e[2] for e in rig.events("read") if e[1] == "e.m"] == [0, 1024]   # < READ_AHEAD + 1
    assert rig.pool.available == 0
    rig.stream.submit(sr, early=True, gradient=CompleteGradient(gr))
    rig.kernel.before_run = lambda st, start: (
        rig.stream.make_ready(expected, CompleteGradient(ge)) if st is sr else None)
    rig.run()
    check_adam(se, ve, [ge])
    check_adam(sr, vr, [gr])
    assert rig.stream.stats["preempted"] == 1
    assert [e[1:3] for e in rig.events("kernel")] == [("r", 0), ("e", 0), ("e", 1024)]
    assert [e[2] for e in rig.events("read") if e[1] == "e.m"] == [0, 1024, 1024]
    assert rig.pool.available == 4


def test_shutting_down_cancels_expected_steps_and_finishes_ready_ones() -> None:
    """Shutdown: what is queued and ready is stepped and lands; an expected job that never got
    its gradients is cancelled; the thread ends."""
    rig = Rig(threaded=True)
    ua, va = rig.unit("a", [2048], seed=1)
    ub, vb = rig.unit("b", [1024], seed=2)
    sa, sb = rig.state(ua, va), rig.state(ub, vb)
    ga = grad_of(va, 3)
    ready = rig.stream.submit(sa, early=True, gradient=CompleteGradient(ga))
    expected = rig.stream.expect(sb)
    rig.stream.shutdown()
    assert not rig.stream._thread.is_alive()
    assert ready.phase is JobPhase.LANDED and expected.phase is JobPhase.CANCELLED
    check_adam(sa, va, [ga])
    assert sb.step == 0 and rig.pool.available == 12


def test_the_stream_thread_steps_jobs_made_ready_later() -> None:
    """The stream's own thread: an expected job waits (read ahead) until the training thread
    makes it ready, then lands with Adam's values; its background time is counted."""
    rig = Rig(threaded=True)
    unit, values = rig.unit("u", [2048])
    state = rig.state(unit, values)
    g = grad_of(values)
    try:
        # one daemon thread, named for stack dumps: a process whose engine was never closed
        # must still exit
        named = [t for t in threading.enumerate() if t.name == "infinity-step-stream"]
        assert rig.stream._thread in named and rig.stream._thread.daemon is True
        job = rig.stream.expect(state)
        rig.stream.make_ready(job, CompleteGradient(g))
        job.landed_future.result(timeout=600)   # only a hang limit
        check_adam(state, values, [g])
        assert rig.timers.background_s > 0.0
    finally:
        rig.stream.shutdown()


# -- jobs of an empty range ---------------------------------------------------------------------

def test_an_empty_range_is_counted_stepped_and_landed_without_io() -> None:
    """A shard past the unit's trainable part: submitted, or expected then made ready, its step
    is counted (as on the ranks that step elements) and it lands with nothing read or written."""
    rig = Rig()
    unit, values = rig.unit("u", [1024])
    a = rig.state(unit, values)
    a.shard = (1024, 1024)
    b = rig.state(unit, values)
    b.shard = (1024, 1024)
    gradient = CompleteGradient(torch.zeros(0), slot=None)
    submitted = rig.stream.submit(a, early=True, gradient=gradient)
    expected = rig.stream.expect(b)
    rig.stream._pull_incoming()
    assert submitted.phase is JobPhase.LANDED and expected.phase is JobPhase.EXPECTED
    rig.stream.make_ready(expected, CompleteGradient(torch.zeros(0)))
    rig.run()
    assert submitted.phase is expected.phase is JobPhase.LANDED
    assert a.step == b.step == 1 and submitted.runs is not None and expected.runs is not None
    assert not rig.events("read") and not rig.events("write") and not rig.events("kernel")


# -- speculative (shadow) writes ------------------------------------------------------------------

@pytest.mark.parametrize("held", [False, True])
def test_a_speculated_step_writes_shadows_and_its_gradient_home(held) -> None:
    """``speculative`` with ``gradient_home``: m, v and the parameters go to the shadow
    extents (the current ones untouched), and the gradient is written to its home for a redo:
    a flat buffer as it is (and kept until the job ends), held parts with zeros in the gaps,
    normed into the job's squares."""
    rig = Rig()
    unit, values = rig.unit("u", [1000, 1000], aligned=not held)   # params direct, or a slot
    g = grad_of(values)
    state = rig.state(unit, values, grad=torch.full((unit.trainable_numel,), 9.0))
    gpool = BufferPool(rig.manager, unit.trainable_numel * 4, 1, "gradient")
    slot = gpool.acquire()
    flat = slot.view(torch.float32, unit.trainable_numel)
    flat.copy_(g)
    grad = {e.offset: g[e.offset:e.offset + e.numel].clone() for e in unit.params} if held \
        else flat
    gradient = CompleteGradient(grad, slot=None if held else slot, pool=gpool)
    job = rig.stream.submit(state, early=True, gradient=gradient, speculative=True,
                            gradient_home=True)
    at_stepped: list = []
    job.stepped_future.add_done_callback(lambda f: at_stepped.append(gpool.available))
    rig.run()
    assert at_stepped == [0]       # a flat buffer written home is kept until the job ends
    assert job.phase is JobPhase.LANDED
    assert not state.exp_avg.data.any() and torch.equal(unit.param_store.data[:2048],
                                                        values.to(unit.dtype))
    assert torch.equal(unit.param_store.shadow[:2048], unit.flat[:2048])
    writes = [e for e in rig.events("write") if e[1] != "u.g"]
    assert writes and all(e[4] for e in writes)
    shadow_m = state.exp_avg.shadow
    _, m, _ = reference_adam_f64(values[:1000], [g[:1000]], lr=1e-2, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.01, adamw_mode=True,
                                 bias_correction=True, grad_scale=1.0)
    close(shadow_m[:1000], m)
    assert torch.equal(state.grad_store.data, g)         # the gaps written as zeros
    assert [e[4] for e in rig.events("write") if e[1] == "u.g"] == [False, False]
    # a flat buffer was normed when complete; held parts are normed as they are written
    assert job.sq_norm == (pytest.approx(float((g.double() ** 2).sum()), rel=1e-6) if held
                           else 0.0)
    assert gpool.available == (0 if held else 1)


def test_a_speculated_step_without_gradient_home_norms_only_a_held_gradient() -> None:
    """A speculated step whose gradient stays here: a flat buffer was normed when complete (the
    kernel does not norm it again), held parts are normed in the kernel; nothing is written to
    the gradient home."""
    sq = {}
    for held in (False, True):
        rig = Rig()
        unit, values = rig.unit("u", [1000])
        g = grad_of(values)
        state = rig.state(unit, values)
        gpool = BufferPool(rig.manager, 1024 * 4, 1, "gradient")
        slot = gpool.acquire()
        slot.view(torch.float32, 1024).copy_(g)
        gradient = CompleteGradient({0: g[:1000].clone()}) if held else \
            CompleteGradient(slot.view(torch.float32, 1024), slot=slot, pool=gpool)
        job = rig.stream.submit(state, early=True, gradient=gradient, speculative=True)
        at_stepped: list = []
        job.stepped_future.add_done_callback(lambda f: at_stepped.append(gpool.available))
        rig.run()
        assert job.phase is JobPhase.LANDED
        if not held:         # the flat buffer is not kept: given back after the last kernel
            assert at_stepped == [1]
        sq[held] = job.sq_norm
    assert sq[False] == 0.0
    assert sq[True] == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)


def test_a_speculated_step_cannot_write_a_resident_param_home() -> None:
    """A speculative step needs a shadow extent: a host param home is an error naming it,
    and the job fails with it."""
    rig = Rig()
    unit, values = rig.unit("u", [1000], param_home="host", aligned=False)
    state = rig.state(unit, values)
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(grad_of(values)),
                            speculative=True)
    rig.run()
    with raises_naming(RuntimeError, "u.p: ", "speculative step",
                       "cannot write a resident store in place", ends=True):
        job.landed_future.result(timeout=0)
    assert rig.pool.available == 12


# -- failures mid-stream ------------------------------------------------------------------------

def test_a_failed_read_fails_every_job_in_hand_and_frees_everything() -> None:
    """A read that fails: the job stepping and every job queued (an expected one too) fail
    with that error, the in-flight reads and writes are waited out, every slot and gradient
    goes back, and the stream goes on with the next job."""
    rig = Rig()
    ua, va = rig.unit("a", [3072], seed=1)
    ub, vb = rig.unit("b", [1024], seed=2)
    sa, sb = rig.state(ua, va), rig.state(ub, vb)
    error = OSError(5, "disk gone")
    sa.exp_avg_sq.errors[("read", 1024)] = error
    gpool = BufferPool(rig.manager, 4096 * 4, 1, "gradient")
    slot = gpool.acquire()
    ga = CompleteGradient(slot.view(torch.float32, 3072), slot=slot, pool=gpool)
    ja = rig.stream.submit(sa, early=True, gradient=ga)
    jb = rig.stream.expect(sb)
    # the expected job never becomes ready: the loop's steps, bounded, as the thread runs them
    for _ in range(20):
        rig.stream._pull_incoming()
        try:
            rig.stream._advance()
        except OSError as exc:
            rig.stream._fail_all(exc)
            break
    for job in (ja, jb):
        assert job.phase is JobPhase.FAILED
        with pytest.raises(OSError, match="disk gone"):
            job.landed_future.result(timeout=0)
    assert rig.pool.available == 12 and gpool.available == 1
    assert not rig.stream._jobs and not rig.stream._loads and not rig.stream._writes
    issued = [e[1:3] for e in rig.log if e[0] in ("read", "write")]
    waited = [e[2:4] for e in rig.log if e[0] in ("done", "failed")]
    assert sorted(issued) == sorted(waited)           # nothing left in flight
    again = rig.stream.submit(sb, early=True, gradient=CompleteGradient(grad_of(vb)))
    rig.run()
    assert again.phase is JobPhase.LANDED


def test_a_failed_read_in_the_loop_fails_the_job_and_the_loop_goes_on() -> None:
    """The same through the stream's loop: the error is reported through the job's futures
    (not raised out of the loop), and a job queued after it still lands with Adam's values."""
    rig = Rig()
    ua, va = rig.unit("a", [2048], seed=1)
    ub, vb = rig.unit("b", [1024], seed=2)
    sa, sb = rig.state(ua, va), rig.state(ub, vb)
    sa.exp_avg.errors[("read", 0)] = OSError(5, "bad sector")
    ja = rig.stream.submit(sa, early=True, gradient=CompleteGradient(grad_of(va)))
    rig.run()
    gb = grad_of(vb)
    jb = rig.stream.submit(sb, early=True, gradient=CompleteGradient(gb))
    rig.run()
    with pytest.raises(OSError, match="bad sector"):
        ja.landed_future.result(timeout=0)
    assert ja.phase is JobPhase.FAILED and jb.phase is JobPhase.LANDED
    check_adam(sb, vb, [gb])
    assert rig.pool.available == 12


def test_a_failed_write_fails_its_job_only_after_everything_was_waited() -> None:
    """A write that fails: its job fails with that error once its other writes landed; its
    slots go back; a job of another unit in the stream lands as usual."""
    rig = Rig()
    ua, va = rig.unit("a", [2048], seed=1)
    ub, vb = rig.unit("b", [2048], seed=2)
    sa, sb = rig.state(ua, va), rig.state(ub, vb)
    sa.exp_avg.errors[("write", 0)] = OSError(28, "no space")
    ga, gb = grad_of(va, 3), grad_of(vb, 4)
    ja = rig.watch(rig.stream.submit(sa, early=True, gradient=CompleteGradient(ga)), "a")
    jb = rig.stream.submit(sb, early=True, gradient=CompleteGradient(gb))
    rig.run()
    assert ja.phase is JobPhase.FAILED and jb.phase is JobPhase.LANDED
    with pytest.raises(OSError, match="no space"):
        ja.landed_future.result(timeout=0)
    assert ja.stepped_future.result(timeout=0) is None      # its kernels did run
    failed_at = rig.log.index(("landed", "a")) if ("landed", "a") in rig.log else None
    assert failed_at is not None
    a_writes = [i for i, e in enumerate(rig.log) if e[0] in ("done", "failed") and
                e[1] == "write" and e[2].startswith("a.")]
    assert len(a_writes) == 6 and max(a_writes) < failed_at
    check_adam(sb, vb, [gb])
    assert rig.pool.available == 12


def test_a_kernel_error_waits_out_the_writes_in_flight_before_freeing_slots(monkeypatch) -> None:
    """The kernel fails at the second sub-group: the first sub-group's writes (issued from
    slots) are waited for before the slots go back, the job fails with the kernel's error."""
    rig = Rig()
    unit, values = rig.unit("u", [3072], aligned=False)
    state = rig.state(unit, values)
    failing, calls = failing_on_call(rig.kernel.run, 2, ValueError("kernel broke"))
    monkeypatch.setattr(rig.kernel, "run", failing)
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(grad_of(values)))
    rig.run()
    with pytest.raises(ValueError, match="kernel broke"):
        job.landed_future.result(timeout=0)
    assert len(calls) == 2 and rig.pool.available == 12
    issued = [e[1:3] for e in rig.log if e[0] in ("read", "write")]
    waited = [e[2:4] for e in rig.log if e[0] in ("done", "failed")]
    assert sorted(issued) == sorted(waited)


# -- staging slots (parameters written home through a slot) ------------------------------------

def _ready_behind_expected(slots: int):
    """A ready unit r (one sub-group, parameters through a slot) read first, then an expected
    unit e read ahead with what is left; e is made ready once r has stepped."""
    rig = Rig(slots=slots)
    ur, vr = rig.unit("r", [1024], aligned=False, seed=1)
    ue, ve = rig.unit("e", [2048], seed=2)
    sr, se = rig.state(ur, vr), rig.state(ue, ve)
    gr, ge = grad_of(vr, 3), grad_of(ve, 4)
    ready = rig.stream.submit(sr, early=True, gradient=CompleteGradient(gr))
    expected = rig.stream.expect(se)
    ready.stepped_future.add_done_callback(
        lambda f: rig.stream.make_ready(expected, CompleteGradient(ge)))
    rig.run()
    check_adam(sr, vr, [gr])
    check_adam(se, ve, [ge])
    return rig


def test_a_staging_slot_taken_while_one_is_free_gives_up_no_expected_read() -> None:
    """Parameters written through a slot while the pool has one free: no expected read is
    given up for it, and every slot comes back."""
    rig = _ready_behind_expected(slots=12)
    assert rig.stream.stats["preempted"] == 0
    assert [e[2] for e in rig.events("read") if e[1] == "e.m"] == [0, 1024]
    assert rig.pool.available == 12


def test_a_staging_slot_with_none_free_gives_up_the_newest_expected_read_only() -> None:
    """The pool held by r's reads and e's read ahead: writing r's parameters gives up e's
    newest sub-group read (one, read again later), not all of them."""
    rig = _ready_behind_expected(slots=6)
    assert rig.stream.stats["preempted"] == 1
    assert [e[2] for e in rig.events("read") if e[1] == "e.m"] == [0, 1024, 1024]
    assert rig.pool.available == 6


def test_a_staging_slot_with_none_free_retires_the_oldest_writes() -> None:
    """Eight slots, four one-sub-group units whose parameters and held gradients (speculated,
    kept at home) go through slots: with every slot held by reads and writes in flight, a
    write's slot comes from retiring the oldest writes (no wait on a slot the stream holds
    itself); all values land."""
    rig = Rig(slots=8)
    units = [rig.unit(f"u{k}", [1024], aligned=False, seed=k) for k in range(4)]
    states = [rig.state(u, v, grad=torch.zeros(1024)) for u, v in units]
    jobs = []
    for k, (state, (unit, v)) in enumerate(zip(states, units)):
        g = grad_of(v, 10 + k)
        jobs.append(rig.stream.submit(state, early=True, gradient=CompleteGradient({0: g}),
                                      speculative=True, gradient_home=True))
    rig.run()
    assert all(j.phase is JobPhase.LANDED for j in jobs)
    for k, (state, (unit, v)) in enumerate(zip(states, units)):
        assert torch.equal(state.grad_store.data, grad_of(v, 10 + k))
        assert torch.equal(unit.param_store.shadow[:1024], unit.flat[:1024])
    assert rig.pool.available == 8 and rig.stream.stats["preempted"] == 0
    # retiring u0's writes freed the slots for u3's reads before u1 was stepped
    assert rig.log.index(("read", "u3.m", 0, 1024)) < rig.log.index(("kernel", "u1", 0, 1024))


def test_a_speculated_held_gradient_is_copied_into_a_host_gradient_home() -> None:
    """A held gradient kept for a redo in a host gradient home: copied in place, the gaps
    between parameters zeroed, normed once."""
    rig = Rig()
    unit, values = rig.unit("u", [1000, 1000])
    g = grad_of(values)
    state = rig.state(unit, values, grad=torch.full((unit.trainable_numel,), 9.0),
                      grad_disk=False)
    parts = {e.offset: g[e.offset:e.offset + e.numel].clone() for e in unit.params}
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(parts),
                            speculative=True, gradient_home=True)
    rig.run()
    assert job.phase is JobPhase.LANDED
    assert torch.equal(state.grad_store.tensor[:2048], g)
    assert job.sq_norm == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)
    assert rig.pool.available == 12


def test_a_speculated_step_made_ready_later_takes_its_settings_from_make_ready() -> None:
    """``make_ready`` sets the speculation of an expected job: speculative, the results go to
    the shadow extents; with ``gradient_home`` the held gradient is written home, without it
    only normed (in the kernel)."""
    for home in (False, True):
        rig = Rig()
        unit, values = rig.unit("u", [1000])
        g = grad_of(values)
        state = rig.state(unit, values, grad=torch.zeros(unit.trainable_numel))
        job = rig.stream.expect(state)
        if home:
            rig.stream.make_ready(job, CompleteGradient({0: g[:1000].clone()}),
                                  speculative=True, gradient_home=True)
        else:
            rig.stream.make_ready(job, CompleteGradient({0: g[:1000].clone()}),
                                  speculative=True)
        rig.run()
        assert job.phase is JobPhase.LANDED
        assert not state.exp_avg.data.any() and state.exp_avg.shadow.any()
        assert torch.equal(state.grad_store.data, g if home else torch.zeros_like(g))
        assert job.sq_norm == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)


def test_a_shard_of_the_unit_reads_and_writes_its_stores_from_their_start() -> None:
    """States of a shard [1024, 3072) of the unit (stores of 2048 elements: store element i is
    the unit's 1024 + i): the shard steps to Adam's values, written at the store's offsets;
    the elements before the shard are not touched."""
    rig = Rig()
    unit, values = rig.unit("u", [3000])
    n = unit.trainable_numel
    state = UnitOptimState(unit, DiskStore("u.m", torch.zeros(n - 1024), rig.log),
                           DiskStore("u.v", torch.zeros(n - 1024), rig.log), None, None,
                           shard=(1024, n))
    g = grad_of(values)
    job = rig.stream.submit(state, early=True,
                            gradient=CompleteGradient(g[1024:].clone(), origin=1024))
    rig.run()
    assert job.phase is JobPhase.LANDED
    p, m, v = reference_adam_f64(values[1024:3000], [g[1024:3000]], lr=1e-2, beta1=0.9,
                                 beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                                 bias_correction=True, grad_scale=1.0)
    close(state.exp_avg.data[:1976], m)
    close(state.exp_avg_sq.data[:1976], v)
    close(unit.flat[1024:3000], p)
    assert torch.equal(unit.flat[:1024], values[:1024])
    assert torch.equal(unit.param_store.data[:3000], unit.flat[:3000])
    assert sorted(e[2] for e in rig.events("write") if e[1] == "u.m") == [0, 1024]


def test_an_fp32_device_copy_with_a_separate_master_takes_the_master_as_it_is() -> None:
    """A separate fp32 master with an fp32 device copy: nothing to round; the device copy is
    the stepped master."""
    rig = Rig()
    unit, values = rig.unit("u", [2000])
    state = rig.state(unit, values, master=True)
    g = grad_of(values)
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(g))
    rig.run()
    assert job.phase is JobPhase.LANDED
    check_adam(state, values, [g])


def test_runs_ending_at_the_sub_group_end_round_into_the_device_copy() -> None:
    """A run that ends exactly at the sub-group's end covers it, whatever gap follows in the
    later runs."""
    flat = SimpleNamespace(flat=torch.zeros(100, dtype=torch.bfloat16))
    runs = [StepRun(0, 0, 40, 1), StepRun(0, 60, 100, 1)]
    assert flat_rounded_by_kernel(flat, torch.zeros(100), runs, 0, 40)
    assert flat_rounded_by_kernel(flat, torch.zeros(100), runs, 60, 100)
    assert not flat_rounded_by_kernel(flat, torch.zeros(100), runs, 0, 41)


def test_a_speculated_step_writes_a_separate_master_to_its_shadow() -> None:
    """bf16 compute with an fp32 master: a speculative step's new master goes to the master's
    shadow extent; the current master keeps the values before the step."""
    rig = Rig()
    unit, values = rig.unit("u", [1000], dtype=torch.bfloat16)
    state = rig.state(unit, values, master=True)
    unit.flat[:unit.trainable_numel].copy_(values.to(torch.bfloat16))
    g = grad_of(values)
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(g), speculative=True)
    rig.run()
    assert job.phase is JobPhase.LANDED
    assert torch.equal(state.master.data, values)
    p, _, _ = reference_adam_f64(values[:1000], [g[:1000]], lr=1e-2, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.01, adamw_mode=True,
                                 bias_correction=True, grad_scale=1.0)
    close(state.master.shadow[:1000], p)


def test_sharded_parameters_are_written_at_their_place_in_the_own_shard_home() -> None:
    """Rank 1 of 2 with sharded parameters: its param home holds only its own shard (the unit's
    elements [2048, 4096)); the stepped shard is written there from its start."""
    rig = Rig()
    g0 = torch.Generator().manual_seed(5)
    param = nn.Parameter(torch.randn(4000, generator=g0))
    unit = Unit(0, "u", nn.Module(), [("w", param, 0)], torch.float32, torch.device("cpu"),
                comm=SimpleNamespace(rank=1), shards=2, params_sharded=True)
    assert (unit.home_start, unit.home_numel) == (2048, 2048)
    unit.flat = rig.manager.host_empty(unit.flat_numel, torch.float32, "flat")
    unit.flat.zero_()
    unit.flat[:4000].copy_(param.detach())
    unit.param_store = DiskStore("u.p", torch.zeros(2048), rig.log)
    values = unit.flat[:4096].clone()
    hi = unit.trainable_numel
    state = UnitOptimState(unit, DiskStore("u.m", torch.zeros(hi - 2048), rig.log),
                           DiskStore("u.v", torch.zeros(hi - 2048), rig.log), None, None,
                           shard=(2048, hi))
    g = grad_of(values)
    job = rig.stream.submit(state, early=True,
                            gradient=CompleteGradient(g[2048:hi].clone(), origin=2048))
    rig.run()
    assert job.phase is JobPhase.LANDED
    p, _, _ = reference_adam_f64(values[2048:4000], [g[2048:4000]], lr=1e-2, beta1=0.9,
                                 beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                                 bias_correction=True, grad_scale=1.0)
    close(unit.flat[2048:4000], p)
    assert torch.equal(unit.param_store.data[:1952], unit.flat[2048:4000])


def test_background_time_is_the_sum_of_the_loop_turns() -> None:
    """``timers.background_s`` adds up the stream's working turns: at least the time spent in
    its kernels (each runs inside a turn), at most the wall time around the run."""
    rig = Rig()
    units = [rig.unit(f"u{k}", [2048], seed=k) for k in range(3)]
    spent: list[float] = []
    real_run = rig.kernel.run

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_run(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)
    rig.kernel.run = timed
    for unit, v in units:
        rig.stream.submit(rig.state(unit, v), early=True, gradient=CompleteGradient(grad_of(v)))
    rig.timers.reset()          # the stream thread's idle turns before its shutdown
    t0 = time.perf_counter()
    rig.run()
    wall = time.perf_counter() - t0
    assert len(spent) == 6
    assert sum(spent) <= rig.timers.background_s <= wall


def test_a_read_that_finds_too_few_slots_gives_back_those_it_took() -> None:
    """Three slots, two needed per sub-group: the next sub-group's read takes one slot, finds
    no second, gives the first back and waits for the step to free more; at the end the pool
    holds its three slots again."""
    rig = Rig(slots=3)
    unit, values = rig.unit("u", [3072], param_home="none")
    state = rig.state(unit, values)
    g = grad_of(values)
    rig.stream.submit(state, early=True, gradient=CompleteGradient(g))
    rig.run()
    check_adam(state, values, [g])
    back = [rig.pool.try_acquire() for _ in range(3)]
    assert all(s is not None for s in back) and len({s.index for s in back}) == 3


def test_a_read_with_no_slot_free_and_nothing_to_give_up_waits_on_the_pool(monkeypatch) -> None:
    """Slots taken without blocking find none free (the pool's slots lent out and coming back:
    ``try_acquire`` always None here), nothing is loaded and no expected read can be given up:
    the ready read, and the parameters' staging slot, then wait on the pool (a blocking acquire,
    bounded: a pool that never gives a slot back fails the job instead of hanging the stream)
    rather than failing or giving up, one sub-group at a time, and the job steps to Adam's
    values."""
    rig = Rig(slots=4)
    unit, values = rig.unit("u", [3072], aligned=False)
    state = rig.state(unit, values)
    g = grad_of(values)
    monkeypatch.setattr(rig.pool, "try_acquire", lambda: None)
    timeouts: list = []
    acquire = rig.pool.acquire

    def blocking(timeout=None):
        timeouts.append(timeout)
        return acquire(timeout=timeout)
    monkeypatch.setattr(rig.pool, "acquire", blocking)
    job = rig.stream.submit(state, early=True, gradient=CompleteGradient(g))
    rig.run()
    assert job.phase is JobPhase.LANDED and job.error is None
    check_adam(state, values, [g])
    assert len(timeouts) == 3 * 3 and all(t is not None for t in timeouts)  # m, v, staging
    order = [(e[0], e[2]) for e in rig.log if e[0] in ("read", "kernel") and
             (e[0] == "kernel" or e[1] == "u.m")]
    assert order == [("read", 0), ("kernel", 0), ("read", 1024), ("kernel", 1024),
                     ("read", 2048), ("kernel", 2048)]
    assert rig.pool.available == 4 and rig.stream.stats["preempted"] == 0


def test_each_cancelled_step_is_counted() -> None:
    rig = Rig()
    jobs = [rig.stream.expect(rig.state(*rig.unit(f"u{k}", [1024], seed=k))) for k in range(2)]
    for job in jobs:
        rig.stream.cancel(job)
    rig.run()
    assert rig.stream.stats["cancelled"] == 2 and all(j.cancelled for j in jobs)


def _home_writer(store) -> tuple[SimpleNamespace, list]:
    """A stand-in step stream for ``_write_params``: its own ``_write_values``, and slots that
    are plain tensors; the writes it issues are recorded."""
    issued: list = []
    ns = SimpleNamespace(_staging=lambda writes, dtype, n: torch.empty(n, dtype=dtype))
    ns._write_values = lambda *a, **k: StepStream._write_values(ns, *a, **k)
    store.store_async = lambda values, at, n, shadow=False: \
        issued.append((values[:n].clone(), values.data_ptr(), at, n, shadow)) or "request"
    return ns, issued


def _unit(store, flat: torch.Tensor, aligned: bool) -> SimpleNamespace:
    return SimpleNamespace(param_store=store, home_start=2, flat=flat,
                           flat_on_aligned_host=aligned)


@pytest.mark.parametrize("resident", [True, False])
def test_a_home_is_written_from_the_values_the_device_copy_was_made_from(resident) -> None:
    """Where the disk does not write the device copy directly (a GPU's copy, a host home), the
    home takes the stepped host values the copy was made from: reading a GPU's copy back would
    be a copy on the compute stream. A device copy on "meta" cannot be read at all, so a write
    that read it fails here."""
    written = torch.arange(4, dtype=torch.bfloat16) + 1
    store = SimpleNamespace(resident=resident, dtype=torch.bfloat16, name="params",
                            tensor=torch.zeros(10, dtype=torch.bfloat16) if resident else None)
    ns, issued = _home_writer(store)
    unit = _unit(store, torch.zeros(12, dtype=torch.bfloat16, device="meta"), aligned=False)
    writes: list = []
    StepStream._write_params(ns, unit, 5, 4, writes, False, written)
    if resident:                       # at start - home_start: the home holds the own shard
        assert store.tensor[3:7].tolist() == written.tolist() and store.tensor.sum() == 10
        assert writes == [] and issued == []
    else:
        assert [(v.tolist(), at, n, shadow) for v, _, at, n, shadow in issued] == \
            [(written.tolist(), 3, 4, False)]
        assert writes == [("request", None)]
    if resident:                       # a resident home is never a speculation's shadow
        with pytest.raises(RuntimeError, match="cannot write a resident store in place"):
            StepStream._write_params(ns, unit, 5, 4, [], True, written)
    else:
        StepStream._write_params(ns, unit, 5, 4, [], True, written)
        assert issued[-1][-1] is True


def test_a_device_copy_the_disk_writes_directly_is_written_as_it_is() -> None:
    """Page-aligned host memory (a CPU device) goes to an NVMe home straight from the device
    copy, written values or not: no staging copy."""
    flat = torch.arange(12, dtype=torch.bfloat16)
    store = SimpleNamespace(resident=False, dtype=torch.bfloat16, name="params", tensor=None)
    ns, issued = _home_writer(store)
    writes: list = []
    StepStream._write_params(ns, _unit(store, flat, aligned=True), 5, 4, writes, False,
                             torch.zeros(4, dtype=torch.bfloat16))
    assert [(ptr, at, n) for _, ptr, at, n, _ in issued] == [(flat[5:].data_ptr(), 3, 4)]
    assert issued[0][0].tolist() == flat[5:9].tolist()
    # without written values, a copy the disk cannot write directly goes through a slot
    StepStream._write_params(ns, _unit(store, flat, aligned=False), 5, 4, writes, False)
    assert issued[-1][0].tolist() == flat[5:9].tolist() and issued[-1][1] != flat[5:].data_ptr()
