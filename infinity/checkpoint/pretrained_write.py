"""Weights out as a Hugging Face directory: sharded safetensors with an index, ``config.json``.

``save_pretrained(state, directory, ...)`` writes an engine's current weights (after its last
step has landed), streamed unit by unit through the checkpoint chunks, so a model of any size
needs about one chunk of host memory (with several ranks each unit is gathered, one at a time,
and rank 0 writes). ``export_pretrained(checkpoint_dir, directory, ...)`` writes the same from
a checkpoint with no engine (``infinity export``), reading each tensor's slices from every
rank's file (DeepSpeed's ``zero_to_fp32`` with the Hugging Face layout).

The layout is transformers': ``model.safetensors`` when the weights fit in ``max_shard_size``,
else ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes}, "weight_map": {tensor: file}}``); tensors in ``{"format": "pt"}``
files, a shard closed before the tensor that would take it past the size (a tensor larger than
the size gets a shard of its own). A tied parameter is written once, under the name
transformers keeps (the source of the model's ``_tied_weights_keys``). A save over an earlier one replaces it as a whole, at one
commit point, under the directory's save lock (see [Note: committing a weights directory] in
checkpoint/weights_dir.py): a reader loads one save or the other, never a mix.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.checkpoint.layout import UnitLayout, persistent_buffers, unit_layouts
from infinity.checkpoint.save import RankAgreement, check_at_rest
from infinity.checkpoint.sharded_writer import ShardedWriter, Table, numel, write_weights
from infinity.checkpoint.sliced import (
    model_files_of,
    open_ranks,
    param_shapes,
    refuse_without_frozen,
)
from infinity.checkpoint.tensor_file import CheckpointError, itemsize
from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import ChunkPool, parts_of, read_chunks, save_entries

log = get_logger("checkpoint")

DEFAULT_MAX_SHARD_SIZE = "5GB"
EXPORT_PIECE_BYTES = 16 << 20      # an export reads each tensor this much at a time
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def shard_bytes(value: int | str) -> int:
    """``max_shard_size`` as bytes: an int, or transformers' strings ("5GB" = 5e9 bytes,
    "500MiB" = 500 * 2**20)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", value.upper())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"max_shard_size {value!r}: expected bytes or a size like "
                             "\"5GB\" or \"500MiB\"")
        size = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise TypeError(f"max_shard_size must be an int or a string like \"5GB\", got "
                        f"{type(value).__name__}")
    if size <= 0:
        raise ValueError(f"max_shard_size {value!r} must be positive")
    return size


def out_dtype(value: Any, default: torch.dtype) -> torch.dtype:
    """The dtype asked for (None: ``default``): a torch dtype or "fp32", "bf16", "fp16"."""
    if value is None:
        return default
    if isinstance(value, torch.dtype) and value in (torch.float32, torch.bfloat16, torch.float16):
        return value
    if isinstance(value, str) and value.lower().replace("torch.", "") in DTYPES:
        return DTYPES[value.lower().replace("torch.", "")]
    raise ValueError(f"dtype {value!r}: expected one of fp32, bf16, fp16 (or the torch dtypes)")


