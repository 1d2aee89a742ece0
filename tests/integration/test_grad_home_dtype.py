"""The deferred schedule's gradient home in the compute dtype (see [Note: the gradient home in the
compute dtype] in infinity/planner/placement.py): with bf16 compute, one micro-step and one rank
the home holds each gradient as autograd made it, so training is bit for bit what a float32 home
gives (the same values in twice the bytes); where the home sums (accumulation over micro-steps)
it stays float32. The float32 home is forced by patching the one rule the planner and the engine
share."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.base.cpu_bf16 import ENV
from infinity.checkpoint import consolidated_state_dict
from infinity.planner import engine_sizes as engine_sizes_module
from parity import VOCAB, loss_of, make_model, zero_config

STEPS = 4


def _ds(stage: int, param: str, optimizer: str, swap_dir, accumulation: int = 1) -> dict:
    swap_dir.mkdir(parents=True, exist_ok=True)
    ds = zero_config(stage, param, optimizer, str(swap_dir), compute_dtype="bf16")
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds["train_micro_batch_size_per_gpu"] = 2
    ds["gradient_accumulation_steps"] = accumulation
    ds["gradient_clipping"] = 0.5      # the deferred schedule (the norm comes first), and it acts
    return ds


def _train(family: str, ds: dict, save_to) -> tuple[list[float], list[float], torch.dtype]:
    """Losses and global norms of STEPS steps; the checkpoint is saved to ``save_to``."""
    model = make_model(family, layers=2, width=64)
    engine, *_ = infinity.initialize(model=model, config=ds)
    gen = torch.Generator().manual_seed(7)
    losses, norms = [], []
    try:
        home = engine.optimizer.states[0].grad_store.dtype
        for _ in range(STEPS * ds["gradient_accumulation_steps"]):
            x = torch.randint(0, VOCAB, (2, 16), generator=gen)
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.is_gradient_accumulation_boundary():
                norms.append(engine.get_global_grad_norm())
        engine.save_checkpoint(save_to, tag="last")
    finally:
        engine.close()
    return losses, norms, home


@pytest.mark.parametrize("family", ["torch", "llama", "gpt2"])
@pytest.mark.parametrize("stage,param,optimizer", [(3, "nvme", "nvme"), (3, "cpu", "cpu"),
                                                   (2, "none", "cpu")])
def test_a_bf16_home_trains_bit_for_bit_like_a_float32_home(
        family: str, stage: int, param: str, optimizer: str, tmp_path, disk_dir,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    small = _train(family, _ds(stage, param, optimizer, disk_dir / "a"), tmp_path / "ckpt_a")
    with monkeypatch.context() as m:
        m.setattr(engine_sizes_module, "gradient_home_itemsize", lambda *args: 4)
        wide = _train(family, _ds(stage, param, optimizer, disk_dir / "b"), tmp_path / "ckpt_b")
    assert small[2] == torch.bfloat16 and wide[2] == torch.float32
    assert small[0] == wide[0] and small[1] == wide[1]      # losses and clipping norms, exactly
    assert all(n > 0.5 for n in small[1])                    # clipping acted on every step
    weights_a = consolidated_state_dict(tmp_path / "ckpt_a" / "last")
    weights_b = consolidated_state_dict(tmp_path / "ckpt_b" / "last")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    states_a = load_file(str(tmp_path / "ckpt_a" / "last" / "rank0_optim.safetensors"))
    states_b = load_file(str(tmp_path / "ckpt_b" / "last" / "rank0_optim.safetensors"))
    assert states_a.keys() == states_b.keys()
    for name in states_a:
        assert torch.equal(states_a[name], states_b[name]), name


def test_an_accumulating_home_stays_float32_and_the_budget_counts_each(
        disk_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two micro-steps a step sum in the home: float32 there; the planner's host bytes for the
    home follow the dtype (2 B an element with one micro-step, 4 with two)."""
    monkeypatch.setenv(ENV, "1")
    homes = {}
    for accumulation in (1, 2):
        model = make_model("llama", layers=2, width=64)
        ds = _ds(3, "nvme", "nvme", disk_dir / f"g{accumulation}", accumulation)
        engine, *_ = infinity.initialize(model=model, config=ds)
        try:
            trainable = sum(s.numel for s in engine.optimizer.states)
            homes[accumulation] = (engine.optimizer.states[0].grad_store.dtype,
                                   engine.sizes.grad_home_itemsize,
                                   engine.sizes.host_home_bytes, trainable)
        finally:
            engine.close()
    assert homes[1][:2] == (torch.bfloat16, 2) and homes[2][:2] == (torch.float32, 4)
    assert homes[1][2] == 2 * homes[1][3] and homes[2][2] == 4 * homes[2][3]
