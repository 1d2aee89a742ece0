"""``infinity train``: the main job, as a library (``run_training``) under the thin CLI command.

Modules: ``data`` (byte tokens from the shipped corpus or --data), ``models`` (byte-level Llama
presets, any HF causal LM), ``run_config`` (the ds_config: demo default or --config, plus flags),
``baseline`` (the plain-PyTorch reference engine), ``metrics`` (per-step records, JSON lines,
summary, plot), ``progress`` (the stderr progress line), ``loop`` (the run itself), ``defaults``.
Names are served lazily so that ``infinity --help`` does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainOptions", "TrainResult", "run_training"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("infinity.train.loop"), name)
    raise AttributeError(f"module 'infinity.train' has no attribute {name!r}")
