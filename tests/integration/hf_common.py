"""Shared by the Hugging Face tests and their rank workers: for the Trainer tests, the data, the
arguments both Trainers (plain and infinity's) get, and the ds_config of "auto" values; for the
pretrained tests (tests/integration/test_hf_pretrained.py,
tests/distributed/test_hf_pretrained_ranks.py), small models saved by transformers, loaded back
by it, and their weights and logits."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from parity import VOCAB, make_model

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


# -- Hub directories written and read by transformers (the pretrained tests) ---------------------

SHARD = "40KB"        # the small models below come out as 5 to 20 shards


def quiet_transformers():
    """transformers, its warnings and logging quietened."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_saved(directory: Path, family: str = "llama", dtype: torch.dtype | None = None,
             shard: str = SHARD, **kwargs) -> Path:
    """A small random ``family`` model saved by transformers into ``directory/src``."""
    quiet_transformers()
    model = make_model(family, layers=kwargs.pop("layers", 3), width=kwargs.pop("width", 64),
                       **kwargs)
    if dtype is not None:
        model = model.to(dtype)
    src = directory / "src"
    model.save_pretrained(src, max_shard_size=shard)
    return src


def hf_load(path: Path, **kwargs):
    """transformers' own ``from_pretrained`` of ``path``, in eval mode."""
    return quiet_transformers().AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def weights_in(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory``, by name."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    """``model``'s logits of the token ids ``x``, without gradients."""
    with torch.no_grad():
        return model(input_ids=x).logits


def hf_moe(directory: Path, family: str) -> Path:
    """A small random MoE saved by transformers in the Hub layout (experts one by one)."""
    transformers = quiet_transformers()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, output_router_logits=True,
                  router_aux_loss_coef=0.02)       # the loss includes the router's
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=4, num_experts_per_tok=2, **common))
    elif family == "phimoe":        # renames too: block_sparse_moe -> mlp, gate -> router
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
            input_jitter_noise=0.0, **common))     # no noise: two runs route alike
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=64, **common))
    src = directory / family
    model.save_pretrained(src, max_shard_size="60KB")     # experts of a layer across shards
    return src
