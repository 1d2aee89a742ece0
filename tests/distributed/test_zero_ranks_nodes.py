"""Stage 3 with parameters and optimizer states on NVMe at 4 ranks: one node of 4 processes
(launched as torchrun would), and two "nodes" of 2 (two ``torchrun --nnodes 2 --node_rank
0|1`` launchers on 127.0.0.1), each equal to plain torch AdamW on the whole batch of 4 ranks
(the tolerances of test_zero_ranks.py), and the two launches equal to each other.

Both schedules run in one process group per launch (the early step; the deferred one with
clipping and accumulation 2). Torch threads: one per rank (2 cores, 4 ranks).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ranks import (check_ranks, free_port, launch, read_results, script_path,
                   worker_pythonpath)
from test_zero_ranks import STEPS, _check_case

pytestmark = pytest.mark.distributed

WORLD = 4
CASES = [{"name": f"s3-nvme-nvme-{schedule}", "stage": 3, "opt": "nvme", "param": "nvme",
          "schedule": schedule} for schedule in ("early", "deferred")]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    out, nvme = tmp_path_factory.mktemp("node4"), tmp_path_factory.mktemp("nvme4")
    results = launch(WORLD, "parity_ranks_worker.py",
                     [str(out), str(nvme), json.dumps(CASES), str(STEPS)], timeout=300)
    check_ranks(results)
    return read_results(out, WORLD), out


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    out, nvme = tmp_path_factory.mktemp("nodes2x2"), tmp_path_factory.mktemp("nvme2x2")
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=worker_pythonpath())
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
         str(node), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
         str(port), str(script_path("parity_ranks_worker.py")), str(out), str(nvme),
         json.dumps(CASES), str(STEPS)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    logs = []
    for proc in launchers:
        try:
            logs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for p in launchers:
                p.kill()
            logs.append(proc.communicate()[0] + "\n[killed after 300 s]")
    for node, (proc, log) in enumerate(zip(launchers, logs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{log[-4000:]}"
    return read_results(out, WORLD), out


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_four_ranks_on_one_node_train_as_one_process_with_the_whole_batch(one_node, case):
    results, out = one_node
    _check_case(case, results, out, WORLD)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_two_nodes_of_two_ranks_train_as_one_process_with_the_whole_batch(two_nodes, case):
    results, out = two_nodes
    _check_case(case, results, out, WORLD)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_two_nodes_of_two_equal_one_node_of_four(one_node, two_nodes, case):
    """The same ranks, collectives and data: the same numbers, bit for bit."""
    (one, out1), (two, out2) = one_node, two_nodes
    name = case["name"]
    for rank in range(WORLD):
        assert one[rank][name]["losses"] == two[rank][name]["losses"], (name, rank)
        assert one[rank][name]["sent"] == two[rank][name]["sent"], (name, rank)
        a = torch.load(out1 / f"{name}.rank{rank}.pt")
        b = torch.load(out2 / f"{name}.rank{rank}.pt")
        for pname in a:
            assert torch.equal(a[pname], b[pname]), (name, rank, pname)
