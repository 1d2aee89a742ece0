"""AioConfig: one definition for the config's "aio" section and the I/O engine: DeepSpeed names,
validation that names the key, the thread_count alias, and limits the engine shares."""
from __future__ import annotations

import dataclasses

import pytest

from infinity.config import AioConfig, ConfigError, InfinityConfig
from infinity.config.aio import MAX_QUEUE_DEPTH, MAX_THREAD_COUNT
from infinity.io import AioConfig as IoAioConfig
from infinity.io import AioEngine, backend_available


def test_defaults_match_the_documented_ones() -> None:
    c = AioConfig()
    assert (c.backend, c.block_size, c.queue_depth, c.thread_count, c.single_submit,
            c.overlap_events, c.use_gds) == ("auto", 1 << 20, 32, 1, False, True, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.queue_depth = 8  # type: ignore[misc]


def test_the_io_engine_and_the_config_share_one_class() -> None:
    assert IoAioConfig is AioConfig
    assert InfinityConfig.from_dict({}).aio == AioConfig()


@pytest.mark.parametrize("kw, field", [
    ({"block_size": 1000}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": 6000}, "block_size"),
    ({"block_size": 2 << 30}, "block_size"),
    ({"queue_depth": 0}, "queue_depth"),
    ({"queue_depth": 1 << 20}, "queue_depth"),
    ({"thread_count": 0}, "thread_count"),
    ({"thread_count": MAX_THREAD_COUNT + 1}, "thread_count"),
    ({"thread_count": 2.5}, "thread_count"),
    ({"single_submit": 1}, "single_submit"),
    ({"overlap_events": "yes"}, "overlap_events"),
    ({"backend": "uring"}, "backend"),
])
def test_bad_values_name_the_key_and_value(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"aio\.{field}") as info:
        AioConfig(**kw)
    assert repr(next(iter(kw.values()))) in str(info.value) or str(next(iter(kw.values()))) in str(info.value)
    with pytest.raises(ConfigError, match=rf"aio\.{field}"):    # the config file says the same
        InfinityConfig.from_dict({"aio": kw})


def test_intra_op_parallelism_is_an_alias_of_thread_count() -> None:
    assert AioConfig.from_dict({"intra_op_parallelism": 4}).thread_count == 4
    with pytest.raises(ConfigError, match="given twice"):
        AioConfig.from_dict({"thread_count": 2, "intra_op_parallelism": 4})


def test_from_dict_reads_a_deepspeed_aio_section() -> None:
    c = AioConfig.from_dict({"block_size": "4MiB", "queue_depth": 8, "intra_op_parallelism": 2,
                             "single_submit": True, "overlap_events": False, "use_gds": False})
    assert (c.block_size, c.queue_depth, c.thread_count, c.single_submit, c.overlap_events) == \
        (4 << 20, 8, 2, True, False)
    with pytest.raises(ConfigError, match="did you mean 'aio.queue_depth'"):
        AioConfig.from_dict({"queue_dept": 8})
    with pytest.raises(ConfigError, match="use_gds"):
        AioConfig.from_dict({"use_gds": True})


@pytest.mark.parametrize("backend", ["threads", "io_uring", "libaio"])
def test_the_largest_values_the_config_accepts_start_the_engine(backend: str) -> None:
    """A thread_count (or queue_depth) the config accepts is one the native engine accepts: 128
    threads used to pass the config and fail at the first NVMe access."""
    if not backend_available(backend):
        pytest.skip(f"the {backend} backend is not available in this process")
    cfg = InfinityConfig.from_dict({"aio": {"backend": backend, "thread_count": MAX_THREAD_COUNT,
                                            "queue_depth": MAX_QUEUE_DEPTH // 64}}).aio
    with AioEngine(cfg) as engine:
        assert engine.config.thread_count == MAX_THREAD_COUNT
    with AioEngine(AioConfig(backend=backend, queue_depth=MAX_QUEUE_DEPTH)) as engine:
        assert engine.config.queue_depth == MAX_QUEUE_DEPTH
    with pytest.raises(ConfigError, match=r"aio\.thread_count"):
        InfinityConfig.from_dict({"aio": {"thread_count": MAX_THREAD_COUNT + 1}})
