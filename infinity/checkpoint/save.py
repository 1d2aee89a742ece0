"""``Engine.save_checkpoint``: stream every unit's states into a new checkpoint directory.

The engine hands over its parts as a ``TrainingState`` (checkpoint/training_state.py). It is
brought to rest first (the last step's deferred steps run and every write
lands), then each unit's parameters (the fp32 master), Adam moments and step counts are read
from their homes a chunk at a time and appended to the rank's tensor files (see
checkpoint/layout.py), and the directory is committed as in checkpoint/directory.py. Nothing
the user saved before is touched until the new checkpoint is complete on disk.
"""
from __future__ import annotations

import errno
import json
import math
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from infinity.checkpoint.directory import (
    FORMAT,
    VERSION,
    check_tag,
    commit,
    ensure_save_dir,
    prepare_staging,
    remove_checkpoint_files,
    write_latest,
    write_manifest,
)
from infinity.checkpoint.layout import (
    MOMENTS,
    UnitLayout,
    aliases,
    model_file,
    optim_file,
    persistent_buffers,
    unit_layouts,
)
from infinity.checkpoint.tensor_file import TensorFileWriter, itemsize
from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import ChunkPool, save_entries
from infinity.checkpoint.writer_lock import SaveLock
from infinity.base.log import get_logger
from infinity.storage.preflight import free_bytes
from infinity.base.sizes import format_bytes

log = get_logger("checkpoint")
RANK = 0        # one rank per engine until the multi-rank work lands


def check_at_rest(state: TrainingState, what: str) -> None:
    """Checkpoints are taken between optimizer steps: gradients of an unfinished cycle are in
    no checkpoint, and losing them silently would be worse than saying so."""
    state.check_open(what)
    if state.backwards_since_step:
        raise RuntimeError(f"engine.{what}() between backward() and step(): the gradients of "
                           "this step would not be in it. Call engine.step() first")
    gas = state.gradient_accumulation_steps
    if state.micro_steps % gas:
        raise RuntimeError(
            f"engine.{what}() in the middle of a gradient accumulation cycle (micro-step "
            f"{state.micro_steps % gas} of {gas}): the accumulated gradients would not be in "
            "it. Call it after the step at the accumulation boundary")
    if state.any_pinned():
        raise RuntimeError(f"engine.{what}() inside GatheredParameters: leave the context first "
                           "(its changes are written back on exit)")


