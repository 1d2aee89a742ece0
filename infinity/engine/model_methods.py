"""What the engine puts on the user's model besides hooks, and takes off at ``close()``.

Why apart from engine.py: these are the model's own methods answering for the engine (a torch
loop calls ``model.zero_grad()``, Hugging Face's Trainer ``model.load_state_dict``), kept as
instance attributes that shadow the class's, so removing them restores the model as it was.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from infinity.engine.module_state import load_module_state_dict

if TYPE_CHECKING:
    from infinity.engine import Engine

ROUTED = ("zero_grad", "load_state_dict")


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first materialised parameter, else this machine's default."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def route_module_methods(model: nn.Module, engine: "Engine") -> None:
    """``model.zero_grad()`` (what a torch loop, or Hugging Face's Trainer, calls) discards the
    engine's pending gradients too, as it would discard the .grad torch keeps; and
    ``model.load_state_dict(sd)`` writes every unit's homes (``zero.module_state``). Instance
    attributes, which close() removes."""
    module_zero_grad = model.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        engine.zero_grad(set_to_none)
        module_zero_grad(set_to_none)

    def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        engine._check_open("load_state_dict")
        return load_module_state_dict(engine, state_dict, strict=strict, assign=assign)

    model.zero_grad = zero_grad
    model.load_state_dict = load_state_dict


def unroute_module_methods(model: nn.Module) -> None:
    """The module's own methods again (``close()``)."""
    for name in ROUTED:
        model.__dict__.pop(name, None)
