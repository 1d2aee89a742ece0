"""Ctrl-C held back until an optimizer step is whole.

Why: ``engine.step()`` waits on background steps and then updates counters, the LR schedule, the
speculative step's extents and which units are held. A KeyboardInterrupt landing in between (a
notebook user stopping a cell) left that half done, and a loop resumed after it trained on wrong
values. Inside ``deferred_interrupts`` the first Ctrl-C is noted (with a log line saying the
step finishes first) and raised as KeyboardInterrupt when the block ends; a second one is raised
at once (the user insists; the engine may then be left mid-step, as before). Only the main
thread receives signals, and a handler other than Python's default (a training loop's own) is
left alone, unless it is ``StopSignals``' (which raises KeyboardInterrupt too).

[Note: a signal raised inside a finalizer]
Python runs a signal handler at the next bytecode of the main thread, wherever that is, and
that may be inside a ``weakref.finalize`` callback or a ``__del__`` (the activation swapper
frees its buffers from finalizers during every backward). An exception raised there is printed
("Exception ignored in: <finalize object ...>") and dropped: a Ctrl-C or SIGTERM was lost and
training went on. ``StopSignals`` remembers the signal as well as raising it, and a loop calls
``check()`` where it can stop (after each micro-batch): a signal whose exception was dropped is
raised again there.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

from infinity.base.log import get_logger

log = get_logger("engine")


@contextlib.contextmanager
def deferred_interrupts(what: str) -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) received inside the block until it ends (see the module)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    current = signal.getsignal(signal.SIGINT)
    if current is not signal.default_int_handler and not getattr(current, "deferrable", False):
        yield
        return
    received: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        if current is signal.default_int_handler:
            raise KeyboardInterrupt
        current(signum, frame)          # StopSignals': remembers it, then raises

    def hold(signum, frame) -> None:
        if received:
            interrupt(signum, frame)    # a second Ctrl-C: at once
        received.append(signum)
        log.warning("Ctrl-C: %s finishes first (press Ctrl-C again to stop at once)", what)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        interrupt(received[0], None)


class StopSignals:
    """SIGTERM and Ctrl-C for a training loop: SIGTERM raises SystemExit(128 + 15), which
    unwinds through the loop's ``finally`` as Ctrl-C does (Python's default SIGTERM action ends
    the process at once, leaving the swap directory behind); each is remembered, and ``check()``
    raises one again whose exception was dropped (see [Note: a signal raised inside a
    finalizer]). ``install()`` in the main thread (elsewhere it does nothing); ``restore()``
    puts the handlers back. A SIGINT handler other than Python's default is left alone."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self

        def on_term(signum: int, frame: Any) -> None:
            self.received.append(signum)
            raise SystemExit(128 + signum)

        def on_int(signum: int, frame: Any) -> None:
            self.received.append(signum)
            raise KeyboardInterrupt

        on_int.deferrable = True    # type: ignore[attr-defined]  # deferred_interrupts holds it
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_term)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_int)
        return self

    def check(self) -> None:
        """Raise again a signal received (its exception was dropped, or it would not be here)."""
        if not self.received:
            return
        signum = self.received[0]
        log.warning("%s received earlier was lost inside a finalizer: stopping now",
                    signal.Signals(signum).name)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