def _check_string_keys(value: Any, what: str, depth: int = 0) -> None:
    if depth > 100:
        return            # json.dumps reports a circular or too deep value itself
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{what} has a dict key {key!r} of type {type(key).__name__}: a "
                                "checkpoint manifest is JSON, whose keys are strings, so it would "
                                "come back as {!r}. Use string keys".format(str(key)))
            _check_string_keys(item, what, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_string_keys(item, what, depth + 1)


def json_value(value: Any, what: str) -> Any:
    """``value`` as the manifest will hold it (JSON; tuples come back as lists), or a TypeError
    naming ``what``. A dict key that is not a string is refused: JSON would turn ``{1: x}``
    into ``{"1": x}`` and the load would hand back another dict than the one saved."""
    _check_string_keys(value, what)
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-serializable (numbers, strings, booleans, lists "
                        f"and dicts with string keys) to go in a checkpoint manifest: {exc}. "
                        "Convert tensors with .tolist() or .item()") from None


def manifest_state(state: TrainingState, client_state: Any) -> dict[str, Any]:
    """The manifest's non-tensor state (validated before anything is written)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state.param_groups]
    scheduler = state.lr_scheduler
    return {
        "engine": {"global_steps": state.global_steps, "micro_steps": state.micro_steps,
                   "skipped_steps": state.skipped_steps, "stage": state.stage,
                   "compute_dtype": state.compute_dtype_name,
                   "gradient_accumulation_steps": state.gradient_accumulation_steps,
                   # whether the next step speculates ("auto"): a resumed run takes the
                   # uninterrupted run's path (a rolled-back step's gradient is rebuilt)
                   "speculation_pays": state.speculation_pays},
        "param_groups": json_value(groups, "the optimizer's param group settings"),
        "lr_scheduler": None if scheduler is None else
        json_value(scheduler.state_dict(), "the LR scheduler's state_dict()"),
        "loss_scaler": None if state.loss_scaler is None else state.loss_scaler.state_dict(),
        "client_state": json_value(client_state, "client_state"),
    }


def _model_tensors(layouts: list[UnitLayout], buffers) -> list[tuple]:
    tensors = []
    for lay in layouts:
        for _, entries in lay.model_sources():
            tensors += [(e.name, lay.file_dtype(e), tuple(e.shape)) for e in entries]
    return tensors + [(name, buf.dtype, tuple(buf.shape)) for name, buf in buffers]


def _optim_tensors(layouts: list[UnitLayout]) -> list[tuple]:
    return [(f"{e.name}.{moment}", torch.float32, tuple(e.shape))
            for lay in layouts if lay.state is not None for moment in MOMENTS
            for e in lay.trainable]


def _file_bytes(tensors: list[tuple]) -> int:
    return sum(itemsize(dtype) * math.prod(shape) for _, dtype, shape in tensors)


def _params_manifest(layouts: list[UnitLayout]) -> dict[str, dict]:
    params = {}
    for lay in layouts:
        for e in lay.saved:
            entry: dict[str, Any] = {"shape": list(e.shape), "trainable": e.trainable}
            if e.trainable and lay.state is not None:
                entry["group"] = e.group_index
                entry["steps"] = lay.state.param_steps.get(e.offset, 0)
            params[e.name] = entry
    return params


def _write_model(path: Path, layouts: list[UnitLayout], buffers, chunks: ChunkPool) -> tuple:
    writer = TensorFileWriter(path, _model_tensors(layouts, buffers), {"format": FORMAT})
    try:
        for lay in layouts:
            for source, entries in lay.model_sources():
                save_entries(source, entries, chunks, lambda e, v: writer.append(e.name, v))
        for name, buf in buffers:
            writer.append(name, buf)
        return writer.close()
    finally:
        writer.abort()


def _write_optim(path: Path, layouts: list[UnitLayout], chunks: ChunkPool) -> tuple:
    writer = TensorFileWriter(path, _optim_tensors(layouts), {"format": FORMAT})
    try:
        for lay in layouts:
            if lay.state is None:
                continue
            for moment in MOMENTS:
                save_entries(getattr(lay.state, moment), lay.trainable, chunks,
                             lambda e, v, m=moment: writer.append(f"{e.name}.{m}", v))
        return writer.close()
    finally:
        writer.abort()


def _write_files(state: TrainingState, staging: Path, tag: str, layouts: list[UnitLayout], buffers,
                 need: int) -> dict[str, dict[str, Any]]:
    """This rank's tensor files in ``staging``; their sizes and sha256 for the manifest."""
    free = free_bytes(staging)
    if free < need:
        raise OSError(errno.ENOSPC, f"checkpoint {tag} needs {format_bytes(need)} in "
                                    f"{staging.parent}, which has {format_bytes(free)} free; free "
                                    "space or choose another save_dir")
    chunks = ChunkPool(state.manager, state.lendable_pools)
    files = {}
    for name, write in ((model_file(RANK), lambda p: _write_model(p, layouts, buffers, chunks)),
                        (optim_file(RANK), lambda p: _write_optim(p, layouts, chunks))):
        nbytes, digest = write(staging / name)
        files[name] = {"bytes": nbytes, "sha256": digest}
    return files


def save_checkpoint(training: TrainingState, save_dir: str | Path, tag: str | None = None,
                    client_state: Any = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> Path:
    """Save the training state under ``save_dir/tag`` (default tag
    ``global_step<N>``); with ``save_latest`` point ``save_dir/latest`` at it. Returns the
    checkpoint's directory. ``exclude_frozen_parameters``: leave parameters that do not train
    out (they keep their values when the checkpoint is loaded)."""
    check_at_rest(training, "save_checkpoint")
    tag = check_tag(tag if tag is not None else f"global_step{training.global_steps}")
    state = manifest_state(training, {} if client_state is None else client_state)
    save_dir = Path(save_dir)
    started = time.perf_counter()
    training.flush()
    layouts = unit_layouts(training, with_frozen=not exclude_frozen_parameters)
    buffers = persistent_buffers(training.module)
    need = _file_bytes(_model_tensors(layouts, buffers)) + _file_bytes(_optim_tensors(layouts))
    ensure_save_dir(save_dir)
    with SaveLock.acquire(save_dir):     # one writer per directory (checkpoint/writer_lock.py)
        staging = prepare_staging(save_dir, tag)
        try:
            files = _write_files(training, staging, tag, layouts, buffers, need)
            write_manifest(staging, {
                "format": FORMAT, "version": VERSION, "tag": tag, "world_size": 1,
                "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "files": files, "params": _params_manifest(layouts),
                "aliases": aliases(training.module, training.units),
                "frozen_excluded": exclude_frozen_parameters,
                "buffers": [name for name, _ in buffers], **state})
            final = commit(staging, save_dir, tag)
        except BaseException as exc:
            if staging.exists():
                remove_checkpoint_files(staging, ours_only=False)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and "checkpoint" not in str(exc):
                raise OSError(errno.ENOSPC, f"checkpoint {tag}: the disk of {save_dir} filled up "
                                            f"while it was written ({format_bytes(need)} needed, "
                                            f"{format_bytes(free_bytes(save_dir))} free now that "
                                            "its partial files are removed); the previous "
                                            "checkpoint and latest are unchanged: free space or "
                                            "choose another save_dir") from exc
            raise
        if save_latest:
            write_latest(save_dir, tag)
    log.info("saved checkpoint %s (%s) in %.1f s", final, format_bytes(need),
             time.perf_counter() - started)
    return final
