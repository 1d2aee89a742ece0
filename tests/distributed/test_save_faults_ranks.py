"""Weights saves over two ranks that fail on rank 0 alone ([Note: one rank writes while every
rank gathers] in checkpoint/pretrained_write.py): a target that is a file, and a full disk
partway through the writes, for ``save_pretrained`` and ``save_16bit_model``. Every rank
raises an error naming the cause (rank 1: that rank 0 failed), the processes go on training
and the next saves succeed (into the same directory too: its lock was released), and the
earlier save in the directory is unchanged. Before,
rank 0 raised out of the gathers the other rank was in, and gloo aborted the process."""
from __future__ import annotations

import json

import pytest

from ranks import launch

pytestmark = pytest.mark.distributed


def test_a_save_failing_on_rank_0_alone_is_an_error_on_every_rank(tmp_path):
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    out.mkdir()
    nvme.mkdir()
    results = launch(2, "save_faults_ranks_worker.py", [str(out), str(nvme)], timeout=300)
    for rank, done in enumerate(results):
        assert done.returncode == 0, f"rank {rank} exited {done.returncode}: {done.stderr[-3000:]}"
    reports = [json.loads(done.stdout.strip().splitlines()[-1]) for done in results]
    for report in reports:
        said = report["results"]
        assert said["first"] == said["first_16bit"] == said["after"] == said["again"] == "ok", \
            said
        assert report["unchanged"], "a failed save changed the earlier save's files"
        for case in ("into_a_file", "16bit_into_a_file", "partway", "16bit_partway"):
            assert said[case] != "ok", f"rank {report['rank']}: {case} did not fail"
        if report["rank"] == 0:
            assert "a_file" in said["into_a_file"] and "cannot create" in said["into_a_file"]
            assert "a_file" in said["16bit_into_a_file"]
            assert "No space left" in said["partway"] or "free" in said["partway"], said
            assert "No space left" in said["16bit_partway"] or "free" in said["16bit_partway"]
            assert report["user_file"] == "the user's file\n"
        else:
            for case in ("into_a_file", "16bit_into_a_file", "partway", "16bit_partway"):
                assert "rank 0" in said[case], (case, said[case])
