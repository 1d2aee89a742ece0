"""Sharding is real (stage 3, parameters and optimizer states on NVMe, both schedules): at 2
ranks each rank holds, reads and sends its 1/N, measured against the same run at 1 rank.

- every sharded state of a rank (param store, Adam moments, kept gradients) holds ceil(total /
  N) elements rounded up to the shard alignment, and the ranks' optimizer ranges tile the unit;
- a rank's bytes in the tier manager and in its swap files' allocated blocks are half of one
  rank's plus alignment padding;
- a rank's NVMe read bytes per step (early step; over the run for the deferred one) are at
  most half of one rank's plus padding;
- the bytes the collectives wrapper counts per step are the stage-3 formula: two all-gathers of
  the model (forward and backward) and one reduce-scatter of its gradient, each (N-1)/N of the
  bytes per rank, within 1% of the model's parameter bytes (exactly, from the units' padded
  flat buffers, but for the few bytes of the scalars: the clipping norm, the gradient mask).

The model is TinyLM untied (a tied embedding is gathered at each of its two uses in forward),
width 512, so that the 4 KiB alignment of each parameter and the shard alignment are small
against the units (about 0.2%).
"""
from __future__ import annotations

import itertools
import subprocess

import pytest

from infinity.planner.alignment import SHARD_ALIGN_NUMEL
from ranks import read_results, start

pytestmark = pytest.mark.distributed

SCHEDULES = ("early", "deferred")
FP32 = 4
PAGE = 4096


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The worker at 1 rank and at 2 ranks (both at once: the 2 cores are shared anyway)."""
    nvme = tmp_path_factory.mktemp("nvme", numbered=True)
    outs = {n: tmp_path_factory.mktemp(f"shards{n}") for n in (1, 2)}
    procs = {n: start(n, "sharding_worker.py", [str(outs[n]), str(nvme)]) for n in (1, 2)}
    for n, ranks in procs.items():
        for rank, proc in enumerate(ranks):
            try:
                _, err = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            assert proc.returncode == 0, f"world {n} rank {rank}:\n{err[-4000:]}"
    return {n: read_results(outs[n], n) for n in (1, 2)}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_sharded_state_holds_its_share(runs, schedule):
    one = runs[1][0][schedule]
    for r, rank in enumerate(runs[2]):
        run = rank[schedule]
        for u1, u in zip(one["units"], run["units"]):
            assert u1["param_store_numel"] == u1["numel"]          # one rank: the whole unit
            share = _ceil(u["numel"], 2)
            assert share <= u["shard_numel"] < share + SHARD_ALIGN_NUMEL, u
            assert u["param_store_numel"] == u["shard_numel"], u
        for s1, s, u in zip(one["states"], run["states"], run["units"]):
            assert s["lo"] == r * u["shard_numel"] and \
                s["hi"] == min(u["trainable_numel"], (r + 1) * u["shard_numel"]), (s, u)
            for store in ("exp_avg", "exp_avg_sq", "grad_store", "master"):
                if s1[store] is None:
                    assert s[store] is None, (store, s)
                    continue
                assert s[store] == s["hi"] - s["lo"] <= u["shard_numel"], (store, s, u)
    # the ranks' ranges tile each unit's trainable part
    for i, u in enumerate(runs[2][0][schedule]["units"]):
        ranges = sorted((rank[schedule]["states"][i]["lo"], rank[schedule]["states"][i]["hi"])
                        for rank in runs[2])
        assert ranges[0][0] == 0 and ranges[-1][1] == u["trainable_numel"]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges
    deferred = schedule == "deferred"
    assert all((s["grad_store"] is not None) == deferred for s in one["states"])


def _padding_bytes(run: dict) -> int:
    """The most a rank's NVMe states can exceed half of one rank's: each store's shard rounded
    up to the shard alignment, and to a page."""
    stores = sum(1 + sum(s[k] is not None for k in ("exp_avg", "exp_avg_sq", "grad_store",
                                                    "master"))
                 for s in run["states"])
    return stores * (SHARD_ALIGN_NUMEL * FP32 + PAGE)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_rank_holds_half_of_the_bytes_in_the_tier_manager_and_on_disk(runs, schedule):
    one = runs[1][0][schedule]["held"]
    for rank in runs[2]:
        run = rank[schedule]
        pad = _padding_bytes(run)
        held = run["held"]
        assert held["tier_bytes"]["nvme"] == held["swap_allocated"]
        assert held["tier_bytes"]["nvme"] <= one["tier_bytes"]["nvme"] / 2 + pad, (held, one)
        assert held["tier_bytes"]["nvme"] >= one["tier_bytes"]["nvme"] / 2 - pad, (held, one)
        assert held["swap_blocks"] <= one["swap_blocks"] / 2 + pad, (held, one)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_rank_reads_half_of_the_nvme_bytes(runs, schedule):
    """Per step under the early step; under the deferred one a unit's step lands at its next
    fetch, so which step's counters its reads fall in depends on timing (and the last step's
    are read in flush): there, over the whole run."""
    one = runs[1][0][schedule]
    for rank in runs[2]:
        run = rank[schedule]
        pad = _padding_bytes(run)
        assert one["read_total"] > 0
        assert run["read_total"] <= one["read_total"] / 2 + len(run["steps"]) * pad, \
            (run["read_total"], one["read_total"])
        if schedule == "early":
            for step, (s1, s2) in enumerate(zip(one["steps"], run["steps"])):
                assert s1["io_read_bytes"] > 0, (step, s1)
                assert s2["io_read_bytes"] <= s1["io_read_bytes"] / 2 + pad, (step, s2, s1)
            assert run["read_total"] == sum(s["io_read_bytes"] for s in run["steps"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_bytes_communicated_per_step_are_the_stage_3_formula(runs, schedule):
    n = 2
    model_bytes = runs[1][0][schedule]["model_numel"] * FP32
    formula = 3 * model_bytes * (n - 1) / n
    for r, rank in enumerate(runs[2]):
        run = rank[schedule]
        units = run["units"]
        flat_bytes = sum(u["flat_numel"] * FP32 for u in units)
        for step, s in enumerate(run["steps"]):
            # which collectives moved what: every unit gathered twice, reduce-scattered once
            assert sorted(s["all_gather"]) == sorted(2 * [u["nbytes"] for u in units]), \
                (r, step, s["all_gather"])
            assert sorted(s["reduce_scatter"]) == sorted(u["nbytes"] for u in units), \
                (r, step, s["reduce_scatter"])
            assert s["comm_sent_bytes"] == s["comm_received_bytes"]
            exact = 3 * flat_bytes * (n - 1) // n
            assert 0 <= s["comm_sent_bytes"] - exact <= 64, (r, step, s, exact)   # scalars
            assert s["comm_sent_bytes"] == pytest.approx(formula, rel=0.01), \
                (r, step, s["comm_sent_bytes"], formula)
    assert all(s["comm_sent_bytes"] == 0 for s in runs[1][0][schedule]["steps"])
