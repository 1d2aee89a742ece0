"""``Engine.save_checkpoint``: stream every unit's states into a new checkpoint directory.

The engine hands over its parts as a ``TrainingState`` (checkpoint/training_state.py). It is
brought to rest first (the last step's deferred steps run and every write
lands), then each unit's parameters (the fp32 master), Adam moments and step counts are read
from their homes a chunk at a time and appended to the rank's tensor files (see
checkpoint/layout.py), and the directory is committed as in checkpoint/directory.py. Nothing
the user saved before is touched until the new checkpoint is complete on disk.
"""
from __future__ import annotations

import contextlib
import errno
import math
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infinity.checkpoint.directory import (
    FORMAT,
    VERSION,
    FP32_STATES_VERSION,
    SAVE_ID,
    SavedError,
    check_tag,
    commit,
    ensure_save_dir,
    prepare_staging,
    remove_checkpoint_files,
    write_latest,
    write_manifest,
)
from infinity.checkpoint.json_state import encode, through_json
from infinity.checkpoint.layout import (
    MOMENTS,
    UnitLayout,
    aliases,
    model_file,
    optim_file,
    persistent_buffers,
    unit_layouts,
)
from infinity.checkpoint.moment_files import moment_parts, optim_table, write_scales
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileWriter, itemsize
from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import ChunkPool, save_entries
from infinity.checkpoint.writer_lock import SaveLock
from infinity.base.log import get_logger
from infinity.io.aio import FILE_TOO_LARGE
from infinity.storage.preflight import free_bytes
from infinity.base.sizes import format_bytes

log = get_logger("checkpoint")


def check_at_rest(state: TrainingState, what: str) -> None:
    """Checkpoints are taken between optimizer steps: gradients of an unfinished cycle are in
    no checkpoint, and losing them silently would be worse than saying so."""
    state.run.check_open(what)
    if state.backwards_since_step:
        raise RuntimeError(f"engine.{what}() between backward() and step(): the gradients of "
                           "this step would not be in it. Call engine.step() first")
    gas = state.gradient_accumulation_steps
    if state.micro_steps % gas:
        raise RuntimeError(
            f"engine.{what}() in the middle of a gradient accumulation cycle (micro-step "
            f"{state.micro_steps % gas} of {gas}): the accumulated gradients would not be in "
            "it. Call it after the step at the accumulation boundary")
    if state.run.any_pinned():
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
                                f"come back as {str(key)!r}. Use string keys")
            _check_string_keys(item, what, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_string_keys(item, what, depth + 1)


def json_value(value: Any, what: str) -> Any:
    """``value`` as the manifest will hold it (JSON; tuples come back as lists), or a TypeError
    naming ``what``. A dict key that is not a string is refused: JSON would turn ``{1: x}``
    into ``{"1": x}`` and the load would hand back another dict than the one saved."""
    _check_string_keys(value, what)
    return through_json(value, f"{what} must be JSON-serializable (numbers, strings, booleans, "
                        "lists and dicts with string keys)")


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
        # Python values with their types (checkpoint/json_state.py): decoded on load
        "lr_scheduler": None if scheduler is None else
        encode(scheduler.state_dict(), "the LR scheduler's state_dict()"),
        "loss_scaler": None if state.loss_scaler is None else state.loss_scaler.state_dict(),
        "client_state": encode(client_state, "client_state"),
        # config.json and the like of a transformers model: `infinity export` writes them
        "model_files": dict(state.model_files or {}),
        # where the model was loaded from: `infinity export` copies its tokenizer files
        "model_source": (None if state.model_source is None
                         else str(Path(state.model_source).resolve())),
    }


def _model_tensors(layouts: list[UnitLayout], buffers) -> list[tuple]:
    tensors = []
    for lay in layouts:
        for _, parts in lay.model_sources():
            tensors += [(*lay.tensor_name(p), lay.file_dtype(p[0])) for p in parts]
    tensors = [(name, dtype, shape) for name, shape, dtype in tensors]
    return tensors + [(name, buf.dtype, tuple(buf.shape)) for name, buf in buffers]


