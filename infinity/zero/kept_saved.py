"""A tensor saved for backward that saved-tensor hooks keep in memory as it is.

Under ``torch.autograd.graph.saved_tensors_hooks`` autograd keeps whatever the pack hook returns
and hands back whatever the unpack hook gives, so two things it does for a saved tensor of its
own become the hooks' to do:
- it keeps a saved output without its ``grad_fn``. Kept as it is, the tensor points back at its
  ``grad_fn``, which holds the packed value: a cycle through C++ that Python's collector cannot
  see into, so a graph dropped without a backward (a forward that raised, a training-mode
  forward whose loss was never used) would never be freed. A detached alias shares the storage
  and the version counter, and autograd gives the unpacked tensor its ``grad_fn`` back.
- it checks that the tensor was not modified in place between its save and its use, and
  raises; without the check the backward would read the new values (a wrong gradient).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class KeptSaved(NamedTuple):
    """A saved tensor kept in memory: a detached alias and its version when saved."""

    tensor: torch.Tensor
    version: int


def keep_saved(tensor: torch.Tensor) -> KeptSaved:
    return KeptSaved(tensor.detach(), tensor._version)


def kept_value(kept: KeptSaved) -> torch.Tensor:
    """The tensor for the backward; raises, as autograd would, if it was modified in place."""
    tensor, version = kept
    if tensor._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a tensor of shape {tuple(tensor.shape)} saved for backward is "
            f"at version {tensor._version}; expected version {version} instead. Clone it before "
            "modifying it in place, or modify a copy (an optimizer step since the forward "
            "changes the weights in place too: backward every loss of a forward before step(), "
            "e.g. their sum)")
    return tensor
