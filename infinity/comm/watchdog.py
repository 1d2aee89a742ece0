"""Naming the lost rank: when a collective fails, say which rank stopped and why.

[Note: lost rank]
A collective fails on the surviving ranks in one of two ways: at once, when a peer's process
is gone (gloo reads "Connection closed by peer" on its socket: a rank killed, or one that
raised and exited), or after ``infinity.collective_timeout`` seconds, when a peer is alive but
never joins (it hangs, or it issues another collective). Neither error says which rank. So every
rank keeps a side channel in the process group's store (the TCPStore torch rendezvoused
through, hosted by rank 0 or by torchrun's agent), under ``infinity/``:

- ``who/<r>``: host and pid of rank r, set when its watch starts;
- ``beat/<r>``: a counter rank r's heartbeat thread adds 1 to every ``beat_s`` seconds;
- ``failed/<r>``: the error that escaped rank r's forward, backward or step, or its script
  (``sys.excepthook``), set before the exception leaves the rank; cleared if the rank carries
  on and steps again;
- ``exited/<r>``: set at a normal interpreter exit (``atexit``).

When a collective fails, ``diagnose`` reads them: a rank that reported a failure is named with
its error; else a rank whose heartbeat does not advance over ~3 beats has stopped (killed, or
exited without a word); a rank whose ``exited`` key is set finished its script early. A store
that no longer answers means its host is gone: rank 0 when the ranks rendezvoused by
``MASTER_ADDR`` themselves (torchrun's agent hosts it otherwise). The heartbeat and the
diagnosis each have their own store connection (``Store.clone``), made up front with a short
timeout, so a dead host fails them at once and the training thread's never waits on the beat.
A LostRankError is not reported as a failure: its cause is another rank's.

[Note: calls every rank makes]
A save, a load or a full state dict at stage 3 gathers every unit: every rank must make the call,
as under DeepSpeed. The Hugging Face habit ``if rank == 0: model.save_pretrained(...)`` made rank
0's first gather pair with rank 1's next training collective: gloo aborted both processes
("Received data size doesn't match expected size"), or both waited out the collective timeout.
So before the first collective of such a call (``Collectives.every_rank``) a rank writes
``call/<n>/<r>`` (its n-th such call's name) and waits for every other rank's. Two things end
the wait early, neither depending on timing: another rank's n-th call has another name; or
another rank has issued more collectives than this one (``issued/<r>``, which the heartbeat
publishes): it went past this point without the call and waits in a collective this rank will
never issue. The error names the call and says every rank must make it; the other ranks' blocked
collective then fails naming this rank's error (the diagnosis above). A rank whose script ended,
or whose heartbeat stopped (killed, or exited on an error), ends the wait too, named as above;
otherwise it lasts the collective timeout.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import torch.distributed as dist

from infinity.base.log import get_logger

log = get_logger("comm")

PREFIX = "infinity/"
STORE_TIMEOUT_S = 5.0
MAX_TEXT = 2000
AGREE_HINT_S = 60.0
"""How long a call every rank makes waits for a live rank that neither calls it nor issues a
collective before it says what that usually is (a rank waiting in ``dist.barrier()``), long
before the collective timeout ends the wait."""


class CallNotMadeError(RuntimeError):
    """A call every rank must make (a save, a load, a full state dict) that another rank made
    differently or went on without (see [Note: calls every rank makes])."""


class RankWatch:
    """This rank's heartbeat and failure reports in ``store``, and the diagnosis of a failed
    collective from the other ranks' (see [Note: lost rank])."""

    def __init__(self, store: Any, rank: int, world_size: int, *, beat_s: float = 1.0,
                 store_host: str = "") -> None:
        self.rank, self.world_size, self.beat_s = rank, world_size, beat_s
        self.store_host = store_host      # who hosts the store, for the message when it is gone
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        self._store = store.clone()
        self._store.set_timeout(timeout)
        self._beat_store = store.clone()
        self._beat_store.set_timeout(timeout)
        self._reported = False
        # collectives this rank issued (``count_issue``; the heartbeat publishes the count) and
        # calls every rank makes so far (see [Note: calls every rank makes])
        self.issued = 0
        self.last_issued = ""     # what the last one was ("all-gather of unit 3"), published too
        self._calls = 0
        self._closed = threading.Event()
        self._store.set(f"{PREFIX}who/{rank}", f"{socket.gethostname()}, pid {os.getpid()}")
        self._beat_store.add(f"{PREFIX}beat/{rank}", 1)
        self._thread = threading.Thread(target=self._beat, name=f"infinity-heartbeat-{rank}",
                                        daemon=True)
        self._thread.start()

    # -- this rank ------------------------------------------------------------------------
    def _beat(self) -> None:
        key = f"{PREFIX}beat/{self.rank}"
        published = 0
        while not self._closed.wait(self.beat_s):
            try:
                self._beat_store.add(key, 1)
                issued = self.issued
                if issued != published:
                    self._beat_store.set(f"{PREFIX}issued/{self.rank}",
                                         f"{issued} {self.last_issued}")
                    published = issued
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing to tell
                return

    def count_issue(self, what: str = "") -> None:
        """This rank is issuing one more collective (on the watched group), ``what``."""
        self.last_issued = what
        self.issued += 1

    def agree(self, call: str, timeout_s: float, hint_after_s: float = AGREE_HINT_S) -> None:
        """Wait until every other rank makes ``call`` too, before its first collective; raise
        when one cannot (see [Note: calls every rank makes]). A wait past ``hint_after_s``
        says once which ranks it waits for and what that usually means: a rank waiting in
        something the engine does not count (``dist.barrier()``, accelerate's
        ``wait_for_everyone()``) neither calls nor moves on, so only the timeout ends it."""
        n, self._calls = self._calls, self._calls + 1
        started = time.monotonic()
        hinted = False
        mine = self.issued
        self._store.set(f"{PREFIX}call/{n}/{self.rank}", call)
        pending = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + timeout_s
        beats: dict[int, int] = {}           # each rank's last heartbeat count seen, and when
        since: dict[int, float] = {}
        every = (f"{call} must be called on every rank, at the same point (each rank holds "
                 "a share of the model, and every rank takes part in reading or writing it)"
                 + ("; an optimizer step comes at the accumulation boundary, which every rank "
                    "must reach at the same micro-step (set_gradient_accumulation_boundary or "
                    "the count of micro-steps differ?)" if call == "step()" else ""))
        polls = 0
        with contextlib.suppress(Exception):   # ranks usually arrive together: back at once
            self._store.wait([f"{PREFIX}call/{n}/{r}" for r in pending],
                             datetime.timedelta(milliseconds=50))
        while pending:
            for r in list(pending):
                key = f"{PREFIX}call/{n}/{r}"
                if self._store.check([key]):
                    theirs = self._store.get(key).decode(errors="replace")
                    if theirs != call:
                        raise CallNotMadeError(f"rank {self.rank} called {call} where rank {r} "
                                           f"called {theirs}: {every}")
                    pending.remove(r)
                    continue
                issued = f"{PREFIX}issued/{r}"
                # its key is read again: it may have made the call (and gone past it, its
                # collectives counted) between the reads; it writes its key before any
                if self._store.check([issued]) and self._issued_of(issued) > mine and \
                        not self._store.check([key]):
                    # more collectives than this rank: it went past the call, or ran a pass
                    # this rank did not (an evaluation batch more) and is still to make it
                    raise CallNotMadeError(
                        f"rank {self.rank} called {call} but rank {r}{self._who(r)} has issued "
                        f"more collectives than this rank: it went on without the call, or "
                        f"ran a forward this rank did not (an evaluation batch more) before "
                        f"it: {every}")
                beat = self._store.add(f"{PREFIX}beat/{r}", 0)
                if beat != beats.get(r):
                    beats[r], since[r] = beat, time.monotonic()
                # a rank whose script ended; one that raised stops its heartbeat as it exits
                # (its failure alone is no proof: a rank that caught its error may still call)
                stopped = self._store.check([f"{PREFIX}exited/{r}"])
                if stopped or time.monotonic() - since[r] > 5 * self.beat_s:
                    story = self.diagnose(f"agreement on {call}")   # a silent beat: confirmed
                    if stopped or not story.startswith("every other rank is alive"):
                        from infinity.comm.collectives import LostRankError
                        raise LostRankError(f"rank {self.rank}: {call} waited for rank {r}: "
                                            f"{story} ({every})")
                    since[r] = time.monotonic()
            if pending and not hinted and time.monotonic() - started > hint_after_s:
                hinted = True
                log.warning("rank %d has waited %.0f s in %s for rank(s) %s, alive but not "
                            "calling it yet: a rank still working toward it will, one that "
                            "waits in dist.barrier() (accelerate's wait_for_everyone()) never "
                            "will. %s; this wait ends after infinity.collective_timeout (%g s)",
                            self.rank, time.monotonic() - started, call, pending, every,
                            timeout_s)
            if pending and time.monotonic() > deadline:
                raise CallNotMadeError(f"rank {self.rank} called {call} and waited "
                                   f"{timeout_s:g}s for rank(s) {pending} to call it: {every}")
            if pending:
                # ranks usually arrive together: a fixed 50 ms poll cost every agreement that
                # much (each step, each GatheredParameters); backing off from 0.5 ms it costs
                # about the other rank's lag, and 50 ms a poll on a long wait
                time.sleep(min(0.05, 0.0005 * 2 ** polls))
                polls += 1
        if n:
            # every other rank wrote call n after it was done agreeing on call n - 1, so no rank
            # reads this rank's key of that one any more: dropped, or a call every step (step()
            # is one) would grow the store by a key per rank per step
            with contextlib.suppress(Exception):
                self._store.delete_key(f"{PREFIX}call/{n - 1}/{self.rank}")

    def report(self, error: BaseException, where: str) -> None:
        """Tell the other ranks that ``error`` escaped this rank's ``where`` (the first report
        stands: a later one is the same failure seen further up)."""
        from infinity.comm.collectives import LostRankError
        if self._reported or self._closed.is_set() or isinstance(error, LostRankError):
            return
        lines = traceback.format_exception_only(type(error), error)
        text = f"{''.join(lines).strip()} (in {where})"[:MAX_TEXT]
        # the store may be gone too: the error is raised anyway
        with contextlib.suppress(Exception):
            self._store.set(f"{PREFIX}failed/{self.rank}", text)
            self._reported = True

    def carried_on(self) -> None:
        """This rank went past a reported failure (the caller caught it) and stepped: withdraw
        the report, so that a later failure is not blamed on it."""
        if self._reported:
            self._reported = False
            with contextlib.suppress(Exception):
                self._store.delete_key(f"{PREFIX}failed/{self.rank}")

    def mark_exited(self) -> None:
        if not self._reported and not self._closed.is_set():
            with contextlib.suppress(Exception):
                self._store.set(f"{PREFIX}exited/{self.rank}", "1")
        self.close()

    def close(self) -> None:
        """Stop the heartbeat, and wait for a beat in flight (at most its store timeout): at
        exit the process group's store is torn down next, and a daemon thread still inside a
        store call then could abort the interpreter's exit ("terminate called without an
        active exception")."""
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_TIMEOUT_S + 1.0)

    # -- the others -------------------------------------------------------------------------
    def _failures(self, others: list[int]) -> dict[int, str]:
        found = {}
        for r in others:
            key = f"{PREFIX}failed/{r}"
            if self._store.check([key]):
                found[r] = self._store.get(key).decode(errors="replace")
        return found

    def _who(self, r: int) -> str:
        key = f"{PREFIX}who/{r}"
        try:
            return f" ({self._store.get(key).decode()})" if self._store.check([key]) else ""
        except Exception:  # noqa: BLE001
            return ""

    def diagnose(self, what: str = "collective") -> str:
        """Which rank(s) stopped, and how, from the store; takes up to ~3 heartbeats."""
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            failed = self._failures(others)
            if not failed:
                beats = {r: self._store.add(f"{PREFIX}beat/{r}", 0) for r in others}
                deadline = time.monotonic() + 3 * self.beat_s
                silent = set(others)
                while silent and time.monotonic() < deadline:
                    time.sleep(self.beat_s / 4)
                    silent = {r for r in silent
                              if self._store.add(f"{PREFIX}beat/{r}", 0) == beats[r]}
                failed = self._failures(others)    # one may have reported meanwhile
        except Exception as exc:  # noqa: BLE001 - the store went with its host
            return (f"the store the ranks share no longer answers ({type(exc).__name__}: "
                    f"{exc}): {self.store_host or 'its host'} has stopped")
        if failed:
            return "; ".join(f"rank {r}{self._who(r)} failed: {text}"
                             for r, text in sorted(failed.items()))
        if silent:
            parts = []
            for r in sorted(silent):
                if self._store.check([f"{PREFIX}exited/{r}"]):
                    parts.append(f"rank {r}{self._who(r)} exited (its script ended) while "
                                 f"this rank waited in the {what}")
                else:
                    parts.append(f"rank {r}{self._who(r)} stopped: its heartbeat stopped "
                                 "(killed, or it exited without reporting an error)")
            return "; ".join(parts)
        return (f"every other rank is alive (their heartbeats advance) and none reported an "
                f"error, but the {what} did not complete: a rank hangs, or the ranks issue "
                "different collectives" + self._counts_apart(others))

    def _issued_of(self, key: str) -> int:
        """A rank's count of issued collectives, as its heartbeat published it."""
        return int(self._store.get(key).decode().partition(" ")[0])

    def _last_of(self, key: str) -> str:
        """What that rank's last issued collective was ("" where unknown)."""
        return self._store.get(key).decode().partition(" ")[2]

    def _counts_apart(self, others: list[int]) -> str:
        """Where the ranks' counts of issued collectives (the heartbeat publishes them) differ,
        each rank's count and who issued fewest (the rank that ran out of data or skipped a
        call, often); empty where they agree or cannot be read."""
        counts, lasts = {self.rank: self.issued}, {self.rank: self.last_issued}
        with contextlib.suppress(Exception):
            for r in others:
                key = f"{PREFIX}issued/{r}"
                if self._store.check([key]):
                    counts[r], lasts[r] = self._issued_of(key), self._last_of(key)
        if len(set(counts.values())) < 2:
            if len(counts) < 2 or len(set(lasts.values())) < 2 or not all(lasts.values()):
                return ""
            said = "; ".join(f"rank {r}'s is the {lasts[r]}" for r in sorted(lasts))
            return (f". Each rank's collective number {self.issued} differs: {said}: the "
                    "ranks' paths parted before it (a forward more on one rank -- evaluation "
                    "batches that differ in number between ranks --, a call one rank alone "
                    "made, or at stage 3 a backward through a unit on some ranks only: a "
                    "module whose output some ranks' losses do not read, the data deciding)")
        fewest = min(counts.values())
        fewer = sorted(r for r, c in counts.items() if c == fewest)
        said = ", ".join(f"rank {r} {counts[r]}" for r in sorted(counts))
        return (f". Collectives issued so far: {said}: the ranks' paths parted (rank(s) "
                f"{fewer} issued fewest: a rank that ran out of data, skipped a step() or a "
                "call the others made, or waits in something of its own)")


