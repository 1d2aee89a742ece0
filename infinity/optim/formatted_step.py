"""Adam over one sub-group whose states are stored in bf16 or int8 (issue 38): the dispatch from
the optimizer's step runs to the native format kernels (optim/adam_formats.py).

Why its own module: the fp32 path (optim/kernel.py) steps any range of a unit as it comes; the
int8 moments come in blocks of 2048 elements with one scale each, and a block must be
requantized whole, from all its updated values, by the one call that steps them. So the runs
of a sub-group are cut at block edges here: the blocks inside one run go to the native kernel in
one call per run; a block that two runs share, or that holds a parameter not stepped this
time (see [Note: parameters without a gradient] in optim/partitioned.py), is stepped by
``_split_block``.

[Note: a block shared by two runs]
Such a block (a param group boundary inside a unit, or a parameter that got no gradient next
to one that did) is dequantized to fp32, each run's part is stepped there by the fp32 kernel
(the format kernels compute in fp32 registers with the same operations, so the update is the
one the block's own call would give for the same moments), and the block is requantized whole
with the kernels' rule (``quantize_blockwise``). The elements that were not stepped are
requantized under the block's new scale: one more rounding of their moments, within the map's
resolution. With a bf16 master the stepped values are rounded stochastically here, with their
own seeded stream. Such blocks are a few per unit at most (a Llama layer has one group
boundary, where the norms start).
"""
from __future__ import annotations

import hashlib
import threading

import torch

from infinity.optim import adam_formats as F
from infinity.optim.cpu_adam import adam_step_flat
from infinity.optim.grad_norm import sum_of_squares
from infinity.optim.records import StepRun, UnitOptimState, gather_gradient, run_pieces
from infinity.planner.state_format import QBLOCK

__all__ = ["MomentScales", "scales_of", "step_formatted", "unit_seed"]