def _optim_tensors(layouts: list[UnitLayout]) -> list[tuple]:
    return optim_table(layouts, {"format": FORMAT})[0]


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


def _write_model(path: Path, layouts: list[UnitLayout], buffers, chunks: ChunkPool,
                 save_id: str) -> tuple:
    writer = TensorFileWriter(path, _model_tensors(layouts, buffers),
                              {"format": FORMAT, SAVE_ID: save_id})
    try:
        for lay in layouts:
            for placed, parts in lay.model_sources():
                save_entries(placed.source, parts, chunks,
                             lambda p, v, lay=lay: writer.append(lay.tensor_name(p)[0], v),
                             origin=placed.origin)
        for name, buf in buffers:
            writer.append(name, buf)
        return writer.close()
    finally:
        writer.abort()


def _write_optim(path: Path, layouts: list[UnitLayout], chunks: ChunkPool,
                 save_id: str) -> tuple:
    """Each unit's moments in its state's format, int8 scales after their codes (see [Note:
    moments in their format in a checkpoint] in checkpoint/moment_files.py)."""
    writer = TensorFileWriter(path, *optim_table(layouts, {"format": FORMAT, SAVE_ID: save_id}))
    try:
        for lay in layouts:
            if lay.state is None:
                continue
            for moment in MOMENTS:
                parts = moment_parts(lay, moment)
                save_entries(getattr(lay.state, moment), [p.part for p in parts], chunks,
                             lambda p, v, m=moment, lay=lay:
                             writer.append(lay.tensor_name(p, f".{m}")[0], v),
                             origin=lay.state.lo)
                write_scales(writer.append, lay, moment, parts)
        return writer.close()
    finally:
        writer.abort()


def _write_files(state: TrainingState, staging: Path, tag: str, layouts: list[UnitLayout], buffers,
                 need: int, save_id: str) -> dict[str, dict[str, Any]]:
    """This rank's tensor files in ``staging``, marked as the save's (see [Note: which save a
    file belongs to] in checkpoint/directory.py); their sizes and sha256 for the manifest."""
    free = free_bytes(staging)
    if free < need:
        raise OSError(errno.ENOSPC, f"checkpoint {tag} needs {format_bytes(need)} in "
                                    f"{staging.parent}, which has {format_bytes(free)} free; free "
                                    "space or choose another save_dir")
    chunks = ChunkPool(state.manager, state.lendable_pools)
    files = {}
    rank = state.rank
    for name, write in ((model_file(rank),
                         lambda p: _write_model(p, layouts, buffers, chunks, save_id)),
                        (optim_file(rank), lambda p: _write_optim(p, layouts, chunks, save_id))):
        nbytes, digest = write(staging / name)
        files[name] = {"bytes": nbytes, "sha256": digest}
    return files


