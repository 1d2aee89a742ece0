"""Materialise parameters built on the meta device, one unit at a time, with the model's own init.

Used for models built under ``infinity.zero.Init``: their parameters are meta tensors until the
engine adopts each unit. A meta tensor cannot be given CPU storage in place, so each meta
parameter is replaced by a new ``nn.Parameter`` (same shape, dtype, requires_grad) in every
module that holds it (``module._parameters``, the FSDP2 way; tied weights stay tied), then the
owning modules are initialised by the model's own initialisation (``_init_weights`` of a
``transformers`` model, ``reset_parameters`` otherwise). Peak memory is about one unit.
"""
from __future__ import annotations

import torch
from torch import nn


def materialize_params(model: nn.Module, params: list[tuple[str, nn.Parameter]],
                       device: torch.device) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """Replace the meta parameters among ``params``; returns (name, old, new) for each."""
    meta = [(name, p) for name, p in params if p.device.type == "meta"]
    if not meta:
        return []
    replaced: list[tuple[str, nn.Parameter, nn.Parameter]] = []
    owners: list[nn.Module] = []
    for name, old in meta:
        new = nn.Parameter(torch.zeros(old.shape, dtype=old.dtype, device=device),
                           requires_grad=old.requires_grad)
        replaced.append((name, old, new))
    for module in model.modules():
        touched = False
        for key, value in list(module._parameters.items()):
            for _, old, new in replaced:
                if value is old:
                    module._parameters[key] = new
                    touched = True
        if touched:
            owners.append(module)
    init_weights = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for module in owners:
            if callable(init_weights):
                init_weights(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            else:
                names = [n for n, _ in module.named_parameters(recurse=False)]
                raise ValueError(
                    f"cannot initialise parameters {names} of {type(module).__name__} built under "
                    "infinity.zero.Init: the module has no reset_parameters() and the model no "
                    "_init_weights(); build this model outside zero.Init or add one")
    return replaced
