"""Adam's moments in a checkpoint's tensor files, in the format the optimizer keeps them (issue
38): which tensors a save writes for them, and each saved part read back as it was stored.

[Note: moments in their format in a checkpoint]
A trainable parameter's moments are ``<name>.exp_avg`` and ``<name>.exp_avg_sq`` in the
rank's optim file (a slice ``<name>.exp_avg#<first>`` with several ranks: see [Note:
checkpoints by parameter and slice] in checkpoint/layout.py), in the dtype of the unit's
state (planner/state_format.py): F32 for fp32 moments (these files hold the tensors they
held before the formats, which a version 1 reader reads), BF16 for bf16 moments, U8 for int8 ones: the codes into the
signed map (exp_avg) or the unsigned one (exp_avg_sq) of ``adam_formats.quantization_map``.

An int8 part (a parameter, or the slice of it a rank saves) comes with ``<file tensor>.scales``
(F32): the absmax of every block of the saving state's grid that the part touches, in order
(block j of a state covers its elements [j * 2048, (j + 1) * 2048), i.e. unit elements from the
state's first one). The file's ``__metadata__`` says where the part begins in its first block:
``int8_first`` is a JSON object {scales tensor: position}, ``int8_block`` the block size. So
element i of a part is ``map[code[i]] * scales[(first + i) // block]``: every element is
dequantizable on its own, whatever rank count or unit layout loads it. A block holding two
parameters has its scale in both parameters' scales tensors (4 bytes per 2048 elements, once
more per parameter boundary).

The master: a unit with a bf16 master (``optimizer_master`` "bf16") has no fp32 one; its
model file holds the trainable parameters in BF16 (``UnitLayout.file_dtype``), which are its
master. So every format is told by the files alone: F32 / BF16 / U8 moments, F32 / BF16
trainable parameters; a checkpoint from before the formats is all F32, and loads as one.

A load converts what it reads into the loading state's format (checkpoint/moment_load.py):
codes and scales are copied raw where the loading block is the saved one (bit-exact resume),
and anything else is read as fp32 (upcast, or dequantized) and converted on the loading
state's own grid, with a log line saying what was converted and how far it moved.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from infinity.checkpoint.layout import MOMENTS, UnitLayout
from infinity.checkpoint.sliced import SlicedReader
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader
from infinity.checkpoint.unit_io import Part
from infinity.optim.adam_formats import quantization_map
from infinity.planner.state_format import QBLOCK

__all__ = ["SCALES", "SavedPart", "moment_parts", "optim_table", "write_scales",
           "SavedMoments", "Piece", "FORMAT_OF_DTYPE"]

SCALES = ".scales"
"""The suffix of an int8 part's scales tensor: ``<file tensor of its codes>.scales``."""
FIRST_KEY = "int8_first"
BLOCK_KEY = "int8_block"
FORMAT_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}
"""A moment's format, by the dtype of its file tensor."""


def scales_name(file_name: str) -> str:
    return file_name + SCALES


def blocks_of(first: int, count: int, block: int = QBLOCK) -> int:
    """Blocks touched by ``count`` elements starting at position ``first`` of a block."""
    return 0 if count <= 0 else (first + count + block - 1) // block


# -- save ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SavedPart:
    """One part of a moment a rank saves: its file tensor, and for int8 the blocks of the
    state's scales it touches, beginning at position ``first`` of the first."""

    part: Part
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: tuple[int, int] | None = None
    first: int = 0

    @property
    def scales(self) -> str:
        return scales_name(self.name)


def moment_parts(lay: UnitLayout, moment: str) -> list[SavedPart]:
    """The parts of ``moment`` (exp_avg or exp_avg_sq) that this rank saves of ``lay``'s
    state, in file order."""
    state = lay.state
    store = getattr(state, moment)
    int8 = state.fmt.moments == "int8"
    found = []
    for part in lay.saved_parts(lay.placed_state(store), lay.trainable):
        name, shape = lay.tensor_name(part, f".{moment}")
        if not int8:
            found.append(SavedPart(part, name, shape, store.dtype))
            continue
        a = part[1] - state.lo                 # the part's first element in the state
        b0 = a // QBLOCK
        found.append(SavedPart(part, name, shape, store.dtype,
                               (b0, b0 + blocks_of(a % QBLOCK, part[2] - part[1])), a % QBLOCK))
    return found


