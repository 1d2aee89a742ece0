"""What a DeepSpeed user brings along works as it does there: the zero3 config the Hugging Face
integration hands over (its "auto"s filled by auto_values), DeepSpeed's older config_params name,
and fp16.auto_cast."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import infinity
from parity import (VOCAB, engine_and_reference, make_model, run_parity, with_adamw,
                    zero_config)

HF_ZERO3 = {
    "fp16": {"enabled": "auto", "auto_cast": False, "loss_scale": 0, "initial_scale_power": 32,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 0, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
        "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000, "wall_clock_breakdown": False,
}
FILLED = {"fp16.enabled": False, "bf16.enabled": False, "optimizer.params.lr": 1e-3,
          "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
          "optimizer.params.weight_decay": 0.01, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}


def test_the_hugging_face_zero3_config_trains_like_torch(monkeypatch) -> None:
    original = infinity.initialize
    monkeypatch.setattr(infinity, "initialize",
                        lambda **kw: original(**kw, auto_values=FILLED))   # what run_parity calls
    model = make_model("llama", layers=2, width=64)
    result = run_parity(model, copy.deepcopy(HF_ZERO3), steps=4, clip=1.0, close=False)
    try:
        assert result.worst_relative <= 1e-5, (result.losses, result.ref_losses)
        assert result.engine.config.gradient_clipping == 1.0
    finally:
        result.engine.close()


def test_auto_without_a_value_says_how_to_give_one() -> None:
    with pytest.raises(Exception, match=r"auto_values=\{'gradient_accumulation_steps'"):
        infinity.initialize(model=nn.Linear(4, 4), config=HF_ZERO3)


def test_config_params_is_deepspeeds_older_name_and_not_both() -> None:
    engine, *_ = infinity.initialize(model=nn.Linear(4, 4), config_params=with_adamw({
        "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5}))
    try:
        assert engine.config.gradient_clipping == 0.5
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"config 2 times \(config, config_params\)"):
        infinity.initialize(model=nn.Linear(4, 4), config={}, config_params={})


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.body(inputs["x"]) * inputs["scale"]


def _fp16_engine(model: nn.Module, auto_cast: bool):
    config = {"train_micro_batch_size_per_gpu": 4,
              "fp16": {"enabled": True, "auto_cast": auto_cast, "initial_scale_power": 8},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}},
              "infinity": {"compute_dtype": "fp16"}}
    engine, *_ = infinity.initialize(model=model, config=with_adamw(config))
    return engine


def test_fp16_auto_cast_casts_floating_inputs_to_the_compute_dtype() -> None:
    """fp32 inputs, nested in a dict, reach fp16 weights cast (an int tensor stays as it is);
    the losses are those of the same engine fed inputs cast by hand; without auto_cast the
    fp32 inputs meet fp16 weights and torch refuses, as in DeepSpeed."""
    torch.manual_seed(0)
    model = _Regressor()
    twin = copy.deepcopy(model)
    auto, by_hand = _fp16_engine(model, True), _fp16_engine(twin, False)
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(3):
            x = torch.randn(4, 8, generator=gen)
            scale = torch.tensor(2, dtype=torch.int64)
            loss_a = auto({"x": x, "scale": scale}).float().pow(2).mean()
            loss_b = by_hand({"x": x.half(), "scale": scale}).float().pow(2).mean()
            assert loss_a.item() == loss_b.item()
            for engine, loss in ((auto, loss_a), (by_hand, loss_b)):
                engine.backward(loss)
                engine.step()
        with pytest.raises(RuntimeError, match="dtype"):
            by_hand({"x": torch.randn(4, 8), "scale": scale})
    finally:
        auto.close()
        by_hand.close()


def test_a_deepspeed_script_with_args_and_training_data(tmp_path) -> None:
    """DeepSpeed's CIFAR-style script: add_config_arguments, --deepspeed_config, training_data in,
    a loader of micro-batches out; the loader covers the dataset once per epoch."""
    import argparse

    config_file = tmp_path / "ds_config.json"
    config_file.write_text('{"train_micro_batch_size_per_gpu": 4, "dataloader_drop_last": false,'
                           ' "optimizer": {"type": "Adam", "params": {"lr": 0.01}},'
                           ' "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},'
                           ' "offload_optimizer": {"device": "cpu"}}}')
    parser = infinity.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(config_file)])
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randn(10, 1))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    engine, optimizer, loader, _ = infinity.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data)
    try:
        assert optimizer is engine.optimizer
        sizes = []
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            sizes.append(len(x))
        assert sizes == [4, 4, 2] and engine.global_steps == 3
        seen = torch.cat([x for x, _ in loader])
        assert sorted(seen[:, 0].tolist()) == sorted(data.tensors[0][:, 0].tolist())
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r"config 2 times \(config, args\.deepspeed_config\)"):
        infinity.initialize(args=args, model=nn.Linear(2, 2), config={})
    with pytest.raises(ValueError, match="mpu"):
        infinity.initialize(model=nn.Linear(2, 2), config={}, mpu=object())


def test_the_deepspeed_engine_accessors(disk_dir) -> None:
    """What scripts, Hugging Face's Trainer and accelerate ask DeepSpeed's engine."""
    model = make_model("gpt2", layers=2, width=32)
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "steps_per_print": 7, "fp16": {"enabled": True, "initial_scale_power": 4},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = infinity.initialize(model=model, config=with_adamw(config))
    try:
        assert engine.gradient_accumulation_steps() == 2
        assert engine.train_batch_size() == 8 and engine.train_micro_batch_size_per_gpu() == 4
        assert engine.get_batch_info() == (8, 4, 2) and engine.steps_per_print() == 7
        assert engine.wall_clock_breakdown() is False
        assert engine.zero_optimization_stage() == 3 and engine.gradient_clipping() == 1.0
        # the ZeRO flags accelerate and DeepSpeed's own saves read
        assert engine.zero_optimization() and engine.zero_optimization_partition_weights()
        assert engine.zero_offload_optimizer() and engine.zero_cpu_offload()
        assert engine.zero_offload_param()
        assert engine.zero_gather_16bit_weights_on_model_save() is False
        assert engine.empty_partition_cache() is None
        consolidated = engine._zero3_consolidated_16bit_state_dict()
        assert set(consolidated) == set(model.state_dict())
        # what the engine computes in (fp32 here on a CPU: an fp16 section keeps loss scaling),
        # which scripts read to cast their inputs
        assert engine.fp16_enabled() == (engine.compute_dtype == torch.float16)
        assert not engine.bfloat16_enabled() and engine.loss_scale > 1
        assert engine.get_global_grad_norm() is None
        x = torch.randint(1, 60, (4, 8))
        with engine.no_sync():
            for _ in range(2):
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
        norm = engine.get_global_grad_norm()
        assert norm is not None and norm > 0 and engine.was_step_applied()
        assert engine.global_samples == 8 and engine.get_mom() == [(0.9, 0.999)]
        with torch.no_grad():       # attribute access falls through to the model
            assert engine.generate(x[:1, :3], max_new_tokens=2, do_sample=False).shape == (1, 5)
        assert engine.config is not model.config        # the engine's own config stays its own
        # one neither the engine nor the model has names the engine (it named the model's class)
        with pytest.raises(AttributeError, match="infinity engine has no attribute "
                                                 "'set_train_batch_size', nor has its model"):
            engine.set_train_batch_size(16)
        assert engine.get_data_parallel_world_size() == 1 and engine.optimizer_name() == "AdamW"
        assert engine.scheduler_name() is None and engine.dynamic_loss_scale()
        engine.save_fp16_model(disk_dir, "weights.safetensors")
        assert (disk_dir / "weights.safetensors").is_file()
        engine.destroy()
        with pytest.raises(RuntimeError, match="after engine.close"):
            engine(input_ids=x)
    finally:
        engine.close()


@pytest.mark.parametrize("bf16", [False, None], ids=["false", "unsaid"])
def test_bf16_enabled_false_is_fp32_on_a_cpu_too(monkeypatch, bf16) -> None:
    """A DeepSpeed config's ``"bf16": {"enabled": false}`` is fp32 training; on a CPU that
    multiplies bf16 natively (forced here: INFINITY_CPU_BF16=1) "auto" took bf16 all the same
    (0.3 relative off torch in ten steps) while bfloat16_enabled() said False. Unsaid, "auto"
    picks bf16 there, and bfloat16_enabled() says what the engine computes in."""
    from infinity.base.cpu_bf16 import ENV

    if torch.cuda.is_available():
        pytest.skip("on a GPU bf16.enabled decides alone (tests/unit/test_cpu_bf16.py)")
    monkeypatch.setenv(ENV, "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
    if bf16 is not None:
        config["bf16"] = {"enabled": bf16}
    engine, *_ = infinity.initialize(model=model, config=with_adamw(config))
    try:
        out = engine(torch.randn(4, 16))
        want = torch.float32 if bf16 is False else torch.bfloat16
        assert out.dtype == want and engine.compute_dtype == want
        assert engine.bfloat16_enabled() is (want == torch.bfloat16)
    finally:
        engine.close()


def test_zero_init_takes_deepspeeds_arguments_and_refuses_misspelled_ones() -> None:
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    with infinity.zero.Init(remote_device="cpu", pin_memory=True, dtype=torch.float32,
                            config_dict_or_path=config):
        layer = nn.Linear(4, 4)
    assert layer.weight.device.type == "meta"
    with pytest.raises(TypeError, match=r"unknown arguments \['remot_device'\]"):
        infinity.zero.Init(config_dict_or_path=config, remot_device="cpu")
    # a Hugging Face config's "auto" values are initialize's to fill: Init reads the stage
    # (it refused them, advising an auto_values= it does not take)
    with infinity.zero.Init(config_dict_or_path={**HF_ZERO3, "zero_optimization": {"stage": 3}}):
        layer = nn.Linear(4, 4)
    assert layer.weight.device.type == "meta"


def test_backward_and_step_take_deepspeeds_arguments() -> None:
    """backward(scale_wrt_gas=False) adds unscaled gradients and returns the loss it used;
    step(lr_kwargs=...) passes them to the scheduler's step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    twin = copy.deepcopy(model)
    config = {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                           "warmup_max_lr": 0.1,
                                                           "warmup_num_steps": 10}}}
    engine, *_ = infinity.initialize(model=model, config=config)
    reference, *_ = infinity.initialize(model=twin, config=config)
    x = torch.randn(3, 4)
    try:
        loss = engine(x).pow(2).mean()
        assert engine.backward(loss, scale_wrt_gas=False).item() == pytest.approx(loss.item())
        ref_loss = reference(x).pow(2).mean()
        assert reference.backward(ref_loss * 2).item() == pytest.approx(loss.item())
        for e in (engine, reference):
            e.step()
            e.backward(e(x).pow(2).mean() * 0)
        engine.step(lr_kwargs={"last_batch_iteration": 6})
        reference.step()
        torch.testing.assert_close(model.weight, twin.weight)     # the same gradients
        assert engine.lr_scheduler.last_batch_iteration == 6
        assert reference.lr_scheduler.last_batch_iteration == 0
    finally:
        engine.close()
        reference.close()


