"""Ctrl-C held back until an optimizer step is whole.

Why: ``engine.step()`` waits on background steps and then updates counters, the LR schedule, the
speculative step's extents and which units are held. A KeyboardInterrupt landing in between (a
notebook user stopping a cell) left that half done, and a loop resumed after it trained on wrong
values. Inside ``deferred_interrupts`` the first Ctrl-C is noted (with a log line saying the
step finishes first) and raised as KeyboardInterrupt when the block ends; a second one is raised
at once (the user insists; the engine may then be left mid-step, as before). Only the main
thread receives signals, and a handler other than Python's default (a training loop's own) is
left alone.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

from infinity.base.log import get_logger

log = get_logger("engine")


@contextlib.contextmanager
def deferred_interrupts(what: str) -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) received inside the block until it ends (see the module)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: list[int] = []

    def hold(signum, frame) -> None:
        if received:
            raise KeyboardInterrupt    # a second Ctrl-C: at once
        received.append(signum)
        log.warning("Ctrl-C: %s finishes first (press Ctrl-C again to stop at once)", what)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
