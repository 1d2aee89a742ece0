"""The engine's side of checkpoints: the parts it hands to infinity.checkpoint (a
``TrainingState``, never the engine itself), and what a load restores, applied here: only the
engine changes its own state."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from infinity.base.log import get_logger
from infinity.checkpoint import (
    Restore,
    TrainingState,
    prepare_load,
    save_checkpoint,
    save_model_weights,
)
from infinity.checkpoint.json_state import encode
from infinity.engine.guards import every_rank_call
from infinity.engine.pretrained import model_texts

if TYPE_CHECKING:
    from infinity.engine.engine import Engine

log = get_logger("checkpoint")


def warn_if_unsaveable(scheduler: Any) -> None:
    """A scheduler whose state no checkpoint can hold (a set, a tensor, an object in its
    ``state_dict()``) is said at initialize: ``save_checkpoint`` refuses it, and found at the
    first save that was hours into a run. A warning, not an error: a run that never saves
    trains as it would."""
    if scheduler is None:
        return
    if not callable(getattr(scheduler, "state_dict", None)):
        log.warning("engine.save_checkpoint will refuse this run's LR scheduler, said now "
                    "rather than at the first save: a %s has no state_dict()",
                    type(scheduler).__name__)
        return
    try:
        encode(scheduler.state_dict(), "the LR scheduler's state_dict()")
    except Exception as exc:  # noqa: BLE001 - said, not raised: a run that never saves goes on
        log.warning("engine.save_checkpoint will refuse this run's LR scheduler, said now "
                    "rather than at the first save: %s", exc)


def training_state(engine: "Engine") -> TrainingState:
    """The engine's parts and counters as they are now, for one save or load."""
    optimizer = engine.optimizer
    return TrainingState(
        module=engine.module, units=engine.units, unit_states=optimizer.states,
        param_groups=optimizer.param_groups, lr_scheduler=engine.lr_scheduler,
        loss_scaler=engine.loss_scaler, global_steps=engine.global_steps,
        micro_steps=engine.micro_steps, skipped_steps=engine.skipped_steps, stage=engine.stage,
        compute_dtype=engine.compute_dtype,
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        speculation_pays=getattr(optimizer, "speculation_pays", None),
        backwards_since_step=engine._backwards_since_step, manager=engine.manager,
        lendable_pools=(optimizer.step_pool, engine.fetch_pool), run=_EngineAtRest(engine),
        comm=engine.comm, model_files=model_texts(engine.module, engine.compute_dtype),
        model_source=engine.__dict__.get("pretrained_source"))