@pytest.mark.parametrize("tiers,early_step,speculative_step", [
    ("nvme", "on", "auto"), ("cpu", "on", "auto"),     # early step: the kernels norm
    ("nvme", "off", "on"),                            # speculated, held gradients normed
    ("nvme", "off", "off"),                           # deferred: normed for clipping
])
def test_the_global_grad_norm_is_torchs_under_every_schedule(disk_dir, tiers: str,
                                                             early_step: str,
                                                             speculative_step: str) -> None:
    """get_global_grad_norm() after each step equals the total norm of the un-offloaded
    copy's gradients (what clip_grad_norm_ returns, what Hugging Face's Trainer logs), also
    where no step needs the norm (the early step sums it in the Adam kernel). A unit
    without a gradient in a step (the sometimes-used body half) counts as zero."""
    from test_unused_params import SometimesUsedModel

    torch.manual_seed(0)
    model = SometimesUsedModel()
    ds = zero_config(3, tiers, tiers, str(disk_dir), early_step=early_step,
                     speculative_step=speculative_step)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, reference, ref_opt = engine_and_reference(model, ds)
    gen = torch.Generator().manual_seed(7)
    try:
        assert engine.optimizer.early_step == (early_step == "on")
        for _ in range(4):
            x = torch.randint(0, VOCAB, (2, 8), generator=gen)
            engine.backward(engine(input_ids=x, labels=x))
            engine.step()
            reference(input_ids=x, labels=x).backward()
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
            assert engine.get_global_grad_norm() == pytest.approx(float(want), rel=1e-5)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    finally:
        engine.close()


