"""Stage 3 and checkpoints on a CUDA device (skipped visibly without one; tools/gpu_check.sh runs
them where a GPU is lent): the device is the GPU, parameters are fetched from host or NVMe into
device memory, and the results equal plain PyTorch AdamW on the same GPU: in fp32 (TF32 off)
for every tier and both schedules (a unit's step as its gradients arrive, or all after the
backward), within 1e-5; in bf16 and fp16 (static loss scale) against torch running the same
16-bit recipe (parity.py ``half_recipe_losses``), within 1e-3 relative: a kernel choice that
rounds a 16-bit output's last bit differently (2^-8 of one element) averages out over the loss's
terms (the same test on the CPU, compute forced to 16 bits: 6.5e-5 bf16, 1.5e-5 fp16), while a
step left out or a doubled learning rate moves the losses 2.8e-3 to 5.6e-3 there."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import infinity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from parity import (VOCAB, accumulating_micro_steps, assert_same_parameters,  # noqa: E402
                    half_recipe_losses, loss_of, make_model, reference_step, train_steps,
                    zero_config)

# fp32 matmuls without TF32 (tests/gpu/conftest.py): parity with torch at fp32 bounds
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]


def _config(disk_dir, stage: int, param: str, optimizer: str, **extra) -> dict:
    ds = zero_config(stage, param, optimizer, str(disk_dir))
    # every parameter of these 64-wide models is under the default persistence threshold,
    # which holds where the persistent units fit a share of the device memory (planner/
    # sizes.py): on a GPU they did, so without this nothing was fetched (the second H200 pass:
    # fetches 0); a CPU device's emulated budget is too small for them
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    ds.update(extra)
    return ds


def _batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen).cuda() for _ in range(count)]


TIERS = [(3, "nvme", "nvme"), (3, "cpu", "cpu"), (3, "none", "cpu"), (2, "none", "nvme")]
# (tiers, clip, schedule): "early" steps a unit as its gradients arrive; "deferred" steps every
# unit after the backward; "speculative" steps early under clipping (which needs the global norm
# first) and keeps or redoes the step: stage 3 with parameters and states on NVMe only
SCHEDULES = {"early": {"early_step": "on"},
             "deferred": {"early_step": "off", "speculative_step": "off"},
             "speculative": {"early_step": "auto", "speculative_step": "on"}}
CASES = [(tiers, clip, schedule) for tiers in TIERS
         for clip, schedule in ((0.0, "early"), (0.0, "deferred"), (0.5, "deferred"))]
CASES.append((TIERS[0], 0.5, "speculative"))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("tiers, clip, schedule", CASES)
def test_training_on_cuda_equals_torch(disk_dir, family, tiers, clip, schedule) -> None:
    model = make_model(family, layers=2, width=64).cuda()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    config = _config(disk_dir, *tiers, gradient_clipping=clip)
    config["infinity"].update(SCHEDULES[schedule])
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        assert engine.device.type == "cuda"
        assert (bool(engine.optimizer.early_step), engine.optimizer.speculation != "off") == \
            (schedule == "early", schedule == "speculative"), schedule
        for x in _batches(6):
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            ref_loss = reference_step(reference, ref_opt, x, clip)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        if tiers[0] == 3 and tiers[1] != "none":
            assert engine.coordinator.fetch_stats["fetches"] > 0, engine.coordinator.fetch_stats
        if schedule == "deferred" and tiers[1] == "cpu":
            # host-homed units are copied to the device at their prefetch, so their deferred
            # steps start before their use (zero/steps_ahead.py): that path ran on the GPU
            assert engine.coordinator.fetch_stats["steps_ahead"] > 0, engine.coordinator.fetch_stats
    finally:
        engine.close()


@pytest.mark.parametrize("param", ["cpu", "none"])
def test_the_last_micro_batch_steps_early_on_cuda_as_torch(disk_dir, monkeypatch, param) -> None:
    """Two micro-batches a step, early_step "auto", no clipping: the last micro-batch's backward
    steps each unit from its host gradient home, the home's adds made by the copies' adder
    thread (optim/boundary_steps.py, storage/transfers.py); the losses and the parameters
    equal torch AdamW over the accumulated gradient."""
    from infinity.optim.boundary_steps import BoundarySteps
    started, count = BoundarySteps.started, {"jobs": 0}

    def counting(self, job) -> None:
        count["jobs"] += 1
        started(self, job)
    monkeypatch.setattr(BoundarySteps, "started", counting)
    model = make_model("llama", layers=2, width=64).cuda()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    config = _config(disk_dir, 3, param, "cpu", gradient_accumulation_steps=2)
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        assert engine.optimizer.boundary.enabled
        batches = _batches(8)
        for step in range(4):
            accumulating_micro_steps(engine, reference, batches[2 * step:2 * step + 2])
            ref_opt.step()
            ref_opt.zero_grad()
        assert count["jobs"] == 4 * len(engine.optimizer.states)
        engine.flush()
        assert_same_parameters(model, reference)
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("tiers", TIERS[:3] + [(2, "none", "none")])
def test_16_bit_training_on_cuda_follows_torch_16_bit(disk_dir, dtype, tiers) -> None:
    """"auto" on a GPU computes in the dtype the ds_config enables (DeepSpeed's bf16 / fp16
    sections); the engine's losses follow torch's own 16-bit recipe on the same GPU."""
    model = make_model("llama", layers=2, width=64).cuda()
    scale = 1024.0 if dtype == "fp16" else 1.0
    batches = _batches(8)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    reference = half_recipe_losses(copy.deepcopy(model), batches, 1e-3, 0.01, dtype=torch_dtype,
                                   loss_scale=scale)
    config = _config(disk_dir, *tiers)
    config["infinity"]["compute_dtype"] = "auto"
    config[dtype] = {"enabled": True, **({"loss_scale": scale} if dtype == "fp16" else {})}
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        assert engine.compute_dtype == torch_dtype
        losses = train_steps(engine, batches)
        assert engine.skipped_steps == 0
    finally:
        engine.close()
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert worst <= 1e-3, (losses, reference)


@pytest.mark.parametrize("saved", [(3, "nvme", "nvme"), (2, "none", "none")])
def test_a_cuda_checkpoint_resumes_on_the_cpu_and_back(disk_dir, saved) -> None:
    """Saved by a CUDA engine (its optimizer states on NVMe, or in device memory), loaded by a
    CPU one and by CUDA ones (states on the host, in device memory): the same next losses."""
    batches = _batches(6)
    a, *_ = infinity.initialize(model=make_model("llama", layers=2).cuda(),
                                config=_config(disk_dir, *saved))
    try:
        for x in batches[:3]:
            a.backward(loss_of(a(input_ids=x, labels=x)))
            a.step()
        a.save_checkpoint(disk_dir / "ckpt")
        expected = []
        for x in batches[3:]:
            loss = loss_of(a(input_ids=x, labels=x))
            a.backward(loss)
            a.step()
            expected.append(loss.item())
    finally:
        a.close()
    for device, tiers in (("cpu", (3, "cpu", "cpu")), ("cuda", (3, "cpu", "cpu")),
                          ("cuda", (2, "none", "none"))):
        b, *_ = infinity.initialize(model=make_model("llama", seed=4, layers=2).to(device),
                                    config=_config(disk_dir, *tiers))
        try:
            b.load_checkpoint(disk_dir / "ckpt")
            got = []
            for x in batches[3:]:
                x = x.to(device)
                loss = loss_of(b(input_ids=x, labels=x))
                b.backward(loss)
                b.step()
                got.append(loss.item())
        finally:
            b.close()
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def test_a_model_built_under_init_computes_with_its_buffers_on_the_gpu(disk_dir) -> None:
    """``zero.Init`` leaves buffers real and on the CPU (BERT's position-id table, read by an
    embedding in the forward): the engine puts them on its device, as DeepSpeed's Init does,
    and trains as torch does the same weights (loaded through the model's routed
    ``load_state_dict``)."""
    import transformers

    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(cfg).cuda()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ds = _config(disk_dir, 3, "cpu", "cpu")
    with infinity.zero.Init(config=ds):
        model = transformers.BertForMaskedLM(cfg)
    assert any(b.device.type == "cpu" for b in model.buffers())
    engine, *_ = infinity.initialize(model=model, config=ds)
    try:
        assert engine.device.type == "cuda"
        assert all(b.device.type == "cuda" for b in model.buffers())
        model.load_state_dict(reference.state_dict())
        for x in _batches(4):
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            ref_loss = reference_step(reference, ref_opt, x, 0.0)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("stage, clip, schedule", [(0, 0.0, "deferred"), (2, 0.0, "deferred"),
                                                    (2, 0.5, "deferred"), (2, 0.0, "early"),
                                                    (3, 0.5, "deferred"), (3, 0.0, "early")])
def test_an_optimizer_left_on_the_gpu_trains_as_torch(disk_dir, stage, clip, schedule) -> None:
    """offload_optimizer "none" on a GPU: master weights, moments and gradients stay in device
    memory and the step runs there ([Note: Adam on the device] in optim/cpu_adam.py; the first
    H100 pass failed at the first step, the host kernel's checks refusing device tensors). The
    losses and the weights equal torch AdamW on the same GPU, with clipping (the norm summed on
    the device) and with each schedule."""
    model = make_model("llama", layers=2, width=64).cuda()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    config = _config(disk_dir, stage, "none", "none", gradient_clipping=clip)
    config["infinity"].update(SCHEDULES[schedule])
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        for x in _batches(4):
            loss = loss_of(engine(input_ids=x, labels=x))
            engine.backward(loss)
            engine.step()
            torch.testing.assert_close(loss, reference_step(reference, ref_opt, x, clip),
                                       rtol=1e-5, atol=1e-6)
        assert infinity.native_info()["in_use"]["adam_kernel"] == "torch on cuda"
        assert_same_parameters(model, reference)
    finally:
        engine.close()