class _EngineAtRest:
    """The engine as a checkpoint's ``RunAtRest`` (checkpoint/training_state.py)."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine

    def check_open(self, what: str) -> None:
        self._engine._check_open(what)

    def any_pinned(self) -> bool:
        return bool(self._engine.coordinator.pinned_units())

    def flush(self) -> None:
        self._engine.flush()

    def release_units(self) -> None:
        self._engine.coordinator.release_all()

    @contextlib.contextmanager
    def gathered(self, unit) -> Iterator[None]:
        """``unit`` fetched whole (gathered over the ranks) for the block, then let go."""
        self._engine.pin_unit(unit)
        try:
            yield
        finally:
            self._engine.unpin_unit(unit, modified=False)


def apply_restore(engine: "Engine", restore: Restore) -> None:
    """Set the counters and settings a load restores (after every unit is loaded)."""
    engine.global_steps = restore.global_steps
    engine.skipped_steps = restore.skipped_steps
    engine.micro_steps = restore.micro_steps
    if restore.saved_gradient_accumulation_steps != engine.gradient_accumulation_steps():
        log.info("checkpoint saved with gradient_accumulation_steps %d, resumed with %d",
                 restore.saved_gradient_accumulation_steps, engine.gradient_accumulation_steps())
    optimizer = engine.optimizer
    if restore.param_groups is not None:
        for group, restored in zip(optimizer.param_groups, restore.param_groups):
            group.update(restored)
    if restore.loss_scaler is not None:
        engine.loss_scaler.load_state_dict(restore.loss_scaler)
    if restore.speculation_pays is not None:
        optimizer.speculation_pays = restore.speculation_pays
    if restore.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(restore.lr_scheduler)
        if restore.lr_from_scheduler:     # the next step must use the schedule's rate
            for group, lr in zip(optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
                group["lr"] = lr


def load_checkpoint(engine: "Engine", load_dir: str | Path, tag: str | None,
                    load_module_strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_only: bool,
                    verify_checksums: bool) -> tuple[str | None, Any]:
    """``Engine.load_checkpoint``: check the checkpoint whole, write it into every unit's
    homes, then apply what it restores; a write that fails part-way marks the engine (its
    units hold a mix: ``check_open`` refuses to train on until a load completes)."""
    load = prepare_load(training_state(engine), load_dir, tag, load_module_strict,
                        load_optimizer_states, load_lr_scheduler_states, load_module_only,
                        verify_checksums)
    if load is None:
        return None, None
    with load:
        try:
            load.write()
            if load.restore is not None:
                apply_restore(engine, load.restore)
        except BaseException as exc:
            engine._load_failure = exc
            raise
        engine._load_failure = None
    if load.restore is None:     # load_module_only: the engine's counters are its own
        log.info("loaded the weights of checkpoint %s (the engine stays at global step %d)",
                 load.directory, engine.global_steps)
    else:
        log.info("loaded checkpoint %s (global step %d)", load.directory, engine.global_steps)
    return str(load.directory), load.client_state


class CheckpointCalls:
    """The engine's checkpoint and export calls (DeepSpeed's names and arguments): each hands
    ``training_state(self)`` to infinity.checkpoint, or applies what a load returns."""

    @every_rank_call("save_checkpoint()")
    def save_checkpoint(self, save_dir: str | Path, tag: str | None = None,
                        client_state: Any = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> Path:
        """Save the whole training state under ``save_dir/tag`` (default ``global_step<N>``),
        streamed unit by unit, and point ``save_dir/latest`` at it (see infinity/checkpoint).
        ``client_state``: JSON's values, tuples and dicts of any simple keys (checkpoint/
        json_state.py), given back by ``load_checkpoint`` with their types;
        ``exclude_frozen_parameters``: parameters that do not train are left out."""
        return save_checkpoint(training_state(self), save_dir, tag, client_state, save_latest,
                               exclude_frozen_parameters)

    @every_rank_call("load_checkpoint()")
    def load_checkpoint(self, load_dir: str | Path, tag: str | None = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        verify_checksums: bool = True) -> tuple[str | None, Any]:
        """Load a checkpoint (default: the one ``load_dir/latest`` names, or ``load_dir`` itself
        when it is one checkpoint's directory, as ``save_checkpoint`` returns it); returns
        (its directory, client_state), or (None, None) when there is no ``latest``. The
        checkpoint is checked whole (files, checksums, parameter names and shapes) before
        anything is loaded."""
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, verify_checksums)

    @every_rank_call("save_16bit_model()")
    def save_16bit_model(self, save_dir: str | Path, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> Path:
        """The model's weights in their compute dtype as ``save_dir/save_filename``
        (safetensors, loadable by ``transformers``), streamed unit by unit;
        ``exclude_frozen_parameters``: only the trained ones (an adapter's), as DeepSpeed's."""
        return save_model_weights(training_state(self), Path(save_dir) / save_filename,
                                  with_frozen=not exclude_frozen_parameters)

    @every_rank_call("save_pretrained()")
    def save_pretrained(self, save_directory: str | Path, max_shard_size: int | str = "5GB",
                        dtype: Any = None, merged: bool = False) -> Path:
        """The model's current weights (after the last step has landed) as a directory
        transformers and ``infinity.from_pretrained`` load: ``model.safetensors``, or shards
        of at most ``max_shard_size`` ("5GB", "500MiB" or bytes) with
        ``model.safetensors.index.json``, then ``config.json`` and the generation config of a
        transformers model, and the tokenizer files of the directory it was loaded from.
        Streamed unit by unit (any size); every rank calls it, rank 0 writes. ``dtype``:
        "fp32", "bf16", "fp16"; None: the compute dtype, or fp32 (from the fp32 masters) at
        stage 3 without ``stage3_gather_16bit_weights_on_model_save`` (see [Note: the dtype
        of a saved model] in engine/pretrained.py). ``model.save_pretrained(dir)`` comes here.
        A PEFT model saves its adapter; with ``merged=True`` its base with the LoRA adapter
        merged in, under the base's names (engine/peft_merge.py)."""
        from infinity.engine.pretrained import save_pretrained

        return save_pretrained(self, save_directory, max_shard_size, dtype, merged=merged)
