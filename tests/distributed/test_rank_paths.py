"""Ranks whose models take different paths (a block run on one rank and skipped on another)
pair unrelated buffers in their gathers and gradient averages, silently when the sizes agree:
the collectives' fingerprint check at each optimizer step says so on every rank instead."""
from __future__ import annotations

import pytest

from ranks import launch

pytestmark = pytest.mark.distributed


def test_ranks_that_run_different_blocks_are_stopped_at_the_step():
    results = launch(2, "divergent_ranks_worker.py", ["diverge"], timeout=120)
    for rank, r in enumerate(results):
        assert r.returncode != 0, (rank, r.stdout)
        assert "the ranks issued different collectives before optimizer step 1" in r.stderr, \
            r.stderr[-2000:]


def test_ranks_that_run_the_same_blocks_train():
    results = launch(2, "divergent_ranks_worker.py", ["same"], timeout=120)
    for rank, r in enumerate(results):
        assert r.returncode == 0 and "trained" in r.stdout, (rank, r.stderr[-2000:])
