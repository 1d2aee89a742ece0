"""A checkpoint's Adam states loaded into the loading run's formats (issue 38): moments saved in
fp32, bf16 or int8 into stores of any of the three, and the master between fp32 and bf16, with
one log line per load saying what was converted and how far the values moved.

[Note: converting states on load]
- Same format, same grid: a unit with int8 moments copies the saved codes and scales raw into a
  block when every element of the block comes from int8 parts that sit at the same positions of
  their saved blocks and carry the same scale (the saving unit's layout and shard, i.e. a
  resume): the resumed state is the saved one bit for bit. bf16 into bf16 and fp32 into fp32 are
  copies too.
- Otherwise the saved values are read as fp32 (bf16 upcast and int8 dequantized, both exact) and
  converted into the loading state's format on its own grid: rounded to nearest bf16, or
  quantized block by block by the kernels' rule (``adam_formats.quantize_blockwise``). Only these
  are lossy. The error of a conversion is measured against the fp32 values it started from:
  relative per element for bf16 (at most 2^-8 for normal values), and for int8 against the
  block's absmax, which is what the blockwise map is relative to (up to ~0.7% of it for m and
  ~0.35% for v, see [Note: Adam state formats] in optim/adam_formats.py; a relative error per
  element would say nothing, as a value 7 decades under its block's absmax is stored as 0).
  The log line gives the worst of each, and the error relative to the values' norm.
- The master: a bf16-master checkpoint's BF16 parameters seed an fp32 master exactly; an fp32
  master loaded into a bf16-master run is rounded to nearest (the run's own steps round
  stochastically; a load has no step to draw for).
Elements that no saved parameter covers (the gaps between parameters) are zero, stored as
the code of 0.0 in int8.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.checkpoint.moment_files import FORMAT_OF_DTYPE, Piece, SavedMoments, signed_moment
from infinity.checkpoint.sliced import SlicedReader
from infinity.checkpoint.unit_io import ChunkPool, Fill, Part, parts_of, pieces
from infinity.optim.adam_formats import dequantize_blockwise, quantize_blockwise
from infinity.planner.state_format import QBLOCK
from infinity.zero.unit import ParamEntry

__all__ = ["Conversions", "moment_fill", "master_fill", "load_int8"]

ZERO_CODE = {True: 127, False: 0}   # the code of 0.0 in the signed / unsigned map
CONVERT_CHUNK = 1 << 20   # elements converted at a time (~25 bytes of temporaries each)
_MIN_NORMAL = torch.finfo(torch.float32).tiny


@dataclass
class _Tally:
    elements: int = 0
    worst: float = 0.0          # per element: relative (bf16), of the block's absmax (int8)
    err_sq: float = 0.0
    ref_sq: float = 0.0


class Conversions:
    """What one load converted, by (state, from format, to format, lossy), for its one log
    line."""

    def __init__(self) -> None:
        self.tallies: dict[tuple[str, str, str, bool], _Tally] = {}

    def note(self, what: str, source: str, target: str, count: int,
             reference: torch.Tensor | None = None, got: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> None:
        """``count`` elements of ``what`` loaded from ``source`` format into ``target``;
        with ``reference`` (the fp32 values read) and ``got`` (what is stored now, as fp32) a
        lossy conversion, its error measured per element relative to ``scale`` (default:
        |reference|; elements where that is 0 or not finite are left out)."""
        if not count:
            return
        lossy = reference is not None
        tally = self.tallies.setdefault((what, source, target, lossy), _Tally())
        tally.elements += count
        if not lossy:
            return
        diff = (got - reference).abs()
        denominator = reference.abs() if scale is None else scale
        ok = torch.isfinite(diff) & (denominator >= _MIN_NORMAL) & torch.isfinite(denominator)
        if ok.any():
            tally.worst = max(tally.worst, (diff[ok] / denominator[ok]).max().item())
            tally.err_sq += diff[ok].double().square().sum().item()
            tally.ref_sq += reference[ok].double().square().sum().item()

    def line(self) -> str | None:
        """One line of what was loaded in which format, or None when all of it was fp32
        loaded as fp32 (a checkpoint from before the formats into a run without them). The
        two moments are counted once where they went the same way (their counts are equal)."""
        if all(s == t == "fp32" for _, s, t, _ in self.tallies):
            return None
        same: dict[tuple[str, str], int] = {}
        exact: dict[tuple[str, str, str], int] = {}
        said = []
        for (what, source, target, lossy), t in sorted(self.tallies.items()):
            group = "moments" if what in ("exp_avg", "exp_avg_sq") else what
            if not lossy and source == target:
                same[group, source] = max(same.get((group, source), 0), t.elements)
            elif not lossy:
                exact[group, source, target] = max(exact.get((group, source, target), 0),
                                                   t.elements)
            else:
                how = ("rounded to nearest" if target == "bf16" else
                       "requantized on this run's blocks" if source == "int8" else
                       "quantized on this run's blocks")
                per = "of its block's absmax" if target == "int8" else "relative"
                norm = (t.err_sq / t.ref_sq) ** 0.5 if t.ref_sq else 0.0
                said.append(f"{what} {source} -> {target} ({t.elements} elements, lossy, {how}: "
                            f"worst error {t.worst:.2e} {per}, {norm:.2e} of the values' norm)")
        exact_said = [f"{g} {s} -> {t} ({n} elements, exact"
                      + (": the fp32 master seeded from the bf16 parameters)" if g == "master"
                         else ")") for (g, s, t), n in exact.items()]
        same_said = ["as saved, bit-exact: " + ", ".join(
            f"{g} {s} ({n} elements)" for (g, s), n in same.items())] if same else []
        return "; ".join(said + exact_said + same_said)


# -- fp32 and bf16 stores ------------------------------------------------------------------
def moment_fill(saved: SavedMoments, names: dict[ParamEntry, str], suffix: str,
                target: torch.dtype, conversions: Conversions) -> Fill:
    """Fill a host tensor of fp32 or bf16 moments from the saved parts of an entry's moment,
    whatever their formats (read as they are in the same dtype, else converted and noted)."""
    what, to = suffix.lstrip("."), FORMAT_OF_DTYPE[target]
    reader = saved.reader

    def fill(entry: ParamEntry, start: int, out: torch.Tensor) -> None:
        name = names[entry] + suffix
        if saved.dtypes_of(name, start, start + out.numel()) == {out.dtype} \
                and out.is_contiguous():
            reader.read_into(name, out, start)     # as before the formats
            conversions.note(what, to, to, out.numel())
            return
        for piece in saved.pieces(name, start, out.numel()):
            view = out[piece.start - start:piece.start - start + piece.count]
            if piece.stored.dtype == out.dtype:
                view.copy_(piece.stored)
                conversions.note(what, piece.fmt, to, piece.count)
                continue
            values = piece.values()
            view.copy_(values)
            if out.dtype == torch.float32:      # an upcast or a dequantization: exact
                conversions.note(what, piece.fmt, to, piece.count)
            else:
                conversions.note(what, piece.fmt, to, piece.count, values, view.float())

    return fill


def master_fill(base: Fill, model: SlicedReader, names: dict[ParamEntry, str], bf16_master: bool,
                has_state: bool, conversions: Conversions) -> Fill:
    """``base`` (the model file's values, cast to the home's dtype) that notes the master
    conversions of a unit with optimizer states: BF16 parameters (a bf16-master checkpoint)
    into an fp32 home seed an fp32 master; F32 ones into a bf16-master run's parameters are
    rounded to nearest, and the error is measured."""
    if not has_state:
        return base

    def fill(entry: ParamEntry, start: int, out: torch.Tensor) -> None:
        saved = model.info(names[entry]).dtype
        if not entry.trainable or saved == out.dtype:
            base(entry, start, out)
        elif saved == torch.bfloat16 and out.dtype == torch.float32:
            base(entry, start, out)
            conversions.note("master", "bf16", "fp32", out.numel())
        elif saved == torch.float32 and bf16_master:
            part = torch.empty(out.numel(), dtype=torch.float32)
            model.read_into(names[entry], part, start)
            out.copy_(part)
            conversions.note("master", "fp32", "bf16", out.numel(), part, out.float())
        else:
            base(entry, start, out)

    return fill


# -- int8 stores ---------------------------------------------------------------------------
@dataclass
class _Block:
    """What a chunk of an int8 store is built from: fp32 values, raw codes and scales, and
    per block whether the raw ones can be kept."""

    values: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    scaled: torch.Tensor      # a raw scale was set for the block
    raw: torch.Tensor         # every element of the block came raw, under one scale
    source: torch.Tensor      # per element: 0 a gap or kept, 1 fp32, 2 bf16, 3 int8 (the log)


_SOURCE = {"fp32": 1, "bf16": 2, "int8": 3}


def _take(block: _Block, piece: Piece, at: int, source: int | None = None) -> None:
    """Put ``piece`` at element ``at`` of the chunk (a block edge is element 0); ``source``:
    its tag for the log (default: its format's)."""
    end = at + piece.count
    block.values[at:end] = piece.values()
    block.source[at:end] = _SOURCE[piece.fmt] if source is None else source
    b0, b1 = at // QBLOCK, (end - 1) // QBLOCK + 1
    if piece.fmt != "int8" or piece.block != QBLOCK or piece.first != at % QBLOCK:
        block.raw[b0:b1] = False        # another format or another grid: converted
        return
    block.codes[at:end] = piece.stored
    scales = piece.scales[:b1 - b0]
    prior = block.scaled[b0:b1]
    same = block.scales[b0:b1].view(torch.int32) == scales.view(torch.int32)
    block.raw[b0:b1] &= ~prior | same
    block.scales[b0:b1] = torch.where(prior, block.scales[b0:b1], scales)
    block.scaled[b0:b1] = True


def load_int8(codes_store, scales_store, lo: int, loaded: list[ParamEntry],
              kept: list[ParamEntry], saved: SavedMoments, names: dict[ParamEntry, str],
              suffix: str, chunks: ChunkPool, conversions: Conversions) -> None:
    """Fill an int8 moment (``codes_store`` uint8, ``scales_store`` host float32 of its
    blocks; element 0 is the unit's element ``lo``) from the checkpoint's parts of the
    ``loaded`` entries, block by block (see [Note: converting states on load]). ``kept``:
    trainable entries that keep their values (a partial load): their blocks are read first
    and converted with the loaded values."""
    signed = signed_moment(suffix)
    what = suffix.lstrip(".")
    numel = codes_store.numel
    scales = scales_store.tensor
    resident = codes_store.resident
    step = CONVERT_CHUNK if resident else min(CONVERT_CHUNK, chunks.elements(torch.uint8))
    assert step % QBLOCK == 0, step
    loaded_parts = parts_of(loaded, (lo, lo + numel))
    kept_parts = parts_of(kept, (lo, lo + numel))
    for a in range(0, numel, step):
        n = min(step, numel - a)
        nblocks = (n + QBLOCK - 1) // QBLOCK
        slot = None if resident else chunks.acquire()
        try:
            full = codes_store.tensor[a:a + n] if resident else slot.view(torch.uint8, step)
            buf = full[:n]
            chunk = _Block(torch.zeros(n), torch.full((n,), ZERO_CODE[signed], dtype=torch.uint8),
                           torch.zeros(nblocks), torch.zeros(nblocks, dtype=torch.bool),
                           torch.ones(nblocks, dtype=torch.bool), torch.zeros(n, dtype=torch.int8))
            span = (lo + a, lo + a + n)
            if kept_parts:
                _keep(chunk, codes_store, full, scales, a, n, kept_parts, span, signed, chunks)
            for entry, x, y in pieces(loaded_parts, *span):
                for piece in saved.pieces(names[entry] + suffix, x - entry.offset, y - x):
                    _take(chunk, piece, x - span[0] + piece.start - (x - entry.offset))
            codes, absmax = quantize_blockwise(chunk.values, signed)
            raw = chunk.raw & chunk.scaled
            per_element = raw.repeat_interleave(QBLOCK)[:n]
            codes = torch.where(per_element, chunk.codes, codes)
            absmax = torch.where(raw, chunk.scales, absmax)
            _tally(conversions, what, chunk, per_element, codes, absmax, signed)
            buf.copy_(codes)
            if not resident:
                chunks.manager.wait(codes_store.store_async(full, a, n))
            scales[a // QBLOCK:a // QBLOCK + nblocks] = absmax
        finally:
            if slot is not None:
                chunks.release(slot)


def _keep(chunk: _Block, store, full: torch.Tensor, scales: torch.Tensor, a: int, n: int,
          kept_parts: list[Part], span: tuple[int, int], signed: bool, chunks: ChunkPool) -> None:
    """A partial load: the kept entries' current codes go into the chunk as raw ones on this
    grid, so a block of kept values only is left as it is; a block they share with loaded
    values is requantized whole unless those came raw under the same scale."""
    if not store.resident:
        chunks.manager.wait(store.load_async(full, a, n))
    b0 = a // QBLOCK
    current = full[:n].clone()
    for _, x, y in pieces(kept_parts, *span):
        at, count = x - span[0], y - x
        first_block = b0 + at // QBLOCK
        kept = Piece(at, count, "int8", current[at:at + count],
                     scales[first_block:first_block + (at % QBLOCK + count + QBLOCK - 1) // QBLOCK
                            ].clone(), at % QBLOCK, QBLOCK, signed)
        _take(chunk, kept, at, source=0)


def _tally(conversions: Conversions, what: str, chunk: _Block, raw: torch.Tensor,
           codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    converted = ~raw & (chunk.source > 0)
    for name, code in _SOURCE.items():
        mine = chunk.source == code
        count = int(mine.sum())
        if not count:
            continue
        exact = int((mine & raw).sum())
        if exact:
            conversions.note(what, name, "int8", exact)
        lossy = mine & converted
        if lossy.any():
            got = dequantize_blockwise(codes, absmax, signed)[lossy]
            scale = absmax.repeat_interleave(QBLOCK)[:codes.numel()][lossy]
            conversions.note(what, name, "int8", int(lossy.sum()), chunk.values[lossy], got, scale)
