"""Ranks whose data route tokens to different experts (a mixture-of-experts layer): an
expert's parameters get a gradient on one rank only. Each rank finished such a unit at another
point of its backward (at the last gradient, or at the backward's end), so at stage 3 one
rank's reduce-scatter met the other's next gather and both hung until the collective timeout,
and at stages 1-2 the averages paired other units. A unit's backward now ends where every rank
reaches it alike, once its call's inputs have their gradient (each through a view of its own:
zero/input_gradients.py), or at the backward's end where they carry none, and the experts train
as torch's one-process reference with both ranks' batches does."""
from __future__ import annotations

import pytest

from ranks import launch

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("model,stage,tier,early", [
    ("routed", 3, "cpu", "on"), ("routed", 3, "nvme", "off"), ("routed", 2, "cpu", "on"),
    ("routed", 1, "cpu", "off"), ("shared", 3, "cpu", "on"), ("shared", 2, "cpu", "off"),
    ("leaf", 3, "cpu", "on"), ("towers", 3, "cpu", "off"), ("latents", 2, "cpu", "on"),
    ("reentrant", 3, "cpu", "off"), ("skipped", 3, "cpu", "on")])
def test_experts_hit_on_one_rank_train_as_torch(tmp_path, model, stage, tier, early) -> None:
    """moe_ranks_worker.py's models (a chain; blocks reading a shared context; a leaf input
    with a parameter-only op first; two towers over the raw batch; a learned parameter handed
    to every block; the same read on one rank only; the chain under reentrant
    checkpointing)."""
    results = launch(2, "moe_ranks_worker.py", [model, str(stage), tier, early, str(tmp_path)],
                     timeout=180)
    for rank, r in enumerate(results):
        assert r.returncode == 0 and "trained" in r.stdout, (rank, r.stdout[-500:],
                                                             r.stderr[-3000:])
