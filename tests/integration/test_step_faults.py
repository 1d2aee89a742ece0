"""An I/O error inside an optimizer step reaches the caller without a hang -- at engine.step() in
the early schedule, where the deferred step runs (the next forward's fetch, or engine.flush())
in the other -- and engine.close() still removes the swap files."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import infinity
from infinity.storage.manager import FlatStore
from parity import VOCAB, loss_of, make_model, nvme_engine, reference_step, zero_config


@pytest.mark.parametrize("schedule", ["on", "off"])
def test_write_error_in_a_step_is_raised_at_step_and_close_cleans_up(disk_dir, monkeypatch,
                                                                      schedule) -> None:
    engine = nvme_engine(disk_dir, schedule, layers=3)
    x = torch.randint(0, VOCAB, (1, 8))
    engine.backward(loss_of(engine(input_ids=x, labels=x)))
    engine.step()                                   # a clean first step

    original = FlatStore.store_async

    def failing(self, buf, start=0, count=None, shadow=False):
        if self.name.endswith(".exp_avg_sq"):
            raise OSError(5, "injected EIO", self.name)
        return original(self, buf, start, count, shadow)

    monkeypatch.setattr(FlatStore, "store_async", failing)
    try:
        with pytest.raises(OSError, match="injected EIO"):
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            engine.flush()        # the deferred step runs here (no next forward)
        monkeypatch.setattr(FlatStore, "store_async", original)
        # the states may be half-written: the engine says so, once and for every call (the
        # other failed units' errors are not raised one by one), and saves nothing
        for call in (lambda: engine(input_ids=x, labels=x), engine.step, engine.flush,
                     lambda: engine.save_checkpoint(disk_dir / "ckpt")):
            with pytest.raises(RuntimeError, match="an optimizer step failed earlier .*injected "
                                                   "EIO.*load_checkpoint"):
                call()
        assert not (disk_dir / "ckpt").exists()
    finally:
        monkeypatch.setattr(FlatStore, "store_async", original)
        engine.close()
    swap_dirs = [d for d in os.listdir(disk_dir) if d.startswith("infinity-swap")]
    assert swap_dirs == [], f"close() left {swap_dirs} in {disk_dir}"


class _TrackedRequest:
    """A write request that remembers whether anyone waited for it."""

    def __init__(self, request, buf: torch.Tensor) -> None:
        self.request = request
        self.start = buf.data_ptr()
        self.end = self.start + buf.numel() * buf.element_size()
        self.waited = False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.request.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.request, name)


@pytest.mark.parametrize("schedule", ["on", "off"])
def test_a_failed_sub_group_waits_its_issued_writes_before_freeing_slots(disk_dir, monkeypatch,
                                                                          schedule) -> None:
    """exp_avg's write is issued, then exp_avg_sq's fails: the slot that exp_avg is written
    from must not go back to the pool (and be refilled) while that write may be in flight."""
    from infinity.storage.buffer_pool import BufferPool

    engine = nvme_engine(disk_dir, schedule, layers=2)
    x = torch.randint(0, VOCAB, (1, 8))

    issued: list[_TrackedRequest] = []
    freed_early: list[str] = []
    original_store = FlatStore.store_async
    original_release = BufferPool.release

    def tracking_store(self, buf, start=0, count=None, shadow=False):
        if self.name.endswith(".exp_avg_sq"):
            raise OSError(5, "injected EIO", self.name)
        request = _TrackedRequest(original_store(self, buf, start, count, shadow), buf)
        issued.append(request)
        return request

    def checking_release(self, slot):
        lo = slot.buffer.data_ptr()
        hi = lo + slot.buffer.numel()
        freed_early.extend(f"slot {slot.index} of {self.name}" for r in issued
                           if not r.waited and r.start < hi and lo < r.end)
        return original_release(self, slot)

    monkeypatch.setattr(FlatStore, "store_async", tracking_store)
    monkeypatch.setattr(BufferPool, "release", checking_release)
    try:
        with pytest.raises(OSError, match="injected EIO"):
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            engine.flush()        # the deferred step runs here (no next forward)
    finally:
        monkeypatch.setattr(FlatStore, "store_async", original_store)
        monkeypatch.setattr(BufferPool, "release", original_release)
        engine.close()
    assert any(r.waited for r in issued), "the injected failure came before any write"
    assert freed_early == [], f"freed while a write from it was in flight: {freed_early}"


@pytest.mark.parametrize("schedule", ["on", "off"])
def test_training_goes_on_after_a_backward_that_raises(disk_dir, schedule) -> None:
    """A backward raises half-way (the units after the failing layer have their gradients, the
    others not): the next backward must neither wait for the dropped gradients (the early step
    held them) nor add them in; with the deferred schedule training then equals torch that
    skipped the batch (the early step has already stepped the units done before the failure,
    which cannot be undone). The held gradients' room is empty after every step."""
    import threading

    from parity import ArmedBackwardHook, engine_and_reference, make_model, zero_config

    torch.manual_seed(0)
    model = make_model("llama", layers=3, width=64)
    failing = ArmedBackwardHook(error="injected backward failure")
    model.model.layers[0].register_full_backward_pre_hook(failing)
    engine, reference, ref_opt = engine_and_reference(
        model, zero_config(3, "nvme", "nvme", str(disk_dir), early_step=schedule))
    gen = torch.Generator().manual_seed(2)
    try:
        for step in range(5):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            loss = loss_of(engine(input_ids=x, labels=x))
            if step == 2:
                failing.armed = True
                with pytest.raises(RuntimeError, match="injected backward failure"):
                    engine.backward(loss)
                continue                               # the batch is skipped
            done = threading.Event()

            def backward_and_step() -> None:
                engine.backward(loss)
                engine.step()
                done.set()

            worker = threading.Thread(target=backward_and_step, daemon=True)
            worker.start()
            worker.join(timeout=120)
            assert done.is_set(), f"step {step}: backward did not finish after a failed one"
            # the dropped gradients gave their room back (a leak would make later backwards wait)
            assert engine.optimizer.held_room.held == 0, (step, engine.optimizer.held_room.held)
            ref_loss = loss_of(reference(input_ids=x, labels=x))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            if schedule == "off" or step < 3:
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            assert torch.isfinite(loss)
        if schedule == "off":   # the failed backward's speculated units were rolled back
            assert engine.optimizer.speculation_stats["rolled_back"] == 1
    finally:
        engine.close()


