"""infinity.offload_activations "auto" (the default): saved activations go to the swap space when
the planner's prediction does not fit in what the host budget leaves, and only then; the
losses equal those of "none" exactly (fp32: autograd gets back the bytes it saved); without a
swap directory a config that fits no more is a warning naming the overshoot, not an error.
"""
from __future__ import annotations

import logging

import torch

import infinity
from infinity.base import malloc_tuning
from infinity.base.log import get_logger
from parity import VOCAB, make_model, with_adamw, zero_config

BATCH = (8, 64)
"""~7 MiB of saved activations for the small Qwen2 below in fp32 (the planner's count)."""


def _train(disk_dir, budget: str, mode: str = "auto", steps: int = 2, nvme: bool = True,
           batch: tuple[int, int] = BATCH):
    model = make_model("qwen2", layers=3, width=64)
    # a small min_bytes and window, so that the tensors of this tiny model are really written
    section = {"offload_activations": mode, "host_memory_budget": budget,
               "activation_min_bytes": 1, "activation_window": "16KiB"}
    placement = ("nvme", "nvme") if nvme else ("cpu", "cpu")
    ds = with_adamw(zero_config(3, *placement, str(disk_dir), **section))
    engine, *_ = infinity.initialize(model=model, config=ds)
    gen = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            x = torch.randint(0, VOCAB, batch, generator=gen)
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        return losses, engine.activation_swapper, engine.sizes
    finally:
        engine.close()


def test_auto_offloads_under_a_small_budget_and_not_under_a_large_one(disk_dir) -> None:
    small, swapper, sizes = _train(disk_dir, "40MiB")
    choice = swapper.choice
    assert sizes.activation_staging, sizes
    assert choice.decision == "nvme", choice.reason
    assert choice.predicted_bytes + choice.working_bytes > sizes.activation_room, choice
    assert swapper.stats.written > 0, swapper.describe()

    large, swapper, sizes = _train(disk_dir, "1GiB")
    assert swapper.choice.decision == "none", swapper.choice.reason
    assert swapper.choice.predicted_bytes <= sizes.activation_room, swapper.choice
    assert swapper.stats.swapped == 0, swapper.describe()

    none, swapper, _ = _train(disk_dir, "40MiB", mode="none")
    assert swapper is None
    assert small == none, (small, none)       # the same bytes back: exactly the same losses
    assert large == none, (large, none)


def test_auto_without_a_swap_directory_warns_and_trains(disk_dir, caplog) -> None:
    """Parameters and optimizer on the host: no swap space. A budget too small for the
    activations worked with "none" and keeps working with "auto", with the overshoot named."""
    logger = get_logger()       # the package logger does not propagate to caplog's root
    logger.addHandler(caplog.handler)
    try:
        losses, swapper, sizes = _train(disk_dir, "8MiB", nvme=False)
    finally:
        logger.removeHandler(caplog.handler)
    choice = swapper.choice
    assert swapper.swapper is None and not sizes.activation_staging
    assert choice.decision == "none" and choice.overshoot_bytes > 0, choice
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and
              "offload_activations auto" in r.getMessage()]
    assert warned and "no swap directory" in warned[0].getMessage(), \
        [r.getMessage() for r in caplog.records]
    assert all(torch.isfinite(torch.tensor(losses))), losses


def test_nvme_names_the_logits_work_past_the_budget(disk_dir, caplog) -> None:
    """"nvme" sends every forward's activations away, but the loss's logits, their fp32 copies
    and gradients (16 bytes a vocabulary entry a token here) stay in memory whatever the mode:
    "auto" counted them and "nvme" said nothing. 8 x 256 tokens of a 256-word vocabulary: 8
    MiB of them, past the ~4.5 MiB a 40 MiB budget leaves; 8 x 16 tokens: 0.5 MiB, within."""
    logger = get_logger()       # the package logger does not propagate to caplog's root
    logger.addHandler(caplog.handler)
    try:
        losses, policy, sizes = _train(disk_dir, "40MiB", mode="nvme", batch=(8, 256))
        over = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and
                "offload_activations nvme" in r.getMessage()]
        caplog.clear()
        _, small_policy, _ = _train(disk_dir, "40MiB", mode="nvme", batch=(8, 16))
        quiet = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and
                 "offload_activations nvme" in r.getMessage()]
    finally:
        logger.removeHandler(caplog.handler)
    choice = policy.choice
    assert choice.decision == "nvme" and choice.working_bytes > sizes.activation_room, choice
    assert choice.overshoot_bytes == choice.working_bytes - sizes.activation_room, choice
    assert policy.stats.written > 0 and small_policy.stats.written > 0, policy.describe()
    assert len(over) == 1 and "exceed the" in over[0] and "host_memory_budget" in over[0], over
    assert small_policy.choice.overshoot_bytes == 0 and not quiet, (small_policy.choice, quiet)
    assert all(torch.isfinite(torch.tensor(losses))), losses


class _RootWithParameter(torch.nn.Module):
    """A transformers model under a root that owns a parameter itself (a learned loss scale):
    the coordinator fetches the root's own unit, and its hooks on the root reorder the pre-hooks
    after each call."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_model("qwen2", layers=3, width=64)
        self.config = self.lm.config
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids, labels=None):
        return self.lm(input_ids=input_ids, labels=labels).loss * self.scale


def test_auto_swaps_each_forward_by_its_own_batch_under_a_root_owning_parameters(disk_dir) -> None:
    """Short and long batches alternate under a budget the long ones overflow: each forward's
    saved tensors are swapped exactly when its own batch was decided "nvme". The policy's hook
    must run before the engine's pass hook enters the swapper: before the fix the coordinator
    moved the pass hook back in front after the first call, and every later forward used the
    previous batch's choice (the short batch swapped, the long one kept)."""
    model = _RootWithParameter()
    section = {"host_memory_budget": "40MiB", "activation_min_bytes": 1,
               "activation_window": "16KiB"}
    ds = with_adamw(zero_config(3, "nvme", "nvme", str(disk_dir), **section))
    engine, *_ = infinity.initialize(model=model, config=ds)
    policy = engine.activation_swapper
    gen = torch.Generator().manual_seed(1)
    seen, thresholds = [], []
    try:
        for seq in (8, 64, 8, 64):
            x = torch.randint(0, VOCAB, (8, seq), generator=gen)
            before = policy.swapper.stats.swapped
            loss = engine(input_ids=x, labels=x)
            seen.append((seq, policy.choice.decision, policy.swapper.stats.swapped - before))
            thresholds.append(malloc_tuning._applied)
            engine.backward(loss)
            engine.step()
    finally:
        engine.close()
    assert [d for _, d, _ in seen] == ["none", "nvme", "none", "nvme"], seen
    assert all((swapped > 0) == (decision == "nvme") for _, decision, swapped in seen), seen
    if malloc_tuning._glibc() is not None:
        # the low threshold (min(malloc_mmap_threshold, activation_min_bytes)) only while
        # offloading: a batch kept in memory gets the configured 4 MiB back
        assert thresholds == [4 << 20, 1, 4 << 20, 1], thresholds
