"""The routing rule of host collectives ([Note: host collectives on a device-only group] in
infinity/comm/routing.py), on the descriptions torch gives of groups made with "nccl", "gloo"
and "cpu:gloo,cuda:nccl" (torch's ``BackendConfig``, what ``dist.get_backend_config`` returns,
built here without CUDA), and on a real in-process group with a CUDA backend only (torch's fake
backend, registered for "cuda"). The multi-rank behaviour is in
tests/distributed/test_comm_routing_ranks.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from infinity.comm.group import CUDA_BACKEND, default_backend
from infinity.comm.routing import (backends_of, has_tensor_ops, parse_backend_config,
                                   routes_to_side, side_group_needed, tensor_device_type)


def _described(backend: str) -> dict[str, str]:
    """What ``backends_of`` reads for a group made with ``backend``: torch's description."""
    return parse_backend_config(repr(dist.distributed_c10d.BackendConfig(backend)))


def test_torch_describes_the_three_backends_as_expected():
    assert _described("nccl") == {"cuda": "nccl"}
    assert _described("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert _described("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}


@pytest.mark.parametrize("backend, cpu_to_side", [("nccl", True), ("gloo", False),
                                                  ("cpu:gloo,cuda:nccl", False),
                                                  ("cuda:gloo", True)])
def test_host_tensors_leave_only_a_group_without_a_cpu_backend(backend, cpu_to_side):
    described = _described(backend)
    assert side_group_needed(described) is cpu_to_side
    assert routes_to_side(described, "cpu") is cpu_to_side
    assert routes_to_side(described, "cuda") is False      # device tensors stay on the group


def test_a_cuda_tensor_on_a_host_only_group_stays_there():
    assert routes_to_side(_described("cpu:gloo"), "cuda") is False
    assert side_group_needed(_described("cpu:gloo")) is False


def test_collectives_without_a_tensor_count_as_host_ones():
    assert tensor_device_type(None) == "cpu"
    assert tensor_device_type(torch.zeros(1)) == "cpu"
    assert tensor_device_type(torch.empty(0, device="meta")) == "meta"


def test_flat_tensor_operations_follow_the_backend_that_runs_them():
    nccl = _described("nccl")
    assert has_tensor_ops(nccl, "cpu")          # the gloo side group
    assert has_tensor_ops(nccl, "cuda")
    assert not has_tensor_ops(_described("mpi"), "cpu")
    assert has_tensor_ops(_described("cpu:gloo,cuda:nccl"), "cpu")


def test_bare_names_and_bad_descriptions():
    assert parse_backend_config("NCCL") == {"cuda": "nccl"}
    assert parse_backend_config("mybackend") == {"cpu": "mybackend", "cuda": "mybackend"}
    with pytest.raises(ValueError, match="'cpu:gloo,cuda'"):
        parse_backend_config("cpu:gloo,cuda")


def test_the_engine_makes_one_group_with_gloo_for_host_tensors_on_cuda():
    assert default_backend(torch.device("cuda", 0)) == CUDA_BACKEND == "cpu:gloo,cuda:nccl"
    assert default_backend(torch.device("cpu")) == "gloo"
    assert not side_group_needed(_described(CUDA_BACKEND))


def test_a_real_group_with_a_cuda_backend_only():
    """torch's fake backend registered for "cuda" alone: the group rejects CPU tensors as an
    NCCL one does, and ``backends_of`` reads it from torch's description."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(backend="cuda:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        described = backends_of(None)
        assert described == {"cuda": "fake"}
        assert routes_to_side(described, "cpu") and not routes_to_side(described, "cuda")
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(1))
    finally:
        dist.destroy_process_group()