# -- from an engine ---------------------------------------------------------------------------
def saved_names(model: nn.Module, layouts: Sequence[UnitLayout],
                tie_targets: Collection[str] = ()) -> dict[Any, str]:
    """Each entry's name in the files: its own, or for a tied parameter a name that is not
    among ``tie_targets`` (the names a model ties to another: ``lm_head.weight`` ->
    ``model.embed_tokens.weight``)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    chosen = {}
    for lay in layouts:
        for entry in lay.entries:
            aliases = names.get(id(entry.param), [entry.name])
            kept = [n for n in aliases if n not in tie_targets]
            chosen[entry] = entry.name if entry.name in kept or not kept else kept[0]
    return chosen


def save_pretrained(state: TrainingState, directory: str | Path, *,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                    dtype: torch.dtype | None = None, texts: Mapping[str, str] | None = None,
                    carry_from: Path | None = None, tie_targets: Collection[str] = (),
                    what: str = "save_pretrained",
                    hub_name: Callable[[str], str] | None = None,
                    hub_split: Callable[[str, torch.Tensor],
                                        list[tuple[str, torch.Tensor]] | None] | None = None
                    ) -> Path:
    """The engine's current weights (every unit, after the last step lands) and persistent
    buffers into ``directory`` in ``dtype``: floating-point buffers too, as ``model.to(dtype)``
    and then transformers' ``save_pretrained`` would write them, and as ``infinity export
    --dtype`` writes them (``engine.save_pretrained`` always passes one: by default the compute
    dtype, so a bf16 engine's buffers are saved in bf16; None, for callers of this function:
    parameters in the compute dtype, buffers as the model holds them), with ``texts``
    (config.json ...) and the files ``carry_from`` has; a tied parameter under a name not in
    ``tie_targets`` (``saved_names``); each name as ``hub_name`` gives it (transformers'
    renamings reversed: GPT-NeoX's ``lm_head`` saved as ``embed_out``), or as the tensors
    ``hub_split`` splits it into (a MoE's fused experts one by one: the parameter is gathered
    whole, about a unit, then split). Every rank calls it; rank 0 writes."""
    directory = Path(directory)
    max_bytes = shard_bytes(max_shard_size)
    check_at_rest(state, what)
    state.run.flush()
    buffers = [(name, buf.detach().to(dtype) if dtype is not None and buf.is_floating_point()
                else buf.detach()) for name, buf in persistent_buffers(state.module)]
    dtype = dtype or state.compute_dtype
    layouts = unit_layouts(state)
    names = saved_names(state.module, layouts, tie_targets)
    tensors, splits = hub_table(
        [(names[e], dtype, tuple(e.shape)) for lay in layouts for e in lay.entries]
        + [(name, buf.dtype, tuple(buf.shape)) for name, buf in buffers], hub_name, hub_split)
    dup = {n for n in (t[0] for t in tensors) if sum(1 for t in tensors if t[0] == n) > 1}
    if dup:
        raise CheckpointError(f"{what}: two tensors would be saved as {sorted(dup)[0]}")
    writes = state.rank == 0

    def hub_layout(writer: ShardedWriter) -> Any:
        return _HubLayoutWriter(writer, splits, hub_split, hub_name) \
            if splits or hub_name else writer

    def fill(writer: Any) -> None:
        _stream_units(state, layouts, names, dtype, writer)
        if writer is not None:
            for name, buf in buffers:
                if buf.numel():
                    writer.append(name, buf)

    agreement = RankAgreement(state, "no file was written") if state.world_size > 1 else None

    def write() -> Path:
        write_weights(directory, tensors, max_bytes, fill, layout=hub_layout, texts=texts,
                      carry_from=carry_from, what=what, writes=writes, agreement=agreement)
        return directory

    if agreement is not None:
        return agreement.all_succeed(write, "save the weights")
    return write()


class _HubLayoutWriter:
    """A writer that gathers each tensor of ``shapes`` (a name -> its shape) whole from its
    pieces, then appends the tensors ``split`` makes of it (transformers' Hub layout); every
    other tensor goes straight through, under ``rename(name)`` where given."""

    def __init__(self, writer: ShardedWriter, shapes: Mapping[str, tuple[int, ...]],
                 split: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]] | None],
                 rename: Callable[[str], str] | None = None) -> None:
        self.writer, self.shapes, self.split, self.rename = writer, shapes, split, rename
        self._whole: dict[str, tuple[torch.Tensor, int]] = {}

    def append(self, name: str, values: torch.Tensor) -> None:
        shape = self.shapes.get(name)
        if shape is None:
            self.writer.append(self.rename(name) if self.rename else name, values)
            return
        whole, filled = self._whole.get(name) or (torch.empty(numel(shape), dtype=values.dtype), 0)
        whole[filled:filled + values.numel()].copy_(values.reshape(-1))
        filled += values.numel()
        if filled < whole.numel():
            self._whole[name] = (whole, filled)
            return
        self._whole.pop(name, None)
        for part, value in self.split(name, whole.view(shape)) or []:
            self.writer.append(part, value.contiguous())


def hub_table(tensors: Table, hub_name: Callable[[str], str] | None,
              hub_split: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]] | None]
              | None) -> tuple[Table, dict[str, tuple[int, ...]]]:
    """``tensors`` (name, dtype, shape) as transformers saves them, each renamed by
    ``hub_name`` or split into several (or none) by ``hub_split`` (shapes from the meta
    device); and the split ones' shapes, by their own names (for ``_HubLayoutWriter``)."""
    table: Table = []
    splits: dict[str, tuple[int, ...]] = {}
    for name, dtype, shape in tensors:
        parts = hub_split(name, torch.empty(shape, dtype=dtype, device="meta")) \
            if hub_split else None
        if parts is not None:           # [] drops it
            splits[name] = tuple(shape)
            table += [(part, dtype, tuple(value.shape)) for part, value in parts]
        else:
            table.append((hub_name(name) if hub_name else name, dtype, tuple(shape)))
    return table, splits


def _stream_units(state: TrainingState, layouts: Sequence[UnitLayout], names, dtype: torch.dtype,
                  writer: ShardedWriter | None) -> None:
    chunks = ChunkPool(state.manager, state.lendable_pools)

    def emit(part, values: torch.Tensor) -> None:
        if writer is not None:
            writer.append(names[part[0]], values.to(dtype))

    for lay in layouts:
        # an fp32 save of a 16-bit engine reads the trainable parameters' fp32 master
        from_master = dtype == torch.float32 and lay.master is not None and bool(lay.trainable)
        if state.world_size > 1:
            with state.run.gathered(lay.unit):
                if from_master:
                    full = _gathered_master(state, lay, chunks)
                    save_entries(full, parts_of(lay.trainable), chunks, emit)
                    save_entries(lay.unit.flat, parts_of(lay.frozen), chunks, emit)
                else:
                    save_entries(lay.unit.flat, parts_of(lay.entries), chunks, emit)
            continue
        if from_master:
            master = lay.placed_state(lay.master)
            save_entries(master.source, parts_of(lay.trainable, master.covers), chunks, emit,
                         origin=master.origin)
            placed, entries = lay.placed_params, lay.frozen
        else:
            placed, entries = lay.placed_params, lay.entries
        save_entries(placed.source, parts_of(entries, placed.covers), chunks, emit,
                     origin=placed.origin)


def _gathered_master(state: TrainingState, lay: UnitLayout, chunks: ChunkPool) -> torch.Tensor:
    """The unit's fp32 master whole, on every rank: each rank's own range of it (its shard of
    the trainable part), all-gathered (one unit of fp32 host memory)."""
    unit = lay.unit
    full = torch.zeros(unit.flat_numel, dtype=torch.float32)
    placed = lay.placed_state(lay.master)
    lo, hi = placed.covers
    if hi > lo:
        for a, values in read_chunks(placed.source, 0, hi - lo, chunks):
            full[lo + a:lo + a + values.numel()].copy_(values[:hi - lo - a])
    if state.world_size > 1:
        state.comm.all_gather(full, tag=unit.index)
    return full


def trainable_masters(state: TrainingState, params: Collection[int], what: str
                      ) -> dict[int, torch.Tensor]:
    """The fp32 masters of the trainable parameters among ``params`` (by id) whose units keep
    one (16-bit compute), whole, after the last step lands: for a save that must write them
    as the optimizer holds them (a PEFT adapter: PEFT keeps adapters in fp32 on a 16-bit base
    and saves them so). Every rank calls it (the masters are gathered)."""
    check_at_rest(state, what)
    state.run.flush()
    chunks = ChunkPool(state.manager, state.lendable_pools)
    found: dict[int, torch.Tensor] = {}
    for lay in unit_layouts(state):
        wanted = [e for e in lay.trainable if id(e.param) in params]
        if lay.master is None or not wanted:
            continue
        full = _gathered_master(state, lay, chunks)
        for e in wanted:
            found[id(e.param)] = full[e.offset:e.offset + e.numel].reshape(e.shape).clone()
    return found


# -- from a checkpoint (no engine) --------------------------------------------------------
def export_pretrained(checkpoint_dir: str | Path, directory: str | Path, *,
                      tag: str | None = None, dtype: torch.dtype | None = torch.float32,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                      texts: Mapping[str, str] | None = None, carry_from: Path | None = None,
                      verify_checksums: bool = True,
                      hub_names_of: Callable[[str], Any] | None = None) -> Path:
    """A checkpoint's weights (trainable ones from their fp32 master) as a transformers
    directory in ``dtype`` (None: as stored: fp32 masters, frozen ones in the compute dtype),
    a tensor at a time; ``config.json`` from ``texts`` or else the checkpoint's manifest
    (``model_files``, saved by engines over a transformers model). ``hub_names_of(config
    text)``: the model's conversions to the Hub layout (``to_hub``, ``split``: see
    engine/hf_conversions.py), applied as ``save_pretrained`` applies them."""
    save, files = model_files_of(Path(checkpoint_dir), tag, verify_checksums, tag_hint="--tag")
    with save:
        return _export_pinned(save, files, directory, dtype, max_shard_size, texts, carry_from,
                              hub_names_of)


def _recorded_source(checkpoint: Path, recorded: Any) -> Path | None:
    """The directory the checkpoint's model was loaded from, where its tokenizer files are,
    when it is still there (else a warning: the export has no tokenizer)."""
    if not isinstance(recorded, str) or not recorded:
        return None
    path = Path(recorded)
    if path.is_dir():
        log.info("export %s: the tokenizer files from %s, where its model was loaded from",
                 checkpoint, path)
        return path
    log.warning("export %s: its model was loaded from %s, which is not there any more: the "
                "export has no tokenizer files; pass --config DIR (a directory holding them)",
                checkpoint, path)
    return None


SHAPE_KEYS = ("model_type", "architectures", "num_hidden_layers", "hidden_size",
              "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_local_experts", "num_experts", "n_routed_experts",
              "moe_intermediate_size", "n_layer", "n_embd", "n_head", "n_inner", "d_model",
              "num_layers", "num_decoder_layers", "d_ff", "encoder_layers", "decoder_layers")
"""config.json keys that decide a transformers model's parameters (their names and shapes)."""


def check_config_matches(saved: Any, given: Any, checkpoint: Path) -> None:
    """Refuse a ``--config`` whose model is not the checkpoint's own (its config.json, kept in
    the manifest): transformers would build that model over the exported weights, its extra
    layers random ("newly initialized"), without a word from the export. Other keys (the
    tokenizer's, generation settings) may differ: that is what --config is for."""
    if not isinstance(saved, str) or not isinstance(given, str):
        return
    try:
        ours, theirs = json.loads(saved), json.loads(given)
    except json.JSONDecodeError:
        return          # the given one is read (and refused) where the export parses it
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return
    differ = [f"{key} {ours.get(key)!r} in the checkpoint, {theirs.get(key)!r} given"
              for key in SHAPE_KEYS if key in ours and key in theirs   # a key left out: no
              and ours.get(key) != theirs.get(key)]                   # word either way
    if differ:
        raise ValueError(
            f"export {checkpoint}: --config describes another model than the checkpoint's own "
            f"config.json ({'; '.join(differ)}): transformers would build that model over "
            "these weights, what does not match left random. Leave --config out (the "
            "checkpoint's config is exported), or give the config of the model trained")


PEFT_PREFIX = "base_model.model."
"""How every parameter name of a PEFT ``PeftModel`` begins."""


def _export_pinned(save, files: list[str], directory: str | Path, dtype: torch.dtype | None,
                   max_shard_size: int | str, texts: Mapping[str, str] | None,
                   carry_from: Path | None, hub_names_of: Callable[[str], Any] | None = None
                   ) -> Path:
    source, manifest = save.directory, save.manifest
    refuse_without_frozen(source, manifest, "export", "export from the engine that holds the "
                          "whole model (engine.save_pretrained), or for an adapter (LoRA) save "
                          "the adapter alone (save_pretrained on the PEFT model)")
    shapes = param_shapes(manifest)
    wrapped = [name for name in shapes if name.startswith(PEFT_PREFIX)]
    if wrapped:
        # a PEFT model's names (base_model.model....base_layer, lora_A.default): transformers
        # would load none of them, every weight of the model left random
        raise ValueError(
            f"export {source}: the checkpoint is of a PEFT model ({wrapped[0]}, ...), whose "
            "names no transformers model loads (every weight would be left random). Save the "
            "adapter with save_pretrained on the engine that trains it, or the merged model "
            "with engine.save_pretrained(dir, merged=True) after load_checkpoint")
    model_texts = dict(texts or {})
    saved_texts = manifest.get("model_files") or {}
    check_config_matches(saved_texts.get("config.json"), model_texts.get("config.json"), source)
    for name, text in saved_texts.items():
        if isinstance(name, str) and isinstance(text, str) and Path(name).name == name:
            model_texts.setdefault(name, text)
    if "config.json" not in model_texts:
        log.warning("export %s: the checkpoint holds no config.json (its model was not a "
                    "transformers model, or an older infinity saved it): pass --config",
                    source)
    if dtype is not None and "config.json" in model_texts:
        model_texts["config.json"] = config_with_dtype(model_texts["config.json"], dtype)
    if carry_from is None:
        carry_from = _recorded_source(source, manifest.get("model_source"))
    out = Path(directory)
    conversions = hub_names_of(model_texts["config.json"]) \
        if hub_names_of is not None and "config.json" in model_texts else None
    with open_ranks(save, files, shapes) as reader:
        table: Table = []
        for name, info in reader.tensors.items():
            keep = info.dtype if dtype is None or not info.dtype.is_floating_point else dtype
            table.append((name, keep, tuple(info.shape)))
        stored = table
        floats = {keep for _, keep, _ in table if keep.is_floating_point}
        if dtype is None and floats and "config.json" in model_texts and \
                "config.json" not in (texts or {}):     # a config given is written as given
            # as stored: the checkpoint's config names the widest written (it kept the run's
            # compute dtype, bf16 over fp32 masters: transformers' default load lost them)
            model_texts["config.json"] = config_with_dtype(
                model_texts["config.json"], max(floats, key=itemsize))
        if conversions is not None:     # the Hub's names and per-expert tensors
            table, splits = hub_table(stored, conversions.to_hub, conversions.split)

        def fill(writer: ShardedWriter | None) -> None:
            assert writer is not None
            if conversions is not None:
                writer = _HubLayoutWriter(  # type: ignore[assignment]
                    writer, splits, conversions.split, conversions.to_hub)
            buf = torch.empty(EXPORT_PIECE_BYTES, dtype=torch.uint8)
            for name, keep, shape in stored:
                info = reader.info(name)
                step = max(1, EXPORT_PIECE_BYTES // itemsize(info.dtype))
                n = numel(shape)
                for a in range(0, n, step):
                    piece = buf[:min(step, n - a) * itemsize(info.dtype)].view(info.dtype)
                    reader.read_into(name, piece, a)
                    writer.append(name, piece.to(keep))

        write_weights(out, table, shard_bytes(max_shard_size), fill, texts=model_texts,
                      carry_from=carry_from, what="export")
    return out


def config_with_dtype(text: str, dtype: torch.dtype) -> str:
    """A config.json's text saying the weights are ``dtype`` (transformers' "dtype" key, and
    "torch_dtype" where an older one wrote it)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config.json is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("config.json is not a JSON object")
    name = str(dtype).replace("torch.", "")
    data["dtype"] = name
    if "torch_dtype" in data:
        data["torch_dtype"] = name
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
