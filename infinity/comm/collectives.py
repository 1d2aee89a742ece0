"""The collectives the engine runs over data-parallel ranks, on flat buffers, with every byte
counted.

Why one module: ZeRO's traffic is three operations on a unit's flat buffer (all-gather of
parameter shards, reduce-scatter of gradients, all-reduce at stage 0) plus a few scalars (the
global gradient norm, which parameters got a gradient on any rank). Keeping them here gives one
place that buckets them (``reduce_bucket_size`` / ``allgather_bucket_size``), falls back to
operations every backend has, measures their time and counts their bytes for ``step_stats()``.

[Note: bytes counted]
The counts are what this rank puts on and takes off the wire under the ring algorithms torch's
backends use for these operations: an all-gather or a reduce-scatter of a buffer of B bytes over
N ranks sends and receives (N-1)/N * B each; an all-reduce twice that. They are computed from the
sizes of the tensors actually passed, per call (a formula applied to each real call, not an
estimate of a step).

[Note: collective order]
Every rank must issue the same collectives in the same order, or gloo pairs one rank's
all-gather of unit 3 with another's of unit 4. The engine issues them only from the training
thread, at points every rank reaches in the same order: a unit made whole before its module
runs (forward and backward hooks, in the model's call order), a unit's gradient complete in
backward (autograd's order, the same for the same graph, as torch's DDP assumes), and the
optimizer step's scalars. Nothing that depends on timing (a prefetch that found a free slot, a
write that landed) decides whether a collective runs.

A collective issued ahead (``all_gather_async``, ``overlap_comm``) keeps the rule: it is issued
from the training thread, at one of those points, and enters the sequence (and its fingerprint,
as its own kind "all-gather ahead") at its issue, not at its wait; only the moment its bytes
land is left to timing. So whether and where a gather is issued ahead is decided from what is
the same on every rank -- the recorded order of the pass, the units' sizes, what the hooks hold
and a device budget agreed over the ranks -- never from whether a prefetch landed or found room:
see [Note: gathers issued ahead] in zero/gather_ahead.py. A gather issued ahead owns its output
until its handle is waited on (the caller holds the unit: not released, its buffer not reused);
gloo and NCCL run the calls of one group in issue order, so a gather in flight beside later
collectives (a reduce-scatter, the next unit's gather) pairs with the same call on every rank.

Where the engine's group has no CPU backend, host tensors' collectives run on a gloo group
beside it (see [Note: host collectives on a device-only group] in comm/routing.py). Each group
keeps its own order: the rule above holds per group, since which group a call goes to depends
only on its tensor's device, the same on every rank. Making the side group is itself a
collective, at the construction of ``Collectives``, which every rank reaches at the same point.
The fingerprint covers the calls of both groups, in issue order.
"""
from __future__ import annotations

import contextlib
import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from infinity.base.log import get_logger
from infinity.comm.ahead import CudaGather, LateGathers, WorkGather, late_gathers
from infinity.comm.routing import (backends_of, has_tensor_ops, routes_to_side, side_group,
                                   side_group_needed, tensor_device_type)
from infinity.comm.watchdog import CallNotMadeError
from infinity.storage.transfers import DONE, CopyEvent

log = get_logger("comm")


@dataclass
class CommCounters:
    """Bytes this rank sent and received and seconds spent in collectives, since the last reset."""

    sent_bytes: int = 0
    received_bytes: int = 0
    comm_s: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.sent_bytes = self.received_bytes = self.calls = 0
        self.comm_s = 0.0


class LostRankError(RuntimeError):
    """A collective failed because another rank stopped (raised, was killed, or timed out)."""


