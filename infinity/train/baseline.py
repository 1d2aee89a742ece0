"""The baseline path of ``infinity train --engine torch``: plain PyTorch, every state in memory.

Why it exists: it is the reference the engine is compared against (same model, data, seed and
hyperparameters; ``torch.optim.AdamW(fused=True)``, the fastest CPU AdamW measured in
shared/peers/RESULTS.md), and a real option for models that fit in memory. It offers the engine
methods the training loop uses (``train``, call, ``backward``, ``step``, ``step_stats``,
``get_lr``, ``close``) and reads the same ds_config sections (optimizer, scheduler, gradient
clipping, gradient accumulation); ZeRO and offload sections have no effect on it.

[Note: the baseline's compute dtype]
The baseline computes in the engine's compute dtype, chosen by the same rule
(``infinity.planner.placement.compute_dtype_choice``: an explicit ``infinity.compute_dtype``,
else "auto", which is bf16 on a CPU that multiplies bf16 natively): a comparison of the two
engines is then one of the same arithmetic. In bf16 it runs the engine's recipe in plain torch:
the parameters are bf16 (forward and backward in bf16), each has an fp32 master that AdamW steps
(its gradient is the bf16 gradient widened, clipped over the masters), and the parameters are
rounded from the masters after each step -- what tests/integration/test_cpu_bf16_compute.py
holds the engine to. Buffers stay as built, as in the engine; floating inputs are cast to bf16
when "auto" chose it, as the engine casts them. fp16 (loss-scaled) is not reproduced: it runs
fp32, with a warning.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.config import InfinityConfig
from infinity.config.optimizer import MISSING_OPTIMIZER
from infinity.engine.model_methods import model_device
from infinity.optim.schedules import build_scheduler

_log = get_logger("train.baseline")


def baseline_compute_dtype(config: InfinityConfig) -> torch.dtype:
    """The dtype the baseline computes in (see [Note: the baseline's compute dtype])."""
    from infinity.planner.inputs import detect_hardware
    from infinity.planner.placement import compute_dtype_choice

    name, why = compute_dtype_choice(config, detect_hardware())
    if name == "fp16":
        _log.warning("torch baseline: compute dtype fp16 (%s) is not reproduced (no loss "
                     "scaling here): it computes in fp32", why)
        return torch.float32
    _log.info("torch baseline: compute dtype %s (%s)", name, why)
    return torch.bfloat16 if name == "bf16" else torch.float32


class TorchBaselineEngine:
    """Trains ``model`` with torch AdamW; the whole model, gradients and moments stay in memory."""

    def __init__(self, model: nn.Module, config: InfinityConfig) -> None:
        self.module = model
        self.config = config
        self.device = model_device(model)    # where the batches go (train/loop.py)
        opt = config.optimizer
        if opt is None:
            raise ValueError(MISSING_OPTIMIZER.format(call="the run"))
        if not opt.bias_correction:
            # torch's Adam always corrects: the comparison run would differ from step 2
            raise ValueError("optimizer.params.bias_correction = false: torch's Adam/AdamW "
                             "always correct the bias, so the --engine torch run cannot be "
                             "the same run; remove the key (or set it true) to compare")
        params = [p for p in model.parameters() if p.requires_grad]
        self.compute_dtype = baseline_compute_dtype(config)
        self._cast_inputs = config.infinity.compute_dtype == "auto" and \
            self.compute_dtype != torch.float32
        self._params = params
        self._masters: list[torch.Tensor] | None = None
        if self.compute_dtype != torch.float32:
            # fp32 masters taken before any rounding, then the model's parameters in bf16
            self._masters = [p.detach().clone().float() for p in params]
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.to(self.compute_dtype)
        # Adam with decoupled weight decay is AdamW; plain Adam (adam_w_mode off) is L2 decay.
        cls = torch.optim.AdamW if opt.adam_w_mode else torch.optim.Adam
        self.optimizer = cls(self._masters if self._masters is not None else params, lr=opt.lr,
                             betas=tuple(opt.betas), eps=opt.eps,
                             weight_decay=opt.weight_decay, fused=True)
        self.lr_scheduler = build_scheduler(config, self.optimizer, None)
        self._accumulation = config.gradient_accumulation_steps or 1
        self.micro_steps = 0
        self.global_steps = 0
        self._phase = {"compute_s": 0.0, "optimizer_s": 0.0}
        self._step_started: float | None = None
        self._last_stats: dict[str, float] = {}

    # -- the engine methods the loop uses ----------------------------------------------------
    def train(self, mode: bool = True) -> "TorchBaselineEngine":
        self.module.train(mode)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._step_started is None:
            self._step_started = time.perf_counter()
        start = time.perf_counter()
        if self._cast_inputs:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        out = self.module(*args, **kwargs)
        self._phase["compute_s"] += time.perf_counter() - start
        return out

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` scaled by 1/gradient_accumulation_steps (the engine's rule)."""
        start = time.perf_counter()
        if self._accumulation > 1:
            loss = loss / self._accumulation
        loss.backward()
        self._phase["compute_s"] += time.perf_counter() - start

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary clip, step AdamW and the schedule."""
        self.micro_steps += 1
        if self.micro_steps % self._accumulation:
            return
        start = time.perf_counter()
        stepped = self._params
        if self._masters is not None:   # the bf16 gradients, widened, are the masters'
            for master, p in zip(self._masters, self._params):
                master.grad = None if p.grad is None else p.grad.float()
                p.grad = None
            stepped = self._masters
        if self.config.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(stepped, self.config.gradient_clipping)
        self.optimizer.step()
        if self._masters is not None:
            with torch.no_grad():
                for master, p in zip(self._masters, self._params):
                    p.copy_(master)
        held = self._held_bytes()  # parameters, gradients and moments, before the grads go
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        end = time.perf_counter()
        self._phase["optimizer_s"] += end - start
        self.global_steps += 1
        self._last_stats = {
            "step_s": end - (self._step_started or start),
            "compute_s": self._phase["compute_s"], "io_wait_s": 0.0,
            "optimizer_s": self._phase["optimizer_s"], "comm_s": 0.0,
            "device_bytes": held, "host_bytes": 0, "nvme_bytes": 0,
            "io_read_bytes": 0, "io_write_bytes": 0,
        }
        self._phase = {"compute_s": 0.0, "optimizer_s": 0.0}
        self._step_started = None

    def step_stats(self) -> dict[str, float]:
        """Timings and bytes of the last optimizer step, with the engine's keys."""
        return dict(self._last_stats)

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def save_pretrained(self, directory: str) -> None:
        """The model as ``from_pretrained`` loads it: in fp32, from the masters when it computes
        in bf16 (as the engine exports a stage-3 model), its bf16 copy otherwise lost."""
        if self._masters is None:
            self.module.save_pretrained(directory)
            return
        computed = {p: p.data for p in self.module.parameters()}
        masters = {p: m for p, m in zip(self._params, self._masters)}
        try:
            for p in computed:
                p.data = masters[p] if p in masters else p.data.float()
            self.module.save_pretrained(directory)
        finally:
            for p, data in computed.items():
                p.data = data

    def close(self) -> None:
        """Nothing on disk to remove; drop the optimizer states."""
        self.optimizer.state.clear()

    def _cast(self, value: Any) -> Any:
        return value.to(self.compute_dtype) if isinstance(value, torch.Tensor) and \
            value.is_floating_point() else value

    def _held_bytes(self) -> int:
        """Parameters (and fp32 masters), gradients and optimizer moments held (all in the
        DEVICE tier here)."""
        total = 0
        for p in [*self.module.parameters(), *(self._masters or [])]:
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
        for param, state in self.optimizer.state.items():
            for value in state.values():  # the moments; not the per-parameter step counters
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    total += value.numel() * value.element_size()
        return total
