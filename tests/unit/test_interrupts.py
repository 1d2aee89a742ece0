"""deferred_interrupts: a Ctrl-C inside the block is raised when the block is done; a second
one at once; another handler than Python's default is left alone."""
from __future__ import annotations

import os
import signal
import time

import pytest

from infinity.base.interrupts import deferred_interrupts


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)            # the handler runs at the next bytecode boundary


def test_a_ctrl_c_inside_waits_for_the_end_of_the_block() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts("the test step"):
            _ctrl_c()
            done.append("finished after the Ctrl-C")
    assert done == ["finished after the Ctrl-C"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_stops_at_once() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts("the test step"):
            _ctrl_c()
            _ctrl_c()
            done.append("not reached")
    assert done == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_block_without_ctrl_c_raises_nothing_and_a_custom_handler_is_kept() -> None:
    with deferred_interrupts("the test step"):
        pass
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with deferred_interrupts("the test step"):
            _ctrl_c()
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
