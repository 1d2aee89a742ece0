"""Shared by the Trainer tests and their rank worker: the data, the arguments both Trainers
(plain and infinity's) get, and the ds_config of "auto" values."""
from __future__ import annotations

import torch

from parity import VOCAB

STEPS = 20
# epochs of any length: 17 examples, batch 2, accumulation 2, 2 epochs (at one rank 9
# micro-batches an epoch, its 5th optimizer step of one micro-batch)
EPOCHS_ARGS = dict(max_steps=-1, num_train_epochs=2, eval_strategy="no")


def hf_data(count: int = 80, seed: int = 0) -> list[dict]:
    """Arithmetic runs of tokens (a start, a stride of 1-3): something to learn."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count, 1), generator=gen)
    strides = torch.randint(1, 4, (count, 1), generator=gen)
    rows = (starts + strides * torch.arange(16)) % VOCAB
    return [{"input_ids": t, "labels": t} for t in rows]


def hf_args(**extra) -> dict:
    """TrainingArguments of both Trainers: accumulation 2, evaluation every 5 steps, warm-up
    then linear decay, weight decay, the default clipping (max_grad_norm 1.0)."""
    args = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                learning_rate=1e-2, weight_decay=0.1, warmup_steps=3, lr_scheduler_type="linear",
                logging_steps=1, eval_strategy="steps", eval_steps=5, save_strategy="no",
                optim="adamw_torch", seed=0, use_cpu=True, report_to=[], disable_tqdm=True)
    return {**args, **extra}


def hf_ds(nvme_path, **extra) -> dict:
    """Stage 3, parameters and optimizer on NVMe; batch sizes and clipping from the Trainer."""
    path = str(nvme_path)
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path},
                                "offload_optimizer": {"device": "nvme", "nvme_path": path}},
          **extra}
    # the plain Trainer computes in fp32: so do we, even on a CPU with native bf16 ("auto")
    ds["infinity"] = {"compute_dtype": "fp32", **ds.get("infinity", {})}
    return ds


def logged(trainer_or_history, key: str, after: int = 0) -> list[float]:
    """``key`` of each training log entry after step ``after`` (a Trainer or its log_history)."""
    history = getattr(getattr(trainer_or_history, "state", None), "log_history",
                      trainer_or_history)
    return [h[key] for h in history if key in h and "loss" in h and h["step"] > after]


def close_rel(ours: list[float], theirs: list[float], rel: float) -> None:
    """Each of ``ours`` within ``rel`` (relative) of the same entry of ``theirs``, as many."""
    assert len(ours) == len(theirs) and ours, (ours, theirs)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= rel * abs(b), (ours, theirs)