def save_checkpoint(training: TrainingState, save_dir: str | Path, tag: str | None = None,
                    client_state: Any = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> Path:
    """Save the training state under ``save_dir/tag`` (default tag
    ``global_step<N>``); with ``save_latest`` point ``save_dir/latest`` at it. Returns the
    checkpoint's directory. ``exclude_frozen_parameters``: leave parameters that do not train
    out (they keep their values when the checkpoint is loaded). With several ranks every rank
    calls it: see [Note: a save over ranks]."""
    check_at_rest(training, "save_checkpoint")
    tag = check_tag(tag if tag is not None else f"global_step{training.global_steps}")
    state = manifest_state(training, {} if client_state is None else client_state)
    save_dir = Path(save_dir)
    started = time.perf_counter()
    training.run.flush()
    layouts = unit_layouts(training, with_frozen=not exclude_frozen_parameters)
    buffers = persistent_buffers(training.module) if training.rank == 0 else []
    need = _file_bytes(_model_tensors(layouts, buffers)) + _file_bytes(_optim_tensors(layouts))
    ranks = RankAgreement(training)
    if training.world_size > 1:
        _same_target_on_every_rank(ranks, save_dir, tag)
    if training.rank == 0:
        ensure_save_dir(save_dir)
    with contextlib.ExitStack() as held:
        # rank 0 takes the lock, names the staging directory and draws the save's id; the
        # others write into it
        made: list[Path] = []
        try:
            staging, save_id = ranks.decided_by_first(lambda: _begin(save_dir, tag, held, made))
        except BaseException:
            for path in made:       # made, then the ranks' exchange failed (a rank gone)
                remove_checkpoint_files(path, ours_only=False)
            raise
        try:
            ranks.all_succeed(lambda: _check_visible(staging, training.rank),
                              "see rank 0's staging directory")
            files = ranks.all_succeed(
                lambda: _write_files(training, staging, tag, layouts, buffers, need, save_id),
                "write its checkpoint files", share=True)
            final = ranks.decided_by_first(lambda: _finish(
                training, staging, save_dir, tag, files, layouts, state,
                exclude_frozen_parameters, save_id))
        except BaseException as exc:
            if training.rank == 0 and staging.exists():
                try:
                    remove_checkpoint_files(staging, ours_only=False)
                except OSError as cleanup:      # the first failure is the one to report
                    log.warning("could not remove %s after the save failed: %s", staging,
                                cleanup)
            if isinstance(exc, SavedError) or (isinstance(exc, CheckpointError) and
                                               AFTER_COMMIT in str(exc)):
                raise       # the new save is in place: not "unchanged"
            if isinstance(exc, OSError) and "checkpoint" not in str(exc) and \
                    str(save_dir) not in str(exc):    # a bare errno: ours name the directory
                raise _save_error(exc, tag, save_dir, need) from exc
            raise
        if save_latest:
            ranks.decided_by_first(lambda: write_latest(save_dir, tag))
    log.info("saved checkpoint %s (%s) in %.1f s", final, format_bytes(need),
             time.perf_counter() - started)
    return final


def _same_target_on_every_rank(ranks: RankAgreement, save_dir: Path, tag: str) -> None:
    """Every rank names one directory and tag: rank 0 chooses where the save goes, and a rank
    told another place (its node's own directory, a tag of its own) wrote its part there
    without a word, and was told the save was where it asked."""
    targets = ranks.all_succeed(lambda: (str(save_dir.resolve()), tag), "name the save",
                                share=True)
    if len(set(targets)) > 1:
        raise CheckpointError(
            "the ranks name different checkpoints (" + "; ".join(
                f"rank {rank}: {where}/{name}" for rank, (where, name) in enumerate(targets))
            + "): nothing was saved. Every rank saves into one directory every rank mounts, "
            "with one tag (rank 0 commits it)")


def _save_error(exc: OSError, tag: str, save_dir: Path, need: int) -> OSError:
    """A save's OS error as the user needs it: which checkpoint, where, that nothing earlier
    changed, and for a full disk or quota the sizes (a bare "[Errno 27] File too large" or
    "[Errno 122] Disk quota exceeded" said none of it)."""
    unchanged = "the previous checkpoint and latest are unchanged"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OSError(exc.errno, f"checkpoint {tag}: the disk of {save_dir} filled up (or its "
                                  f"quota) while it was written ({format_bytes(need)} needed, "
                                  f"{format_bytes(free_bytes(save_dir))} free now that its "
                                  f"partial files are removed); {unchanged}: free space or "
                                  "choose another save_dir")
    hint = f"; {FILE_TOO_LARGE}" if exc.errno == errno.EFBIG else ""
    return OSError(exc.errno, f"checkpoint {tag} in {save_dir}: "
                              f"{exc.strerror or exc}{hint}; {unchanged}")


def _begin(save_dir: Path, tag: str, held: contextlib.ExitStack,
           made: list[Path]) -> tuple[Path, str]:
    """Rank 0: take the save lock (one writer per directory, checkpoint/writer_lock.py), make
    the staging directory (noted in ``made``), and draw the save's id."""
    held.enter_context(SaveLock.acquire(save_dir))
    staging = prepare_staging(save_dir, tag)
    made.append(staging)
    return staging, secrets.token_hex(16)


def _check_visible(staging: Path, rank: int) -> None:
    if not staging.is_dir():
        raise OSError(errno.ENOENT, f"rank {rank} cannot see {staging}, the staging directory "
                                    "rank 0 made: the save directory must be on a file system "
                                    "every rank mounts (a shared disk across nodes)")


def _any_state_format(layouts: list[UnitLayout]) -> bool:
    """Whether this rank saves a state in a format (see ``directory.VERSION``): rank 0's
    answer is every rank's, as a unit's format is decided on the whole unit, the same on every
    rank (optim/state_formats.py ``build_state``)."""
    return any(lay.state is not None and not lay.state.fmt.is_default for lay in layouts)


def _finish(training: TrainingState, staging: Path, save_dir: Path, tag: str,
            files: list[dict[str, dict[str, Any]]], layouts: list[UnitLayout],
            state: dict[str, Any], exclude_frozen: bool, save_id: str) -> Path:
    """Rank 0: the manifest naming every rank's files, then the atomic commit."""
    write_manifest(staging, {
        "format": FORMAT, "version": VERSION if _any_state_format(layouts) else
        FP32_STATES_VERSION, "tag": tag, SAVE_ID: save_id, "world_size": training.world_size,
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": {name: info for rank_files in files for name, info in rank_files.items()},
        "params": _params_manifest(layouts),
        "aliases": aliases(training.module, training.units),
        # only where a parameter was left out: a whole model's checkpoint stays exportable
        "frozen_excluded": exclude_frozen and any(not entry.trainable for unit in training.units
                                                  for entry in unit.params),
        "buffers": [name for name, _ in persistent_buffers(training.module)], **state})
    return commit(staging, save_dir, tag)


AFTER_COMMIT = "the checkpoint was committed before it: it is in place, whole"
"""What the other ranks say of rank 0's failure after the commit (``SavedError``)."""


class RankAgreement:
    """[Note: a save over ranks]
    Every rank writes its own tensor files into one staging directory, which rank 0 makes
    under the save lock; rank 0 writes the manifest and commits (the rename into place and
    ``latest``) once every rank has written. Each of these moves is agreed: a rank that fails
    (a full disk, a directory it cannot see) makes every rank raise, naming it, rank 0 removes
    the staging directory, and nothing the user saved before is touched. With one rank these
    are plain calls."""

    def __init__(self, training: TrainingState, nothing_done: str = "nothing was committed") -> None:
        self.comm = training.comm if training.world_size > 1 else None
        self.rank = training.rank
        self.nothing_done = nothing_done

    def decided_by_first(self, action):
        """Rank 0 runs ``action``; every rank gets its result, or raises its failure."""
        if self.comm is None:
            return action()
        result, error = None, None
        if self.rank == 0:
            try:
                result = action()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, the others told
                error = exc
        outcome = self.comm.all_gather_objects(
            (result, None if error is None else f"{type(error).__name__}: {error}"))[0]
        if error is not None:
            raise error
        if outcome[1] is not None:
            committed = outcome[1].startswith(f"{SavedError.__name__}:")
            raise CheckpointError(f"rank 0 failed ({outcome[1]}); "
                                  f"{AFTER_COMMIT if committed else self.nothing_done}")
        return outcome[0]

    def all_succeed(self, action, what: str, share: bool = False):
        """Every rank runs ``action``; its result (with ``share``, the list of every rank's
        results by rank), or every rank raises when any failed."""
        if self.comm is None:
            return [action()] if share else action()
        result, error = None, None
        try:
            result = action()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, the others told
            error = exc
        outcomes = self.comm.all_gather_objects(
            (result if share else None,
             None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            raise error
        failed = [(r, e) for r, (_, e) in enumerate(outcomes) if e is not None]
        if failed:
            raise CheckpointError("; ".join(
                f"rank {r} could not {what} ({e})" for r, e in failed)
                + f"; {self.nothing_done}")
        return [r for r, _ in outcomes] if share else result
