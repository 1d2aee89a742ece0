"""The config's LR schedule reaches every step schedule: the lr and (OneCycle) the cycled beta1 and
DeepSpeed's beta2 of 0.99 that each optimizer step uses, early, deferred or speculated, equal
torch AdamW driven by the same schedule."""
from __future__ import annotations

import pytest

from parity import make_model, run_parity, zero_config

ONE_CYCLE = {"type": "OneCycle", "params": {
    "cycle_min_lr": 1e-4, "cycle_max_lr": 3e-3, "cycle_first_step_size": 3,
    "cycle_second_step_size": 2, "decay_lr_rate": 0.5, "decay_step_size": 1,
    "cycle_min_mom": 0.7, "cycle_max_mom": 0.95}}
COSINE = {"type": "WarmupCosineLR", "params": {
    "total_num_steps": 7, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
    "warmup_type": "linear"}}


@pytest.mark.parametrize("schedule", [ONE_CYCLE, COSINE], ids=["OneCycle", "WarmupCosineLR"])
@pytest.mark.parametrize("early_step,clip", [("on", 0.0), ("off", 0.0), ("off", 0.5)],
                         ids=["early", "speculated", "clipped"])
def test_schedule_trains_like_torch(disk_dir, schedule, early_step, clip) -> None:
    model = make_model("llama", layers=2, width=64)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step=early_step)
    result = run_parity(model, ds, steps=8, clip=clip, schedule=schedule, close=False)
    try:
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
        group = result.engine.optimizer.param_groups[0]
        if schedule is ONE_CYCLE:
            assert tuple(group["betas"]) == (0.95, 0.99)    # the decay's beta1, DeepSpeed's beta2
        assert result.engine.lr_scheduler.last_batch_iteration == 7
    finally:
        result.engine.close()
