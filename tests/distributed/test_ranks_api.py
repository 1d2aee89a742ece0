"""DeepSpeed habits across 2 ranks (gloo, localhost): GatheredParameters(modifier_rank=0) makes
rank 0's change every rank's (DeepSpeed broadcasts it), ``training_data`` gives each rank a
disjoint share of the samples (DistributedSampler), the engine reports its rank, and the group
``infinity.init_distributed`` made is destroyed at exit."""
from __future__ import annotations

import json

import pytest

from ranks import check_ranks, launch, read_results

pytestmark = pytest.mark.distributed


def test_modifier_rank_training_data_and_rank_accessors(tmp_path):
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    out.mkdir()
    nvme.mkdir()
    check_ranks(launch(2, "api_ranks_worker.py", [str(out), str(nvme)], timeout=300))
    results = read_results(out, 2)
    for rank, r in enumerate(results):
        assert r["values"] == [1.0], (rank, r["values"])      # rank 0 wrote 1.0, rank 1 2.0
        assert r["ranks"] == [rank, 2, 2]
        assert r["loss_finite"]
        assert r["by_two_names"] == results[0]["by_two_names"], rank
        assert r["swap_dir"].startswith(f"infinity-swap-r{rank}-"), r["swap_dir"]
    # ranks that built the model with their own values start from rank 0's (stage 0 trained
    # a model per rank, stages 1-3 a mix of the ranks'), buffers included
    from parity import make_model

    want = {name: value.float().sum().item()
            for name, value in make_model("torch", seed=0, layers=2, width=32).state_dict().items()}
    for rank, r in enumerate(results):
        for stage in ("0", "3"):
            assert r["started_from"][stage] == pytest.approx(want, rel=1e-6), (rank, stage)
            # and their buffers from rank 0's, as DDP makes them agree
            assert r["buffers_from"][stage] == [[0, 1, 2, 3, 4], [[0.5] * 3] * 2], (rank, stage)
    shares = [set(r["samples"]) for r in results]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(20)), shares
    # the group init_distributed made is destroyed at a normal exit, its gloo threads with it
    # (a gloo group left to the interpreter's teardown can abort the process: comm/group.py
    # ``_destroy_at_exit``, and [Note: a group kept alive by a default argument] there)
    for rank in range(2):
        at_exit = json.loads((out / f"exit{rank}.json").read_text())
        assert at_exit["gloo_threads_before"], at_exit    # the check below can see them
        assert at_exit["initialized"] is False and at_exit["gloo_threads"] == [], at_exit
