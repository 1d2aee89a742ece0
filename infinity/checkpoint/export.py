"""Weights out of infinity: a checkpoint's as a plain ``state_dict`` without an engine
(DeepSpeed's ``zero_to_fp32``), or an engine's as one safetensors file (DeepSpeed's
``save_16bit_model``), to load into a model built without infinity, or to publish."""
from __future__ import annotations

from pathlib import Path

import torch

from infinity.checkpoint.layout import persistent_buffers, unit_layouts
from infinity.checkpoint.save import RankAgreement, check_at_rest
from infinity.checkpoint.sliced import (
    model_files_of,
    open_ranks,
    param_shapes,
    refuse_without_frozen,
)
from infinity.checkpoint.sharded_writer import ShardedWriter, write_weights
from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import ChunkPool, parts_of, save_entries


def consolidated_state_dict(checkpoint_dir: str | Path, tag: str | None = None,
                            verify_checksums: bool = True,
                            trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (trainable ones in fp32) and persistent buffer of the checkpoint by its
    ``state_dict`` name, tied parameters under each of their names (sharing one tensor).
    ``checkpoint_dir`` is a save directory (then ``tag`` or ``latest`` picks the checkpoint)
    or one checkpoint's directory. A checkpoint saved with ``exclude_frozen_parameters`` holds
    only the trainable parameters: it is refused unless ``trainable_only`` says that is what
    you want (a partial ``state_dict``, to load over the model those parameters were trained
    on with ``strict=False``; a tied name of a parameter left out is left out too). On a
    checkpoint that holds every parameter, ``trainable_only`` changes nothing."""
    save, files = model_files_of(Path(checkpoint_dir), tag, verify_checksums)
    manifest = save.manifest
    with save:
        if not trainable_only:
            refuse_without_frozen(save.directory, manifest, "consolidated_state_dict",
                                  "pass trainable_only=True for those alone (a partial "
                                  "state_dict, to load with strict=False over the base model)")
        with open_ranks(save, files, param_shapes(manifest)) as reader:   # every rank's slices
            state = {name: reader.read(name) for name in reader.tensors}
    # a bf16 master (optimizer_master "bf16") is saved as the bf16 parameter: its fp32 value
    params = manifest.get("params", {})
    for name, tensor in state.items():
        if tensor.dtype == torch.bfloat16 and isinstance(params.get(name), dict) \
                and params[name].get("trainable"):
            state[name] = tensor.float()
    for alias, name in manifest.get("aliases", {}).items():
        if name not in state and manifest.get("frozen_excluded"):
            continue            # a frozen parameter the save left out (trainable_only)
        state[alias] = state[name]
    return state


def save_model_weights(state: TrainingState, path: str | Path, with_frozen: bool = True) -> Path:
    """The model's weights in their compute dtype (what a forward uses) as one safetensors file
    with ``{"format": "pt"}`` metadata (what ``transformers`` loads), streamed unit by unit;
    a tied parameter is saved once, under the name of the unit that owns it (without
    ``with_frozen``, parameters that do not train are left out). Written to a
    hidden name, fsync'd, then renamed under the directory's save lock: an existing file is
    replaced only by a whole one, and ``model.safetensors`` over an earlier sharded save
    replaces that save as a whole."""
    path = Path(path)
    if path.suffix in (".bin", ".pt", ".pth"):
        raise ValueError(f"{path.name}: infinity writes safetensors only (no pickle); name the "
                         "file *.safetensors (transformers loads model.safetensors)")
    check_at_rest(state, "save_16bit_model")
    state.run.flush()
    layouts = unit_layouts(state)
    buffers = persistent_buffers(state.module)
    saved = {id(lay): lay.entries if with_frozen else lay.trainable for lay in layouts}
    tensors = [(e.name, lay.unit.dtype, tuple(e.shape)) for lay in layouts for e in saved[id(lay)]]
    tensors += [(name, buf.dtype, tuple(buf.shape)) for name, buf in buffers]
    # with several ranks each unit is gathered by all and rank 0 writes the file (DeepSpeed's
    # stage3_gather_16bit_weights_on_model_save)
    agreement = RankAgreement(state, "no file was written") if state.world_size > 1 else None

    def write() -> Path:
        return _write_weights(state, path, layouts, saved, buffers, tensors, agreement)

    return agreement.all_succeed(write, "write the weights") if agreement is not None \
        else write()


def _write_weights(state: TrainingState, path: Path, layouts, saved, buffers, tensors,
                   agreement: RankAgreement | None) -> Path:
    writes = state.rank == 0
    gathered = state.world_size > 1
    chunks = ChunkPool(state.manager, state.lendable_pools)

    def fill(writer: ShardedWriter | None) -> None:
        for lay in layouts:
            emit = (lambda p, v: writer.append(p[0].name, v)) if writer is not None \
                else (lambda p, v: None)
            if gathered:
                with state.run.gathered(lay.unit):
                    if writer is not None:
                        save_entries(lay.unit.flat, parts_of(saved[id(lay)]), chunks, emit)
                continue
            placed = lay.placed_params
            save_entries(placed.source, parts_of(saved[id(lay)], placed.covers), chunks, emit,
                         origin=placed.origin)
        if writer is not None:
            for name, buf in buffers:
                if buf.numel():
                    writer.append(name, buf)

    # one file, whatever its size; named model.safetensors it is the directory's weights
    # (an earlier sharded save there is replaced as a whole, see checkpoint/weights_dir.py)
    write_weights(path.parent, tensors, max_bytes=1 << 62, fill=fill, what="save_16bit_model",
                  writes=writes, single_name=path.name, agreement=agreement)
    return path
