"""The counters and settings a checkpoint load restores besides the tensors: engine counters,
param-group settings, the fp16 loss scaler's and the LR scheduler's state.

Why apart from load.py: they are read and checked before any tensor is loaded (a damaged
manifest, a scheduler state of another kind, groups that moved) and applied after, so a load
either changes all of the engine or, refused, none of it. They are applied by the engine
(``Restore`` is a value: checkpoint code changes no engine state).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infinity.checkpoint.json_state import decode
from infinity.checkpoint.tensor_file import CheckpointError
from infinity.checkpoint.training_state import TrainingState
from infinity.base.log import get_logger

log = get_logger("checkpoint")


# group keys the config decides (the update rule), not the checkpoint, as in DeepSpeed, where
# adam_w_mode is the optimizer's attribute and not a saved group setting; and the state formats:
# the running engine's stores are built in its own, a checkpoint in another is converted on load
CONFIG_GROUP_KEYS = ("adamw_mode", "optimizer_moments", "optimizer_master")
FORMAT_KEYS = ("optimizer_moments", "optimizer_master")


def _number(value: Any, what: str, directory: Path, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise CheckpointError(f"checkpoint {directory}: its manifest.json has {what} = {value!r}, "
                              f"not {'an integer' if integer else 'a number'}: the manifest was "
                              "edited or damaged. Load another checkpoint")
    return value


def _saved_groups(state: TrainingState, manifest: dict[str, Any], directory: Path) -> list[dict]:
    """The saved group settings to restore, checked against the engine's groups' keys and
    types (a damaged manifest is refused before anything is loaded)."""
    saved = manifest.get("param_groups")
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise CheckpointError(f"checkpoint {directory}: its manifest.json's param_groups is not a "
                              "list of settings: the manifest was edited or damaged")
    groups = []
    for index, (group, settings) in enumerate(zip(state.param_groups, saved)):
        restored = {}
        for key, value in settings.items():
            if key in CONFIG_GROUP_KEYS or key not in group or key == "params":
                if key in FORMAT_KEYS and value != group.get(key):
                    log.info("checkpoint %s was saved with %s = %r in param group %d; the "
                             "config's %r is kept: its states are converted on load",
                             directory, key, value, index, group.get(key))
                elif key in CONFIG_GROUP_KEYS and value != group.get(key):
                    log.warning("checkpoint %s was saved with %s = %r in param group %d; the "
                                "config's %r is kept", directory, key, value, index, group.get(key))
                continue
            what = f"param_groups[{index}].{key}"
            current = group[key]
            if key == "betas":
                if not isinstance(value, list) or len(value) != 2:
                    raise CheckpointError(f"checkpoint {directory}: its manifest.json has {what} "
                                          f"= {value!r}, not two numbers: the manifest was edited "
                                          "or damaged")
                value = tuple(_number(v, what, directory) for v in value)
            elif isinstance(current, bool):
                if not isinstance(value, bool):
                    raise CheckpointError(f"checkpoint {directory}: its manifest.json has {what} "
                                          f"= {value!r}, not true or false")
            elif isinstance(current, (int, float)):
                value = _number(value, what, directory)
            restored[key] = value
        groups.append(restored)
    return groups


def _check_scheduler_state(training: TrainingState, state: Any, directory: Path) -> None:
    """A scheduler state another kind of scheduler saved (a ds_config schedule resumed with a
    torch LambdaLR, say) would fail inside ``load_state_dict``: refused before any load."""
    scheduler = training.lr_scheduler
    if scheduler is None or state is None:
        return
    accepts = getattr(scheduler, "accepts_state", None)   # a schedule that says what it takes
    if accepts is not None and accepts(state):
        return
    expected = set(scheduler.state_dict())
    missing = sorted(expected - set(state)) if isinstance(state, dict) else sorted(expected)
    if missing or accepts is not None:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"checkpoint {directory}: its LR scheduler state ({found}) lacks what this engine's "
            f"{type(scheduler).__name__} keeps ({missing}): it was "
            "saved by another kind of scheduler. Pass load_lr_scheduler_states=False to keep "
            "this engine's schedule")


def decoded(value: Any, what: str, directory: Path) -> Any:
    """A manifest's ``what`` (the scheduler's state, ``client_state``) as the Python value
    saved (checkpoint/json_state.py), or a CheckpointError where its tags are damaged."""
    try:
        return decode(value)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {directory}: its manifest.json's {what}: {exc}. "
                              "Load another checkpoint") from None


@dataclass(frozen=True, kw_only=True)
class Restore:
    """What a load restores besides the tensors, read and checked before anything loads; the
    engine applies it once every unit is loaded."""

    global_steps: int
    skipped_steps: int
    micro_steps: int
    """Saved at an accumulation boundary: the next micro-step starts a cycle of the loading
    engine's length, whatever the saving engine's was."""
    saved_gradient_accumulation_steps: int
    param_groups: list[dict[str, Any]] | None
    """Settings to update each param group with, in order (None: the optimizer's are kept)."""
    loss_scaler: dict[str, Any] | None
    """The fp16 loss scaler's state_dict (None: kept)."""
    speculation_pays: bool | None
    """Whether the next step speculates (None: kept)."""
    lr_scheduler: Any
    """The LR scheduler's state_dict (None: kept)."""
    lr_from_scheduler: bool
    """Set each group's lr from the restored schedule (its settings were not restored, and the
    next step must use the schedule's rate)."""


def read_restore(state: TrainingState, manifest: dict[str, Any], optimizer_states: bool,
                 scheduler_states: bool, directory: Path) -> Restore:
    """The counters and settings of ``manifest`` to restore, checked against ``state``."""
    counters = manifest.get("engine", {})
    if not isinstance(counters, dict):
        raise CheckpointError(f"checkpoint {directory}: its manifest.json's engine counters "
                              "are not a dict: the manifest was edited or damaged")
    gas = state.gradient_accumulation_steps
    global_steps = _number(counters.get("global_steps", 0), "global_steps", directory, True)
    skipped_steps = _number(counters.get("skipped_steps", 0), "skipped_steps", directory, True)
    saved_gas = _number(counters.get("gradient_accumulation_steps", gas),
                        "gradient_accumulation_steps", directory, True)
    if min(global_steps, skipped_steps) < 0:
        raise CheckpointError(f"checkpoint {directory}: its manifest.json has negative step "
                              f"counts ({global_steps}, {skipped_steps})")
    groups = _saved_groups(state, manifest, directory) if optimizer_states else None
    loss_scaler = manifest.get("loss_scaler") if optimizer_states else None
    if loss_scaler is not None and not isinstance(loss_scaler, dict):
        raise CheckpointError(f"checkpoint {directory}: its manifest.json's loss_scaler is "
                              "not a dict: the manifest was edited or damaged")
    speculation_pays = counters.get("speculation_pays") if optimizer_states else None
    scheduler = decoded(manifest.get("lr_scheduler"), "lr_scheduler", directory) \
        if scheduler_states else None
    _check_scheduler_state(state, scheduler, directory)
    return Restore(
        global_steps=global_steps, skipped_steps=skipped_steps, micro_steps=global_steps * gas,
        saved_gradient_accumulation_steps=saved_gas, param_groups=groups,
        loss_scaler=loss_scaler if state.loss_scaler is not None else None,
        speculation_pays=None if speculation_pays is None or state.speculation_pays is None
        else bool(speculation_pays),
        lr_scheduler=scheduler if state.lr_scheduler is not None else None,
        lr_from_scheduler=not optimizer_states)
