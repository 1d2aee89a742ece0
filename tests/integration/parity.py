"""Shared helpers of the engine parity tests: small random-init models and a lock-step runner
that trains a model with infinity and a deep copy with plain PyTorch AdamW on the same batches."""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

VOCAB = 256


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A plain torch language model (no transformers): embedding, blocks, tied head."""

    def __init__(self, width: int = 32, depth: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                           labels[:, 1:].reshape(-1))
        return loss


def make_model(family: str, seed: int = 0, layers: int = 3, width: int = 32) -> nn.Module:
    """A small random-init model of ``family``: torch, llama, gpt2 or qwen2."""
    torch.manual_seed(seed)
    if family == "torch":
        return TinyLM(width=width, depth=layers)
    import transformers

    warnings.filterwarnings("ignore")
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                       intermediate_size=2 * width, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128, **common)
        return transformers.LlamaForCausalLM(cfg)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      **common)
        return transformers.GPT2LMHeadModel(cfg)
    if family == "qwen2":
        cfg = transformers.Qwen2Config(num_hidden_layers=layers, hidden_size=width,
                                       intermediate_size=2 * width, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128, **common)
        return transformers.Qwen2ForCausalLM(cfg)
    raise ValueError(family)


def loss_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def half_recipe_losses(model: nn.Module, batches: list[torch.Tensor], lr: float,
                       weight_decay: float, dtype: torch.dtype = torch.bfloat16,
                       loss_scale: float = 1.0) -> list[float]:
    """torch running the engine's 16-bit recipe: forward and backward in ``dtype`` (bf16 or
    fp16), fp32 master weights (taken before any rounding) stepped by AdamW on the gradients
    unscaled in fp32 (fp16's static ``loss_scale``: the loss is multiplied before the backward),
    the 16-bit parameters rounded from the masters after each step; one step per batch.
    ``model`` is left as it was; the batches may be on the model's device."""
    masters = [p.detach().clone() for p in model.parameters()]
    compute = copy.deepcopy(model).to(dtype)
    params = list(compute.parameters())                           # same order, ties kept
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay, foreach=False)
    losses = []
    for x in batches:
        loss = loss_of(compute(input_ids=x, labels=x))
        (loss * loss_scale).backward()
        for master, p in zip(masters, params):
            master.grad = p.grad.float() / loss_scale
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, params):
                p.copy_(master)
        losses.append(loss.item())
    return losses


def state_bytes(model: nn.Module) -> int:
    """fp32 model states: parameter + gradient + Adam m and v = 16 bytes per parameter."""
    return 16 * sum(p.numel() for p in model.parameters())


@dataclass
class ParityResult:
    losses: list[float]
    ref_losses: list[float]
    engine: object

    @property
    def worst_relative(self) -> float:
        """The largest |loss - torch's| / |torch's| over the steps; inf where a loss is not
        finite (``max`` skips a NaN, as every comparison with it is False: a run whose loss
        went NaN after its first step scored that step's error, and passed)."""
        if not all(math.isfinite(a) for a in self.losses):
            return math.inf
        return max(abs(a - b) / abs(b) for a, b in zip(self.losses, self.ref_losses))


def run_parity(model: nn.Module, ds_config: dict, steps: int = 20, seq: int = 16, batch: int = 2,
               lr: float = 1e-3, weight_decay: float = 0.01, clip: float = 0.0,
               accumulation: int = 1, seed: int = 1, close: bool = True,
               schedule: dict | None = None,
               prepare: Callable[[Any], None] | None = None) -> ParityResult:
    """Train ``model`` with infinity and a copy with torch AdamW(foreach=False) in lock step;
    ``schedule`` (a ds_config "scheduler" section) drives both optimizers' lr and betas;
    ``prepare`` is called with the engine before the first step (to instrument it)."""
    import infinity
    from infinity.config import InfinityConfig
    from infinity.optim.schedules import build_scheduler

    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=weight_decay,
                                foreach=False)
    ref_sched = None if schedule is None else build_scheduler(
        InfinityConfig.from_dict({"scheduler": schedule}), ref_opt, None)
    ds = copy.deepcopy(ds_config)
    if schedule is not None:
        ds["scheduler"] = schedule
    ds.setdefault("optimizer", {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}})
    ds.setdefault("train_micro_batch_size_per_gpu", batch)
    ds["gradient_accumulation_steps"] = accumulation
    ds["gradient_clipping"] = clip
    pin_fp32(ds)
    engine, _, _, _ = infinity.initialize(model=model, config=ds)
    if prepare is not None:
        prepare(engine)
    gen = torch.Generator().manual_seed(seed)
    # a few fixed random sequences, so that the loss visibly falls as the model memorises them
    pool = torch.randint(0, VOCAB, (4, batch, seq), generator=gen)
    losses, ref_losses = [], []
    try:
        for _ in range(steps):
            step_losses, step_ref = [], []
            for _ in range(accumulation):
                x = pool[int(torch.randint(0, len(pool), (1,), generator=gen))]
                loss = loss_of(engine(input_ids=x, labels=x))
                engine.backward(loss)
                engine.step()
                ref_loss = loss_of(reference(input_ids=x, labels=x))
                (ref_loss / accumulation).backward()
                step_losses.append(loss.item())
                step_ref.append(ref_loss.item())
            if clip:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad()
            if ref_sched is not None:
                ref_sched.step()
            losses.append(sum(step_losses) / accumulation)
            ref_losses.append(sum(step_ref) / accumulation)
    finally:
        if close:
            engine.close()
    return ParityResult(losses, ref_losses, engine)


