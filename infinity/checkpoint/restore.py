"""The counters and settings a checkpoint load restores besides the tensors: engine counters,
param-group settings, the fp16 loss scaler's and the LR scheduler's state.

Why apart from load.py: they are read and checked before any tensor is loaded (a damaged
manifest, a scheduler state of another kind, groups that moved) and applied after, so a load
either changes all of the engine or, refused, none of it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from infinity.checkpoint.tensor_file import CheckpointError
from infinity.base.log import get_logger

if TYPE_CHECKING:
    from infinity.engine import Engine

log = get_logger("checkpoint")


# group keys the config decides (the update rule), not the checkpoint, as in DeepSpeed, where
# adam_w_mode is the optimizer's attribute and not a saved group setting
CONFIG_GROUP_KEYS = ("adamw_mode",)


def _number(value: Any, what: str, directory: Path, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise CheckpointError(f"checkpoint {directory}: its manifest.json has {what} = {value!r}, "
                              f"not {'an integer' if integer else 'a number'}: the manifest was "
                              "edited or damaged. Load another checkpoint")
    return value


def _saved_groups(engine: "Engine", manifest: dict[str, Any], directory: Path) -> list[dict]:
    """The saved group settings to restore, checked against the engine's groups' keys and
    types (a damaged manifest is refused before anything is loaded)."""
    saved = manifest.get("param_groups")
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise CheckpointError(f"checkpoint {directory}: its manifest.json's param_groups is not a "
                              "list of settings: the manifest was edited or damaged")
    groups = []
    for index, (group, settings) in enumerate(zip(engine.optimizer.param_groups, saved)):
        restored = {}
        for key, value in settings.items():
            if key in CONFIG_GROUP_KEYS or key not in group or key == "params":
                if key in CONFIG_GROUP_KEYS and value != group.get(key):
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


def _check_scheduler_state(engine: "Engine", state: Any, directory: Path) -> None:
    """A scheduler state another kind of scheduler saved (a ds_config schedule resumed with a
    torch LambdaLR, say) would fail inside ``load_state_dict``: refused before any load."""
    scheduler = engine.lr_scheduler
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


class RestorePlan:
    """The counters and settings a load restores, read and checked before anything loads."""

    def __init__(self, engine: "Engine", manifest: dict[str, Any], optimizer_states: bool,
                 scheduler_states: bool, directory: Path) -> None:
        counters = manifest.get("engine", {})
        if not isinstance(counters, dict):
            raise CheckpointError(f"checkpoint {directory}: its manifest.json's engine counters "
                                  "are not a dict: the manifest was edited or damaged")
        gas = engine.gradient_accumulation_steps()
        self.global_steps = _number(counters.get("global_steps", 0), "global_steps", directory, True)
        self.skipped_steps = _number(counters.get("skipped_steps", 0), "skipped_steps", directory,
                                     True)
        self.saved_gas = _number(counters.get("gradient_accumulation_steps", gas),
                                 "gradient_accumulation_steps", directory, True)
        if min(self.global_steps, self.skipped_steps) < 0:
            raise CheckpointError(f"checkpoint {directory}: its manifest.json has negative step "
                                  f"counts ({self.global_steps}, {self.skipped_steps})")
        self.groups = _saved_groups(engine, manifest, directory) if optimizer_states else None
        self.loss_scaler = manifest.get("loss_scaler") if optimizer_states else None
        if self.loss_scaler is not None and not isinstance(self.loss_scaler, dict):
            raise CheckpointError(f"checkpoint {directory}: its manifest.json's loss_scaler is "
                                  "not a dict: the manifest was edited or damaged")
        self.speculation_pays = counters.get("speculation_pays") if optimizer_states else None
        self.scheduler = manifest.get("lr_scheduler") if scheduler_states else None
        _check_scheduler_state(engine, self.scheduler, directory)
        self.optimizer_states = optimizer_states

    def apply(self, engine: "Engine") -> None:
        engine.global_steps = self.global_steps
        engine.skipped_steps = self.skipped_steps
        # saved at an accumulation boundary: the next micro-step starts a cycle of this engine's
        # length, whatever the saving engine's was
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
        if self.saved_gas != engine.gradient_accumulation_steps():
            log.info("checkpoint saved with gradient_accumulation_steps %d, resumed with %d",
                     self.saved_gas, engine.gradient_accumulation_steps())
        if self.groups is not None:
            for group, restored in zip(engine.optimizer.param_groups, self.groups):
                group.update(restored)
        if engine.loss_scaler is not None and self.loss_scaler is not None:
            engine.loss_scaler.load_state_dict(self.loss_scaler)
        if self.speculation_pays is not None and hasattr(engine.optimizer, "speculation_pays"):
            engine.optimizer.speculation_pays = bool(self.speculation_pays)
        scheduler = engine.lr_scheduler
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(self.scheduler)
            if not self.optimizer_states:     # the next step must use the schedule's rate
                for group, lr in zip(engine.optimizer.param_groups, scheduler.get_last_lr()):
                    group["lr"] = lr
