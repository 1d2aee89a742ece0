"""checkpoint/json_state.py: the scheduler's state and client_state come back from a manifest
as the Python values saved, with their types (JSON alone gave lists for tuples and refused
torch's MultiStepLR, whose milestones are a Counter of int keys)."""
from __future__ import annotations

import json
import random
from collections import Counter, OrderedDict, defaultdict, namedtuple

import pytest

from infinity.checkpoint.json_state import TAG, decode, encode


def _through_a_file(value):
    return decode(json.loads(json.dumps(encode(value, "x"))))


@pytest.mark.parametrize("value", [
    {"milestones": Counter({100: 1, 200: 2}), "gamma": 0.1, "last_epoch": 3},
    {"rng": random.Random(7).getstate()},
    {(1, "a"): [1.5, None, True], 2: {3.5: "x"}, None: (), False: ((1,), [2])},
    OrderedDict([("b", 1), ("a", 2)]),
    {TAG: "a user's own key", "k": [{"n": float("inf")}]},
    [(), [], {}, Counter(), ""],
])
def test_values_come_back_with_their_types(value) -> None:
    back = _through_a_file(value)
    assert back == value
    assert repr(back) == repr(value)           # the same types at every depth, in order


def test_a_plain_json_value_is_written_and_read_as_before() -> None:
    """Manifests written before the tags read the same; string-keyed dicts are not tagged."""
    plain = {"a": [1, 2.5, "s", None, {"b": False}]}
    assert encode(plain, "x") == plain
    assert decode(plain) == plain


def test_a_defaultdict_and_a_namedtuple_come_back_plain_with_a_warning(
        infinity_log, monkeypatch) -> None:
    """DeepSpeed pickles client_state, so both are habits; refused, a first save hours into a
    run failed: their items come back, the type said to be lost (once per kind: the record
    of what was said is the test's own)."""
    from infinity.checkpoint import json_state

    monkeypatch.setattr(json_state, "_warned", set())
    point = namedtuple("point", "x y")
    back = _through_a_file({"m": defaultdict(list, a=[1]), "p": [point(1, (2,))]})
    assert back == {"m": {"a": [1]}, "p": [(1, (2,))]}
    assert type(back["m"]) is dict and type(back["p"][0]) is tuple
    assert "x['m'] is a defaultdict, which a checkpoint gives back as a plain dict" in \
        infinity_log.text
    assert "x['p'][0] is a point, which a checkpoint gives back as a plain tuple" in \
        infinity_log.text


def test_what_cannot_come_back_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"has a key frozenset\(\{1\}\) of type frozenset"):
        encode({frozenset({1}): 2}, "client_state")
    with pytest.raises(TypeError, match="must hold numbers.*Object of type set"):
        encode({"s": {1, 2}}, "client_state")


def test_a_damaged_tag_is_an_error_not_another_value() -> None:
    for damaged in ({TAG: "tuple", "items": 3}, {TAG: "set", "items": []},
                    {TAG: "dict", "items": [[1]]}):
        with pytest.raises(ValueError, match="not one this engine wrote"):
            decode(damaged)