def _failing_llama():
    """A small Llama (seed 0) whose first layer's backward raises when ``failing.armed``."""
    from parity import ArmedBackwardHook, make_model

    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    failing = ArmedBackwardHook(error="injected backward failure")
    model.model.layers[0].register_full_backward_pre_hook(failing)
    return model, failing


def _assert_weights_as(engine, reference) -> None:
    """The engine's current weights are the reference's (fp32 rounding through Adam)."""
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        for (name, p), q in zip(engine.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("how", ["engine", "direct"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_backward_failed_mid_cycle_skips_its_batch_under_accumulation(disk_dir, how, tier):
    """gradient_accumulation_steps 2: the second micro-batch's backward of batch 2 raises and
    the loop skips the batch (as docs/training-loop.md says training sees). The cycle's
    gradients are dropped and its micro-batches counted from its first again: the counter was
    left mid-cycle, so each later step took one micro-batch of two batches (0.03 off torch);
    a ``loss.backward()`` that raised dropped nothing at all (the engine cannot catch its
    error: the next forward finds its end never came)."""
    from parity import engine_and_reference, zero_config

    model, failing = _failing_llama()
    ds = zero_config(3, tier, tier, str(disk_dir), early_step="off")
    ds.update(gradient_accumulation_steps=2, gradient_clipping=5.0)
    engine, reference, ref_opt = engine_and_reference(model, ds)
    gen = torch.Generator().manual_seed(2)
    try:
        for batch in range(5):
            halves = [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2)]
            skipped = False
            for micro, x in enumerate(halves):
                loss = loss_of(engine(input_ids=x, labels=x))
                failing.armed = batch == 2 and micro == 1
                with pytest.raises(RuntimeError, match="injected") if failing.armed \
                        else contextlib.nullcontext():
                    if how == "engine":
                        engine.backward(loss)
                    else:
                        (loss / 2).backward()
                    engine.step()
                skipped = skipped or (batch == 2 and micro == 1)
            if skipped:
                continue
            for x in halves:
                (loss_of(reference(input_ids=x, labels=x)) / 2).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 5.0)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        assert engine.global_steps == 4
        _assert_weights_as(engine, reference)
    finally:
        engine.close()


@pytest.mark.parametrize("after,early_step", [("zero_grad", "off"), ("step", "off"),
                                              ("zero_grad", "auto")])
def test_a_failed_loss_backward_is_dropped_before_zero_grad_or_step(disk_dir, after,
                                                                     early_step) -> None:
    """A torch loop recovers from a failed ``loss.backward()`` with ``zero_grad()`` or goes on
    to ``step()``: the step stepped the partial gradients (0.01 on the last layer), and under
    the early step with accumulation (the last micro-batch's backward steps units as it goes)
    the zero_grad was refused as if that backward had completed. The engine cannot catch that
    error, so zero_grad and step first drop what it left, as a failed ``engine.backward``."""
    from parity import engine_and_reference, zero_config

    model, failing = _failing_llama()
    ds = zero_config(3, "cpu", "cpu", str(disk_dir), early_step=early_step)
    ds["gradient_accumulation_steps"] = accumulation = 2 if early_step == "auto" else 1
    engine, reference, ref_opt = engine_and_reference(model, ds)
    gen = torch.Generator().manual_seed(2)
    try:
        for micro in range(6):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            failing.armed = micro == 1
            try:
                (loss_of(engine(input_ids=x, labels=x)) / accumulation).backward()
            except RuntimeError:
                getattr(engine.optimizer, after)()       # the loop's recovery: not refused
                continue
            engine.optimizer.step()
            if accumulation == 1:
                engine.optimizer.zero_grad()
                loss_of(reference(input_ids=x, labels=x)).backward()
                ref_opt.step()
                ref_opt.zero_grad()
        if accumulation == 1:
            _assert_weights_as(engine, reference)
        else:       # the failed micro-batch 2 of the first cycle: its cycle counted again
            assert engine.global_steps == 2 and engine.micro_steps == 4
    finally:
        engine.close()


def test_a_failed_gradient_of_the_inputs_keeps_the_cycle(disk_dir) -> None:
    """A saliency map (``torch.autograd.grad`` of the inputs, no parameter gradient) that raises
    between two micro-batches of a cycle: it delivered no gradient, so the next forward lets
    its pass go and keeps micro-batch 1's gradients (they were dropped, the count restarted)."""
    from parity import engine_and_reference, make_model, zero_config

    torch.manual_seed(0)
    model = make_model("llama", layers=2, width=64)
    ds = zero_config(3, "cpu", "cpu", str(disk_dir), early_step="off")
    ds["gradient_accumulation_steps"] = 2
    engine, reference, ref_opt = engine_and_reference(model, ds)
    gen = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2))
    try:
        engine.backward(loss_of(engine(input_ids=first, labels=first)))
        engine.step()
        embeds = engine.module.model.embed_tokens(first).detach().requires_grad_()
        embeds.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("saliency")))
        with pytest.raises(RuntimeError, match="saliency"):
            torch.autograd.grad(loss_of(engine(inputs_embeds=embeds, labels=first)), embeds)
        engine.backward(loss_of(engine(input_ids=second, labels=second)))
        engine.step()
        assert engine.global_steps == 1
        for x in (first, second):
            (loss_of(reference(input_ids=x, labels=x)) / 2).backward()
        ref_opt.step()
        _assert_weights_as(engine, reference)
    finally:
        engine.close()