def optim_table(layouts: list[UnitLayout], metadata: dict[str, str]
                ) -> tuple[list[tuple], dict[str, str]]:
    """The optim file's tensors (name, dtype, shape) in order: each unit's moments, each
    moment's parts then their scales (int8); and its metadata: ``metadata`` plus, when int8
    parts are in it, where each begins in its block (see the note). A file of fp32 moments
    has the tensors and metadata it had before the formats."""
    tensors: list[tuple] = []
    firsts: dict[str, int] = {}
    for lay in layouts:
        if lay.state is None:
            continue
        for moment in MOMENTS:
            parts = moment_parts(lay, moment)
            tensors += [(p.name, p.dtype, p.shape) for p in parts]
            for p in parts:
                if p.blocks is not None:
                    tensors.append((p.scales, torch.float32, (p.blocks[1] - p.blocks[0],)))
                    firsts[p.scales] = p.first
    if firsts:
        metadata = {**metadata, BLOCK_KEY: str(QBLOCK),
                    FIRST_KEY: json.dumps(firsts, separators=(",", ":"))}
    return tensors, metadata


def write_scales(append, lay: UnitLayout, moment: str, parts: list[SavedPart]) -> None:
    """Hand each int8 part's scales to ``append(name, values)`` (after its moment's codes)."""
    if not any(p.blocks is not None for p in parts):
        return
    store = getattr(lay.state, f"{moment}_scales")
    scales = store.tensor          # host memory (optim/state_formats.py)
    for p in parts:
        if p.blocks is not None:
            append(p.scales, scales[p.blocks[0]:p.blocks[1]])


# -- load ----------------------------------------------------------------------------------
@dataclass
class Piece:
    """Elements [start, start + count) of a saved moment, from one file slice, as stored:
    ``stored`` in the file's dtype; for int8 also its scales, from the block in which
    element ``start`` sits at position ``first``, of ``block`` elements."""

    start: int
    count: int
    fmt: str
    stored: torch.Tensor
    scales: torch.Tensor | None = None
    first: int = 0
    block: int = QBLOCK
    signed: bool = True

    def values(self) -> torch.Tensor:
        """The fp32 values (int8: dequantized, what the saving run's kernel read)."""
        if self.scales is None:
            return self.stored.float()
        index = (torch.arange(self.count) + self.first) // self.block
        return _qmap(self.signed)[self.stored.long()] * self.scales[index]


_QMAPS: dict[bool, torch.Tensor] = {}


def _qmap(signed: bool) -> torch.Tensor:
    if signed not in _QMAPS:
        _QMAPS[signed] = quantization_map(signed)
    return _QMAPS[signed]


def signed_moment(suffix: str) -> bool:
    """exp_avg (m) is coded with the signed map, exp_avg_sq (v) with the unsigned one."""
    return not suffix.endswith("exp_avg_sq")


