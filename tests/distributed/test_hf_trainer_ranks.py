"""infinity's Trainer at 2 gloo ranks (one sample per rank and micro-batch, accumulation 2):
the losses, grad norms and learning rates the plain Trainer logs on one rank with the same
global batch (accumulation 4); save_model reloads to the engine's logits; a run resumed at 2
ranks from a Trainer checkpoint continues the interrupted run's losses. And epochs of any
length: 17 examples, batch 2 per rank, accumulation 2, 2 epochs (5 micro-batches a rank an
epoch: each epoch's 3rd step is one micro-batch) take the steps, losses, grad norms, rates and
final weights of the plain Trainer at the same 2 ranks (DDP), in the same processes."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from hf_common import close_rel, hf_args, hf_data, logged
from parity import make_model
from ranks import check_ranks, launch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.distributed


def test_two_ranks_train_save_resume_and_end_short_epochs_as_the_plain_trainer(
        disk_dir, tmp_path) -> None:
    check_ranks(launch(2, "hf_trainer_worker.py", [str(tmp_path), str(disk_dir)], timeout=300))
    ranks2 = json.loads((tmp_path / "train.json").read_text())
    resumed = json.loads((tmp_path / "resume.json").read_text())
    epochs = json.loads((tmp_path / "epochs.json").read_text())
    assert epochs["steps"] == [6, 6]
    for key in ("loss", "grad_norm"):
        close_rel(logged(epochs["ours"], key), logged(epochs["plain"], key), 1e-5)
    assert logged(epochs["ours"], "learning_rate") == pytest.approx(
        logged(epochs["plain"], "learning_rate"), rel=1e-12)
    assert epochs["weights_max_diff"] <= 1e-6

    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    plain = transformers.Trainer(
        model=make_model("llama", layers=2, width=32), train_dataset=hf_data(48),
        eval_dataset=hf_data(8, seed=1),
        args=transformers.TrainingArguments(
            tmp_path / "plain", **hf_args(per_device_train_batch_size=1,
                                          gradient_accumulation_steps=4, max_steps=12,
                                          eval_steps=6)))
    plain.train()
    close_rel(logged(ranks2, "loss"), logged(plain, "loss"), 1e-5)
    close_rel(logged(ranks2, "grad_norm"), logged(plain, "grad_norm"), 1e-5)
    assert logged(ranks2, "learning_rate") == pytest.approx(logged(plain, "learning_rate"),
                                                            rel=1e-12)
    close_rel([h["eval_loss"] for h in ranks2 if "eval_loss" in h],
           [h["eval_loss"] for h in plain.state.log_history if "eval_loss" in h], 1e-5)
    close_rel(logged(resumed, "loss", after=6), logged(ranks2, "loss", after=6), 1e-5)
    close_rel(logged(resumed, "grad_norm", after=6), logged(ranks2, "grad_norm", after=6), 1e-5)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    x = torch.stack([d["input_ids"] for d in hf_data(8, seed=1)])
    with torch.no_grad():
        theirs = reloaded(input_ids=x).logits
    ours = load_file(tmp_path / "logits.safetensors")["logits"]
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
