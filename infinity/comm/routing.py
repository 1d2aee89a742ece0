"""Which process group a collective runs on: the engine's group, or a gloo group over the same
ranks for tensors on the host when the engine's group cannot take them.

[Note: host collectives on a device-only group]
Many of the engine's collectives run on host tensors: the gradient reduction into host buffers,
the scalars of the step (the global gradient norm, which parameters got a gradient, the
sequence check), the broadcast of a host-resident unit, the object gathers of the start-up
checks. A process group has one backend per device type, and a group made with the backend
"nccl" (what ``deepspeed.init_distributed("nccl")``, accelerate and most torchrun scripts make)
has one for "cuda" only: a collective on a CPU tensor raises "No backend type associated with
device type cpu". So:

- a group the engine makes itself on CUDA uses torch's device-mapped backend
  "cpu:gloo,cuda:nccl" (comm/group.py ``default_backend``): one group, gloo for host tensors,
  NCCL for device tensors;
- for a group the engine is given (or finds) without a CPU backend, ``Collectives`` makes a
  gloo group over the same ranks once, at its construction, and every collective whose tensors
  are on the host (and the object gathers and the barrier, which have no tensor of the
  caller's) runs on it; device tensors stay on the engine's group.

What a group serves is read from torch's description of it, ``dist.get_backend_config(group)``
("cuda:nccl" for "nccl", "cpu:gloo,cuda:gloo" for "gloo", "cpu:gloo,cuda:nccl" as written): a
public API that names every device type the group has a backend for, the same list the group
registered its backends from (``ProcessGroup._device_types``, private, is the fallback when a
group is missing from torch's table). ``dist.get_backend(group)`` is not enough: it returns the
string the group was created with, where "nccl" and "cuda:nccl" both mean CUDA only and an
unknown name means "cpu and cuda".

Making the side group is a collective over the ranks (torch's ``new_group``): every rank makes
it at the same point, the construction of the engine's ``Collectives``, which every rank reaches
in the same order (after joining the group and before the first collective). Only over the whole
world: a plain ``new_group``, which every rank of the world calls. A device-only group over a
subset of the ranks is refused, with the fix (make it "cpu:gloo,cuda:nccl"): its members alone
would make the side group (``use_local_synchronization``), whose store key torch derives from
the ranks and from how many groups each process has made so far, so members with different
histories (a group made on some ranks only, or an earlier engine on an overlapping subgroup)
wait on different keys and hang until the collective timeout without naming anyone. Its ranks
are numbered as the group numbers them, so the shards of a gather land where they would. One side
group is made per engine group per process and reused by later engines. It gets the engine
group's collective timeout (the config's ``infinity.collective_timeout``, set on the group
before), and its failures are named by the same watch as the engine group's (the watch reads
the store, not the group: see [Note: lost rank] in comm/watchdog.py). The two groups each run
their calls in issue order, separately: see [Note: collective order] in comm/collectives.py.
"""
from __future__ import annotations

import datetime
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from infinity.base.log import get_logger

log = get_logger("comm")

__all__ = ["HOST", "backends_of", "group_timeout", "has_tensor_ops", "parse_backend_config",
           "routes_to_side", "side_group", "side_group_needed", "tensor_device_type"]

HOST = "cpu"
"""The device type of host tensors (and of the object gathers' pickled bytes)."""

# backends with all_gather_into_tensor and reduce_scatter_tensor (gloo since torch 2.6, NCCL
# always; MPI and older gloo have neither)
_TENSOR_OPS_BACKENDS = frozenset({"gloo", "nccl"})


def parse_backend_config(text: str) -> dict[str, str]:
    """{device type: backend} of torch's description of a group's backends
    ("cpu:gloo,cuda:nccl"); a bare name ("gloo", from an older torch) is read as torch reads
    it at creation (``BackendConfig``: its capability, or "cpu and cuda" when unknown)."""
    text = str(text).strip().lower()
    if ":" not in text:
        known = dist.Backend.backend_capability.get(text, ["cpu", "cuda"])
        return dict.fromkeys(known, text)
    out = {}
    for pair in text.split(","):
        device, sep, backend = pair.strip().partition(":")
        if not sep or not device or not backend:
            raise ValueError(f"the process group's backend description {text!r} is not "
                             "'<device>:<backend>,...' (e.g. 'cpu:gloo,cuda:nccl')")
        out[device] = backend
    return out


