"""AioConfig: DeepSpeed "aio" names, validation that names the field, the thread_count alias."""
from __future__ import annotations

import dataclasses

import pytest

from infinity.io import AioConfig


def test_defaults_match_the_documented_ones() -> None:
    c = AioConfig()
    assert (c.backend, c.block_size, c.queue_depth, c.thread_count, c.single_submit,
            c.overlap_events) == ("auto", 1 << 20, 32, 1, False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.queue_depth = 8  # type: ignore[misc]


@pytest.mark.parametrize("kw, field", [
    ({"block_size": 1000}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"queue_depth": 0}, "queue_depth"),
    ({"queue_depth": 1 << 20}, "queue_depth"),
    ({"thread_count": 0}, "thread_count"),
    ({"thread_count": 2.0}, "thread_count"),
    ({"single_submit": 1}, "single_submit"),
    ({"overlap_events": "yes"}, "overlap_events"),
    ({"backend": "uring"}, "backend"),
])
def test_bad_values_name_the_field_and_value(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"AioConfig.{field}") as info:
        AioConfig(**kw)
    assert repr(next(iter(kw.values()))) in str(info.value) or str(next(iter(kw.values()))) in str(info.value)


def test_intra_op_parallelism_is_an_alias_of_thread_count() -> None:
    assert AioConfig(intra_op_parallelism=4).thread_count == 4
    assert AioConfig(thread_count=4, intra_op_parallelism=4).thread_count == 4
    with pytest.raises(ValueError, match="disagree"):
        AioConfig(thread_count=2, intra_op_parallelism=4)


def test_from_dict_reads_a_deepspeed_aio_section() -> None:
    c = AioConfig.from_dict({"block_size": "4MiB", "queue_depth": 8, "intra_op_parallelism": 2,
                             "single_submit": True, "overlap_events": False, "use_gds": False})
    assert (c.block_size, c.queue_depth, c.thread_count, c.single_submit, c.overlap_events) == \
        (4 << 20, 8, 2, True, False)
    with pytest.raises(ValueError, match="did you mean 'queue_depth'"):
        AioConfig.from_dict({"queue_dept": 8})
    with pytest.raises(ValueError, match="use_gds"):
        AioConfig.from_dict({"use_gds": True})