def test_a_closed_engine_says_so(disk_dir) -> None:
    """close() twice is harmless; a forward, backward or step afterwards is a clear error (not
    a new swap space and an unallocated-extent error)."""
    engine = nvme_engine(disk_dir, "on", layers=1)
    x = torch.randint(0, VOCAB, (1, 8))
    loss = loss_of(engine(input_ids=x, labels=x))
    engine.close()
    engine.close()
    for call in (lambda: engine(input_ids=x, labels=x), lambda: engine.backward(loss),
                 engine.step, engine.module_state_dict):
        with pytest.raises(RuntimeError, match=r"after engine.close\(\)"):
            call()
    assert [d for d in os.listdir(disk_dir) if d.startswith("infinity-swap")] == []
    # the model's own calls on its released parameters say their values are gone (a forward
    # failed with "'weight' must be 2-D", a state dict and a gather gave empty tensors)
    model = engine.module
    for call in (lambda: model(input_ids=x, labels=x), model.state_dict,
                 model.lm_head.state_dict):       # a part's too (it saved empty tensors)
        with pytest.raises(RuntimeError, match="released by an engine that closed"):
            call()
    with pytest.raises(ValueError, match="GatheredParameters on parameters an engine released"):
        with infinity.zero.GatheredParameters(list(model.parameters())):
            pass


