"""Weights out of infinity: a checkpoint's as a plain ``state_dict`` without an engine
(DeepSpeed's ``zero_to_fp32``), or an engine's as one safetensors file (DeepSpeed's
``save_16bit_model``), to load into a model built without infinity, or to publish."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from infinity.checkpoint.layout import persistent_buffers, unit_layouts
from infinity.checkpoint.save import RankAgreement, check_at_rest
from infinity.checkpoint.sliced import model_files_of, open_ranks, param_shapes
from infinity.checkpoint.tensor_file import TensorFileWriter
from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import ChunkPool, parts_of, save_entries


def consolidated_state_dict(checkpoint_dir: str | Path, tag: str | None = None,
                            verify_checksums: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter (trainable ones in fp32) and persistent buffer of the checkpoint by its
    ``state_dict`` name, tied parameters under each of their names (sharing one tensor).
    ``checkpoint_dir`` is a save directory (then ``tag`` or ``latest`` picks the checkpoint)
    or one checkpoint's directory."""
    directory, manifest, files = model_files_of(Path(checkpoint_dir), tag, verify_checksums)
    with open_ranks(directory, files, param_shapes(manifest)) as reader:   # every rank's slices
        state = {name: reader.read(name) for name in reader.tensors}
    for alias, name in manifest.get("aliases", {}).items():
        state[alias] = state[name]
    return state


def save_model_weights(state: TrainingState, path: str | Path, with_frozen: bool = True) -> Path:
    """The model's weights in their compute dtype (what a forward uses) as one safetensors file
    with ``{"format": "pt"}`` metadata (what ``transformers`` loads), streamed unit by unit;
    a tied parameter is saved once, under the name of the unit that owns it (without
    ``with_frozen``, parameters that do not train are left out). Written to a
    temporary name, fsync'd, then renamed: an existing file is replaced only by a whole one."""
    path = Path(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        raise ValueError(f"{path.name}: infinity writes safetensors only (no pickle); name the "
                         "file *.safetensors (transformers loads model.safetensors)")
    check_at_rest(state, "save_16bit_model")
    state.flush()
    layouts = unit_layouts(state)
    buffers = persistent_buffers(state.module)
    saved = {id(lay): lay.entries if with_frozen else lay.trainable for lay in layouts}
    tensors = [(e.name, lay.unit.dtype, tuple(e.shape)) for lay in layouts for e in saved[id(lay)]]
    tensors += [(name, buf.dtype, tuple(buf.shape)) for name, buf in buffers]
    writes = state.rank == 0
    # with several ranks each unit is gathered by all and rank 0 writes the file (DeepSpeed's
    # stage3_gather_16bit_weights_on_model_save)
    return RankAgreement(state, "no file was written").all_succeed(
        lambda: _write_weights(state, path, layouts, saved, buffers, tensors, writes),
        "write the weights") if state.world_size > 1 else \
        _write_weights(state, path, layouts, saved, buffers, tensors, writes)


def _write_weights(state: TrainingState, path: Path, layouts, saved, buffers, tensors,
                   writes: bool) -> Path:
    gathered = state.world_size > 1
    partial = path.with_name(f".{path.name}.partial")
    writer = None
    if writes:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)
        writer = TensorFileWriter(partial, tensors, {"format": "pt"})
    try:
        chunks = ChunkPool(state.manager, state.lendable_pools)
        for lay in layouts:
            emit = (lambda p, v: writer.append(p[0].name, v)) if writes else (lambda p, v: None)
            if gathered:
                with state.gathered(lay.unit):
                    if writes:
                        save_entries(lay.unit.flat, parts_of(saved[id(lay)]), chunks, emit)
                continue
            placed = lay.placed_params
            save_entries(placed.source, parts_of(saved[id(lay)], placed.covers), chunks, emit,
                         origin=placed.origin)
        if writer is not None:
            for name, buf in buffers:
                writer.append(name, buf)
            writer.close()
            os.replace(partial, path)
    except BaseException:
        if writer is not None:
            writer.abort()
            partial.unlink(missing_ok=True)
        raise
    return path
