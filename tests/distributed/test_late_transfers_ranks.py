"""Two ranks under late copies (storage/transfers.py ``LateCopies``, issue 36): stage 3 with
parameters and optimizer on NVMe, gloo, 2 processes on localhost, every copy to the device
(through host fetch slots, the device memory cache off as on CUDA) and every gradient's copy to
its host buffer completed late on a helper thread. With several ranks a gradient is never held
(see [Note: gradients over ranks] in optim/gradients.py): each goes through a copy to the host,
and the reduce-scatter reads the unit's buffer only after the copies' events. The mean loss of
the ranks equals plain torch AdamW's on the whole batch within the parity tests' 1e-5, in both
schedules, with nothing poisoned or lost. The single-process cases and the planted faults:
tests/integration/test_late_transfers.py."""
from __future__ import annotations

import json

import pytest
from parity import make_model
from parity_ranks_worker import LR, WEIGHT_DECAY, global_batches
from ranks import check_ranks, launch, read_results, reference_run

from infinity.storage.transfers import LATE_ENV

pytestmark = pytest.mark.distributed

STEPS = 3
CASES = [{"name": f"late-s3-nvme-nvme-{schedule}", "stage": 3, "opt": "nvme", "param": "nvme",
          "schedule": schedule, "slots": True} for schedule in ("early", "deferred")]


def test_two_ranks_under_late_copies_train_as_one_process(tmp_path_factory) -> None:
    out, nvme = tmp_path_factory.mktemp("late2"), tmp_path_factory.mktemp("late2-nvme")
    results = launch(2, "parity_ranks_worker.py", [str(out), str(nvme), json.dumps(CASES),
                                                   str(STEPS)],
                     timeout=600, env_extra={LATE_ENV: "11"})
    check_ranks(results)
    per_rank = read_results(out, 2)
    for case in CASES:
        name, deferred = case["name"], case["schedule"] == "deferred"
        ranks = [r[name] for r in per_rank]
        for counts in (r["copies"] for r in ranks):
            assert counts is not None and counts["to_host"] > 0, (name, counts)
            assert counts["poisoned"] == 0 and counts["lost"] == 0, (name, counts)
        batches = global_batches(1, STEPS, 2 if deferred else 1, 2)
        ref_losses, _ = reference_run(make_model("torch", seed=0, layers=3, width=32), batches,
                                      lr=LR, weight_decay=WEIGHT_DECAY,
                                      clip=0.05 if deferred else 0.0)
        losses = [sum(r["losses"][s] for r in ranks) / 2 for s in range(STEPS)]
        for s, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), (name, s, losses, ref_losses)
