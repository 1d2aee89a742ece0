"""``Engine.load_checkpoint``: check a checkpoint whole, then stream it into every unit's homes.

Two phases, so that the engine knows when its state began to change. ``prepare_load`` finds
everything that can be wrong with a checkpoint before any state is touched: the manifest, each
file's size and sha256, each tensor file's table, and the match between the checkpoint's
parameters and buffers and the model's (names, through tied aliases; shapes; optimizer states
for the trainable ones); the counters and settings to restore are read and checked too
(checkpoint/restore.py). Only then does ``CheckpointLoad.write`` write the homes, unit by
unit; a write that fails part-way leaves a mix of the checkpoint's values and the engine's,
which the engine refuses to train on until a load completes (``Engine.load_checkpoint``).
Parameters are kept by name, so a checkpoint loads into another stage, offload tier, unit
layout or compute dtype than the one that saved it, and at another number of ranks (see [Note:
checkpoints by parameter and slice] in checkpoint/layout.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.checkpoint.directory import checkpoint_directory
from infinity.checkpoint.layout import (
    MOMENTS,
    UnitLayout,
    model_file,
    optim_file,
    persistent_buffers,
    unit_layouts,
)
from infinity.checkpoint.moment_files import SavedMoments
from infinity.checkpoint.moment_load import Conversions, load_int8, master_fill, moment_fill
from infinity.checkpoint.pinned import PinnedSave, SavedWhileLoading, pin_save
from infinity.checkpoint.restore import Restore, decoded, read_restore
from infinity.checkpoint.save import RankAgreement, check_at_rest
from infinity.checkpoint.sliced import SlicedReader, open_ranks, param_shapes, saved_ranks
from infinity.checkpoint.tensor_file import CheckpointError
from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import ChunkPool, Fill, load_entries, parts_of
from infinity.base.log import get_logger
from infinity.zero.unit import ParamEntry

log = get_logger("checkpoint")


def _reader_fill(reader: SlicedReader, names: dict[ParamEntry, str], suffix: str = "") -> Fill:
    """Fill a host tensor from the file tensor an entry maps to, casting when dtypes differ."""

    def fill(entry: ParamEntry, start: int, out: torch.Tensor) -> None:
        name = names[entry] + suffix
        if reader.info(name).dtype == out.dtype and out.is_contiguous():
            reader.read_into(name, out, start)
            return
        part = torch.empty(out.numel(), dtype=reader.info(name).dtype)
        reader.read_into(name, part, start)
        out.copy_(part)

    return fill


class Match:
    """Which file tensor each of the model's parameters loads from, found before any load."""

    def __init__(self, model: nn.Module, layouts: list[UnitLayout], manifest: dict[str, Any],
                 reader: SlicedReader) -> None:
        other_names: dict[nn.Parameter, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            other_names.setdefault(p, []).append(name)
        saved_as = manifest.get("aliases", {})
        self.names: dict[ParamEntry, str] = {}
        self.missing: list[str] = []
        self.mismatched: list[str] = []
        for lay in layouts:
            for entry in lay.entries:
                candidates = [entry.name, *other_names.get(entry.param, [])]
                candidates += [saved_as[c] for c in candidates if c in saved_as]
                found = next((c for c in candidates if c in reader.tensors), None)
                if found is None and not entry.trainable and manifest.get("frozen_excluded"):
                    continue        # saved without frozen parameters: they keep their values
                if found is None:
                    self.missing.append(entry.name)
                elif reader.tensors[found].shape != tuple(entry.shape):
                    self.mismatched.append(f"{entry.name}: checkpoint {list(reader.tensors[found].shape)}"
                                           f", model {list(entry.shape)}")
                else:
                    self.names[entry] = found
        used = set(self.names.values())
        self.unexpected = [n for n in manifest.get("params", {}) if n not in used]
        # a saved name the model has as another name of a tied parameter: two tensors saved,
        # one in the model (an untied head loaded into a tied model)
        self.tied = {n: names[0] for p, names in other_names.items() if len(names) > 1
                     for n in names[1:] if n in self.unexpected}
        self.frozen_excluded = bool(manifest.get("frozen_excluded"))

    def check(self, strict: bool, directory: Path) -> None:
        if self.mismatched:
            raise CheckpointError(f"checkpoint {directory} does not fit the model: shapes differ "
                                  f"for {len(self.mismatched)} parameter(s): "
                                  + "; ".join(self.mismatched[:5]))
        problems = []
        if self.missing:
            problems.append(f"{len(self.missing)} of the model's parameters are not in it "
                            f"({', '.join(self.missing[:5])})" + (
                                ": it was saved with exclude_frozen_parameters=True, which "
                                "leaves out the parameters frozen at the save"
                                if self.frozen_excluded else ""))
        if self.tied:
            problems.append(
                f"{len(self.tied)} of its parameters are saved apart but tied to another in "
                "this model (" + ", ".join(f"{n}, tied to {m}" for n, m in
                                          list(self.tied.items())[:3])
                + "): the model was saved untied; build it untied (tie_word_embeddings=False). "
                "Loading what matches would keep the other's value and drop the saved one")
        untied = [n for n in self.unexpected if n not in self.tied]
        if untied:
            problems.append(f"{len(untied)} of its parameters are not in the model "
                            f"({', '.join(untied[:5])})")
        if problems and strict:
            raise CheckpointError(f"checkpoint {directory} does not match the model: "
                                  + "; ".join(problems)
                                  + ". Pass load_module_strict=False to load what matches")
        for problem in problems:
            log.warning("loading %s: %s; those keep their current values", directory, problem)


def _check_optimizer(layouts: list[UnitLayout], match: Match, manifest: dict[str, Any],
                     optim: SlicedReader, state: TrainingState, directory: Path) -> None:
    saved_groups = manifest.get("param_groups", [])
    if len(saved_groups) != len(state.param_groups):
        raise CheckpointError(
            f"checkpoint {directory} has {len(saved_groups)} optimizer param group(s), the engine "
            f"{len(state.param_groups)}: build the engine with the same groups, or pass "
            "load_optimizer_states=False to load the model only")
    lacking = [e.name for lay in layouts for e in lay.trainable
               if e in match.names and f"{match.names[e]}.{MOMENTS[0]}" not in optim.tensors]
    if lacking:
        raise CheckpointError(
            f"checkpoint {directory} has no Adam states for {len(lacking)} trainable "
            f"parameter(s) ({', '.join(lacking[:5])}): they were frozen when it was saved. Pass "
            "load_optimizer_states=False to load the model only")
    params = manifest.get("params")
    moved = [f"{e.name} (group {params[match.names[e]]['group']} then, {e.group_index} now)"
             for lay in layouts for e in lay.trainable if e in match.names
             and isinstance(params, dict) and isinstance(params.get(match.names[e]), dict)
             and params[match.names[e]].get("group", e.group_index) != e.group_index]
    if moved:
        raise CheckpointError(
            f"checkpoint {directory}: {len(moved)} parameter(s) are in another optimizer param "
            f"group than when it was saved ({'; '.join(moved[:3])}), and the groups' settings "
            "(lr, weight decay, betas) are restored by position: they would train with another "
            "group's settings. Build the param groups in the order and by the rules used when "
            "saving, or pass load_optimizer_states=False to load the model only")
    unlisted = [match.names[e] for lay in layouts for e in lay.trainable if e in match.names
                and not (isinstance(params, dict) and isinstance(params.get(match.names[e]), dict)
                         and isinstance(params[match.names[e]].get("steps", 0), int))]
    if unlisted:
        raise CheckpointError(
            f"checkpoint {directory}: its manifest.json has no step count for {len(unlisted)} "
            f"parameter(s) ({', '.join(unlisted[:5])}) although its tensor files hold them: the "
            "manifest was edited or damaged. Load another checkpoint, or pass "
            "load_optimizer_states=False to load the model only")


def _load_unit(lay: UnitLayout, match: Match, model: SlicedReader,
               saved: SavedMoments | None, chunks: ChunkPool, params_manifest: dict[str, Any],
               conversions: Conversions) -> None:
    loaded = [e for e in lay.entries if e in match.names]
    partial = len(loaded) < len(lay.entries)
    state = lay.state
    # the model file's values; a master saved in another format than this run's is noted
    values = master_fill(_reader_fill(model, match.names), model, match.names,
                         state is not None and state.fmt.master == "bf16", state is not None,
                         conversions)
    params = lay.placed_params     # each home takes the range of the unit it holds
    load_entries(params.source, parts_of(loaded, params.covers), chunks, values,
                 both_extents=True, merge=partial, origin=params.origin)
    trainable = [e for e in lay.trainable if e in match.names]
    if lay.master is not None:
        master = lay.placed_state(lay.master)
        load_entries(master.source, parts_of(trainable, master.covers), chunks, values,
                     merge=len(trainable) < len(lay.trainable), origin=master.origin)
    if saved is None or state is None:
        return
    kept = [e for e in lay.trainable if e not in match.names]
    for moment in MOMENTS:
        store = getattr(state, moment)
        if state.fmt.moments == "int8":     # block by block (checkpoint/moment_load.py)
            load_int8(store, getattr(state, f"{moment}_scales"), state.lo, trainable, kept,
                      saved, match.names, f".{moment}", chunks, conversions)
            continue
        placed = lay.placed_state(store)
        load_entries(placed.source, parts_of(trainable, placed.covers), chunks,
                     moment_fill(saved, match.names, f".{moment}", store.dtype, conversions),
                     merge=bool(kept), origin=placed.origin)
    for entry in trainable:
        state.param_steps[entry.offset] = int(params_manifest[match.names[entry]].get("steps", 0))
    state.step = max(state.param_steps.values(), default=0)


def _check_buffers(buffers: list[tuple[str, torch.Tensor]], reader: SlicedReader,
                   strict: bool, directory: Path) -> None:
    missing = [n for n, _ in buffers if n not in reader.tensors]
    wrong = [f"{n}: checkpoint {list(reader.tensors[n].shape)}, model {list(b.shape)}"
             for n, b in buffers if n in reader.tensors and reader.tensors[n].shape != tuple(b.shape)]
    if wrong or (missing and strict):
        raise CheckpointError(f"checkpoint {directory} does not match the model's buffers: "
                              + "; ".join(wrong[:5] + [f"missing {m}" for m in missing[:5]]))


class CheckpointLoad:
    """A checkpoint read and checked whole (``prepare_load``), its files open, ready to be
    written into the units' homes; ``restore`` and ``client_state`` are for the engine."""

    def __init__(self, state: TrainingState, save: PinnedSave, restore: Restore | None) -> None:
        self.state = state
        self.save = save
        """The save being loaded, held open (see [Note: a load pinned to one save])."""
        self.directory = save.directory
        self.manifest = save.manifest
        self.restore = restore
        """The counters and settings to apply once written (None: load_module_only)."""
        self.client_state: Any = decoded(save.manifest.get("client_state"), "client_state",
                                         save.directory)
        self.layouts = unit_layouts(state)
        self.buffers = persistent_buffers(state.module)
        self.model: SlicedReader | None = None
        self.optim: SlicedReader | None = None
        self.moments: SavedMoments | None = None
        self.match: Match | None = None

    def check(self, strict: bool, optimizer_states: bool) -> None:
        """Open the tensor files and match them to the model (nothing is written)."""
        directory = self.directory
        saved = saved_ranks(self.manifest, directory)
        shapes = param_shapes(self.manifest)
        self.model = open_ranks(self.save, [model_file(r) for r in range(saved)], shapes)
        self.match = Match(self.state.module, self.layouts, self.manifest, self.model)
        self.match.check(strict, directory)
        if optimizer_states:
            moments = {f"{name}.{m}": shape for name, shape in shapes.items() for m in MOMENTS}
            # a moment's slices may differ in format (see [Note: moments in their format in
            # a checkpoint] in checkpoint/moment_files.py)
            self.optim = open_ranks(self.save, [optim_file(r) for r in range(saved)], moments,
                                    mixed_dtypes=True)
            self.moments = SavedMoments(self.optim, directory)
            self.moments.check(moments)
            _check_optimizer(self.layouts, self.match, self.manifest, self.optim, self.state,
                             directory)
        _check_buffers(self.buffers, self.model, strict, directory)

    def write(self) -> None:
        """Write the checkpoint's buffers and every unit's states into their homes. A failure
        here leaves some units with the checkpoint's values and others with their own."""
        assert self.model is not None and self.match is not None, "check() first"
        with torch.no_grad():
            for name, buf in self.buffers:
                if name in self.model.tensors:
                    buf.copy_(self.model.read(name))
        chunks = ChunkPool(self.state.manager, self.state.lendable_pools)
        # the step counts are read only with optimizer states, whose check refused a manifest
        # without them; a module-only load needs none
        params = self.manifest.get("params", {})
        conversions = Conversions()
        for lay in self.layouts:
            _load_unit(lay, self.match, self.model, self.moments, chunks, params, conversions)
        said = conversions.line()
        if said:     # states saved in another format than this run's (or in bf16 / int8)
            log.info("loaded %s: %s", self.directory, said)

    def close(self) -> None:
        for reader in (self.optim, self.model):
            if reader is not None:
                reader.close()
        self.model = self.optim = self.moments = None
        self.save.close()

    def __enter__(self) -> "CheckpointLoad":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prepare_load(state: TrainingState, load_dir: str | Path, tag: str | None = None,
                 load_module_strict: bool = True, load_optimizer_states: bool = True,
                 load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                 verify_checksums: bool = True) -> CheckpointLoad | None:
    """Read and check ``load_dir/tag`` (default: the tag ``latest`` names) whole, then bring
    the units to rest (the last step's writes land, fetched units are released): the load to
    ``write``, or None when ``load_dir`` has no ``latest`` (nothing to resume from). Nothing
    of the training state has changed when this returns or raises (beyond the last step's
    work finishing)."""
    check_at_rest(state, "load_checkpoint")
    state.run.flush()      # the last step's work finishes first (with several ranks, together)
    # every rank reads and checks the checkpoint; a failure on any makes all raise
    ranks = RankAgreement(state, "nothing was loaded")
    load = ranks.all_succeed(
        lambda: _prepare(state, Path(load_dir), tag, load_module_strict, load_optimizer_states,
                         load_lr_scheduler_states, load_module_only, verify_checksums),
        "read the checkpoint")
    if state.world_size > 1:
        try:
            _same_save_on_every_rank(ranks, load)
        except BaseException:
            if load is not None:
                load.close()
            raise
    return load


def _same_save_on_every_rank(ranks: RankAgreement, load: CheckpointLoad | None) -> None:
    """Each rank pinned the save it found; a save of the tag between two ranks' pins would
    have them load two saves (see [Note: a load pinned to one save])."""
    pinned = ranks.all_succeed(
        lambda: None if load is None else (str(load.directory.resolve()),
                                           load.save.manifest_sha256),
        "compare the save it opened", share=True)
    if len(set(pinned)) <= 1:
        return
    if len({p[0] if p else None for p in pinned}) > 1:
        # another directory or tag (a node-local copy that is older, or none): loading again
        # cannot mend it (the message said a save happened meanwhile)
        raise CheckpointError(
            "the ranks found different checkpoints (" + "; ".join(
                f"rank {rank}: {p[0] if p else 'none (no latest)'}"
                for rank, p in enumerate(pinned)) + "): nothing was loaded. Every rank must "
            "load one checkpoint, from a directory every rank mounts (or identical copies)")
    raise SavedWhileLoading(
        f"the ranks opened different saves of {load.directory} (a save of that tag happened "
        "while they were opening it): nothing was loaded; load again")


def _prepare(state: TrainingState, load_dir: Path, tag: str | None, load_module_strict: bool,
             load_optimizer_states: bool, load_lr_scheduler_states: bool,
             load_module_only: bool, verify_checksums: bool) -> CheckpointLoad | None:
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = False

    def locate() -> Path | None:
        return checkpoint_directory(load_dir, tag)   # a save dir, or one checkpoint's

    def needed(save: PinnedSave) -> list[str]:
        saved = saved_ranks(save.manifest, save.directory)
        return [model_file(r) for r in range(saved)] + \
            ([optim_file(r) for r in range(saved)] if load_optimizer_states else [])

    # each rank hashes its share of the files; prepare_load's agreement fails every rank when
    # one finds a damaged file
    save = pin_save(locate, needed, verify_checksums, share=(state.rank, state.world_size))
    if save is None:
        log.warning("no %s/latest: no checkpoint loaded (pass tag= to load a given one)", load_dir)
        return None
    try:
        restore = None if load_module_only else read_restore(
            state, save.manifest, load_optimizer_states, load_lr_scheduler_states, save.directory)
    except BaseException:
        save.close()
        raise
    load = CheckpointLoad(state, save, restore)
    try:
        load.check(load_module_strict, load_optimizer_states)
        state.run.release_units()
    except BaseException:
        load.close()
        raise
    return load
