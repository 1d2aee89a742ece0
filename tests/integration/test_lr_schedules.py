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


@pytest.mark.parametrize("how", ["config", "factory"])
def test_a_schedule_that_cannot_be_built_is_refused_before_the_weights_move(disk_dir, how):
    """A WarmupDecayLR without total_num_steps, a factory's LambdaLR with a lambda per group of
    another count: raised by building the scheduler, after the parameters had moved into the
    engine's stores -- at stage 3 the model was left with empty weights, a retry refused
    ("build the model again"). Now raised first; the corrected call trains."""
    import torch

    import infinity

    model = make_model("llama", layers=2, width=32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    if how == "config":
        warmup = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2}}
        bad = ({**ds, "scheduler": warmup}, None)
        good = ({**ds, "scheduler": {**warmup, "params": {**warmup["params"],
                                                          "total_num_steps": 10}}}, None)
    else:
        bad = (ds, lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 1.0] * 2))
        good = (ds, lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 1.0]))
    with pytest.raises(ValueError, match="total_num_steps" if how == "config" else
                       "Expected 1 lr_lambdas, but got 2"):
        infinity.initialize(model=model, config=bad[0], lr_scheduler=bad[1])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    engine, *_ = infinity.initialize(model=model, config=good[0], lr_scheduler=good[1])
    try:
        assert engine.lr_scheduler is not None
        torch.testing.assert_close(engine.module_state_dict()["lm_head.weight"],
                                   before["lm_head.weight"])
    finally:
        engine.close()


def test_a_value_adam_refuses_is_refused_before_any_unit_steps(disk_dir, infinity_log) -> None:
    """OneCycle's momentum decay has no bound (DeepSpeed's formula): beta1 passed 1 and the
    Adam kernel refused it in the middle of a step, some units stepped, the engine unusable
    after it (not even a save). Warned at the config with the step it comes at; refused before
    the step, naming the group; corrected, the run goes on and saves."""
    import torch

    import infinity

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    ds = zero_config(2, "none", "cpu", str(disk_dir))
    ds.update(train_micro_batch_size_per_gpu=4,
              optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
              scheduler={"type": "OneCycle", "params": {
                  "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2,
                  "decay_step_size": 1, "decay_mom_rate": 0.1}})
    engine, optimizer, _, _ = infinity.initialize(model=model, config=ds)
    assert any("decay_mom_rate = 0.1" in r.getMessage() and "reaches 1 at about step 6"
               in r.getMessage() for r in infinity_log.records)
    try:
        for _ in range(6):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
        assert engine.get_mom()[0][0] > 1.0
        before = engine.module_state_dict()
        with pytest.raises(ValueError, match=r"param group 0: beta1 must be in \[0, 1\), got "
                                             r"1\.08.*nothing was stepped"):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
        assert all(torch.equal(v, before[k]) for k, v in engine.module_state_dict().items())
        # a direct loss.backward() is refused at its first gradient, which torch had written
        # already: it was left on the parameter and added into the next backward's
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        with pytest.raises(ValueError, match=r"beta1 must be in \[0, 1\)"):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())
        for group in optimizer.param_groups:
            group["betas"] = (0.9, 0.999)
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
        engine.save_checkpoint(disk_dir / "ckpt")
    finally:
        engine.close()
