"""A unit's place in the backward (zero/pass_state.py ``UnitBackward``): the verbs the
coordinator's hooks call move it through PENDING -> FETCHED -> INPUTS_DONE -> DONE, a second
finish in one backward is refused, and what the coordinator asks of it (done, inputs done, may
an op still read it) follows the state."""
from __future__ import annotations

import pytest

from infinity.zero.pass_state import UnitBackward, UnitStatus


def test_a_unit_goes_through_its_backward_once() -> None:
    status = UnitStatus()
    status.start_backward(trainable=3)
    assert (status.backward, status.grads_pending) == (UnitBackward.PENDING, 3)
    assert not (status.backward_done or status.inputs_done or status.backward_may_read)
    status.fetched_for_backward()
    assert status.backward is UnitBackward.FETCHED and status.backward_may_read
    status.fetched_for_backward()                 # a second call's pre-backward hook: no change
    assert status.backward is UnitBackward.FETCHED
    status.reached_inputs()
    assert status.inputs_done and status.backward_may_read and not status.backward_done
    status.fetched_for_backward()                 # fetched again after its inputs: stays
    assert status.backward is UnitBackward.INPUTS_DONE
    status.finish_backward()
    assert status.backward_done and not status.inputs_done and not status.backward_may_read
    status.fetched_for_backward()                 # fetched after its backward: stays done
    status.reached_inputs()
    assert status.backward is UnitBackward.DONE
    with pytest.raises(RuntimeError, match="finished twice in one backward.*done"):
        status.finish_backward()
    status.start_backward(trainable=1)            # the next backward starts it over
    assert status.backward is UnitBackward.PENDING and status.grads_pending == 1


@pytest.mark.parametrize("path", [["finish"], ["fetch", "finish"], ["inputs", "finish"]])
def test_gradients_may_complete_before_the_inputs_or_without_a_fetch(path) -> None:
    status = UnitStatus()
    verbs = {"fetch": status.fetched_for_backward, "inputs": status.reached_inputs,
             "finish": status.finish_backward}
    for verb in path:
        verbs[verb]()
    assert status.backward_done


def test_a_unit_is_what_the_optimizer_steps() -> None:
    """optim is written against zero.protocols.SteppedUnit, not the concrete Unit: every member
    of the Protocol is one of Unit's (a member Unit lacks fails here, before any engine)."""
    import torch
    from torch import nn

    from infinity.zero.protocols import SteppedUnit
    from infinity.zero.unit import Unit

    members = [n for n in (*SteppedUnit.__annotations__, *vars(SteppedUnit))
               if not n.startswith("_")]
    assert len(members) >= 15
    unit = Unit(0, "u", nn.Linear(2, 2), [("weight", nn.Parameter(torch.zeros(2, 2)), 0)],
                torch.float32, torch.device("cpu"))
    missing = [n for n in members if not hasattr(unit, n)]
    assert not missing, missing


def test_with_several_ranks_a_unit_finishes_where_every_rank_does() -> None:
    """[Note: a call's inputs mark its backward]: with several ranks a unit whose calls are
    watched finishes once they have the gradient of their inputs, whatever gradients this rank
    got (``forced`` where it lacked some), never at its last gradient (a rank with every
    expert's gradient finished before the others, and the ranks' collectives parted); one with
    a call whose inputs carry none waits for the backward's end; one rank: its gradients."""
    from infinity.zero.input_gradients import CallInputs

    status = UnitStatus()
    status.start_backward(trainable=2)
    call = CallInputs(1, lambda c: None)
    status.note_call(call)
    status.grads_pending = 0                      # every gradient in, the mark not reached
    assert not status.may_finish(True, False, ranks=2)
    assert status.may_finish(True, False, ranks=1)
    status.grads_pending = 1
    status.reached_inputs(call)                   # the mark, one gradient missing here
    assert status.may_finish(True, False, ranks=2) and status.forced
    blind = UnitStatus()
    blind.start_backward(trainable=1)
    blind.note_call(None)
    blind.grads_pending = 0
    assert not blind.may_finish(True, False, ranks=2)
    dropped = UnitStatus()
    dropped.start_backward(trainable=1)
    dropped.note_call(CallInputs(1, lambda c: None))   # its graph gone: the call with it
    live = CallInputs(1, lambda c: None)
    dropped.note_call(live)
    dropped.reached_inputs(live)
    assert not dropped.open_calls and dropped.calls_done