class Collectives:
    """Collectives over ``group`` (None: the default group) for a world of ``world_size``;
    those on host tensors over a gloo group beside it when ``group`` has no CPU backend (NCCL),
    made here on every rank (``_group_for``; [Note: host collectives on a device-only group]
    in comm/routing.py).

    ``bucket_bytes``: the most bytes one all-gather or reduce-scatter call moves (DeepSpeed's
    ``allgather_bucket_size`` / ``reduce_bucket_size`` in elements, converted by the caller);
    a larger buffer goes in several calls. With one rank every operation is a no-op (what
    ``average`` divides by is 1), so the single-process engine pays nothing.
    """

    def __init__(self, group: Any = None, world_size: int = 1, rank: int = 0, *,
                 gather_bucket_bytes: int = 1 << 62, reduce_bucket_bytes: int = 1 << 62,
                 on_failure: Any = None, watch: Any = None, timeout_s: float = 1800.0) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.gather_bucket_bytes = max(1, gather_bucket_bytes)
        self.reduce_bucket_bytes = max(1, reduce_bucket_bytes)
        self.counters = CommCounters()
        # called with (what, error) when a collective fails; returns the lost rank's story
        # (a RankWatch's diagnosis by default: see [Note: lost rank] in comm/watchdog.py)
        self.watch = watch
        self.timeout_s = timeout_s      # the group's collective timeout, for waits of its own
        self.unit_names: list[str] = []   # by a collective's tag, for a lost rank's story
        # the call every rank makes that this rank is in: its name before the agreement, ""
        # after, None outside one (see ``every_rank``)
        self._every_rank: str | None = None
        self._not_made: CallNotMadeError | None = None    # its agreement failed
        self.on_failure = on_failure if on_failure is not None or watch is None else \
            (lambda what, exc: watch.diagnose(what))
        # {device type: backend} of the group, and the gloo group beside it for host tensors
        # when it has no CPU backend (made here, on every rank: a collective; see [Note: host
        # collectives on a device-only group] in comm/routing.py)
        self._backends: dict[str, str] = backends_of(group) if self.active else {}
        self.side_group: Any = side_group(group) \
            if self.active and side_group_needed(self._backends) else None
        # calls issued on each group ("main": ``group``, "side": ``side_group``)
        self.calls_by_group: dict[str, int] = {"main": 0, "side": 0}
        self._sequence = 0    # a fingerprint of the collectives issued (see check_same_sequence)
        # when a list: (kind, elements, tag) of every collective, in issue order (tests compare
        # the ranks' lists; the fingerprint above is what runs compare)
        self.sequence_log: list[tuple[str, int, int | None]] | None = None
        # gathers issued ahead land late, for tests (comm/ahead.py); None: they land when done
        self.late: LateGathers | None = late_gathers() if self.active else None
        # the stream NCCL all-gathers issued ahead are issued from (created at the first one;
        # see ``all_gather_async``)
        self._gather_stream: Any = None

    @property
    def active(self) -> bool:
        return self.world_size > 1

    # -- bookkeeping ----------------------------------------------------------------------
    def _count(self, nbytes: int, factor: float, start: float) -> None:
        moved = int(nbytes * factor * (self.world_size - 1) / self.world_size)
        self.counters.sent_bytes += moved
        self.counters.received_bytes += moved
        self.counters.comm_s += time.perf_counter() - start
        self.counters.calls += 1

    def _group_for(self, tensor: torch.Tensor | None) -> tuple[Any, str]:
        """The group a collective on ``tensor`` runs on, and its name ("main", "side"): the
        one routing rule of every collective here (None: a collective without a tensor of the
        caller's, on the host). See [Note: host collectives on a device-only group] in
        comm/routing.py."""
        if self.side_group is not None and \
                routes_to_side(self._backends, tensor_device_type(tensor)):
            return self.side_group, "side"
        return self.group, "main"

    def _tensor_ops(self, tensor: torch.Tensor) -> bool:
        """Whether the backend that runs a collective on ``tensor`` has the flat-tensor
        all-gather and reduce-scatter."""
        return not self.active or has_tensor_ops(self._backends, tensor.device.type)

    @contextlib.contextmanager
    def every_rank(self, call: str) -> Iterator[None]:
        """Within: ``call`` (a save, a load, a full state dict: what gathers the whole model),
        which every rank must make; its first collective, if it issues one, waits until every
        rank made it, and raises naming it when a rank went on without it (see [Note: calls
        every rank makes] in comm/watchdog.py). A call inside another is the outer one's."""
        if not self.active or self.watch is None or self._every_rank is not None:
            yield
            return
        self._every_rank = call
        try:
            yield
        finally:
            self._every_rank = self._not_made = None

    def _issue(self, call, *args, on: torch.Tensor | None, what: str = "", **kwargs) -> Any:
        """``call(*args, group=..., **kwargs)`` on the group of ``on`` (``_group_for``);
        ``what`` it is, for the watch (a timeout's story names each rank's)."""
        if self.watch is not None:
            if self._not_made is not None:     # nor any later collective of that call (a
                raise self._not_made           # save's exchange of its ranks' outcomes)
            if self._every_rank:
                what, self._every_rank = self._every_rank, ""   # agreed once per call
                try:
                    self.watch.agree(what, self.timeout_s)
                except CallNotMadeError as exc:
                    self._not_made = exc
                    raise
            self.watch.count_issue(what)
        group, name = self._group_for(on)
        self.calls_by_group[name] += 1
        return call(*args, group=group, **kwargs)

    def _run(self, what: str, call, *args, on: torch.Tensor | None, tag: int | None = None,
             **kwargs) -> Any:
        """Issue one collective on the group of ``on`` (its tensor; ``_group_for``)
        (``kwargs``: ``async_op=True`` for one issued ahead, whose ``Work`` is returned): it
        enters the sequence's fingerprint and a failure names the lost rank."""
        first = args[0] if args else None
        size = first.numel() if isinstance(first, torch.Tensor) else \
            len(first) if isinstance(first, (list, tuple)) else 0
        # the fingerprint of the sequence: each call's kind, size and ``tag`` (the unit)
        code = zlib.crc32(f"{what}:{size}:{tag}".encode())
        self._sequence = (self._sequence * 1_000_003 + code) % _SEQUENCE_MOD
        if self.sequence_log is not None:
            self.sequence_log.append((what, size, tag))
        unit = (self.unit_names[tag] if 0 <= tag < len(self.unit_names) else str(tag)) \
            if tag is not None else ""
        try:
            return self._issue(call, *args, on=on,
                               what=f"{what} of unit {unit}" if unit else what, **kwargs)
        except (CallNotMadeError, LostRankError):
            raise                 # told already (the agreement of a call every rank makes)
        except Exception as exc:  # noqa: BLE001 - translated, with the lost rank named
            raise self._lost(what, exc) from exc

    def _lost(self, what: str, exc: BaseException) -> LostRankError:
        """The error a failed collective ``what`` raises: the lost rank's story, if known."""
        detail = None
        if self.on_failure is not None:
            try:
                detail = self.on_failure(what, exc)
            except Exception as why:  # noqa: BLE001 - never hide the collective's error
                detail = f"(naming the lost rank failed: {type(why).__name__}: {why})"
        cause = detail if isinstance(detail, str) and detail else \
            "another rank has likely stopped"
        return LostRankError(f"rank {self.rank}: the {what} failed: {cause}. The "
                             f"collective's error: {type(exc).__name__}: {exc}")

    def report_failure(self, error: BaseException, where: str) -> None:
        """``error`` escaped this rank's ``where`` (forward, backward, step): tell the other
        ranks, whose next collective fails, who stopped and why (see [Note: lost rank] in
        comm/watchdog.py)."""
        if self.watch is not None:
            self.watch.report(error, where)

    def carried_on(self) -> None:
        """A step completed after a reported failure (the caller caught it): withdraw it."""
        if self.watch is not None:
            self.watch.carried_on()

    # -- flat buffers -----------------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, tag: int | None = None) -> None:
        """``output`` holds ``world_size`` equal shards, this rank's filled in: fill the others
        from their ranks (in place). ``tag`` (a unit's index) enters the sequence's
        fingerprint (see ``check_same_sequence``)."""
        if not self.active:
            return
        n = self.world_size
        shard, chunk = gather_split(output, n, self.gather_bucket_bytes)
        start = time.perf_counter()
        tensor_ops = self._tensor_ops(output)
        if shard <= chunk and tensor_ops:
            own = output[self.rank * shard:(self.rank + 1) * shard]
            self._run("all-gather", _ALL_GATHER_TENSOR, output, own, on=output, tag=tag)
        else:
            for off in range(0, shard, chunk):
                c = min(chunk, shard - off)
                pieces = [output[r * shard + off:r * shard + off + c] for r in range(n)]
                own = pieces[self.rank].clone()
                if tensor_ops:
                    tmp = torch.empty(n * c, dtype=output.dtype, device=output.device)
                    self._run("all-gather", _ALL_GATHER_TENSOR, tmp, own, on=output, tag=tag)
                    for r in range(n):
                        pieces[r].copy_(tmp[r * c:(r + 1) * c])
                else:
                    outs = [torch.empty_like(own) for _ in range(n)]
                    self._run("all-gather", dist.all_gather, outs, own, on=output, tag=tag)
                    for r in range(n):
                        pieces[r].copy_(outs[r])
        self._count(output.numel() * output.element_size(), 1.0, start)

    def all_gather_async(self, output: torch.Tensor, tag: int | None = None) -> CopyEvent:
        """``all_gather`` issued now and left in flight (``overlap_comm``): returns a handle
        (storage/transfers.py's ``CopyEvent`` protocol; comm/ahead.py) that whatever reads
        ``output`` waits on first, compute through ``compute_waits``. ``output`` must stay
        allocated and unread until then (the caller holds it). The call enters the sequence
        now, like any other: see [Note: collective order]. A gather that needs several calls
        (a shard above ``allgather_bucket_size``, a backend without ``all_gather_into_tensor``)
        runs whole now and returns a fired handle."""
        if not self.active:
            return DONE
        shard, chunk = gather_split(output, self.world_size, self.gather_bucket_bytes)
        if shard > chunk or not self._tensor_ops(output):
            self.all_gather(output, tag=tag)
            return DONE
        start = time.perf_counter()
        lo, hi = self.rank * shard, (self.rank + 1) * shard

        def issue(out: torch.Tensor, own: torch.Tensor) -> Any:
            # its own kind in the fingerprint: a rank that gathered a unit at use where another
            # issued it ahead is a different sequence, said at the step's check
            return self._run("all-gather ahead", _ALL_GATHER_TENSOR, out, own, on=out,
                             tag=tag, async_op=True)

        def lost(exc: BaseException) -> BaseException:
            return self._lost("all-gather ahead", exc)

        if self.late is not None:
            handle: CopyEvent = self.late.all_gather(
                output, (lo, hi), lambda out, own: WorkGather(issue(out, own), lost))
        elif output.is_cuda:
            # NCCL's stream waits on the stream current at the issue: issued from the compute
            # stream, the gather would start only after the compute queued before it (the
            # units this one is fetched ahead of). The collective stream waits only on what
            # the compute stream queued so far (the own shard's copy, the last reads of the
            # buffer's memory), so the gather overlaps the compute queued after this call.
            if self._gather_stream is None:
                self._gather_stream = torch.cuda.Stream(device=output.device)
            stream = self._gather_stream
            stream.wait_stream(torch.cuda.current_stream(output.device))
            with torch.cuda.stream(stream):
                work = issue(output, output[lo:hi])
                work.wait()       # the collective stream waits for NCCL's; no thread blocks
                event = torch.cuda.Event()
                event.record(stream)
            # the caching allocator must not hand the buffer's memory on before the gather
            # wrote it (the caller's hold keeps it; this covers a release after the wait)
            output.record_stream(stream)
            handle = CudaGather(work, event, output.device, lost)
        else:
            handle = WorkGather(issue(output, output[lo:hi]), lost)
        self._count(output.numel() * output.element_size(), 1.0, start)
        return handle

    def compute_waits(self, handle: CopyEvent) -> None:
        """Compute that reads the output of a gather issued ahead runs after it: on a GPU the
        compute stream waits on the gather's event (no thread blocks, the device is not
        synchronized); elsewhere the calling thread waits. The wait's time counts as
        collective time (what the gather was not hidden behind)."""
        start = time.perf_counter()
        if isinstance(handle, CudaGather):
            torch.cuda.current_stream(handle.device).wait_event(handle.event)
        else:
            handle.wait()
        self.counters.comm_s += time.perf_counter() - start

    def reduce_scatter_mean(self, output: torch.Tensor, source: torch.Tensor,
                            tag: int | None = None) -> None:
        """``output`` = this rank's shard of the mean over ranks of ``source`` (``world_size``
        equal shards). ``source`` is clobbered on backends without ``reduce_scatter_tensor``,
        and divided in place first when 16-bit (see ``_divides_first``)."""
        n = self.world_size
        if source.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter: {source.numel()} elements are not {n} shards of "
                             f"{output.numel()}")
        if not self.active:
            output.copy_(source)
            return
        shard = output.numel()
        start = time.perf_counter()
        first = _divides_first(source)
        if first:
            source.div_(n)
        chunk = max(1, self.reduce_bucket_bytes // (source.element_size() * n))
        if not self._tensor_ops(source):
            # same numerics: a sum over ranks, then this rank's slice (moves twice the bytes)
            self._run("all-reduce", dist.all_reduce, source, dist.ReduceOp.SUM, on=source,
                      tag=tag)
            output.copy_(source[self.rank * shard:(self.rank + 1) * shard])
            self._count(source.numel() * source.element_size(), 2.0, start)
            if not first:
                output.div_(n)
            return
        if shard <= chunk:
            self._run("reduce-scatter", _REDUCE_SCATTER_TENSOR, output, source,
                      dist.ReduceOp.SUM, on=source, tag=tag)
        else:
            for off in range(0, shard, chunk):
                c = min(chunk, shard - off)
                tmp = torch.cat([source[r * shard + off:r * shard + off + c] for r in range(n)])
                self._run("reduce-scatter", _REDUCE_SCATTER_TENSOR, output[off:off + c], tmp,
                          dist.ReduceOp.SUM, on=source, tag=tag)
        self._count(source.numel() * source.element_size(), 1.0, start)
        if not first:
            output.div_(n)

    def all_reduce_mean(self, tensor: torch.Tensor, tag: int | None = None) -> None:
        """``tensor`` = its mean over ranks, in place (stage 0's gradient average; a 16-bit
        one divided first, see ``_divides_first``)."""
        if not self.active:
            return
        start = time.perf_counter()
        first = _divides_first(tensor)
        if first:
            tensor.div_(self.world_size)
        self._run("all-reduce", dist.all_reduce, tensor, dist.ReduceOp.SUM, on=tensor, tag=tag)
        self._count(tensor.numel() * tensor.element_size(), 2.0, start)
        if not first:
            tensor.div_(self.world_size)

    # -- scalars and small vectors ----------------------------------------------------------
    def sum_float(self, value: float) -> float:
        """The sum over ranks of ``value`` (fp64: a gradient norm's squares; inf and NaN
        propagate, so every rank sees an overflow any rank saw)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        start = time.perf_counter()
        self._run("all-reduce", dist.all_reduce, t, dist.ReduceOp.SUM, on=t)
        self._count(8, 2.0, start)
        return float(t.item())

    def any_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The element-wise OR over ranks of a bool mask (which parameters got a gradient)."""
        if not self.active:
            return mask
        t = mask.to(torch.uint8)
        start = time.perf_counter()
        self._run("all-reduce", dist.all_reduce, t, dist.ReduceOp.MAX, on=t)
        self._count(t.numel(), 2.0, start)
        return t.bool()

    def all_gather_objects(self, value: Any) -> list[Any]:
        """``value`` of every rank, by rank (small, picklable: configs' fingerprints)."""
        if not self.active:
            return [value]
        out: list[Any] = [None] * self.world_size
        # pickled on the host: the side group where the group has no CPU backend (NCCL
        # would need this rank's CUDA device set to carry the bytes)
        self._run("object all-gather", dist.all_gather_object, out, value, on=None)
        return out

    def broadcast(self, tensor: torch.Tensor, source_rank: int) -> None:
        """``tensor`` = rank ``source_rank``'s, in place (a change made on one rank)."""
        if not self.active:
            return
        if not 0 <= source_rank < self.world_size:
            raise ValueError(f"broadcast from rank {source_rank}: the ranks are 0 to "
                             f"{self.world_size - 1}")
        start = time.perf_counter()
        # ``group_src``: the rank in the group (``src`` would be the rank in the world)
        self._run("broadcast", dist.broadcast, tensor, on=tensor, group_src=source_rank)
        self._count(tensor.numel() * tensor.element_size(), 1.0, start)

    def check_same_sequence(self, where: str, settings: str = "") -> None:
        """Raise on every rank when the ranks issued different collectives since the last check
        (a model whose path depends on the rank's data: one rank ran a unit another skipped,
        so gathers and reductions paired unrelated buffers), or step with different
        ``settings`` (the step's lr and betas: an lr set, or a scheduler stepped, on one rank
        only stepped each rank's shard at its own rate, without a word). Called once per
        optimizer step, in the same collective: a mismatch is said at the step it happened
        in, instead of training on mixed values."""
        if not self.active:
            return
        mine = self._sequence
        said = zlib.crc32(settings.encode())
        t = torch.tensor([mine, -mine, said, -said], dtype=torch.int64)
        start = time.perf_counter()
        try:
            self._issue(dist.all_reduce, t, dist.ReduceOp.MAX, on=t, what="sequence check")
        except (CallNotMadeError, LostRankError):
            raise
        except Exception as exc:  # noqa: BLE001 - the same story as any collective
            raise self._lost("sequence check", exc) from exc
        self._count(16, 2.0, start)
        self._sequence = 0
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(
                f"rank {self.rank}: the ranks issued different collectives before {where} (their "
                "fingerprints differ): the model took a different path on some rank (a unit "
                "run or skipped depending on the data, a forward or a call more on one rank), "
                "so its gathers and gradient averages paired unrelated buffers and this step's "
                "values are not to be trusted. Every rank must call the same units each step "
                "(inside a unit, parameters may get gradients on some ranks only: experts; "
                "route a data-dependent unit through every rank, e.g. multiply a skipped "
                "branch by zero); resume from the last checkpoint")
        if int(t[2]) != -int(t[3]):
            raise RuntimeError(
                f"rank {self.rank}: the ranks step with different settings at {where} (this "
                f"rank's: {settings}): an lr or betas set on some ranks only (by hand, by a "
                "scheduler stepped or built differently per rank, or in the optimizer each rank "
                "passed to initialize), so each rank would step its share of the model at its "
                "own rate. Set them alike on every rank")

    def barrier(self) -> None:
        if self.active:
            self._run("barrier", dist.barrier, on=None)


_SEQUENCE_MOD = (1 << 61) - 1


def _divides_first(values: torch.Tensor) -> bool:
    """Whether a mean over ranks divides each rank's values before the sum instead of the sum
    after: for 16-bit values (gradients reduced in the communication dtype on a GPU). A sum of
    N fp16 gradients overflows at 65504 / N of one rank's size (8 ranks: an eighth), skipping
    steps and dropping the loss scale; each value divided first stays in range. With N a power
    of two the result is the same bits either way (scaling by 2^-k commutes with rounding,
    barring subnormals); fp32 keeps the sum first, as it always has."""
    return values.is_floating_point() and values.element_size() < 4


def gather_split(output: torch.Tensor, world_size: int, bucket_bytes: int) -> tuple[int, int]:
    """(shard, chunk) of an all-gather into ``output``: the elements of each of its
    ``world_size`` equal shards, and how many of one shard's elements one call may carry
    (``allgather_bucket_size``: a larger shard is gathered in several calls). One rule for the
    engine's gathers and the dry run's (simulate/collectives.py)."""
    shard = output.numel() // world_size
    if shard * world_size != output.numel():
        raise ValueError(f"all_gather: {output.numel()} elements do not split into "
                         f"{world_size} shards")
    return shard, max(1, bucket_bytes // (output.element_size() * world_size))


# torch 2.13 renamed the flat-tensor collectives (the old names warn)
_ALL_GATHER_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


NO_COMM = Collectives()
