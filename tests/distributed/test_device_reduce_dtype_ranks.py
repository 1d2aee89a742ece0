"""Two gloo ranks, bf16 compute, gradients reduced on the device (the GPU's path forced on the CPU
device, parity_ranks_worker.py's "device_reduce") in the communication dtype: unset (the
gradients' own, bf16, as DeepSpeed) against "fp32" ([Note: gradients reduced on the device] in
optim/device_gradients.py).

Against torch on one rank with the whole batch (the engine's bf16 recipe: bf16 forward and
backward, fp32 AdamW masters, parameters rounded to bf16 after each step), the tolerance is
derived from what differs. The bf16 recipe itself (matmul reductions in another order on a
flat shard's views than on torch's tensors) is held to 2e-2 relative loss per step
(tests/integration/test_cpu_bf16_compute.py, issue 28). The ranks add: each rank's gradient of
its half of the batch is rounded to bf16 (torch rounds the whole batch's once), and the bf16
reduce rounds the two ranks' sum once more (bf16's unit roundoff 2^-9 relative), the halving
being exact: at most three roundings, 3 x 2^-9 = 0.6% relative on each gradient element, which
AdamW's normalized step turns into at most 0.6% of each parameter's update (lr 1e-3: 6e-6),
far inside the recipe's 2e-2. So the bound stays 2e-2. The bf16 reduce is also held to the
fp32 reduce of the same run, where only the reduce differs: the first step's loss (no update
yet) bit for bit; the later ones within 2^-7 relative (the losses are bf16 values, 2^-8
apart relative: two units, each side rounding a loss the reduce moved by far less); each
final parameter (bf16, gathered) within one bf16 unit of its size (2^-7 relative: the fp32
masters, differing by at most 3 steps x 6e-6, may round to neighbouring bf16 values) plus
1e-4 (those 3 x 6e-6, with room: AdamW's ratio m / sqrt(v) over 3 steps can amplify a
relative gradient error up to sqrt(3) times).

The bf16 reduce moves half the reduce's bytes (``comm_sent_bytes``: the all-gathers are the
same bf16 parameters in both). Under late copies (INFINITY_LATE_TRANSFERS) the bf16 shard
lands late in its staging and is widened at the wait: losses bit for bit the immediate run's,
nothing poisoned or lost."""
from __future__ import annotations

import json

import pytest
import torch
from parity import half_recipe_losses, make_model
from parity_ranks_worker import LR, WEIGHT_DECAY, global_batches
from ranks import check_ranks, launch, mean_losses, read_results

from infinity.storage.transfers import LATE_ENV

pytestmark = pytest.mark.distributed

STEPS = 3
_BASES = [
    {"name": "s3-nvme-nvme-early", "stage": 3, "opt": "nvme", "param": "nvme",
     "schedule": "early", "slots": True},
    {"name": "s3-cpu-cpu-early", "stage": 3, "opt": "cpu", "param": "cpu", "schedule": "early"},
]
CASES = [dict(base, name=f"{base['name']}-{comm or 'unset'}", compute="bf16", comm=comm,
              device_reduce=True) for base in _BASES for comm in (None, "fp32")]


def _torch_bf16_losses() -> list[float]:
    """torch on one rank, the whole global batch, the engine's bf16 recipe."""
    batches = [x for (x,) in global_batches(1, STEPS, 1, 2)]
    return half_recipe_losses(make_model("torch", seed=0, layers=3, width=32), batches, LR,
                              WEIGHT_DECAY)


def test_a_bf16_reduce_trains_as_torch_and_as_the_fp32_reduce(tmp_path_factory) -> None:
    out, nvme = tmp_path_factory.mktemp("dtype"), tmp_path_factory.mktemp("dtype-nvme")
    results = launch(2, "parity_ranks_worker.py", [str(out), str(nvme), json.dumps(CASES),
                                                   str(STEPS)], timeout=900)
    check_ranks(results)
    per_rank = read_results(out, 2)
    want = _torch_bf16_losses()
    for base in _BASES:
        bf16, fp32 = f"{base['name']}-unset", f"{base['name']}-fp32"
        assert [r[bf16]["reduce_dtype"] for r in per_rank] == ["bfloat16"] * 2, bf16
        assert [r[fp32]["reduce_dtype"] for r in per_rank] == ["float32"] * 2, fp32
        for r in per_rank:
            assert r[bf16]["sent"][-1] < r[fp32]["sent"][-1], (bf16, r[bf16]["sent"],
                                                                r[fp32]["sent"])
        low, wide = mean_losses(per_rank, bf16, STEPS), mean_losses(per_rank, fp32, STEPS)
        assert low[0] == wide[0], (bf16, low, wide)
        for s in range(1, STEPS):
            assert abs(low[s] - wide[s]) <= 2 ** -7 * abs(wide[s]), (bf16, s, low, wide)
        for rank in range(2):
            a = torch.load(out / f"{bf16}.rank{rank}.pt")
            b = torch.load(out / f"{fp32}.rank{rank}.pt")
            for pname in a:
                x, y = a[pname].float(), b[pname].float()
                bound = 2 ** -7 * torch.maximum(x.abs(), y.abs()) + 1e-4
                assert ((x - y).abs() <= bound).all(), (bf16, rank, pname,
                                                        float((x - y).abs().max()))
        for s, (x, y) in enumerate(zip(low, want)):
            assert abs(x - y) <= 2e-2 * abs(y), (bf16, s, low, want)


def test_a_bf16_reduce_under_late_copies_is_the_immediate_run_bit_for_bit(
        tmp_path_factory) -> None:
    cases = [case for case in CASES if case["comm"] is None]
    runs = []
    for env in ({}, {LATE_ENV: "1"}):
        out = tmp_path_factory.mktemp("dtype-late")
        nvme = tmp_path_factory.mktemp("dtype-late-nvme")
        results = launch(2, "parity_ranks_worker.py", [str(out), str(nvme), json.dumps(cases),
                                                       str(STEPS)], timeout=900, env_extra=env)
        check_ranks(results)
        runs.append(read_results(out, 2))
    immediate, late = runs
    for case in cases:
        name = case["name"]
        for rank in range(2):
            counts = late[rank][name]["copies"]
            assert counts["to_host"] > 0 and counts["poisoned"] == counts["lost"] == 0, counts
            assert late[rank][name]["reduce_dtype"] == "bfloat16"
            assert late[rank][name]["losses"] == immediate[rank][name]["losses"], (
                name, rank, late[rank][name]["losses"], immediate[rank][name]["losses"])
