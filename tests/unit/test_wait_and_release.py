"""buffer_pool.wait_and_release: every chunk in flight is waited and its slot given back, even
after a failed wait (a failed checkpoint load kept one optimizer slot for good, each time)."""
from __future__ import annotations

from collections import deque

import pytest

from infinity.storage.buffer_pool import wait_and_release


class _Request:
    def __init__(self, name: str, error: bool, log: list) -> None:
        self.name, self.error, self.log = name, error, log

    def wait(self) -> None:
        self.log.append(("wait", self.name))
        if self.error:
            raise OSError(5, f"EIO in {self.name}")


@pytest.mark.parametrize("container", [list, deque])
def test_every_slot_goes_back_after_its_own_requests_and_the_first_error_is_raised(container):
    log: list = []
    in_flight = container([
        ([_Request("a1", False, log), _Request("a2", True, log)], "slot-a"),
        ([_Request("b1", True, log)], "slot-b"),
        ([_Request("c1", False, log)], "slot-c"),
    ])
    with pytest.raises(OSError, match="EIO in a2"):
        wait_and_release(in_flight, lambda request: request.wait(),
                         lambda slot: log.append(("release", slot)))
    assert log == [("wait", "a1"), ("wait", "a2"), ("release", "slot-a"), ("wait", "b1"),
                   ("release", "slot-b"), ("wait", "c1"), ("release", "slot-c")]
    assert len(in_flight) == 0