def test_close_gives_the_parameters_host_homes_back(disk_dir) -> None:
    """Parameters homed in host memory: close() freed the Adam states but not the parameters'
    homes, so an engine kept in a variable (``engine, optimizer, _, _ = initialize(...)``)
    held one fp32 copy of the model after close (52 MB for 13.6M parameters)."""
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    x = torch.randint(0, VOCAB, (1, 8))
    engine.backward(loss_of(engine(input_ids=x, labels=x)))
    engine.step()
    stores = [u.param_store for u in engine.units if u.param_store is not None]
    assert stores and all(store.allocated for store in stores)
    engine.close()
    assert not any(store.allocated for store in stores)


@pytest.mark.parametrize("schedule", ["on", "off", "clipped"])
def test_an_engine_dropped_without_close_is_collected(disk_dir, schedule) -> None:
    """A notebook re-running a cell drops its engine without close(): three references kept
    every such engine alive until exit, with its swap directory, buffers and step thread (the
    parameters' gradient hooks, held in C++ where the collector never looks; the step thread;
    a read's integrity check in the swap space's finalizer). Now it is collected and its
    finalizers remove the directory; its thread ends. The bound is generous: a pass of the
    step thread in progress holds the stream until it ends, on a loaded machine a while."""
    import gc
    import time
    import weakref

    if schedule == "clipped":       # the deferred schedule's reads ahead, checked when waited
        ds = zero_config(3, "nvme", "nvme", str(disk_dir))
        ds.update(gradient_clipping=1.0, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
        engine, *_ = infinity.initialize(model=make_model("llama", layers=2, width=64), config=ds)
    else:
        engine = nvme_engine(disk_dir, schedule, layers=2)
    x = torch.randint(0, VOCAB, (1, 8))
    for _ in range(2):
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
    dropped = weakref.ref(engine)
    thread = engine.optimizer._stream._thread       # this engine's, not an earlier test's
    del engine
    deadline = time.monotonic() + 60
    while dropped() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert dropped() is None, "the engine was not collected"
    assert [d for d in os.listdir(disk_dir) if d.startswith("infinity-swap")] == []
    thread.join(timeout=60)
    assert not thread.is_alive(), "the dropped engine's step thread still runs"


@pytest.mark.parametrize("schedule", ["on", "off"])
def test_a_parameter_read_that_fails_to_start_leaves_no_memory_held(disk_dir, monkeypatch,
                                                                     schedule) -> None:
    """A prefetch or fetch whose read fails when it is issued (not when waited): the forward
    raises, and the unit's memory or slot goes back, so the next steps fetch it again."""
    engine = nvme_engine(disk_dir, schedule, layers=3, stage3_max_reuse_distance=0)
    x = torch.randint(0, VOCAB, (1, 8))
    engine.backward(loss_of(engine(input_ids=x, labels=x)))
    engine.step()
    original = FlatStore.load_async
    failed: list[str] = []

    def failing_once(self, buf, start=0, count=None):
        if self.name.endswith(".params") and not failed:
            failed.append(self.name)
            raise OSError(5, "injected EIO at submit", self.name)
        return original(self, buf, start, count)

    monkeypatch.setattr(FlatStore, "load_async", failing_once)
    try:
        with pytest.raises(OSError, match="injected EIO at submit"):
            engine(input_ids=x, labels=x)
        assert failed
        for _ in range(2):
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            assert torch.isfinite(loss)
    finally:
        engine.close()


def test_the_units_a_step_reaped_are_handed_over_once(disk_dir, monkeypatch) -> None:
    """Early step: engine.step() released the units whose steps ended inside it but kept the
    list, and a later backward that raised released those units again -- while new steps of
    theirs ran, on a slow disk, so the next forward read a copy still being stepped (wrong
    values; seen with delayed reads, not reproducible on a fast disk). Here step() is made to
    report every unit as finished: the list must be empty after it, and training goes on equal
    to torch across a failed backward."""
    from infinity.optim.partitioned import PartitionedOptimizer
    from infinity.zero.protocols import Wait
    from parity import ArmedBackwardHook, engine_and_reference, make_model, zero_config

    finish = PartitionedOptimizer._finish_early_steps

    def everything_landed(self):
        finish(self)
        self.steps.reap(Wait.ALL, hand_out=False)          # every write has landed ...
        self.steps.unclaimed[:] = [s.unit for s in self.states]   # ... so every unit may go

    monkeypatch.setattr(PartitionedOptimizer, "_finish_early_steps", everything_landed)
    torch.manual_seed(0)
    model = make_model("llama", layers=3, width=64)
    failing = ArmedBackwardHook(error="injected backward failure")
    model.model.embed_tokens.register_full_backward_pre_hook(failing)
    engine, reference, ref_opt = engine_and_reference(
        model, zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on"))
    gen = torch.Generator().manual_seed(2)
    try:
        for step in range(4):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            loss = loss_of(engine(input_ids=x, labels=x))
            torch.testing.assert_close(loss, loss_of(reference(input_ids=x, labels=x)),
                                       rtol=1e-5, atol=1e-6)
            stepped_on_failure = step == 2
            if stepped_on_failure:
                failing.armed = True
                with pytest.raises(RuntimeError, match="injected backward failure"):
                    engine.backward(loss)
            else:
                engine.backward(loss)
                engine.step()
                assert engine.optimizer.steps.unclaimed == [], \
                    [u.name for u in engine.optimizer.steps.unclaimed]
            loss_of(reference(input_ids=x, labels=x)).backward()
            if stepped_on_failure:     # every unit but the embedding had its gradients
                reference.model.embed_tokens.weight.grad = None
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    finally:
        engine.close()


def test_an_interrupted_wait_for_background_steps_is_not_a_failed_step(disk_dir,
                                                                         monkeypatch) -> None:
    """Ctrl-C while flush() (or save_checkpoint) waits for the steps' writes: the wait was
    interrupted, not the step, yet the engine recorded it as a failed step and refused every
    later call ("load_checkpoint the last checkpoint"), losing the progress since. Now the
    jobs stay pending; saving and training go on, equal to torch.

    The writes of step 1 are held (an Event) from the moment every one of its jobs has stepped
    until the interrupt has happened, so flush() always finds a write in flight, however far
    the stream got before it: a delay (sleeping in each write) lost that race to a main thread
    descheduled on a loaded machine, and flush() found nothing to wait for."""
    import threading
    from concurrent.futures import Future

    from infinity.optim.records import StepJob
    from parity import engine_and_reference, make_model, zero_config

    torch.manual_seed(0)
    engine, reference, ref_opt = engine_and_reference(
        make_model("llama", layers=3, width=64),
        zero_config(3, "nvme", "nvme", str(disk_dir), early_step="on"))
    original_store = FlatStore.store_async
    original_stepped = StepJob.stepped
    all_stepped = threading.Event()   # every job of step 1 ran its kernels: step() can return
    release = threading.Event()       # the held writes may land
    stepped = {"count": 0, "jobs_per_step": None}

    def counted_stepped(self):        # the stream thread, after the job's last kernel
        stepped["count"] += 1
        if stepped["jobs_per_step"] is not None and stepped["count"] >= stepped["jobs_per_step"]:
            all_stepped.set()         # before the future: step() may return as soon as it is set
        original_stepped(self)

    class HeldWrite:
        def __init__(self, request):
            self.request = request

        def wait(self, timeout=None):
            # a hang guard only: the test opens ``release`` itself; if it never does, the write
            # fails (a failed step), and the test with it
            if all_stepped.is_set() and not release.wait(120):
                raise TimeoutError("the test never released the held writes")
            return self.request.wait()

    def held_store(self, buf, start=0, count=None, shadow=False):
        return HeldWrite(original_store(self, buf, start, count, shadow))

    original_result = Future.result
    armed = []

    def interrupted_result(self, timeout=None):
        if armed and threading.current_thread() is threading.main_thread() and not self.done():
            armed.clear()
            raise KeyboardInterrupt
        return original_result(self, timeout)

    monkeypatch.setattr(StepJob, "stepped", counted_stepped)
    gen = torch.Generator().manual_seed(2)
    try:
        for step in range(3):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            if step == 1:
                # step 0's kernels have all run (step() waited for them): the jobs of a step
                stepped["jobs_per_step"], stepped["count"] = stepped["count"], 0
                assert stepped["jobs_per_step"] > 0
                monkeypatch.setattr(FlatStore, "store_async", held_store)
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            if step == 1:
                assert all_stepped.is_set()
                monkeypatch.setattr(Future, "result", interrupted_result)
                armed.append(True)
                with pytest.raises(KeyboardInterrupt):
                    engine.flush()
                monkeypatch.setattr(Future, "result", original_result)
                monkeypatch.setattr(FlatStore, "store_async", original_store)
                assert engine.optimizer.steps.jobs, "the interrupted wait dropped pending jobs"
                release.set()
                assert engine.optimizer.step_failure is None
                engine.save_checkpoint(disk_dir / "ckpt")
            torch.testing.assert_close(loss, reference_step(reference, ref_opt, x, 0.0),
                                       rtol=1e-5, atol=1e-6)
    finally:
        release.set()
        monkeypatch.setattr(Future, "result", original_result)
        engine.close()


@pytest.mark.parametrize("schedule", ["on", "off"])
def test_ctrl_c_during_step_raises_once_the_step_is_whole(disk_dir, monkeypatch,
                                                          schedule) -> None:
    """A real SIGINT while engine.step() is under way (the early schedule then waits on slow
    background steps): before, the step was left half done (counters, schedule, speculation)
    and a loop resumed after the interrupt trained on wrong values. Now the step finishes,
    KeyboardInterrupt follows, and training goes on equal to torch that took the step.

    The SIGINT is sent from inside the step (as the optimizer's part of it begins), not by a
    timer: a timer's 20 ms could run out before a descheduled main thread entered step(), and
    the interrupt then came before the step (nothing counted) or after it."""
    import signal
    import time

    from infinity.optim.kernel import AdamKernel
    from parity import engine_and_reference, make_model, zero_config

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has another handler in this process")
    torch.manual_seed(0)
    engine, reference, ref_opt = engine_and_reference(
        make_model("llama", layers=3, width=64),
        zero_config(3, "nvme", "nvme", str(disk_dir), early_step=schedule))
    slow = {"on": False}
    kernel = AdamKernel.run

    def slow_kernel(self, state, *args, **kwargs):
        if slow["on"]:
            time.sleep(0.1)     # widens the wait; nothing depends on its length
        return kernel(self, state, *args, **kwargs)

    optimizer_step = engine.optimizer.run_step      # the engine's step runs the optimizer's
    sent = []

    def step_with_ctrl_c(*args, **kwargs):
        if slow["on"] and not sent:
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)   # its handler runs before os.kill returns
        return optimizer_step(*args, **kwargs)

    monkeypatch.setattr(AdamKernel, "run", slow_kernel)
    monkeypatch.setattr(engine.optimizer, "run_step", step_with_ctrl_c)
    gen = torch.Generator().manual_seed(2)
    try:
        for step in range(4):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            if step == 1:
                slow["on"] = True
                with pytest.raises(KeyboardInterrupt):
                    engine.step()
                slow["on"] = False
                assert sent, "the step never reached the optimizer"
                assert engine.global_steps == 2
            else:
                engine.step()
            torch.testing.assert_close(loss, reference_step(reference, ref_opt, x, 0.0),
                                       rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_a_swap_file_cut_from_outside_says_so(disk_dir) -> None:
    """Someone truncates the engine's swap files mid-run: the read error told the user to
    "pass allow_short=True", an argument of the I/O layer no user calls; it now says the swap
    file was cut from outside and what to do."""
    engine = nvme_engine(disk_dir, "on", layers=2)
    try:
        x = torch.randint(0, VOCAB, (1, 8))
        engine.backward(loss_of(engine(input_ids=x, labels=x)))
        engine.step()
        engine.flush()
        swap = [d for d in os.listdir(disk_dir) if d.startswith("infinity-swap")]
        for name in os.listdir(disk_dir / swap[0]):
            if name.endswith(".bin"):
                os.truncate(disk_dir / swap[0] / name, 4096)
        with pytest.raises(OSError, match="truncated or replaced from outside the engine.*"
                                          "load_checkpoint") as info:
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            engine.flush()
        assert "allow_short" not in str(info.value)
    finally:
        engine.close()


def test_a_gathered_copy_of_the_model_is_its_own_after_close(disk_dir) -> None:
    """An EMA or teacher copied under GatheredParameters: deepcopy carried the engine's fetch
    hooks, so the copy's forward fetched and released the engine's units (the swap read twice)
    and failed once the engine closed ("the swap space was closed with the engine"). The
    copy's calls are now its own, as in torch."""
    import copy

    engine = nvme_engine(disk_dir, "on", layers=2)
    x = torch.randint(0, VOCAB, (1, 8))
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        twin = copy.deepcopy(engine.module)
    before = twin(input_ids=x).logits.detach().clone()
    engine.backward(loss_of(engine(input_ids=x, labels=x)))
    engine.step()
    engine.close()
    torch.testing.assert_close(twin(input_ids=x).logits, before, rtol=0, atol=0)


def test_a_gathered_copy_carries_none_of_the_engine_and_keeps_the_user_s_hooks(disk_dir) -> None:
    """The copy carried the engine's hooks and routed methods: ``torch.save(copy)`` failed on
    "Can't pickle local object" and the closed engine (its stores, its swap files' handles)
    stayed alive as long as the copy did. A hook the user registered is copied, as torch does."""
    import copy
    import gc
    import io
    import weakref

    engine = nvme_engine(disk_dir, "on", layers=2)
    calls = _CountCall.calls
    calls.clear()
    engine.module.model.layers[0].register_forward_hook(_CountCall())
    x = torch.randint(0, VOCAB, (1, 8))
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        twin = copy.deepcopy(engine.module)
    buffer = io.BytesIO()
    torch.save(twin, buffer)                 # refused for the held model itself
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = twin(input_ids=x).logits
    assert len(calls) == 1, calls            # the user's hook, copied with the model
    torch.testing.assert_close(loaded(input_ids=x).logits, expected, rtol=0, atol=0)
    assert len(calls) == 2, calls
    alive = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    assert alive() is None, [type(r).__name__ for r in gc.get_referrers(alive())][:8]
    torch.testing.assert_close(twin(input_ids=x).logits, expected, rtol=0, atol=0)


class _CountCall:
    """A forward hook the user registers (a picklable object, as a saved model's hooks must be;
    its calls counted on the class, which a copy of the hook shares)."""

    calls: list[str] = []

    def __call__(self, module, args, output) -> None:
        self.calls.append(type(module).__name__)