class SavedMoments:
    """The moments of a checkpoint's optim files (one ``SlicedReader`` of every saving rank's)
    read part by part as stored, after ``check`` found each int8 part whole."""

    def __init__(self, reader: SlicedReader, directory: Path) -> None:
        self.reader = reader
        self.directory = directory
        self._firsts: dict[TensorFileReader, dict[str, int]] = {}
        self._blocks: dict[TensorFileReader, int] = {}

    def dtypes_of(self, name: str, start: int, end: int) -> set[torch.dtype]:
        """The file dtypes of the slices holding elements [start, end) of ``name``."""
        return {r.tensors[f].dtype for _, _, r, f in self.reader.slices(name, start, end)}

    def _metadata(self, reader: TensorFileReader) -> tuple[dict[str, int], int]:
        if reader not in self._firsts:
            meta = reader.metadata
            firsts, block = {}, QBLOCK
            try:
                if FIRST_KEY in meta:
                    firsts = json.loads(meta[FIRST_KEY])
                    block = int(meta.get(BLOCK_KEY, ""))
                if not isinstance(firsts, dict) or block < 1 or not all(
                        type(v) is int and 0 <= v < block for v in firsts.values()):
                    raise ValueError("not {scales tensor: position in its block}")
            except ValueError as exc:
                raise CheckpointError(
                    f"checkpoint {self.directory}: {reader.path.name}'s metadata "
                    f"{FIRST_KEY} / {BLOCK_KEY} ({str(meta.get(FIRST_KEY))[:120]!r}, "
                    f"{meta.get(BLOCK_KEY)!r}) is unreadable ({exc}): the file is damaged. Load "
                    "another tag, or pass load_optimizer_states=False to load the model only"
                ) from None
            self._firsts[reader], self._blocks[reader] = firsts, block
        return self._firsts[reader], self._blocks[reader]

    def check(self, names: Iterable[str]) -> None:
        """Refuse (CheckpointError) a moment stored in a dtype that is no format, or an int8
        part whose scales or position are missing or do not fit its codes."""
        for name in names:
            if name not in self.reader.tensors:
                continue
            for first, count, reader, file_name in self.reader.slices(name):
                self._check_slice(reader, file_name, count)

    def _check_slice(self, reader: TensorFileReader, file_name: str, count: int) -> None:
        where = f"checkpoint {self.directory}: {reader.path.name} tensor {file_name}"
        fix = ("the file is damaged or was not written by infinity. Load another tag, or pass "
               "load_optimizer_states=False to load the model only")
        dtype = reader.tensors[file_name].dtype
        scales = scales_name(file_name)
        if dtype not in FORMAT_OF_DTYPE:
            raise CheckpointError(f"{where} is {dtype}: Adam's moments are stored as float32, "
                                  f"bfloat16 or uint8 (int8 codes) only; {fix}")
        if dtype != torch.uint8:
            if scales in reader.tensors:
                raise CheckpointError(f"{where} has int8 scales ({scales}) but its codes are "
                                      f"{dtype}, not uint8; {fix}")
            return
        firsts, block = self._metadata(reader)
        if scales not in reader.tensors or scales not in firsts:
            missing = "tensor" if scales not in reader.tensors else f"metadata {FIRST_KEY} entry"
            raise CheckpointError(f"{where} holds int8 codes but its scales {missing} ({scales}) "
                                  f"is missing, so its values cannot be read; {fix}")
        info = reader.tensors[scales]
        need = blocks_of(firsts[scales], count, block)
        if info.dtype != torch.float32 or info.shape != (need,):
            raise CheckpointError(
                f"{where}: its scales {scales} are {info.dtype} {list(info.shape)}, but "
                f"{count} codes from position {firsts[scales]} of a {block}-element block need "
                f"float32 [{need}]; {fix}")

    def pieces(self, name: str, start: int, count: int) -> list[Piece]:
        """Elements [start, start + count) of moment tensor ``name`` as stored, slice by
        slice, in order."""
        signed = signed_moment(name)
        found = []
        for first, n, reader, file_name in self.reader.slices(name, start, start + count):
            a, b = max(start, first), min(start + count, first + n)
            dtype = reader.tensors[file_name].dtype
            stored = torch.empty(b - a, dtype=dtype)
            reader.read_into(file_name, stored, a - first)
            if dtype != torch.uint8:
                found.append(Piece(a, b - a, FORMAT_OF_DTYPE[dtype], stored))
                continue
            firsts, block = self._metadata(reader)
            position = firsts[scales_name(file_name)] + (a - first)
            b0 = position // block
            scales = torch.empty(blocks_of(position % block, b - a, block), dtype=torch.float32)
            reader.read_into(scales_name(file_name), scales, b0)
            found.append(Piece(a, b - a, "int8", stored, scales, position % block, block, signed))
        return found