@pytest.mark.parametrize("tier,early_step,family,steps", [
    ("cpu", "off", "llama", 2), ("nvme", "on", "llama", 2),
    # a tied head under both names (untrained: GPT-2's key bias has no gradient, so Adam
    # steps it on rounding noise, ~1e-5 apart from torch after two steps)
    ("cpu", "off", "gpt2", 0)])
def test_rank_accessors_to_and_module_state_dict(disk_dir, tier, early_step, family,
                                                 steps) -> None:
    """DeepSpeed's rank accessors are one rank's; engine.to(device) returns the engine (it
    returned the model); module_state_dict() gives the current full weights -- right after a
    deferred step too, where module.state_dict() held released (empty) and pre-step values."""
    from parity import loss_of, reference_step

    torch.manual_seed(0)
    model = make_model(family, layers=2, width=64)
    engine, reference, ref_opt = engine_and_reference(
        model, zero_config(3, tier, tier, str(disk_dir), early_step=early_step))
    try:
        assert (engine.local_rank, engine.global_rank, engine.world_size,
                engine.dp_world_size) == (0, 0, 1, 1)
        assert engine.to("cpu") is engine and engine.to(torch.device("cpu")) is engine
        gen = torch.Generator().manual_seed(4)
        for _ in range(steps):
            x = torch.randint(0, VOCAB, (2, 12), generator=gen)
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
            reference_step(reference, ref_opt, x, 0.0)
        state = engine.module_state_dict()
        if family == "gpt2":
            assert state["lm_head.weight"] is state["transformer.wte.weight"]
        expected = reference.state_dict()
        assert set(state) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        engine.close()


def test_a_frozen_model_needs_no_optimizer_as_zero_inference(disk_dir) -> None:
    """DeepSpeed's ZeRO-Inference habit (a frozen teacher beside a student, a model to
    evaluate): a config with no optimizer for a model whose parameters are all frozen. It was
    refused for want of an optimizer; it runs forwards, offloaded, as the plain model does."""
    torch.manual_seed(0)
    teacher = make_model("llama", layers=2, width=32)
    teacher.requires_grad_(False)
    plain = copy.deepcopy(teacher)
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                              "nvme_path": str(disk_dir)}},
          "infinity": {"compute_dtype": "fp32"}}
    engine, optimizer, *_ = infinity.initialize(model=teacher, config=ds)
    try:
        x = torch.randint(0, VOCAB, (2, 8))
        with torch.no_grad():
            torch.testing.assert_close(engine(input_ids=x).logits, plain(input_ids=x).logits,
                                       rtol=1e-6, atol=1e-6)
    finally:
        engine.close()
    trainable = make_model("llama", layers=2, width=32)
    with pytest.raises(ValueError, match=r"freeze every parameter first"):
        infinity.initialize(model=trainable, config=ds)
