"""Copies that complete late (storage/transfers.py ``LateCopies``, issue 36): every host-to-device
copy of a unit from its host slot, and every device-to-host copy of a gradient to its host
buffer or home, runs on a helper thread after a seeded random delay; a copied destination reads
NaN until then (a gradient added to its home lacks the add until the reader waits), and a slot
handed back while a copy still reads or writes it is NaN-filled. The paths a GPU takes (the
device memory cache turned off, as a CUDA device has none; gradients copied to host buffers,
never held, as off a CPU device) must still train exactly as torch AdamW does, for three model
families, parameters on NVMe and on the host (both copied to the device ahead of use: from the
host slot once read, from the host home as soon as prefetch picks the unit), both schedules;
and it must fail when compute does not wait for its unit's copy (issued at use or ahead), when a slot goes back before its copy's event, or when a
gradient is read before its device-to-host copies' events (on the training thread, or in the
early step on the step stream, which waits for them in its place). On a CPU device the
immediate copies run these tests' code path with no thread (the default). Two ranks under late
copies: tests/distributed/test_late_transfers_ranks.py."""
from __future__ import annotations

import math
import threading

import pytest
import torch

import infinity
from infinity.engine import sizing as engine_sizing
from infinity.optim.records import CompleteGradient
from infinity.storage import transfers
from infinity.storage.device_cache import DeviceMemoryCache
from infinity.zero.unit import Unit
from parity import VOCAB, loss_of, make_model, run_parity, zero_config

CASES = [(family, param, early) for family in ("llama", "gpt2", "torch")
         for param in ("nvme", "cpu") for early in ("on", "off")]


def _gpu_paths(monkeypatch) -> None:
    """The slot path a device without the memory cache takes, and gradients copied to host
    buffers as off a CPU device (``gradients_held``)."""
    monkeypatch.setattr(DeviceMemoryCache, "supported", staticmethod(lambda device: False))
    monkeypatch.setattr(engine_sizing, "gradients_held", lambda device: False)


def _late(monkeypatch, seed: int) -> None:
    """Late copies on the GPU's paths (``_gpu_paths``)."""
    monkeypatch.setenv(transfers.LATE_ENV, str(seed))
    _gpu_paths(monkeypatch)


def _run(disk_dir, family: str, param: str, early: str):
    ds = zero_config(3, param, "nvme" if param == "nvme" else "cpu", str(disk_dir),
                     early_step=early)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return run_parity(make_model(family, layers=2, width=32), ds, steps=4,
                      clip=0.0 if early == "on" else 1.0, close=False)


@pytest.mark.parametrize("family, param, early", CASES)
def test_late_copies_train_as_torch(disk_dir, monkeypatch, family, param, early) -> None:
    _late(monkeypatch, seed=CASES.index((family, param, early)))
    result = _run(disk_dir, family, param, early)
    try:
        copies = result.engine.manager.copies
        assert isinstance(copies, transfers.LateCopies) and copies.copies > 0
        # every gradient left the device through a copy to the host (none held)
        assert copies.to_host_copies > 0 and not result.engine.optimizer.holds_grads
        # parameters on NVMe come through host slots, on the host from their home store
        assert (result.engine.fetch_pool is not None) == (param == "nvme")
        assert copies.poisoned == 0 and copies.lost == 0 and copies.overtaking == 0
        # prefetched units were copied to the device ahead of their use: from their host slot
        # once read (NVMe), from their host home at once (host memory, ``Unit._copy_home``)
        assert sum(u.prefetch_hits for u in result.engine.units) > 0
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
    finally:
        result.engine.close()


