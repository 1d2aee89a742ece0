"""Two gloo ranks with gradients reduced on the device ([Note: gradients reduced on the device]
in optim/device_gradients.py), the GPU's path forced on the CPU device (``reduces_on_device``
patched in the worker: parity_ranks_worker.py's "device_reduce"): each unit's gradient is
collected in a device buffer, reduce-scattered (stages 1-3) or all-reduced (stage 0) there, and
only the own shard copied to the host.

Tolerances: against the host path (the same cases without "device_reduce", in the same run)
the losses and the final parameters are bit for bit equal: the same fp32 sums (copy first, add
a second gradient, zero the gaps) and the same collective over the same values, then a copy.
Against plain torch AdamW on the whole batch, the parity tests' 1e-5 relative on the mean loss.
Under late copies (INFINITY_LATE_TRANSFERS) the shard's copy to the host lands late on a helper
thread (its host buffer NaN until then): the mean loss still meets torch's within 1e-5, with
nothing poisoned or lost. The planted faults (the shard read before its copy's event, a device
buffer reused before it) are caught deterministically by tests/unit/test_device_gradients.py;
here the first turns the losses into NaN."""
from __future__ import annotations

import json
import math

import pytest
import torch
from parity import make_model
from parity_ranks_worker import LR, WEIGHT_DECAY, global_batches
from ranks import check_ranks, launch, mean_losses, read_results, reference_run

from infinity.storage.transfers import LATE_ENV

pytestmark = pytest.mark.distributed

STEPS = 3
_BASES = [
    {"name": "s3-nvme-nvme-early", "stage": 3, "opt": "nvme", "param": "nvme",
     "schedule": "early", "slots": True},
    {"name": "s3-cpu-cpu-deferred", "stage": 3, "opt": "cpu", "param": "cpu",
     "schedule": "deferred"},
    {"name": "s2-cpu-deferred", "stage": 2, "opt": "cpu", "param": "none", "schedule": "deferred"},
    {"name": "s0-none-deferred", "stage": 0, "opt": "none", "param": "none",
     "schedule": "deferred"},
]
CASES = [dict(base, name=f"{base['name']}-{path}", device_reduce=path == "device")
         for base in _BASES for path in ("host", "device")]


def _torch_losses(case: dict) -> list[float]:
    deferred = case["schedule"] == "deferred"
    batches = global_batches(1, STEPS, 2 if deferred else 1, 2)
    losses, _ = reference_run(make_model("torch", seed=0, layers=3, width=32), batches, lr=LR,
                              weight_decay=WEIGHT_DECAY, clip=0.05 if deferred else 0.0)
    return losses


def test_the_device_path_trains_bit_for_bit_as_the_host_path(tmp_path_factory) -> None:
    out, nvme = tmp_path_factory.mktemp("devred"), tmp_path_factory.mktemp("devred-nvme")
    results = launch(2, "parity_ranks_worker.py", [str(out), str(nvme), json.dumps(CASES),
                                                   str(STEPS)], timeout=900)
    check_ranks(results)
    per_rank = read_results(out, 2)
    for base in _BASES:
        host, device = f"{base['name']}-host", f"{base['name']}-device"
        assert [r[host]["device_reduce"] for r in per_rank] == [False, False], host
        assert [r[device]["device_reduce"] for r in per_rank] == [True, True], device
        for rank in range(2):
            assert per_rank[rank][device]["losses"] == per_rank[rank][host]["losses"], \
                (base["name"], rank, per_rank[rank][device]["losses"],
                 per_rank[rank][host]["losses"])
            a = torch.load(out / f"{host}.rank{rank}.pt")
            b = torch.load(out / f"{device}.rank{rank}.pt")
            for pname in a:
                assert torch.equal(a[pname], b[pname]), (base["name"], rank, pname)
        losses, want = mean_losses(per_rank, device, STEPS), _torch_losses(base)
        for s, (x, y) in enumerate(zip(losses, want)):
            assert abs(x - y) <= 1e-5 * abs(y), (device, s, losses, want)


LATE = [case for case in CASES if case["device_reduce"] and case["stage"] in (3, 0)]


def test_the_device_path_under_late_copies_trains_as_one_process(tmp_path_factory) -> None:
    out, nvme = tmp_path_factory.mktemp("devred-late"), tmp_path_factory.mktemp("devred-l-nvme")
    results = launch(2, "parity_ranks_worker.py", [str(out), str(nvme), json.dumps(LATE),
                                                   str(STEPS)],
                     timeout=900, env_extra={LATE_ENV: "1"})
    check_ranks(results)
    per_rank = read_results(out, 2)
    for case in LATE:
        name = case["name"]
        for r in per_rank:
            assert r[name]["device_reduce"], name
            counts = r[name]["copies"]
            assert counts is not None and counts["to_host"] > 0, (name, counts)
            assert counts["poisoned"] == 0 and counts["lost"] == 0, (name, counts)
        losses, want = mean_losses(per_rank, name, STEPS), _torch_losses(case)
        assert all(math.isfinite(x) for x in losses), (name, losses)
        for s, (x, y) in enumerate(zip(losses, want)):
            assert abs(x - y) <= 1e-5 * abs(y), (name, s, losses, want)
