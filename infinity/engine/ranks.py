"""The engine's side of data-parallel ranks: joining the process group, reading the config for
the world size it finds, and the collectives wrapper the engine's parts share.

Why apart from engine.py: it runs once, before anything is built, and its order matters (the
group before the config, whose batch sizes add up only at the world size the group gives; the
config's timeout before the group's first collective).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from infinity.comm.collectives import Collectives
from infinity.comm.group import RankInfo, join_ranks
from infinity.comm.watchdog import watch_ranks
from infinity.config import InfinityConfig, InfinitySection
from infinity.config.file import decode_base64_config, read_config_file


def join(config: Any, process_group: Any, device: torch.device,
         auto_values: Mapping[str, Any] | None) -> tuple[RankInfo, InfinityConfig, Collectives]:
    """The ranks (``process_group`` when given, else the default group, created from the
    launcher's environment when it is not yet; the config's collective timeout applies to it
    however it was made), the config read for their world size, and their collectives."""
    ranks = join_ranks(process_group, collective_timeout_of(config), device)
    try:
        loaded = InfinityConfig.load(config or {}, world_size=ranks.world_size,
                                     auto_values=auto_values)
    except Exception as exc:
        # a config this rank alone refuses: the others, waiting at their first collective,
        # are told why (they said "its heartbeat stopped", the error unnamed)
        watch = watch_ranks(ranks.group, ranks.rank, ranks.world_size)
        if watch is not None:
            watch.report(exc, "initialize")
        raise
    if loaded.world_size != ranks.world_size:
        raise ValueError(f"the config was read for world size {loaded.world_size} but this run "
                         f"has {ranks.world_size} ranks: pass the config as a dict or path, and "
                         "initialize reads it for the ranks it finds")
    return ranks, loaded, collectives(ranks, loaded)


def collective_timeout_of(config: Any) -> float | None:
    """``infinity.collective_timeout`` of a config not read yet (its batch sizes are checked
    against the world size, which the process group gives): the section alone; None when
    the config leaves it unset."""
    if isinstance(config, InfinityConfig):
        return config.infinity.collective_timeout
    if config is None:
        return None
    if isinstance(config, Mapping):
        data = config
    elif isinstance(config, str) and not Path(config).exists():
        data = decode_base64_config(config)
    else:
        data = read_config_file(Path(config))
    section = data.get("infinity") if isinstance(data, Mapping) else None
    value = section.get("collective_timeout") if isinstance(section, Mapping) else None
    return None if value is None else InfinitySection(collective_timeout=value).collective_timeout


def collective_bucket_bytes(config: InfinityConfig) -> tuple[int, int]:
    """(all-gather, reduce-scatter) bytes one collective call moves at most, from the config
    (DeepSpeed's sizes are elements; counted here as fp32 bytes; unset: unlimited). The
    engine's collectives and the dry run's (simulate/collectives.py) both take them
    from here."""
    z = config.zero
    gather = z.allgather_bucket_size or (1 << 62)
    reduce = z.reduce_bucket_size or (1 << 62)
    return int(gather) * 4, int(reduce) * 4


def collectives(ranks: RankInfo, config: InfinityConfig) -> Collectives:
    """The collectives of this run, bucketed per the config (``collective_bucket_bytes``), with
    the lost-rank watch (comm/watchdog.py)."""
    gather, reduce = collective_bucket_bytes(config)
    return Collectives(ranks.group, ranks.world_size, ranks.rank,
                       gather_bucket_bytes=gather, reduce_bucket_bytes=reduce,
                       watch=watch_ranks(ranks.group, ranks.rank, ranks.world_size),
                       timeout_s=config.infinity.collective_timeout or 1800.0)