FAULTS = ["compute does not wait", "slot back before its copy",
          "gradient read before its copy to the host",
          "early step reads its gradient before its copies to the host"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_missing_wait_fails(disk_dir, monkeypatch, fault: str) -> None:
    """Planted faults: each gives NaN (the destination or the slot was poisoned, a gradient
    read before its copy landed) or a loss off torch's (a gradient missing its add), not a
    pass. The last is the early step's own wait: the training thread hands a unit's copies
    still landing to the step stream (optim/gradients.py ``take``), and a stream that does not
    wait for them (``CompleteGradient.landed``) steps NaN."""
    _late(monkeypatch, seed=7)
    early = "off"
    if fault == FAULTS[0]:
        monkeypatch.setattr(transfers.LateCopies, "compute_waits", lambda self, event: None)
    elif fault == FAULTS[1]:
        monkeypatch.setattr(transfers.LateCopies, "release_after",
                            lambda self, event, release: release())
    elif fault == FAULTS[2]:
        monkeypatch.setattr(transfers.LateCopies, "host_waits", lambda self, events: None)
    else:
        monkeypatch.setattr(CompleteGradient, "landed", lambda self: None)
        early = "on"
    result = _run(disk_dir, "llama", "nvme", early)
    try:
        bad = not all(math.isfinite(x) for x in result.losses) or \
            result.worst_relative > 1e-3
        assert bad, (fault, result.losses, result.ref_losses)
    finally:
        result.engine.close()


def test_compute_not_waiting_for_a_host_homes_copy_ahead_fails(disk_dir, monkeypatch) -> None:
    """Planted fault: a host-homed unit's copy issued ahead (``Unit._copy_home``) that its use
    does not wait for. Deterministic, not by the luck of a slow thread: each such copy is held
    on the helper thread behind a gate that only a wait for some other copy opens, so the use
    reads the NaN its destination holds until the copy lands (the first unit of a forward is
    copied ahead at the pass's start: the loss is NaN)."""
    _late(monkeypatch, seed=11)
    gate = threading.Event()
    issue, wait = Unit._copy_home, transfers._LateEvent.wait

    def not_waited(self, manager) -> bool:
        gate.clear()
        manager.copies._jobs.put(gate.wait)     # the copy lands after the next real wait
        started = issue(self, manager)
        if started:
            self.copy_event = transfers.DONE      # the use no longer waits for the copy
        return started

    def opens(event) -> None:
        gate.set()
        wait(event)
    monkeypatch.setattr(Unit, "_copy_home", not_waited)
    monkeypatch.setattr(transfers._LateEvent, "wait", opens)
    result = _run(disk_dir, "llama", "cpu", "off")
    try:
        assert not math.isfinite(result.worst_relative) or result.worst_relative > 1e-3, \
            (result.losses, result.ref_losses)
    finally:
        gate.set()
        result.engine.close()


def _bf16_losses(disk_dir, monkeypatch, param: str, seed: int | None, early: str,
                 accumulation: int = 1, layers: int = 2, calls: int = 4) -> tuple[list[float], int]:
    """A Llama at stage 3 in bf16 with an fp32 master (AdamW lr 1e-2, optimizer on the host),
    ``calls`` micro-batches on the GPU's other paths, under late copies seeded ``seed`` (None:
    immediate): its losses, and the steps its coordinator started ahead of their unit's use."""
    if seed is None:
        _gpu_paths(monkeypatch)
    else:
        _late(monkeypatch, seed)
    torch.manual_seed(0)
    ds = zero_config(3, param, "cpu", str(disk_dir), compute_dtype="bf16", early_step=early)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    ds["gradient_accumulation_steps"] = accumulation
    engine, *_ = infinity.initialize(model=make_model("llama", layers=layers, width=32), config=ds)
    gen = torch.Generator().manual_seed(1)
    out = []
    try:
        for _ in range(calls):
            x = torch.randint(0, VOCAB, (2, 8), generator=gen)
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        if seed is not None:
            copies = engine.manager.copies
            assert isinstance(copies, transfers.LateCopies)
            assert copies.poisoned == 0 and copies.lost == 0 and copies.overtaking == 0
    finally:
        engine.close()
    return out, engine.coordinator.fetch_stats["steps_ahead"]


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_16_bit_device_copies_written_late_train_as_written_at_once(disk_dir, monkeypatch,
                                                                   param: str) -> None:
    """bf16 compute with an fp32 master: under late copies the step stream writes each stepped
    unit's device copy by a copy that lands later (optim/device_copy.py), as on a GPU, where
    the immediate copies let the kernel round into it. Both runs take the GPU's other paths,
    so only the copies differ; they must give the same bits: the same rounding of the same
    master, seen by the next forward only once landed."""
    at_once, _ = _bf16_losses(disk_dir, monkeypatch, param, None, early="on")
    late, _ = _bf16_losses(disk_dir, monkeypatch, param, 5, early="on")
    assert all(math.isfinite(x) for x in late) and late == at_once, (late, at_once)


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_deferred_steps_run_ahead_of_the_forward_as_at_its_fetch(disk_dir, monkeypatch,
                                                                 param: str) -> None:
    """The deferred schedule (2 micro-batches a step) in bf16 with an fp32 master: under late
    copies each unit's step starts as soon as its fetch has issued its copy to the device, before
    its use (zero/steps_ahead.py), and its device copy is written behind that copy; with the
    immediate copies every step runs at its unit's fetch, the kernel rounding into the fetched
    buffer. Both take the GPU's other paths, so only that differs; they must give the same
    bits."""
    run = dict(early="off", accumulation=2, layers=3, calls=8)     # 4 steps
    at_fetch, ahead_at_once = _bf16_losses(disk_dir, monkeypatch, param, None, **run)
    late, ahead = _bf16_losses(disk_dir, monkeypatch, param, 7, **run)
    assert ahead_at_once == 0           # immediate copies: every step at its unit's fetch
    if param == "cpu":
        # each of the 3 forwards after a step: at least its 3 blocks, whose host homes are
        # copied at their prefetch whatever the timing; an NVMe-homed block goes ahead only if
        # its read has landed before the next use (the disk's timing), so there only the bits
        # are held
        assert ahead >= 3 * 3
    assert all(math.isfinite(x) for x in late) and late == at_fetch, (late, at_fetch)


def test_every_step_write_is_ordered_after_the_copy_that_filled_its_unit(disk_dir,
                                                                        monkeypatch) -> None:
    """A step's write of a unit's device copy has a stream of its own, ordered only after the
    copy that filled that memory (storage/transfers.py ``write_device``, the unit's
    ``fill_event``): a step started ahead of its unit's use may write while that copy is in
    flight. Every write, with steps ahead and without, names the last copy issued into its
    memory; one naming nothing (or another copy) fails here, whether or not the copy had landed
    by chance."""
    to_device, write_device = transfers.LateCopies.to_device, transfers.LateCopies.write_device
    fills: list[tuple[int, int, object]] = []       # (start, end, event), in issue order
    checked = {"writes": 0, "unordered": 0}
    writing = threading.local()     # a write's own copy (the late copies queue it as one)

    def recording_fill(self, dst, src):
        event = to_device(self, dst, src)
        if not getattr(writing, "now", False):
            lo = dst.data_ptr()
            fills.append((lo, lo + dst.numel() * dst.element_size(), event))
        return event

    def checking_write(self, dst, src, *, after=None):
        lo = dst.data_ptr()
        hi = lo + dst.numel() * dst.element_size()
        last = [event for a, b, event in fills if a <= lo and hi <= b]
        checked["writes"] += 1
        checked["unordered"] += not last or after is not last[-1]
        writing.now = True
        try:
            return write_device(self, dst, src, after=after)
        finally:
            writing.now = False
    monkeypatch.setattr(transfers.LateCopies, "to_device", recording_fill)
    monkeypatch.setattr(transfers.LateCopies, "write_device", checking_write)
    for early, accumulation in (("off", 2), ("on", 1)):
        _, ahead = _bf16_losses(disk_dir, monkeypatch, "cpu", 7, early=early,
                                accumulation=accumulation, layers=2, calls=4)
        assert ahead > 0 or early == "on"
    assert checked["writes"] > 0 and checked["unordered"] == 0, checked


def test_a_step_that_does_not_wait_for_the_adds_into_host_homes_fails(disk_dir,
                                                                      monkeypatch) -> None:
    """Planted fault: the adds of each micro-batch's gradient into its resident host home go
    on past the backward (optim/gradients.py ``finish``, ``land_copies(homes=False)``); a step
    that reads the homes without waiting for them (``home_copies_landed``) steps without those
    adds (under late copies they are made at the wait): the losses leave the right run's."""
    from infinity.optim.gradients import GradientCollector
    run = dict(early="off", accumulation=2, layers=2, calls=6)
    right, _ = _bf16_losses(disk_dir, monkeypatch, "cpu", 3, **run)
    monkeypatch.setattr(GradientCollector, "home_copies_landed", lambda self, keep=0: None)
    wrong, _ = _bf16_losses(disk_dir, monkeypatch, "cpu", 3, **run)
    assert wrong[:2] == right[:2] and wrong[2:] != right[2:], (wrong, right)


def test_the_last_micro_batch_steps_under_late_copies_as_under_immediate_ones(
        disk_dir, monkeypatch) -> None:
    """early_step "auto" with 2 micro-batches a step: the last backward steps each unit from
    its host gradient home (optim/boundary_steps.py), the step stream waiting for the copies
    into the home still landing (under late copies the adds are made at that wait). Same bits
    as with the immediate copies; a step that does not wait for them (the planted fault)
    misses the last micro-batch's adds."""
    from infinity.optim.boundary_steps import BoundarySteps
    from infinity.optim.gradients import GradientCollector
    from infinity.storage.host_adds import HostAdd
    started, take_home, claim = BoundarySteps.started, GradientCollector.take_home, HostAdd.claim
    count = {"jobs": 0, "folded": 0}

    def counting(self, job) -> None:
        count["jobs"] += 1
        started(self, job)

    def claiming(self):
        staged = claim(self)
        count["folded"] += staged is not None
        return staged
    monkeypatch.setattr(BoundarySteps, "started", counting)
    monkeypatch.setattr(HostAdd, "claim", claiming)
    run = dict(early="auto", accumulation=2, layers=2, calls=6)
    at_once, _ = _bf16_losses(disk_dir, monkeypatch, "cpu", None, **run)
    late, _ = _bf16_losses(disk_dir, monkeypatch, "cpu", 7, **run)
    assert count["jobs"] == 2 * 3 * 5      # two runs, 3 steps, every unit (5 with layers=2)
    # the late copies' adds (made at their wait) are folded into the steps' kernels ([Note:
    # the last adds fold into the step]): the same bits as the adds made first
    assert count["folded"] > 0
    assert all(math.isfinite(x) for x in late) and late == at_once, (late, at_once)

    def not_waiting(self, state):
        gradient = take_home(self, state)
        gradient.landing = []
        return gradient
    monkeypatch.setattr(GradientCollector, "take_home", not_waiting)
    wrong, _ = _bf16_losses(disk_dir, monkeypatch, "cpu", 7, **run)
    assert wrong[:2] == late[:2] and wrong[2:] != late[2:], (wrong, late)


def test_a_step_that_drops_its_folded_adds_fails(disk_dir, monkeypatch) -> None:
    """Planted fault: the last micro-batch's adds claimed by the step ([Note: the last adds
    fold into the step] in optim/boundary_steps.py) but not given to its kernel: the losses
    leave those of the adds made."""
    from infinity.optim.kernel import AdamKernel
    run = dict(early="auto", accumulation=2, layers=2, calls=6)
    right, _ = _bf16_losses(disk_dir, monkeypatch, "cpu", 7, **run)
    kernel_run = AdamKernel.run
    monkeypatch.setattr(AdamKernel, "run",
                        lambda self, *args, addends=None, **kwargs: kernel_run(self, *args,
                                                                               **kwargs))
    wrong, _ = _bf16_losses(disk_dir, monkeypatch, "cpu", 7, **run)
    assert wrong[:2] == right[:2] and wrong[2:] != right[2:], (wrong, right)


class _SkippingModel(torch.nn.Module):
    """Embedding, 4 residual MLP blocks, a head; ``skip`` leaves block 0 out (the forward's
    order changes: a prefetch issued for it is no longer what the next use needs)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(),
                                torch.nn.Linear(4 * width, width)) for _ in range(4))
        self.head = torch.nn.Linear(width, VOCAB)
        self.skip = False

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 0):
                h = h + block(h)
        logits = self.head(h)[:, :-1].reshape(-1, VOCAB)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))


def test_a_fetch_takes_the_room_of_a_prefetch_whose_step_ran_ahead(disk_dir, monkeypatch) -> None:
    """A device budget of 1.6 blocks, the forward's order changing at steps 3 and 4: the unit
    needed now finds its room held by a prefetch whose deferred step started ahead. The fetch
    waits for that step to land, then cancels the prefetch (before, it raised
    BudgetExceededError); the losses are those of the immediate copies."""
    def losses(seed: int | None) -> tuple[list[float], dict]:
        if seed is None:
            _gpu_paths(monkeypatch)
        else:
            _late(monkeypatch, seed)
        torch.manual_seed(0)
        model = _SkippingModel()
        block = sum(p.numel() for p in model.blocks[0].parameters())
        ds = zero_config(3, "cpu", "cpu", str(disk_dir), compute_dtype="bf16", early_step="off",
                         device_memory_budget=int(block * 2 * 1.6))
        ds["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                       stage3_max_reuse_distance=0,
                                       stage3_prefetch_bucket_size=block)
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
        ds["gradient_clipping"] = 1.0
        engine, *_ = infinity.initialize(model=model, config=ds)
        gen = torch.Generator().manual_seed(1)
        out = []
        try:
            for step in range(6):
                model.skip = step in (3, 4)
                x = torch.randint(0, VOCAB, (2, 8), generator=gen)
                loss = engine(input_ids=x, labels=x)
                engine.backward(loss)
                engine.step()
                out.append(loss.item())
        finally:
            engine.close()
        return out, dict(engine.coordinator.fetch_stats)

    at_use, _ = losses(None)
    late, stats = losses(3)
    assert stats["steps_ahead"] > 0 and stats["prefetches_cancelled"] > 0, stats
    assert all(math.isfinite(x) for x in late) and late == at_use, (late, at_use)
