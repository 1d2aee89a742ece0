"""The buffers of a model that go into its state_dict (``persistent=True``), each named once.

Why a module of its own: a checkpoint saves these beside the units' parameters, and the
engine's ``state_dict`` routes them; both ask here, and neither may import the other.
"""
from __future__ import annotations

import torch
from torch import nn


def all_persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of every buffer ``state_dict()`` saves, under each of its names (a buffer
    two modules share appears twice). The checkpoint layout reads them the same way."""
    return [(f"{prefix}.{name}" if prefix else name, buf)
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set]
