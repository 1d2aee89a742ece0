"""Handles of all-gathers issued ahead of use (``overlap_comm``), and their late mode for tests.

Why a module of its own: an all-gather issued ahead (``Collectives.all_gather_async``) returns
before its bytes are there, so whatever reads its output must wait on a handle first, and the
three ways the wait works (gloo on a CPU, NCCL on a GPU, late for tests) belong together, apart
from the collectives' bookkeeping. A handle follows storage/transfers.py's ``CopyEvent``
protocol (``done()``, ``wait()``: the calling thread blocks until the bytes are in the output);
compute does not call ``wait()`` itself but ``Collectives.compute_waits(handle)``, which on a GPU
makes the compute stream wait on the collective's event instead of blocking the thread (never
the whole device). See [Note: collective order] in comm/collectives.py for when one is issued.

- ``WorkGather`` (gloo, CPU tensors): torch's ``Work`` of an ``async_op=True`` collective; the
  gloo thread fills the output while the training thread computes; ``wait()`` blocks.
- ``CudaGather`` (NCCL): issued from a collective stream of the ``Collectives``, which waited
  only on what the compute stream had queued before the issue (the own shard's copy), so the
  all-gather overlaps the compute queued after it; the collective stream waits for NCCL's
  internal stream at the issue (``work.wait()`` on a CUDA work blocks no thread) and records an
  event, on which the compute stream waits.
- ``LateGathers`` (tests, ``INFINITY_LATE_COLLECTIVES=<seed>``): the real collective runs into a
  temporary buffer from a copy of the own shard; the output's other shards read NaN until the
  gathered bytes land, which they do on a helper thread, a seeded random delay after the
  handle's ``wait()`` was called, never before. So compute that reads the output without the
  wait reads NaN every time, not by the luck of a slow thread. An output whose memory was given
  back before the bytes landed (a unit released under its gather) is not written: the gather is
  counted ``lost``.
"""
from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LATE_COLLECTIVES_ENV", "CudaGather", "LateGathers", "WorkGather", "late_gathers"]

LATE_COLLECTIVES_ENV = "INFINITY_LATE_COLLECTIVES"
"""Set to an integer seed: every ``Collectives``' gathers issued ahead land late (tests)."""

# what a failed collective becomes (``Collectives._lost``: a LostRankError naming the lost rank)
OnError = Callable[[BaseException], BaseException]


class WorkGather:
    """An all-gather in flight on gloo (CPU tensors): torch's ``Work``."""

    def __init__(self, work: Any, on_error: OnError) -> None:
        self._work = work
        self._on_error = on_error
        self._over = False

    def done(self) -> bool:
        if self._over:
            return True
        try:
            return bool(self._work.is_completed())
        except Exception:  # noqa: BLE001 - said by wait(), which raises it translated
            return False

    def wait(self) -> None:
        if self._over:
            return
        try:
            self._work.wait()
        except Exception as exc:
            raise self._on_error(exc) from exc
        self._over = True


class CudaGather:
    """An all-gather in flight on NCCL: ``event`` fires on the collective stream when NCCL's
    stream has written the output (see the module docstring)."""

    def __init__(self, work: Any, event: torch.cuda.Event, device: torch.device,
                 on_error: OnError) -> None:
        self._work = work       # kept: NCCL's work lives until the gather is over
        self.event = event
        self.device = device
        self._on_error = on_error

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        try:
            self.event.synchronize()
        except Exception as exc:
            raise self._on_error(exc) from exc


class _LateGather:
    """One late all-gather: ``work`` fills ``tmp``; the helper thread copies it into ``output``
    once ``wait()`` was called (see ``LateGathers``)."""

    def __init__(self, owner: LateGathers, work: WorkGather, tmp: torch.Tensor,
                 output: torch.Tensor, delay_s: float) -> None:
        self._owner = owner
        self.work, self.tmp, self.output, self.delay_s = work, tmp, output, delay_s
        # the output's memory at the issue: a release moves it away (storage/device_cache.py)
        self.memory = (output.untyped_storage().data_ptr(), output.untyped_storage().nbytes())
        self._asked = False
        self._over = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._over.is_set()

    def wait(self) -> None:
        if not self._asked:
            self._asked = True
            self._owner._jobs.put(self)
        self._over.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class LateGathers:
    """Tests: gathers issued ahead land late, on a helper thread, after their handle's
    ``wait()`` and a seeded random delay (``max_delay_s`` bounds it); see the module
    docstring. ``issued``, ``landed`` and ``lost`` count them."""

    def __init__(self, seed: int, max_delay_s: float = 0.003) -> None:
        self._rng = random.Random(seed)
        self._max_delay = max_delay_s
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="late-gathers", daemon=True)
        self._thread.start()
        self.issued = 0
        self.landed = 0
        self.lost = 0

    def all_gather(self, output: torch.Tensor, own_range: tuple[int, int],
                   issue: Callable[[torch.Tensor, torch.Tensor], WorkGather]) -> _LateGather:
        """Issue the all-gather of ``output`` (this rank's shard is ``output[lo:hi]`` of
        ``own_range``) through ``issue(tmp, own)``, the real collective into a temporary
        buffer, and return its late handle; the output's other shards hold NaN until it
        lands."""
        lo, hi = own_range
        tmp = torch.empty_like(output)
        own = output[lo:hi].clone()     # what the wire reads: a release cannot move it
        work = issue(tmp, own)
        with torch.no_grad():
            output[:lo].view(torch.uint8).fill_(0xFF)
            output[hi:].view(torch.uint8).fill_(0xFF)
        self.issued += 1
        return _LateGather(self, work, tmp, output, self._rng.random() * self._max_delay)

    def _run(self) -> None:
        while True:
            job: _LateGather = self._jobs.get()
            time.sleep(job.delay_s)
            try:
                job.work.wait()
                storage = job.output.untyped_storage()
                if (storage.data_ptr(), storage.nbytes()) != job.memory:
                    # released (its memory given back) before the bytes landed: a missing
                    # hold; the bytes are not written into memory that is someone else's now
                    self.lost += 1
                else:
                    with torch.no_grad():
                        job.output.copy_(job.tmp)
                    self.landed += 1
            except BaseException as exc:  # noqa: BLE001 - raised by the handle's wait()
                job.error = exc
            job._over.set()


def late_gathers() -> LateGathers | None:
    """Late gathers when ``INFINITY_LATE_COLLECTIVES`` is set (tests), else None."""
    seed = os.environ.get(LATE_COLLECTIVES_ENV, "").strip()
    if not seed:
        return None
    if not seed.lstrip("-").isdigit():
        raise ValueError(f"{LATE_COLLECTIVES_ENV}={seed!r}: expected an integer seed (or unset it)")
    return LateGathers(int(seed))
