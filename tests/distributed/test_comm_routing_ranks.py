"""Collectives on host tensors over a process group without a CPU backend (gloo processes on
localhost; comm_routing_ranks_worker.py): the group is made with the backend "cuda:gloo", which
has a backend for CUDA tensors only, as "nccl" has, so a collective on a CPU tensor raises on it
for real (checked first). Every operation of ``Collectives`` on host tensors then runs on the
gloo group beside it, made once per group ([Note: host collectives on a device-only group] in
infinity/comm/routing.py): none reaches the engine's group, and the results equal those over a
plain gloo group exactly (the same backend, the same inputs). A stage-3 engine on such a
default group trains as plain torch AdamW does on the whole batch (losses within 1e-5
relative, as tests/distributed/test_zero_ranks.py), with the side group at the config's
collective timeout, and ``infinity train``'s loss mean over ranks goes through it. A rank that
stops before a host collective is named by the others' error, raised on the side group.
"""
from __future__ import annotations

import pytest

from comm_routing_ranks_worker import CASE
from parity import make_model
from parity_ranks_worker import LR, WEIGHT_DECAY, global_batches
from ranks import check_ranks, launch, read_results, reference_run

pytestmark = pytest.mark.distributed

STEPS = 3
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("routing")
    nvme = tmp_path_factory.mktemp("routing-nvme")
    results = launch(WORLD, "comm_routing_ranks_worker.py", [str(out), str(nvme), str(STEPS)],
                     timeout=600)
    check_ranks(results)
    return read_results(out, WORLD)


def test_the_group_really_has_no_cpu_backend(ranks):
    for r in ranks:
        assert r["backends"] == {"cuda": "gloo"}
        assert "No backend type associated with device type cpu" in r["main_takes_cpu"], r


@pytest.mark.parametrize("size", ["", "_small", "_reverse"],
                         ids=["one-call", "bucketed", "ranks-reversed"])
def test_host_collectives_go_to_the_side_group_with_the_plain_results(ranks, size):
    for rank, r in enumerate(ranks):
        routed, plain = dict(r[f"routed{size}"]), dict(r[f"plain{size}"])
        calls = routed.pop("calls_by_group")
        plain_calls = plain.pop("calls_by_group")
        assert calls["main"] == 0 and calls["side"] > 0, (rank, calls)
        assert plain_calls == {"main": calls["side"], "side": 0}, (rank, calls, plain_calls)
        assert routed == plain, rank
    assert ranks[0]["routed"]["any_mask"] == [True, True, False]
    # a 16-bit mean divides before it sums (a sum of two 40000s is past fp16's 65504)
    for r in ranks:
        assert r[f"routed{size}"]["fp16_reduce_scatter_mean"] == [40000.0] * 6
        assert r[f"routed{size}"]["fp16_all_reduce_mean"] == [40000.0] * 3
    assert ranks[0]["routed"]["objects"] == [{"rank": 0}, {"rank": 1}]
    assert ranks[0]["routed"]["sum_float"] == 0.25 + 1.25
    assert all(r["routed"]["broadcast"] == [1.0] * 4 for r in ranks)
    # numbered in reverse: global rank 1 is rank 0 of the group, and its shard comes first
    assert [r["reverse_rank"] for r in ranks] == [1, 0]
    assert ranks[0]["routed_reverse"]["all_gather"] == ranks[0]["routed"]["all_gather"]


def test_one_side_group_per_group_and_none_for_gloo(ranks):
    for r in ranks:
        assert r["one_side_group"] is True and r["plain_side_group"] is False


def test_a_device_only_subgroup_is_refused_with_the_fix(ranks):
    refused = ranks[0]["subgroup_refused"]
    assert isinstance(refused, str), "a side group was made over a subgroup's members alone"
    assert "ranks [0]" in refused and "'cpu:gloo,cuda:nccl'" in refused


def test_a_stage3_engine_on_a_device_only_group_trains_as_torch(ranks):
    deferred = CASE["schedule"] == "deferred"
    batches = global_batches(1, STEPS, 2 if deferred else 1, WORLD)
    ref_losses, _ = reference_run(make_model("torch", seed=0, layers=3, width=32), batches,
                                  lr=LR, weight_decay=WEIGHT_DECAY,
                                  clip=0.05 if deferred else 0.0)
    engines = [r["engine"] for r in ranks]
    losses = [sum(e["losses"][s] for e in engines) / WORLD for s in range(STEPS)]
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (s, losses, ref_losses)
    for e in engines:
        # the loss mean of ``infinity train``, over the side group: the same on every rank
        assert e["means"] == pytest.approx(losses, rel=1e-12)
        assert e["calls_by_group"]["main"] == 0 and e["calls_by_group"]["side"] > 0, e
        # the config's infinity.collective_timeout, set on the group, reaches the side group
        assert e["side_timeout_s"] == e["main_timeout_s"] == 120.0, e


def test_a_rank_lost_before_a_host_collective_is_named(tmp_path):
    results = launch(WORLD, "comm_routing_ranks_worker.py",
                     [str(tmp_path), str(tmp_path), "0", "lost"], timeout=300)
    assert results[1].returncode == 3, results[1].stderr[-3000:]
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    text = (tmp_path / "rank0.txt").read_text()
    assert "the sequence check failed: rank 1 (" in text, text
    assert "injected failure before the norm (in step)" in text, text
    # the collective's own error follows, not one of the routing's making
    assert "The collective's error: " in text and "TypeError" not in text, text
    assert "calls: {'main': 0, 'side': 2}" in text, text
