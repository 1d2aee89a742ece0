"""What the engine reports of each optimizer step by itself, as DeepSpeed's engine does: the
events of the config's monitor sections (``tensorboard``, ``csv_monitor``, ``wandb``), the
progress line every ``steps_per_print`` steps and, with ``wall_clock_breakdown``, the forward /
backward / step times.

Why a module: the engine only hands over numbers at the end of a step (``StepReport``); which
libraries are loaded, where their files go and what DeepSpeed calls each event is here.

The events, DeepSpeed's names, each at x = the samples trained so far (``global_samples``),
written by rank 0 alone:
- ``Train/Samples/train_loss``: the step's loss, the sum over its micro-batches of the loss
  each backward was given divided by the accumulation steps (the mean micro-batch loss), on
  rank 0, as DeepSpeed keeps it;
- ``Train/Samples/lr``: the first param group's learning rate the step used (DeepSpeed writes
  it after its scheduler moved on: the next step's);
- ``Train/Samples/loss_scale``: the fp16 loss scale after the step (fp16 runs only);
- with ``wall_clock_breakdown``, ``Train/Samples/elapsed_time_ms_{forward,backward,step}``.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from infinity.base.log import get_logger
from infinity.config import InfinityConfig

log = get_logger("engine")

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
PHASES = ("forward", "backward", "step")


class _Writer(Protocol):
    def write(self, events: list[tuple[str, float, int]]) -> None: ...

    def close(self) -> None: ...


def _run_dir(output_path: str, job_name: str, default: Path) -> Path:
    base = Path(os.path.expanduser(output_path)) if output_path else default
    return base / job_name


class _TensorBoard:
    """Event files through torch's SummaryWriter (which needs the tensorboard package)."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = directory
        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Csv:
    """DeepSpeed's csv_monitor layout: ``<run dir>/<name with / as _>.csv``, rows ``x, value``
    under a header ``step,<last part of the name>``."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.started: set[str] = set()

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            path = self.directory / (name.replace("/", "_").replace(" ", "_") + ".csv")
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if name not in self.started:
                    self.started.add(name)
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerow([x, value])

    def close(self) -> None:
        return None


class _Wandb:
    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        import wandb

        self.wandb = wandb
        if wandb.run is None:
            wandb.init(project=project, group=group, entity=team)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            self.wandb.log({name: value}, step=x)

    def close(self) -> None:
        return None


def _require(module: str, section: str, package: str) -> None:
    """A monitor section enabled without its library is an error at initialize (every rank
    checks, so they all stop the same way)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"the config's \"{section}\" section is enabled but the {package} "
                          f"package is not installed: pip install {package} (or "
                          f"infinity-offload[monitor]), or set {section}.enabled false")


def open_monitors(config: InfinityConfig, rank: int) -> list[_Writer]:
    """The writers of the enabled monitor sections (rank 0's; other ranks get none)."""
    tb, csv_cfg, wandb_cfg = config.tensorboard, config.csv_monitor, config.wandb
    if tb.enabled:
        _require("tensorboard", "tensorboard", "tensorboard")
    if wandb_cfg.enabled:
        _require("wandb", "wandb", "wandb")
    if rank != 0:
        return []
    writers: list[_Writer] = []
    if tb.enabled:
        writers.append(_TensorBoard(_run_dir(tb.output_path, tb.job_name,
                                             Path.home() / "tensorboard")))
    if csv_cfg.enabled:
        writers.append(_Csv(_run_dir(csv_cfg.output_path, csv_cfg.job_name,
                                     Path("csv_monitor"))))
    if wandb_cfg.enabled:
        writers.append(_Wandb(wandb_cfg.project, wandb_cfg.group, wandb_cfg.team))
    return writers


class StepReport:
    """The engine's per-step reporting: gathers the losses and phase times of a step and, at
    its end, writes the events and the progress lines."""

    def __init__(self, config: InfinityConfig, rank: int) -> None:
        self.writers = open_monitors(config, rank)
        self.rank = rank
        self.every = config.steps_per_print
        self.breakdown = config.wall_clock_breakdown
        self.fp16 = config.fp16.enabled
        self._loss: torch.Tensor | None = None
        self._step_times = dict.fromkeys(PHASES, 0.0)     # this step
        self._window_times = dict.fromkeys(PHASES, 0.0)   # since the last progress line

    def add_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss as its backward used it (already divided by the accumulation
        steps); kept on its device until the step's end."""
        value = loss.detach().float().reshape(())
        self._loss = value if self._loss is None else self._loss + value

    def add_time(self, phase: str, seconds: float) -> None:
        self._step_times[phase] += seconds

    def after_step(self, *, step: int, samples: int, lr: list[float], loss_scale: float,
                   grad_norm: float | None, skipped: int, mom: list[Any]) -> None:
        """Step ``step`` (counted from 1) has been taken: write its events, and the progress
        line when ``step`` is a multiple of ``steps_per_print``."""
        loss = None if self._loss is None else float(self._loss)
        self._loss = None
        times = self._step_times
        self._step_times = dict.fromkeys(PHASES, 0.0)
        for phase in PHASES:
            self._window_times[phase] += times[phase]
        if self.writers:
            events = []
            if loss is not None:
                events.append((TRAIN_LOSS, loss, samples))
            events.append((LR, lr[0], samples))
            if self.fp16:
                events.append((LOSS_SCALE, loss_scale, samples))
            if self.breakdown:
                events += [(f"Train/Samples/elapsed_time_ms_{p}", times[p] * 1e3, samples)
                           for p in PHASES]
            for writer in self.writers:
                writer.write(events)
        if self.rank != 0 or step % self.every:
            return
        norm = "n/a" if grad_norm is None else f"{grad_norm:.4g}"
        log.info("step=%d, skipped=%d, lr=%s, mom=%s, loss=%s, grad_norm=%s", step, skipped,
                 [f"{x:.4g}" for x in lr], mom, "n/a" if loss is None else f"{loss:.4f}", norm)
        if self.breakdown:
            parts = " | ".join(f"{p}: {self._window_times[p] / self.every * 1e3:.2f}"
                               for p in PHASES)
            log.info("time (ms) per step, mean of steps %d-%d | %s", step - self.every + 1,
                     step, parts)
        self._window_times = dict.fromkeys(PHASES, 0.0)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []
