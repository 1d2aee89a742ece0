"""Epochs of any length (issue 37): an epoch whose micro-batches are not a multiple of the
accumulation ends, in transformers' Trainer, with a shorter optimizer step (its loss scaled by
that step's own item count, ``num_items_in_batch``). infinity's Trainer takes the same steps
(17 examples, batch 2, accumulation 2, 2 epochs: 9 micro-batches an epoch, the 5th step of one
micro-batch of one example), with the same losses, grad norms, rates and final weights, and a
Trainer checkpoint at each epoch end (after the short step). Beneath it, the engine's
``set_gradient_accumulation_boundary``: a cycle ended early is the step plain torch takes over
its micro-batches, and a boundary changed between backward and step is refused. (2 ranks:
test_hf_trainer_ranks.py, against the plain Trainer at 2 ranks.)"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import infinity
from hf_common import EPOCHS_ARGS, close_rel, hf_args, hf_data, hf_ds, logged
from parity import assert_same_parameters, make_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("infinity.integrations.hf")


def test_an_epoch_not_a_multiple_of_the_accumulation_ends_with_the_plain_trainers_short_step(
        disk_dir, tmp_path) -> None:
    warnings.filterwarnings("ignore")
    data = hf_data(17)
    args = hf_args(**EPOCHS_ARGS)
    model = make_model("llama", layers=2, width=32)
    plain = transformers.Trainer(
        model=copy.deepcopy(model), train_dataset=data,
        args=transformers.TrainingArguments(tmp_path / "plain", **args))
    plain.train()
    assert plain.state.global_step == 10

    trainer = hf.Trainer(
        model=model, train_dataset=data,
        args=hf.TrainingArguments(tmp_path / "run", deepspeed=hf_ds(disk_dir),
                                  **{**args, "save_strategy": "epoch"}))
    try:
        trainer.train()
        assert trainer.state.global_step == trainer.engine.global_steps == 10
        close_rel(logged(trainer, "loss"), logged(plain, "loss"), 1e-5)
        close_rel(logged(trainer, "grad_norm"), logged(plain, "grad_norm"), 1e-5)
        assert logged(trainer, "learning_rate") == pytest.approx(logged(plain, "learning_rate"),
                                                                  rel=1e-12)
        ours = trainer.engine.module_state_dict()
        for name, theirs in plain.model.state_dict().items():
            assert torch.allclose(ours[name], theirs, rtol=1e-5, atol=1e-6), \
                (name, (ours[name] - theirs).abs().max())
    finally:
        trainer.close()
    # the checkpoint after the first epoch's short step (a checkpoint is taken at a boundary)
    assert (tmp_path / "run" / "checkpoint-5" / "latest").is_file()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 16), nn.Linear(16, 16)])
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def _cycle_config(disk_dir, offload_param: dict) -> dict:
    """Accumulation 3 of 4-sample micro-batches, stage 3, the optimizer on NVMe, fp32."""
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_param": offload_param,
                                  "offload_optimizer": {"device": "nvme",
                                                        "nvme_path": str(disk_dir)}},
            "infinity": {"compute_dtype": "fp32"}}


def test_a_cycle_ended_early_is_the_step_torch_takes_over_its_micro_batches(disk_dir) -> None:
    """Accumulation 3; cycles of 2 (ended by set_gradient_accumulation_boundary(True)), then 3
    (counted again after None): the weights of torch's AdamW over the summed gradients of each
    cycle; micro_steps counts the short cycle as a whole one."""
    config = _cycle_config(disk_dir, {"device": "nvme", "nvme_path": str(disk_dir)})
    torch.manual_seed(0)
    reference = _Net()
    batches = [torch.randn(4, 4) for _ in range(5)]
    engine, *_ = infinity.initialize(model=copy.deepcopy(reference), config=config)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    try:
        for cycle in (batches[:2], batches[2:]):
            for i, x in enumerate(cycle):
                if len(cycle) == 2:
                    engine.set_gradient_accumulation_boundary(i == len(cycle) - 1)
                engine(x).square().mean().backward()
                engine.step()
                reference(x).square().mean().backward()
            engine.set_gradient_accumulation_boundary(None)
            plain.step()
            plain.zero_grad()
            assert engine.micro_steps == 3 * engine.global_steps
        assert engine.global_steps == 2
        params = list(engine.module.parameters())
        with infinity.zero.GatheredParameters(params):
            for ours, theirs in zip(params, reference.parameters()):
                assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7), \
                    (ours - theirs).abs().max()

        engine(batches[0]).square().mean().backward()      # not a boundary: counted 1 of 3
        engine.set_gradient_accumulation_boundary(True)     # for a next backward: accepted
        with pytest.raises(RuntimeError, match=r"step\(\) at the end of an accumulation cycle "
                                               r"whose last backward ran as not the last"):
            engine.step()                                   # but that backward was not the last
        assert engine.global_steps == 2 and engine.micro_steps == 6
        engine.set_gradient_accumulation_boundary(False)    # as it ran: the step counts it
        engine.step()
        assert engine.micro_steps == 7
        engine.set_gradient_accumulation_boundary(True)
        engine(batches[1]).square().mean().backward()       # the last: stepped at step()
        with pytest.raises(RuntimeError, match=r"set_gradient_accumulation_boundary\(False\) "
                                               r"between backward\(\) and step\(\): that "
                                               r"backward ran as the last"):
            engine.set_gradient_accumulation_boundary(False)
        engine.step()
        assert engine.global_steps == 3
    finally:
        engine.close()


def test_deepspeed_s_step_once_style_is_torch_s_step_over_the_cycle(disk_dir) -> None:
    """DeepSpeed documents a second style: each micro-batch's backward with the boundary set
    (False, ..., True before the last one's forward) and one ``step()`` after them all. It
    was refused at the True ("set it before the forward", where it was). The weights are
    torch AdamW's over the summed gradients; a False under the early step, where each
    backward steps the weights, is refused (every micro-batch trained as a step of its own)."""
    config = _cycle_config(disk_dir, {"device": "cpu"})
    torch.manual_seed(0)
    reference = _Net()
    batches = [torch.randn(4, 4) for _ in range(6)]
    engine, *_ = infinity.initialize(model=copy.deepcopy(reference), config=config)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    try:
        for cycle in (batches[:3], batches[3:]):
            for i, x in enumerate(cycle):
                engine.set_gradient_accumulation_boundary(i == len(cycle) - 1)
                engine.backward(engine(x).square().mean())
                reference(x).square().mean().div(3).backward()
            engine.step()
            plain.step()
            plain.zero_grad()
        assert engine.global_steps == 2
        assert_same_parameters(engine.module, reference, rtol=1e-5, atol=1e-7)
    finally:
        engine.close()

    config["gradient_accumulation_steps"] = 1       # the early step: each backward steps
    config["train_micro_batch_size_per_gpu"] = 4
    engine, *_ = infinity.initialize(model=_Net(), config=config)
    try:
        assert engine.optimizer.early_step
        with pytest.raises(RuntimeError, match=r"set_gradient_accumulation_boundary\(False\) "
                                               r"under the early step"):
            engine.set_gradient_accumulation_boundary(False)
        engine.set_gradient_accumulation_boundary(True)     # what it is: accepted
    finally:
        engine.close()
