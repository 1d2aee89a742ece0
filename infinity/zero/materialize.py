"""Materialise parameters built on the meta device, one unit at a time, with the model's own init.

Used for models built under ``infinity.zero.Init``: their parameters are meta tensors until the
engine adopts each unit; then the unit's parameters get real storage and are initialised by the
model's own initialisation (``_init_weights`` of a ``transformers`` model, ``reset_parameters``
otherwise), so peak memory is about one unit.
"""
from __future__ import annotations

import torch
from torch import nn

from infinity.zero.unit import Unit


def materialize_unit_params(model: nn.Module, unit: Unit) -> None:
    """Give ``unit``'s meta parameters real (CPU) storage and initialise them."""
    meta = [entry.param for entry in unit.params if entry.param.device.type == "meta"]
    if not meta:
        return
    owners: list[nn.Module] = []
    pending = list(meta)
    for module in model.modules():
        direct = [p for p in module.parameters(recurse=False) if any(p is q for q in pending)]
        if direct:
            owners.append(module)
    for param in meta:
        param.data = torch.zeros(param.shape, dtype=param.dtype, device=unit.device)
    init_weights = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for module in owners:
            if callable(init_weights):
                init_weights(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                names = [n for n, p in module.named_parameters(recurse=False)]
                raise ValueError(
                    f"cannot initialise parameters {names} of {type(module).__name__} built under "
                    "infinity.zero.Init: the module has no reset_parameters() and the model no "
                    "_init_weights(); build this model outside zero.Init or add one")
