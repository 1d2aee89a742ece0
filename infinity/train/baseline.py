"""The baseline path of ``infinity train --engine torch``: plain PyTorch, every state in memory.

Why it exists: it is the reference the engine is compared against (same model, data, seed and
hyperparameters; ``torch.optim.AdamW(fused=True)``, the fastest CPU AdamW measured in
shared/peers/RESULTS.md), and a real option for models that fit in memory. It offers the engine
methods the training loop uses (``train``, call, ``backward``, ``step``, ``step_stats``,
``get_lr``, ``close``) and reads the same ds_config sections (optimizer, scheduler, gradient
clipping, gradient accumulation); ZeRO and offload sections have no effect on it.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.config.optimizer import MISSING_OPTIMIZER
from infinity.optim.schedules import build_scheduler


class TorchBaselineEngine:
    """Trains ``model`` with torch AdamW; the whole model, gradients and moments stay in memory."""

    def __init__(self, model: nn.Module, config: InfinityConfig) -> None:
        self.module = model
        self.config = config
        opt = config.optimizer
        if opt is None:
            raise ValueError(MISSING_OPTIMIZER.format(call="the run"))
        params = [p for p in model.parameters() if p.requires_grad]
        # Adam with decoupled weight decay is AdamW; plain Adam (adam_w_mode off) is L2 decay.
        cls = torch.optim.AdamW if opt.adam_w_mode else torch.optim.Adam
        self.optimizer = cls(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
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
        if self.config.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.gradient_clipping)
        self.optimizer.step()
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

    def close(self) -> None:
        """Nothing on disk to remove; drop the optimizer states."""
        self.optimizer.state.clear()

    def _held_bytes(self) -> int:
        """Parameters, gradients and optimizer moments held (all in the DEVICE tier here)."""
        total = 0
        for p in self.module.parameters():
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
        for param, state in self.optimizer.state.items():
            for value in state.values():  # the moments; not the per-parameter step counters
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    total += value.numel() * value.element_size()
        return total
