"""One rank of test_hf_trainer_ranks.py: infinity's Trainer at 2 gloo ranks (one sample per
rank per micro-batch, accumulation 2), started by ranks.launch as torchrun would.

argv: out_dir nvme_dir
First 12 steps, a Trainer checkpoint at step 6, save_model to out/saved; rank 0 writes
out/train.json (log history) and out/logits.safetensors (the engine's eval logits). Then, in
the same processes, a fresh model resumed from out/run/checkpoint-6; rank 0 writes
out/resume.json. Then epochs of any length: the plain transformers Trainer (DDP over the same
gloo ranks) and infinity's, 17 examples, batch 2 per rank, accumulation 2, 2 epochs; rank 0
writes out/epochs.json (both log histories, the largest difference of the final weights).
"""
from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from hf_common import EPOCHS_ARGS, hf_args, hf_data, hf_ds
from infinity.integrations.hf import Trainer, TrainingArguments
from parity import make_model

STEPS = 12


def main() -> None:
    warnings.filterwarnings("ignore")
    out, nvme = Path(sys.argv[1]), sys.argv[2]
    run(out, nvme, "train")
    run(out, nvme, "resume")
    epochs(out, nvme)


def run(out: Path, nvme: str, mode: str) -> None:
    data, evals = hf_data(48), hf_data(8, seed=1)
    model = make_model("llama", layers=2, width=32)
    run = out / ("run" if mode == "train" else "resumed")
    args = TrainingArguments(run, deepspeed=hf_ds(nvme, infinity={"collective_timeout": 120}),
                             **hf_args(per_device_train_batch_size=1, max_steps=STEPS,
                                       eval_steps=6, save_strategy="steps", save_steps=6))
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=evals)
    try:
        if mode == "train":
            trainer.train()
            trainer.save_model(out / "saved")
            engine = trainer.engine.eval()
            with torch.no_grad():
                logits = engine(input_ids=torch.stack([d["input_ids"] for d in evals])).logits
        else:
            trainer.train(resume_from_checkpoint=str(out / "run" / "checkpoint-6"))
        if trainer.args.process_index == 0:
            (out / f"{mode}.json").write_text(json.dumps(trainer.state.log_history))
            if mode == "train":
                save_file({"logits": logits.contiguous()}, out / "logits.safetensors")
    finally:
        trainer.close()


def epochs(out: Path, nvme: str) -> None:
    data, model = hf_data(17), make_model("llama", layers=2, width=32)
    args = hf_args(**EPOCHS_ARGS)
    plain = transformers.Trainer(model=copy.deepcopy(model), train_dataset=data,
                                 args=transformers.TrainingArguments(out / "plain", **args))
    plain.train()
    trainer = Trainer(model=model, train_dataset=data, args=TrainingArguments(
        out / "epochs", deepspeed=hf_ds(nvme, infinity={"collective_timeout": 120}), **args))
    try:
        trainer.train()
        ours = trainer.engine.module_state_dict()        # every rank gathers
        if trainer.args.process_index == 0:
            diff = max((ours[n] - p).abs().max().item()
                       for n, p in plain.model.state_dict().items())
            (out / "epochs.json").write_text(json.dumps(
                {"plain": plain.state.log_history, "ours": trainer.state.log_history,
                 "steps": [plain.state.global_step, trainer.engine.global_steps],
                 "weights_max_diff": diff}))
    finally:
        trainer.close()
    # the group transformers made is the script's to destroy (infinity destroys only its own)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
