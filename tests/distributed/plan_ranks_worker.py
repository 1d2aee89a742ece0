"""One rank of the two-rank "plan is the engine" test (started by ranks.py ``launch``): for
each config of ``CONFIGS`` builds the engine on a small model, compares what this rank holds
with its run plan and ``infinity plan`` (plan_check.compare) after ``initialize`` and after two
steps, and writes the results to ``rank<r>.json``.

argv: out_dir nvme_dir
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import infinity
from infinity.planner.inputs import ModelStats
from parity import make_model, train_random, zero_config
from plan_check import compare, recording_stores

CONFIGS = [  # stage, offload_param, offload_optimizer, compute dtype, early step
    (1, "none", "cpu", "fp32", "off"),
    (2, "none", "nvme", "bf16", "off"),
    (3, "cpu", "cpu", "fp32", "off"),
    (3, "nvme", "nvme", "bf16", "off"),
    (3, "nvme", "nvme", "fp32", "on"),
]


def main() -> None:
    out, nvme = Path(sys.argv[1]), sys.argv[2]
    info = infinity.init_distributed()
    results = {}
    for stage, param, opt, dtype, early in CONFIGS:
        ds = zero_config(stage, param, opt, nvme, compute_dtype=dtype, early_step=early,
                         collective_timeout=120)
        ds["gradient_clipping"] = 1.0 if early == "off" else 0.0
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        ds["train_micro_batch_size_per_gpu"] = 2
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        # wide enough that a unit's shard is many alignments (2048 elements) long: a state
        # planned whole instead of sharded is then far outside the shards' padding
        model = make_model("torch", layers=2, width=192)
        stats = ModelStats.from_module(model)
        with recording_stores() as created:
            engine, *_ = infinity.initialize(model=model, config=ds)
        try:
            first = compare(engine, created, stats, nvme)
            train_random(engine, 2)
            results[f"{stage}-{param}-{opt}-{dtype}-{early}"] = {
                "first": first, "after": compare(engine, created, stats, nvme)}
        finally:
            engine.close()
    (out / f"rank{info.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
