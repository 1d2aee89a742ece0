"""Checkpoints across ranks: saved at 2 ranks (each rank its slices, rank 0 commits), resumed at 1
and at 4 with the same global batch, the run continues as plain torch that was never
interrupted (losses within 1e-5 relative); the resuming ranks divide the checksum reading (each
file hashed once in all) and a damaged file found by one rank fails the load on every rank;
``consolidated_state_dict`` reads the 2-rank checkpoint whole; one rank's files missing is named
at load."""
from __future__ import annotations

import json

import pytest
import torch

from infinity.checkpoint import CheckpointError, consolidated_state_dict
from parity import make_model
from parity_ranks_worker import LR, WEIGHT_DECAY, global_batches
from ranks import check_ranks, launch, read_results, reference_run

pytestmark = pytest.mark.distributed

FIRST, LAST = 2, 5
CASES = [
    {"name": "s3-nvme-nvme", "stage": 3, "opt": "nvme", "param": "nvme", "schedule": "deferred"},
    {"name": "s1-cpu", "stage": 1, "opt": "cpu", "param": "none", "schedule": "deferred"},
    {"name": "s0", "stage": 0, "opt": "none", "param": "none", "schedule": "early"},
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = tmp_path_factory.mktemp("save")
    nvme = tmp_path_factory.mktemp("nvme")
    check_ranks(launch(2, "ckpt_ranks_worker.py", [str(out), str(nvme), str(root),
                                                    json.dumps(CASES), "save", str(FIRST),
                                                    str(LAST)], timeout=600))
    return root, read_results(out, 2), nvme


def _reference(case):
    deferred = case["schedule"] == "deferred"
    batches = global_batches(1, LAST, 2 if deferred else 1, 2)
    return reference_run(make_model("torch", seed=0, layers=3, width=32), batches, lr=LR,
                         weight_decay=WEIGHT_DECAY, clip=0.05 if deferred else 0.0)


@pytest.mark.parametrize("world", [1, 4])
def test_a_checkpoint_saved_at_two_ranks_resumes_at_another_world_size(saved, world,
                                                                      tmp_path):
    root, before, nvme = saved
    check_ranks(launch(world, "ckpt_ranks_worker.py", [str(tmp_path), str(nvme), str(root),
                                                        json.dumps(CASES), "resume",
                                                        str(FIRST), str(LAST)], timeout=600))
    after = read_results(tmp_path, world)
    for case in CASES:
        ref_losses, _ = _reference(case)
        name = case["name"]
        saved_losses = [sum(r[name]["losses"][s] for r in before) / 2 for s in range(FIRST)]
        resumed = [sum(r[name]["losses"][s] for r in after) / world
                   for s in range(LAST - FIRST)]
        for got, want in zip(saved_losses + resumed, ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want), (name, world, saved_losses + resumed,
                                                         ref_losses)
        assert all(r[name]["global_steps"] == LAST for r in after)
        # every file of the 2-rank save (model and optimizer, both ranks) hashed once in all
        hashed = sorted(f for r in after for f in r[name]["hashed"])
        assert hashed == sorted(f"rank{r}_{kind}.safetensors" for r in range(2)
                                for kind in ("model", "optim")), (name, world, hashed)


def test_a_damaged_file_found_by_one_rank_fails_the_load_on_every_rank(saved, tmp_path):
    import shutil

    root, _, nvme = saved
    case = CASES[0]
    copy = tmp_path / "ckpts"
    shutil.copytree(root / case["name"], copy / case["name"])
    tag = (copy / case["name"] / "latest").read_text().strip()
    damaged = copy / case["name"] / tag / "rank1_optim.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF             # same size: only the checksum can tell
    damaged.write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    check_ranks(launch(2, "ckpt_ranks_worker.py", [str(out), str(nvme), str(copy),
                                                    json.dumps([case]), "resume-damaged",
                                                    str(FIRST), str(LAST)], timeout=600))
    results = [r[case["name"]] for r in read_results(out, 2)]
    finders = [rank for rank, r in enumerate(results) if "rank1_optim.safetensors" in r["hashed"]]
    assert len(finders) == 1, results          # hashed by one rank only
    for rank, r in enumerate(results):
        assert "rank1_optim.safetensors" in r["error"] and "sha256" in r["error"], (rank, r)


def test_the_two_rank_checkpoint_reads_whole_without_an_engine(saved):
    root, _, _ = saved
    for case in CASES:
        state = consolidated_state_dict(root / case["name"])
        model = make_model("torch", seed=0, layers=3, width=32)
        names = dict(model.named_parameters())
        assert set(names) <= set(state), case["name"]
        for name, p in names.items():
            assert state[name].shape == p.shape, (name, state[name].shape, p.shape)
        # the tied head is the embedding, saved once and aliased
        assert state["head.weight"] is state["embed.weight"]
        assert torch.isfinite(torch.cat([t.reshape(-1).float() for t in state.values()])).all()


def test_a_missing_rank_file_is_named(saved, tmp_path):
    import shutil

    root, _, _ = saved
    copy = tmp_path / "copy"
    shutil.copytree(root / "s3-nvme-nvme", copy)
    tag = (copy / "latest").read_text().strip()
    (copy / tag / "rank1_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank1_model.safetensors is missing"):
        consolidated_state_dict(copy)


def test_ranks_that_name_different_checkpoints_are_refused(tmp_path):
    """A rank told its node's own directory: its part of a save went into rank 0's without a
    word (and it was told the save was where it asked); a load where one rank found another
    checkpoint (or none) said "a save happened meanwhile, load again", which never mends it."""
    results = launch(2, "ckpt_targets_ranks_worker.py", [str(tmp_path)], timeout=180)
    for rank, r in enumerate(results):
        assert r.returncode == 0, (rank, r.stderr[-3000:])
        lines = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
        assert lines["save"].startswith("CheckpointError: the ranks name different "
                                        "checkpoints"), lines
        assert f"rank 1: {tmp_path / 'node1'}/global_step1" in lines["save"], lines
        assert lines["save shared"] == "ok", lines
        assert lines["load"].startswith("CheckpointError: the ranks found different "
                                        "checkpoints"), lines
        assert "rank 1: none (no latest)" in lines["load"], lines
    assert not (tmp_path / "node0").exists() and not (tmp_path / "node1").exists()