def backends_of(group: Any) -> dict[str, str]:
    """{device type: backend} of ``group`` (None: the default group): see [Note: host
    collectives on a device-only group] for why ``get_backend_config``."""
    try:
        return parse_backend_config(dist.get_backend_config(group))
    except Exception as exc:  # noqa: BLE001 - a group torch's table lacks: ask the group
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        types = [d.type for d in getattr(pg, "_device_types", [])]
        if not types:
            raise RuntimeError(f"cannot tell which devices the process group {pg!r} serves "
                               f"(get_backend_config: {type(exc).__name__}: {exc})") from exc
        name = str(dist.get_backend(group)).lower()
        return {t: parse_backend_config(name).get(t, name) for t in types}


def side_group_needed(backends: Mapping[str, str]) -> bool:
    """Whether a group serving ``backends`` needs a gloo group beside it for host tensors."""
    return HOST not in backends


def routes_to_side(backends: Mapping[str, str], device_type: str) -> bool:
    """Whether a collective on a tensor of ``device_type`` goes to the side group rather than
    to the group serving ``backends``: host tensors when that group has no host backend. A
    device type the group lacks otherwise (a CUDA tensor on a gloo-only "cpu:gloo" group) stays
    on it, and torch's error says so."""
    return device_type == HOST and side_group_needed(backends)


def has_tensor_ops(backends: Mapping[str, str], device_type: str) -> bool:
    """Whether the backend that runs a collective on ``device_type`` has the flat-tensor
    all-gather and reduce-scatter (the side group is gloo)."""
    backend = "gloo" if routes_to_side(backends, device_type) else backends.get(device_type, "")
    return backend in _TENSOR_OPS_BACKENDS


def group_timeout(group: Any) -> datetime.timedelta:
    """The collective timeout ``group`` (None: the default group) runs with now (torch's default
    for gloo when the group does not say)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", []):
        try:
            return pg._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 - a backend without options: try the next
            continue
    return dist.distributed_c10d._get_default_timeout(dist.Backend("gloo"))


# the side group of each engine group, with the engine group, both weakly (torch's registry holds
# them until ``destroy_process_group``; a strong reference here would keep their backends and
# threads alive into the interpreter's teardown: see [Note: a group kept alive by a default
# argument] in comm/group.py)
_SIDE: list[tuple[weakref.ref, weakref.ref]] = []


def side_group(group: Any) -> Any:
    """The gloo group over ``group``'s ranks (None: the default group) that runs its host
    tensors' collectives, made at the first call in this process and reused after; a
    collective: every rank of ``group`` calls it at the same point (see [Note: host collectives
    on a device-only group])."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    timeout = group_timeout(pg)
    live = dist.distributed_c10d._world.pg_map
    _SIDE[:] = [(g, s) for g, s in _SIDE if g() in live and s() in live]
    for g, s in ((g(), s()) for g, s in _SIDE):
        if g is pg:
            dist.distributed_c10d._set_pg_timeout(timeout, s)   # the engine group's, now
            return s
    if not dist.is_gloo_available():
        raise RuntimeError(
            f"the process group's backend ({dist.get_backend_config(group)}) has no CPU "
            "backend and this torch build has no gloo to run the engine's collectives on host "
            "tensors: create the group with backend 'cpu:gloo,cuda:nccl' (or a build with gloo)")
    # the ranks in the group's order (``sort_ranks=False``): rank r of the side group is rank
    # r of the group, so a gather places each shard where the group would
    ranks = dist.get_process_group_ranks(pg)
    if len(ranks) != dist.get_world_size():
        raise RuntimeError(
            f"the engine's process group over ranks {ranks} (of a world of "
            f"{dist.get_world_size()}) has no CPU backend ({dist.get_backend_config(pg)}), and "
            "a gloo group for its host collectives can be made safely only over the whole "
            "world (see [Note: host collectives on a device-only group] in comm/routing.py): "
            "create this group with backend 'cpu:gloo,cuda:nccl' (dist.new_group(ranks, "
            "backend='cpu:gloo,cuda:nccl'))")
    side = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, sort_ranks=False,
                          group_desc="infinity host collectives")
    if dist.get_rank(side) != dist.get_rank(pg):
        raise RuntimeError(f"the gloo group for host collectives numbers this process "
                           f"{dist.get_rank(side)} where the process group numbers it "
                           f"{dist.get_rank(pg)} (ranks {ranks}): create the group with "
                           "backend 'cpu:gloo,cuda:nccl' instead")
    _SIDE.append((weakref.ref(pg), weakref.ref(side)))
    log.info("the process group has no CPU backend (%s): collectives on host tensors run on a "
             "gloo group over the same %d ranks (timeout %gs)", dist.get_backend_config(pg),
             len(ranks), timeout.total_seconds())
    return side


def tensor_device_type(tensor: torch.Tensor | None) -> str:
    """The device type that decides a collective's group: the tensor's, or the host's for a
    collective without one (object gathers: pickled bytes; the barrier)."""
    return HOST if tensor is None else tensor.device.type