def pin_fp32(ds: dict) -> dict:
    """``ds`` (changed in place) computing in fp32 unless it names a compute dtype: parity with
    fp32 torch at fp32 tolerances needs fp32 compute, which "auto" is not on a CPU with native
    bf16 (see infinity/base/cpu_bf16.py)."""
    ds.setdefault("infinity", {}).setdefault("compute_dtype", "fp32")
    return ds


ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}
"""The optimizer section of tests that train with AdamW at lr 1e-3 and no weight decay (a config
without an optimizer section, and no optimizer passed, is refused)."""


def with_adamw(ds: dict) -> dict:
    """``ds`` with the ``ADAMW`` optimizer section unless it has one."""
    return {"optimizer": copy.deepcopy(ADAMW), **ds}


def zero_config(stage: int, param: str, optimizer: str, nvme_path: str, **infinity_section) -> dict:
    z = {"stage": stage, "offload_optimizer": {"device": optimizer}}
    if optimizer == "nvme":
        z["offload_optimizer"]["nvme_path"] = nvme_path
    if stage == 3:
        z["offload_param"] = {"device": param}
        if param == "nvme":
            z["offload_param"]["nvme_path"] = nvme_path
    infinity_section.setdefault("compute_dtype", "fp32")    # see pin_fp32
    return {"zero_optimization": z, "infinity": infinity_section}


def nvme_engine(disk_dir, early_step: str, layers: int, **zero_extra):
    """A small Llama (seed 0) under stage 3 with parameters and optimizer on NVMe, AdamW lr 1e-3;
    ``zero_extra`` goes into the zero_optimization section."""
    import infinity

    torch.manual_seed(0)
    model = make_model("llama", layers=layers, width=64)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step=early_step)
    ds["zero_optimization"].update(zero_extra)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    return engine


def checkpoint_engine(disk_dir, offload: str = "nvme", steps: int = 2):
    """The checkpoint tests' engine: a 2-layer Llama at stage 3 with parameters and optimizer
    on ``offload``, AdamW lr 1e-3, trained ``steps`` steps on random tokens (seed 1)."""
    import infinity

    ds = zero_config(3, offload, offload, str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    train_random(engine, steps)
    return engine


def train_random(engine, steps: int, seed: int = 1) -> list[float]:
    """``steps`` engine steps on random (2, 16) token batches drawn from ``seed``; the losses."""
    gen = torch.Generator().manual_seed(seed)
    return train_steps(engine, [torch.randint(0, VOCAB, (2, 16), generator=gen)
                                for _ in range(steps)])


def engine_and_reference(model: nn.Module, ds_config: dict, lr: float = 1e-3,
                         weight_decay: float = 0.01):
    """``model`` under infinity with AdamW(lr, weight_decay), and an un-offloaded copy of it
    with torch AdamW(foreach=False): (engine, reference, ref_opt), for lock-step tests."""
    import infinity

    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=weight_decay,
                                foreach=False)
    ds = copy.deepcopy(ds_config)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}}
    pin_fp32(ds)
    engine, *_ = infinity.initialize(model=model, config=ds)
    return engine, reference, ref_opt


def train_steps(engine, batches) -> list[float]:
    """One engine step per batch (labels = inputs); the losses."""
    losses = []
    for x in batches:
        loss = loss_of(engine(input_ids=x, labels=x))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def accumulating_micro_steps(engine, reference: nn.Module, batches: list[torch.Tensor]) -> None:
    """One step's micro-batches in lock step: each through the engine (backward and
    ``engine.step()``, which counts micro-steps) and through ``reference``, its loss divided by
    their number as ``engine.backward`` divides it; the losses equal within 1e-5. The caller
    steps the reference's optimizer."""
    for x in batches:
        loss = loss_of(engine(input_ids=x, labels=x))
        engine.backward(loss)
        engine.step()
        ref_loss = loss_of(reference(input_ids=x, labels=x))
        (ref_loss / len(batches)).backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


def assert_same_parameters(model: nn.Module, reference: nn.Module, rtol: float = 1e-5,
                           atol: float = 1e-5) -> None:
    """Every parameter of ``model`` (an engine's, gathered) equals ``reference``'s."""
    import infinity

    mine = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        with infinity.zero.GatheredParameters([mine[name]]):
            torch.testing.assert_close(mine[name], param, rtol=rtol, atol=atol)


def reference_step(reference: nn.Module, ref_opt, x: torch.Tensor, clip: float) -> torch.Tensor:
    """One torch step of the un-offloaded copy on batch ``x`` (labels = inputs), with global-norm
    clipping when ``clip``; its loss."""
    ref_loss = loss_of(reference(input_ids=x, labels=x))
    ref_loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    ref_opt.step()
    ref_opt.zero_grad()
    return ref_loss


def backward_both(engine, reference: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward and backward of batch ``x`` (labels = inputs) through the engine and the torch
    reference; their losses must agree (1e-5). Returns the engine's loss."""
    loss = loss_of(engine(input_ids=x, labels=x))
    engine.backward(loss)
    ref_loss = loss_of(reference(input_ids=x, labels=x))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    return loss


class ArmedBackwardHook:
    """A backward pre-hook that acts once, in the backward it is armed for: raises ``error`` or
    multiplies the output gradients by ``factor`` (inf: an overflow)."""

    def __init__(self, error: str | None = None, factor: float | None = None) -> None:
        self.error, self.factor = error, factor
        self.armed = False

    def __call__(self, module, grad_output):
        if not self.armed:
            return None
        self.armed = False
        if self.error is not None:
            raise RuntimeError(self.error)
        return tuple(g * self.factor if g is not None else None for g in grad_output)
