"""Casts of a model an engine holds: ``model.half()``, ``model.lm_head.float()``,
``.to(dtype)``, ``.type(...)``, refused unless to the compute dtype.

Why: the engine holds the parameters in its own stores in the compute dtype chosen at
initialize (with fp32 masters beside them under 16-bit compute); the model's tensors are its
copies. A cast of the whole model left the units' copies and masters in theirs, so the next
forward failed ("mat1 and mat2 must have the same dtype") or, at stage 2, first ran a step in
the new dtype; a part's cast (keeping a head or the norms in fp32 is a habit) made the part's
parameters tensors of their own, cut from the stores, with the same failure (a released
unit's cast was a no-op). A device move is torch's (the engine's own checks meet it later).
A cast made by the model's own forward is torch's too (SwitchTransformers' router runs its
classifier in fp32: ``self.classifier.to(self.dtype)``): the unit takes the rebound values
back after the call, as it takes any (zero/coordinator.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from infinity.engine.engine import Engine

__all__ = ["CAST_METHODS", "casts_of", "refuse_cast"]

_DTYPES = {"half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32,
           "double": torch.float64}
CAST_METHODS = (*_DTYPES, "to", "type")
"""The methods ``casts_of`` routes (instance attributes: ``close()`` removes them)."""


def refuse_cast(engine: "Engine", call: str, dtype: torch.dtype) -> None:
    """Raise for a cast to a floating (or complex) dtype other than the compute dtype."""
    if dtype == engine.compute_dtype or not (dtype.is_floating_point or dtype.is_complex):
        return
    have = str(engine.compute_dtype).replace("torch.", "")
    raise RuntimeError(
        f"{call} after infinity.initialize: the engine computes in {have}, chosen at initialize "
        "from the config, and holds the parameters in its own stores (the model's tensors are "
        "its copies), which a cast cannot reach. Set the dtype in the config "
        "(infinity.compute_dtype, or the bf16 / fp16 sections) and build the engine again, or "
        f"cast the inputs instead (the model takes {have} inputs; Hugging Face's "
        "fp16_full_eval / bf16_full_eval cast the model: leave them off)")


def casts_of(module: nn.Module, engine: "Engine", path: str) -> dict[str, Callable[..., Any]]:
    """``module``'s routed casts (``path``: how the message names it, ``model`` or
    ``model.lm_head``), each returning the module as torch's do."""
    def allowed() -> bool:
        return engine.forward_running          # the model's own code

    def cast_to(name: str, dtype: torch.dtype) -> Callable[[], nn.Module]:
        def cast() -> nn.Module:
            if allowed():
                return getattr(type(module), name)(module)
            refuse_cast(engine, f"{path}.{name}()", dtype)
            return module
        return cast

    def to(*args: Any, **kwargs: Any) -> nn.Module:
        dtype = torch._C._nn._parse_to(*args, **kwargs)[1]
        if dtype is not None and not allowed():
            refuse_cast(engine, f"{path}.to({dtype})", dtype)
        return type(module).to(module, *args, **kwargs)

    def type_(dst_type: Any) -> nn.Module:
        if not allowed():
            dtype = dst_type if isinstance(dst_type, torch.dtype) else \
                torch.empty(0).type(dst_type).dtype          # "torch.HalfTensor"
            refuse_cast(engine, f"{path}.type({dst_type})", dtype)
        return type(module).type(module, dst_type)
    return {**{name: cast_to(name, dtype) for name, dtype in _DTYPES.items()}, "to": to,
            "type": type_}