_WATCH: RankWatch | None = None
# the group the watch is for, weakly: a strong reference kept the group's gloo backend (its
# worker threads) alive past ``destroy_process_group`` into the interpreter's teardown, where
# destroying it could abort the exit ("terminate called without an active exception")
_WATCH_KEY: weakref.ref | None = None
_LOCK = threading.Lock()


def watch_ranks(group: Any, rank: int, world_size: int) -> RankWatch | None:
    """The watch of this process in ``group``'s store (one per process group, started at its
    first engine; None with one rank or when the store cannot be reached)."""
    global _WATCH, _WATCH_KEY
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    with _LOCK:
        try:
            pg = group if group is not None else dist.distributed_c10d._get_default_group()
            if _WATCH is not None and _WATCH_KEY is not None and _WATCH_KEY() is pg:
                return _WATCH
            store = dist.distributed_c10d._get_process_group_store(pg)
            watch = RankWatch(store, rank, world_size, store_host=_store_host())
        except Exception as exc:  # noqa: BLE001 - the engine runs; failures are just less named
            log.warning("cannot watch the other ranks through the process group's store (%s: "
                        "%s): a lost rank will not be named", type(exc).__name__, exc)
            return None
        if _WATCH is not None:
            _WATCH.close()
        else:
            _install_hooks()
        _WATCH, _WATCH_KEY = watch, weakref.ref(pg)
        return watch


def _store_host() -> str:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return "torchrun's agent on the first node (which hosts it)"
    return "rank 0 (which hosts it)"


def _install_hooks() -> None:
    """Report an exception that ends the script, and mark a normal exit (see [Note: lost
    rank]); the previous excepthook still runs."""
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        if _WATCH is not None and isinstance(value, BaseException):
            _WATCH.report(value, "the script")
            _WATCH.close()      # not a normal exit: the heartbeat stops, no exited key
        previous(kind, value, tb)

    sys.excepthook = excepthook

    def at_exit() -> None:
        if _WATCH is not None:
            _WATCH.mark_exited()

    atexit.register(at_exit)
