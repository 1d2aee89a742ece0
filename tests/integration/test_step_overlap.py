"""The step stream's overlap with training: Adam states read ahead for units whose gradients are
coming (expected steps), the early step's last writes landing behind the next forward, and
gradients held as autograd made them. Each must leave training equal to torch AdamW."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import infinity
from infinity.engine import sizing as engine_sizing
from infinity.optim import partitioned
from infinity.planner import run_plan
from infinity.optim.records import sub_groups
from infinity.optim.step_stream import READ_AHEAD
from infinity.storage.manager import FlatStore, padded_numel
from infinity.storage.tiers import Residency
from infinity.zero.unit import Unit
from parity import VOCAB, make_model, nvme_engine, run_parity, zero_config


class _LateWrites:
    """Writes that reach the disk only when someone waits for them, a little late: a read of
    the same range before that wait would see the old values, and a buffer freed before it
    would be written from freed memory. Both are recorded as violations."""

    DELAY_S = 0.05

    def __init__(self, monkeypatch) -> None:
        self.pending: list[tuple] = []   # store, extent, range, buffer
        self.violations: list[str] = []
        store, load, release = FlatStore.store_async, FlatStore.load_async, Unit.release
        tracker = self

        def late_store(self, buf, start=0, count=None, shadow=False):
            n = self.padded - start if count is None else count
            # the extent written: a speculative step writes the shadow one
            extent = self._shadow if shadow else self._extent
            entry = (self, extent, start, start + n, buf.data_ptr(),
                     buf.data_ptr() + n * buf.element_size())
            tracker.pending.append(entry)
            if extent is None:      # resident: written in place
                return _LateWrite(lambda: store(self, buf, start, count), tracker, entry)
            # issued late, but to the extent asked for now (a flip may come in between)
            span = padded_numel(n, self.dtype)
            return _LateWrite(lambda: self.write_extent(extent, buf, start, span), tracker, entry)

        def checked_load(self, buf, start=0, count=None, shadow=False):
            n = self.padded - start if count is None else count
            read = self._shadow if shadow else self._extent
            for other, extent, a, b, _, _ in list(tracker.pending):
                if other is self and extent is read and a < start + n and start < b:
                    tracker.violations.append(f"read {self.name}[{start}:{start + n}] before "
                                              f"its write [{a}:{b}] landed")
            return load(self, buf, start, count, shadow)

        def checked_release(self, manager):
            if self.residency == Residency.FETCHED and not self.persistent:
                lo = self.flat.data_ptr()
                hi = lo + self.flat.numel() * self.flat.element_size()
                for store_, _, a, b, p, q in list(tracker.pending):
                    if p < hi and lo < q:
                        tracker.violations.append(f"released {self.name} while a write of "
                                                  f"{store_.name} from its memory was pending")
            return release(self, manager)

        monkeypatch.setattr(FlatStore, "store_async", late_store)
        monkeypatch.setattr(FlatStore, "load_async", checked_load)
        monkeypatch.setattr(Unit, "release", checked_release)


class _LateWrite:
    def __init__(self, issue, tracker: _LateWrites, entry) -> None:
        self._issue, self._tracker, self._entry = issue, tracker, entry
        self._request = None

    def done(self) -> bool:
        return self._request is not None and self._request.done()

    def wait(self, *args, **kwargs):
        if self._request is None:
            time.sleep(_LateWrites.DELAY_S)
            self._request = self._issue()
            result = self._request.wait(*args, **kwargs)
            self._tracker.pending.remove(self._entry)
            return result
        return self._request.wait(*args, **kwargs)


@pytest.mark.parametrize("family,early_step,reuse", [
    ("llama", "on", None), ("llama", "off", None),
    ("llama", "on", 0),      # nothing kept: units still writing must not be released
    ("gpt2", "on", None),    # the tied embedding is stepped last and expected first
    ("llama", "off", 0),     # deferred steps run at the next forward's fetches
    ("gpt2", "off", None),   # the tied embedding is fetched first and again for the head
])
def test_late_writes_are_never_overtaken(disk_dir, monkeypatch, family: str, early_step: str,
                                         reuse: int | None) -> None:
    """Writes land as late as the engine allows (the early step leaves its last ones in flight
    after step(), the deferred step's land behind the next forward); nothing reads their range
    or frees their buffer before they land, and training still equals torch."""
    late = _LateWrites(monkeypatch)
    model = make_model(family, layers=3, width=64)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step=early_step)
    if reuse is not None:
        ds["zero_optimization"]["stage3_max_reuse_distance"] = reuse
    result = run_parity(model, ds, steps=4)
    assert late.violations == [], late.violations[:5]
    assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)


class AlternatingHeadModel(nn.Module):
    """Odd steps end in one head, even steps in the other: the backward that the last one
    recorded starts with a head this step does not use."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.block = nn.Linear(width, width)
        self.heads = nn.ModuleList([nn.Linear(width, VOCAB) for _ in range(2)])
        self.calls = 0

    def forward(self, input_ids, labels):
        self.calls += 1
        h = torch.tanh(self.block(self.embed(input_ids)))
        logits = self.heads[self.calls % 2](h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def test_expected_steps_read_ahead_and_unused_ones_are_cancelled(disk_dir) -> None:
    """Units whose gradients are coming have their states read before the gradients are
    complete; expected units that get no gradient are cancelled and their Adam step count does
    not move (bias correction depends on it); training equals torch AdamW."""
    torch.manual_seed(0)
    model = AlternatingHeadModel()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01,
                                foreach=False)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on")
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        x = torch.randint(0, VOCAB, (2, 8))
        for _ in range(6):
            loss = engine(input_ids=x, labels=x)
            engine.backward(loss)
            engine.step()
            ref_loss = reference(input_ids=x, labels=x)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        engine.flush()
        stats = engine.optimizer.stream_stats()
        assert stats["expected"] > 0 and stats["read_early"] > 0, stats
        assert stats["cancelled"] > 0, stats
        steps = {s.unit.name: s.step for s in engine.optimizer.states}
        assert steps["heads.0"] == 3 and steps["heads.1"] == 3, steps
        assert steps["block"] == 6, steps
    finally:
        engine.close()


def test_a_ready_step_never_waits_on_an_expected_one(disk_dir) -> None:
    """An expected step holds the read-ahead window and slots and its gradients never come: a
    step whose gradients are complete takes them over (preemption) and finishes; cancelling
    the expected one leaves its step count alone."""
    engine = nvme_engine(disk_dir, "on", layers=2, sub_group_size=2048)
    try:
        opt = engine.optimizer
        stream = opt._stream
        waiting, ready = [s for s in opt.states
                          if len(sub_groups(s, opt.sub_group_numel)) > READ_AHEAD + 1][:2]
        steps_before = (waiting.step, ready.step)
        expected = stream.expect(waiting)
        deadline = time.monotonic() + 30
        while stream.stats["read_early"] < READ_AHEAD + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream.stats["read_early"] >= READ_AHEAD + 1, stream.stats
        engine.pin_unit(ready.unit)            # an early step updates the fetched copy
        try:
            zeros = partitioned.CompleteGradient({})   # complete (zero) gradients
            stream.submit(ready, early=True, gradient=zeros).landed_future.result(timeout=20)
        finally:
            engine.unpin_unit(ready.unit, modified=False)
        assert stream.stats["preempted"] >= 1, stream.stats
        assert not expected.landed_future.done()
        stream.cancel(expected)
        expected.landed_future.result(timeout=20)
        assert (waiting.step, ready.step) == (steps_before[0], steps_before[1] + 1)
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("held", [True, False])
def test_held_and_copied_gradients_both_match_torch(disk_dir, monkeypatch, family: str,
                                                    held: bool) -> None:
    """The early step reads gradients as autograd made them (CPU device) or from one flat
    host buffer (forced here; the CUDA path): both equal torch AdamW."""
    monkeypatch.setattr(engine_sizing, "gradients_held", lambda device: held)
    model = make_model(family, layers=3, width=64)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on")
    result = run_parity(model, ds, steps=6, close=False)
    try:
        opt = result.engine.optimizer
        assert opt.holds_grads is held
        assert (opt.grad_pool is None) is held, "held gradients need no buffer pool"
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    finally:
        result.engine.close()


def test_reaping_a_finished_step_leaves_the_next_gradient_alone(disk_dir) -> None:
    """A unit's early step can still be pending (writes behind step()) when the next backward
    starts collecting the unit's gradient: reaping the old step must not drop the new
    gradient."""
    engine = nvme_engine(disk_dir, "on", layers=2)
    try:
        opt = engine.optimizer
        state = opt.states[1]
        engine.pin_unit(state.unit)
        try:
            old = opt._stream.submit(state, early=True,
                                     gradient=partitioned.CompleteGradient({}))
            old.landed_future.result(timeout=60)
            opt.steps.add(old)                             # finished, not reaped yet
            entries = state.unit.trainable_entries()
            for entry in entries:                          # the next backward's gradient
                opt.on_grad(state.unit, entry, torch.ones(entry.shape))
            assert opt.reap() == [state.unit]
            held = state.grad.parts if opt.holds_grads else state.grad.buffer
            assert held is not None, "reaping the old step dropped the new gradient"
        finally:
            engine.unpin_unit(state.unit, modified=False)
    finally:
        engine.close()


def test_held_gradient_parts_go_as_their_sub_groups_are_stepped(disk_dir, monkeypatch) -> None:
    """An early step frees each held gradient part once no sub-group still to be stepped
    covers it, not when the unit's whole step has run (a Llama layer's gradient is ~200 MB at
    width 2048): with sub-groups smaller than the parameters, a unit holds fewer parts after
    its first kernels than it was handed, none after its last, and training equals torch."""
    from infinity.optim.step_stream import StepStream

    counts: dict = {}      # job (kept alive: ids are reused) -> parts held before its first
    real = StepStream._free_stepped_parts     # kernel, then after each

    def recording(self, job):
        held = counts.setdefault(job, [len(job.gradient.values)])
        real(self, job)
        held.append(len(job.gradient.values))

    monkeypatch.setattr(StepStream, "_free_stepped_parts", recording)
    model = make_model("llama", layers=2, width=64)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on")
    ds["zero_optimization"]["sub_group_size"] = 4096
    result = run_parity(model, ds, steps=3)
    assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    # layers: several parameters over three sub-groups or more (a one-parameter unit, the
    # embedding, can only go at its end)
    layers = [c for c in counts.values() if len(c) >= 4 and c[0] >= 3]
    assert layers, f"no unit of several parameters took three sub-groups: {counts}"
    for held in layers:
        handed, during, last = held[0], held[1:-1], held[-1]
        assert last == 0, held
        assert during == sorted(during, reverse=True), held
        assert min(during) < handed, f"nothing freed before the step's last kernel: {held}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("units", [1.0, 0.0])
def test_held_gradients_stay_within_their_room(disk_dir, monkeypatch, family: str,
                                               units: float) -> None:
    """The backward waits for background steps to give room back (see [Note: room in bytes,
    freed as the step goes]): with a room of one unit's gradient (the default) or none at all
    (every unit waits for the step ahead of it), the bytes held never exceed the room or the
    gradient of the units still collecting (GPT-2's tied embedding collects through the whole
    backward) by more than a unit's first part, all are given back by each step, and training
    equals torch."""
    from infinity.optim.held_room import HeldRoom

    capacities: list[int] = []
    monkeypatch.setattr(run_plan, "held_room_bytes",
                        lambda max_trainable: capacities.append(int(units * max_trainable * 4))
                        or capacities[-1])
    left_after_step: list[int] = []
    real_step = partitioned.PartitionedOptimizer.run_step     # what the engine's step runs

    def step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        left_after_step.append(self.held_room.held)
        return result

    monkeypatch.setattr(partitioned.PartitionedOptimizer, "run_step", step)
    model = make_model(family, layers=3, width=64)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on")
    ds["zero_optimization"]["sub_group_size"] = 4096
    result = run_parity(model, ds, steps=4, close=False)
    try:
        opt = result.engine.optimizer
        room = opt.held_room
        assert isinstance(room, HeldRoom) and room.capacity == capacities[-1]
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
        unit = max(s.unit.trainable_numel for s in opt.states) * 4
        part = max(e.numel for s in opt.states for e in s.unit.trainable_entries()) * 4
        tied = sum(s.unit.trainable_numel * 4 for s in opt.states
                   if family == "gpt2" and "wte" in s.unit.name)
        # the room (or, with no step running, the unit still collecting), and on top a unit's
        # first part, taken without waiting
        bound = max(room.capacity, unit) + part + tied
        assert room.peak <= bound, (room.peak, room.capacity, part, unit, tied)
        assert room.peak > 0, "no gradient was held"
        assert left_after_step and set(left_after_step) == {0}, left_after_step
    finally:
        result.engine.close()
