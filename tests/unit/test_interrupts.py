"""deferred_interrupts: a Ctrl-C inside the block is raised when the block is done; a second
one at once; another handler than Python's default is left alone."""
from __future__ import annotations

import os
import signal
import time

import pytest

from infinity.base.interrupts import StopSignals, deferred_interrupts


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


def _signal_inside_a_finalizer(signum: int) -> list[str]:
    """Send ``signum`` to this process from inside a ``weakref.finalize`` callback: its handler
    runs there, and the exception it raises is printed and dropped by Python."""
    import weakref

    ran = []

    def finalizer() -> None:
        os.kill(os.getpid(), signum)
        for _ in range(1000):      # the handler runs at one of these bytecodes, in here
            pass
        ran.append("the finalizer's end")     # not reached: the handler raised before

    class Freed:
        pass

    obj = Freed()
    weakref.finalize(obj, finalizer)
    del obj
    return ran


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop
@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, SystemExit),
                                            (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_dropped_inside_a_finalizer_is_raised_again_by_check(signum, raised) -> None:
    """[Note: a signal raised inside a finalizer]: the exception is dropped where it was
    raised (the code after it runs on), and ``check()`` raises it again."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    stop = StopSignals().install()
    try:
        ran = _signal_inside_a_finalizer(signum)     # and here: Python dropped its exception
        assert ran == []                              # the handler ran inside the finalizer
        with pytest.raises(raised) as info:
            stop.check()
        if raised is SystemExit:
            assert info.value.code == 128 + signal.SIGTERM
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    StopSignals().check()                   # nothing received: nothing raised


def test_a_ctrl_c_under_stop_signals_is_held_by_a_step_and_remembered() -> None:
    """deferred_interrupts holds a Ctrl-C under the loop's handler too (it raises
    KeyboardInterrupt as Python's does), raising it when the step is whole; the loop's handler
    remembers it."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    stop = StopSignals().install()
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts("the test step"):
                _ctrl_c()
                done.append("finished after the Ctrl-C")
        assert done == ["finished after the Ctrl-C"] and stop.received == [signal.SIGINT]
    finally:
        stop.restore()
