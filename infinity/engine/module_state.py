"""``model.load_state_dict(sd)`` on a model an engine holds: the values go to every unit's homes.

Why: at stage 3 most parameters are released (0 elements) and their values live in the tiers, so
torch's own load_state_dict fails on their shapes after loading part of the model (host tiers), or
writes into a unit that happens to be fetched and is then overwritten by a step still pending
(NVMe). Here every name and shape is checked first, as torch does but before anything is
written, then each unit is pinned (fetched, pending steps settled), written and unpinned as
modified, which sends it home as ``GatheredParameters(modifier_rank=0)`` does; one unit at a time,
so the memory needed is one unit's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch.nn.modules.module import _IncompatibleKeys

from infinity.base.sizes import format_bytes
from infinity.zero.persistent_buffers import all_persistent_buffers

if TYPE_CHECKING:
    from infinity.engine import Engine


def load_module_state_dict(engine: "Engine", state_dict: Mapping[str, Any], strict: bool = True,
                           assign: bool = False, module: torch.nn.Module | None = None
                           ) -> _IncompatibleKeys:
    """Load ``state_dict`` into ``module`` (``engine.module`` or a part of it, whose keys are
    its own names) with torch's key rules (tied and shared names count under each name);
    raises before writing anything on a shape mismatch, and with ``strict`` on missing or
    unexpected keys."""
    if assign:
        raise ValueError("load_state_dict(assign=True) would replace parameters the engine "
                         "manages: load with assign=False (values are copied into its tiers)")
    model = engine.module if module is None else module
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(all_persistent_buffers(model))
    expected = set(params) | set(buffers)
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    full_shape = {entry.param: entry.shape for unit in engine.units for entry in unit.params}
    mismatched = [f"{name}: checkpoint {tuple(state_dict[name].shape)}, model "
                  f"{tuple(full_shape.get(p, p.shape))}"
                  for name, p in params.items() if name in state_dict
                  and tuple(state_dict[name].shape) != tuple(full_shape.get(p, p.shape))]
    mismatched += [f"{name}: checkpoint {tuple(state_dict[name].shape)}, model {tuple(b.shape)}"
                   for name, b in buffers.items()
                   if name in state_dict and tuple(state_dict[name].shape) != tuple(b.shape)]
    problems = []
    if mismatched:
        problems.append("size mismatch for " + "; ".join(mismatched))
    if strict and missing:
        problems.append(f"missing keys {missing}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if problems:
        raise RuntimeError(f"load_state_dict into {type(model).__name__}: " + " | ".join(problems)
                           + " (nothing was loaded)")

    value_of = {p: state_dict[name] for name, p in params.items() if name in state_dict}
    in_units = {entry.param for unit in engine.units for entry in unit.params}
    with torch.no_grad():
        for param, value in value_of.items():
            if param not in in_units:       # kept as a plain tensor (no unit holds it)
                param.copy_(value)
        for unit in engine.units:
            entries = [e for e in unit.params if e.param in value_of]
            if not entries:
                continue
            engine.pin_unit(unit, modifying=True)
            try:
                for entry in entries:
                    entry.param.data.copy_(value_of[entry.param].reshape(entry.shape))
            except BaseException:
                engine.unpin_unit(unit, modified=False)
                raise
            engine.unpin_unit(unit, modified=True,
                              exact={e: value_of[e.param].detach() for e in entries})
        for name, buf in buffers.items():
            if name in state_dict:
                buf.copy_(state_dict[name])
    return _IncompatibleKeys(missing, unexpected)


def exact_from_source(comm: Any, unit: Any, exact: dict | None, source_rank: int
                      ) -> dict | None:
    """The full-precision values a change by hand gave (a state dict's, fp32 rebound into a
    16-bit unit: ``exact``) as the source rank gave them, on every rank (several ranks: each
    rank's master shard takes them, and a rank's own differed, or it had none: its shard took
    the compute copy's bf16 rounding, or its own dict's values). One fp32 broadcast of the
    unit's length where the source has any, NaN where it gave none (the merge skips NaN)."""
    device = unit.flat.device                # where the collective runs (NCCL: the GPU)
    flag = torch.tensor([1.0 if exact else 0.0], device=device)
    comm.broadcast(flag, source_rank)
    if not flag.item():
        return None
    full = torch.full((unit.flat_numel,), float("nan"), device=device)
    for entry, values in (exact or {}).items():
        full[entry.offset:entry.offset + entry.numel] = values.reshape(-1).to(device,
                                                                             torch.float32)
    comm.broadcast(full, source_rank)
    return {e: full[e.offset:e.offset + e.numel] for e in unit.params}


def full_state_dict(engine: "Engine", destination: Any = None, prefix: str = "",
                    keep_vars: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` on a model an engine holds: every parameter's current full value
    (a copy, after any pending step has landed; released parameters would be empty, and a
    unit still fetched may lag a deferred step), when the model fits in the host budget; else
    an error naming the streamed save. With several ranks every rank calls it (each unit is
    gathered)."""
    return engine.module_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)


def check_whole_model_fits(engine: "Engine", call: str, frozen_too: bool = True) -> None:
    """A whole-model state dict (``call``) that would hold more than the engine's host budget
    is refused, naming the streamed saves (``engine.module_state_dict()`` gathered past it
    without a word; only ``model.state_dict()`` was checked)."""
    nbytes = sum(e.numel for u in engine.units for e in u.params
                 if frozen_too or e.param.requires_grad) * engine.compute_dtype.itemsize
    limit = engine.manager.host_budget.limit
    if limit is None or nbytes <= limit:
        return
    configured = engine.config.infinity.host_memory_budget
    share = "" if configured is None or configured == limit else (
        f" of infinity.host_memory_budget {format_bytes(configured)}: the rest is the "
        "emulated device pool's, on a CPU-only machine")
    raise RuntimeError(
        f"{call} on a model an infinity engine holds would gather its {format_bytes(nbytes)} "
        f"of parameters into host memory, more than the engine's host budget "
        f"({format_bytes(limit)}{share}). Save the weights streamed, a unit at a time: "
        "engine.save_pretrained(dir) (a transformers directory) or engine.save_checkpoint(dir); "
        "read single parameters under infinity.zero.GatheredParameters")