class MomentScales:
    """The int8 scales of one sub-group's blocks (views of the state's scale stores)."""

    def __init__(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq


def scales_of(state: UnitOptimState, at: int, n: int) -> MomentScales | None:
    """The int8 scales of the state's elements [at, at + n) (``at`` a block edge), as views of
    their home in memory (the kernel rewrites them in place); None for other formats."""
    if state.exp_avg_scales is None:
        return None
    blocks = slice(at // QBLOCK, (at + n + QBLOCK - 1) // QBLOCK)
    return MomentScales(state.exp_avg_scales.tensor[blocks],
                        state.exp_avg_sq_scales.tensor[blocks])


def unit_seed(unit_index: int) -> int:
    """The stochastic-rounding seed of one unit's states: fixed per unit (reproducible runs), and
    a different stream for every unit (the element counter restarts at 0 in each)."""
    digest = hashlib.blake2b(f"infinity-adam-sr:{unit_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# [Note: the int8 step's gradient chunks]
# An int8 block spans parameters, so its kernel call needs the block's gradient as one flat
# range; held gradients (the early step on a CPU) come as one tensor per parameter. Gathering a
# whole sub-group's gradient into a fresh tensor cost a new allocation of sub-group x 4 B each
# time: above glibc's mmap threshold (32 MiB at most) every such allocation is fresh pages,
# page-faulted and zeroed by the kernel: 1.9 GB a step at 0.49B (fresh 40 MB tensors here cost
# 0.37 ms of system time a MB and 244 minor faults; one reused, 0.02 ms and 12). So the
# sub-group is stepped in chunks of ``GRAD_CHUNK_BLOCKS`` whole blocks, each gathered into a
# scratch buffer kept per thread (one chunk's worth, 4 MiB: outside the budgets, as the
# kernels' stacks are). The results are the
# ones of one whole-range call bit for bit: the kernels step elements independently and each
# block whole, and the stochastic rounding's counter is the element's unit offset, not its
# place in a call. A flat gradient (the deferred schedule's buffer) is stepped as one range.
GRAD_CHUNK_BLOCKS = 512
_chunk_scratch = threading.local()


def _gradient_chunks(state: UnitOptimState, grad, start: int, end: int):
    """(a, b, gradient of [a, b) indexed from a) covering [start, end): a flat gradient as one
    range; held per-parameter parts a chunk at a time, gathered with zeros in the gaps into this
    thread's scratch (see [Note: the int8 step's gradient chunks]); each chunk's view is valid
    until the next is made."""
    if isinstance(grad, torch.Tensor):
        yield start, end, grad
        return
    chunk = GRAD_CHUNK_BLOCKS * QBLOCK
    scratch = getattr(_chunk_scratch, "buffer", None)
    if scratch is None or scratch.numel() < chunk:
        # fp32 whatever the parts' dtypes: a 16-bit part widens exactly, and parts of
        # different dtypes (a second gradient summed in fp32) share the chunk
        scratch = _chunk_scratch.buffer = torch.empty(chunk, dtype=torch.float32)
    for a in range(start, end, chunk):
        b = min(a + chunk, end)
        yield a, b, gather_gradient(state.unit, grad, start, a, b, scratch)


def step_formatted(state: UnitOptimState, start: int, end: int, param: torch.Tensor,
                   grad, m: torch.Tensor, v: torch.Tensor, scales: MomentScales | None,
                   grad_scale: float, half_out: torch.Tensor | None, hyper: list[dict],
                   runs: list[StepRun], threads: int | None, grad_sq_sum: bool) -> float:
    """Adam on elements [start, end) of the unit whose states are in ``state.fmt``; tensors are
    indexed from ``start`` (``scales``: the int8 scales of the sub-group's blocks). Returns the
    stepped gradient's sum of squares when ``grad_sq_sum``, else 0."""
    seed = unit_seed(state.unit.index)
    if state.fmt.moments == "bf16":
        total = 0.0
        for run, x, y, g in run_pieces(state.unit, runs, grad, start, end):
            s = slice(x - start, y - start)
            F.step_bf16_moments(param[s], g, m[s], v[s], step=run.step, grad_scale=grad_scale,
                                half_out=None if half_out is None else half_out[s],
                                offset=x, seed=seed, threads=threads, **hyper[run.group_index])
            if grad_sq_sum:
                total += sum_of_squares(g)
        return total
    if scales is None:
        raise ValueError(f"{state.unit.name}: int8 moments need the sub-group's block scales")
    if start % QBLOCK:
        # blocks start at lo + k * 2048 and ``offset`` (the stochastic rounding's counter, in
        # unit coordinates, so ranks draw different bits) must be a block edge: lo is a shard
        # start, a multiple of SHARD_ALIGN_NUMEL, which must stay a multiple of QBLOCK
        raise ValueError(f"{state.unit.name}: an int8 sub-group starts at element {start}, not "
                         f"a multiple of {QBLOCK} (the state's range starts at {state.lo})")
    total = 0.0
    for c0, c1, chunk_grad in _gradient_chunks(state, grad, start, end):
        for kind, a, b, run_list in _block_spans(runs, c0, c1):
            s = slice(a - start, b - start)
            g = chunk_grad[a - c0:b - c0]
            blocks = slice((a - start) // QBLOCK, (b - start + QBLOCK - 1) // QBLOCK)
            if kind == "whole":
                run = run_list[0]
                F.step_int8_moments(
                    param[s], g, m[s], v[s], scales.exp_avg[blocks],
                    scales.exp_avg_sq[blocks], step=run.step, grad_scale=grad_scale,
                    half_out=None if half_out is None else half_out[s], offset=a,
                    seed=seed, threads=threads, **hyper[run.group_index])
            else:
                _split_block(param, g, m, v, scales, start, a, b, run_list, grad_scale,
                             half_out, hyper, seed)
            if grad_sq_sum:
                for run in run_list:
                    x, y = max(run.start, a), min(run.end, b)
                    if x < y:
                        total += sum_of_squares(g[x - a:y - a])
    return total


def _block_spans(runs: list[StepRun], start: int, end: int):
    """(kind, a, b, runs) covering the stepped parts of [start, end): "whole" spans are whole
    blocks (the last may end at ``end``) inside one run; "split" spans are single blocks that
    are not (see [Note: a block shared by two runs]). Blocks no run touches are left out."""
    spans = []
    for a in range(start, end, QBLOCK):
        b = min(a + QBLOCK, end)
        touching = [r for r in runs if r.start < b and a < r.end]
        if not touching:
            continue
        inside = len(touching) == 1 and touching[0].start <= a and b <= touching[0].end
        if inside and spans and spans[-1][0] == "whole" and spans[-1][2] == a \
                and spans[-1][3][0] is touching[0]:
            spans[-1] = ("whole", spans[-1][1], b, spans[-1][3])
        else:
            spans.append(("whole" if inside else "split", a, b, touching))
    return spans


def _split_block(param, block_grad, m, v, scales: MomentScales, start: int, a: int, b: int,
                 runs: list[StepRun], grad_scale: float, half_out, hyper, seed: int) -> None:
    """One block [a, b) that runs share (see [Note: a block shared by two runs]); the other
    tensors are indexed from ``start``, ``block_grad`` from ``a``."""
    k = (a - start) // QBLOCK
    s = slice(a - start, b - start)
    m32 = F.dequantize_blockwise(m[s], scales.exp_avg[k:k + 1], signed=True)
    v32 = F.dequantize_blockwise(v[s], scales.exp_avg_sq[k:k + 1], signed=False)
    bf16_master = param.dtype == torch.bfloat16
    p32 = param[s].float() if bf16_master else param[s]
    for run in runs:
        x, y = max(run.start, a) - a, min(run.end, b) - a
        if x >= y:
            continue
        r = slice(x, y)
        adam_step_flat(p32[r], block_grad[r].contiguous(), m32[r], v32[r], step=run.step,
                       grad_scale=grad_scale, half_out=None if half_out is None or bf16_master
                       else half_out[s][r], **hyper[run.group_index])
        if bf16_master:
            param[s][r].copy_(_round_stochastic(p32[r], seed, run.step, a + x))
    codes, absmax = F.quantize_blockwise(m32, signed=True)
    m[s].copy_(codes)
    scales.exp_avg[k:k + 1].copy_(absmax)
    codes, absmax = F.quantize_blockwise(v32, signed=False)
    v[s].copy_(codes)
    scales.exp_avg_sq[k:k + 1].copy_(absmax)


def _round_stochastic(x: torch.Tensor, seed: int, step: int, offset: int) -> torch.Tensor:
    """fp32 -> bf16 rounded stochastically (unbiased: up with probability of the distance),
    from a generator seeded by (seed, step, offset); non-finite values round to nearest."""
    gen = torch.Generator().manual_seed((seed ^ (step * 0x9E3779B97F4A7C15) ^ offset)
                                        & (2**63 - 1))
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32)
    rounded = ((bits + noise) & ~0xFFFF).view(torch.float32)
    finite = torch.isfinite(x) & torch.isfinite(rounded)
    return torch.where(finite, rounded, x).to(torch.bfloat16)
