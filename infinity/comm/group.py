"""The data-parallel process group: taken from the launcher's environment (``torchrun`` sets
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), made by ``infinity.init_distributed()`` as
DeepSpeed's ``deepspeed.init_distributed()``, or passed in by the user. We write no transport and
no launcher: torch.distributed (NCCL on GPUs, gloo on CPUs) is both.
"""
from __future__ import annotations

import atexit
import datetime
import importlib
import os
import sys
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from infinity.base.log import get_logger
from infinity.comm.routing import backends_of

log = get_logger("comm")


@dataclass(frozen=True)
class RankInfo:
    """Who this process is among the data-parallel ranks."""

    rank: int
    world_size: int
    local_rank: int
    group: Any = None     # None: the default group

    @property
    def is_first(self) -> bool:
        return self.rank == 0


SINGLE = RankInfo(0, 1, 0)


def env_world_size() -> int:
    """``WORLD_SIZE`` from the launcher's environment (1 when unset); a value that is not a
    positive integer is an error naming it."""
    raw = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"WORLD_SIZE={raw!r} in the environment is not a positive integer; "
                         "launch with torchrun (which sets it) or unset it")
    return int(raw)


def launched_world_size() -> int:
    """The world size of this run: the process group's when it exists, else the launcher's
    ``WORLD_SIZE`` (1 when unset)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return env_world_size()


CUDA_BACKEND = "cpu:gloo,cuda:nccl"
"""The backend of a group the engine makes on CUDA: NCCL for device tensors, gloo for the host
tensors many of the engine's collectives run on (NCCL alone has no CPU backend: see [Note: host
collectives on a device-only group] in comm/routing.py)."""


def default_backend(device: torch.device | None = None) -> str:
    """Where the ranks compute on CUDA devices, NCCL for CUDA tensors and gloo for host ones
    (``CUDA_BACKEND``, one group); gloo otherwise."""
    if device is not None and device.type == "cuda":
        return CUDA_BACKEND
    if device is None and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        return CUDA_BACKEND
    return "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0,
                     device: torch.device | None = None) -> RankInfo:
    """Join the process group the launcher describes (DeepSpeed's ``init_distributed``): a
    no-op when torch.distributed is already initialised or there is one rank. ``timeout_s``
    bounds every collective (see ``infinity.collective_timeout``): a rank that stopped makes
    the others fail after at most this long instead of waiting for ever."""
    if dist.is_available() and dist.is_initialized():
        return current_ranks()
    world = env_world_size()
    if world == 1:
        return SINGLE
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world} but this torch build has no torch.distributed")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} but {', '.join(missing)} is not set: start the "
                           "ranks with torchrun (torchrun --nproc_per_node N train.py), which "
                           "sets them, or call torch.distributed.init_process_group yourself")
    backend = backend or default_backend(device)
    _import_group_defaults()
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(_destroy_at_exit, weakref.ref(dist.group.WORLD))
    info = current_ranks()
    log.info("joined the process group: rank %d of %d (%s, collective timeout %gs)",
             info.rank, info.world_size, backend, timeout_s)
    return info


def _import_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` before the group exists.

    [Note: a group kept alive by a default argument]
    That module's functions take ``group=group.WORLD`` as a default, evaluated when it is
    imported; torch imports it lazily, from the first ``torch.optim`` optimizer made (its
    ``add_param_group`` imports torch._dynamo, which imports FSDP and the sharded tensor that
    import it). Imported after the group was made, those defaults hold the group for the life
    of the process: ``destroy_process_group`` then leaves its gloo backend and worker threads
    running into the interpreter's teardown, where destroying them can abort a rank that had
    finished ("terminate called without an active exception", SIGABRT: a rank 1 of this
    project's distributed tests, three times). Imported first, the defaults are None (the
    default group, looked up at each call). A group made before (by the user, or transformers)
    may be held so by that module or by others of the same habit (torch.distributed.optim,
    FSDP's sharded grad scaler): the at-exit handlers then set those defaults to None
    (``_drop_default_arguments``)."""
    importlib.import_module("torch.distributed.nn.functional")


# groups whose defaults are let go of at exit, held weakly (an id could be a later group's)
_LET_GO: weakref.WeakSet = weakref.WeakSet()


def _let_go_at_exit(group: weakref.ref) -> None:
    """At exit, torch.distributed's default arguments holding a group the user (or
    transformers) made are let go of (``_drop_default_arguments``), so that the group goes once
    its maker destroys it, before the interpreter's teardown. The group itself is theirs: not
    destroyed here (a handler of theirs that runs after this one may still use it)."""
    live = group()
    if live is not None:
        try:
            _drop_default_arguments(live)
        except Exception as exc:  # noqa: BLE001 - at exit there is no caller to raise to
            log.warning("letting go of the process group at exit failed: %s", exc)


def _destroy_at_exit(made: weakref.ref) -> None:
    """The group ``init_distributed`` made (``made``), still the default one and run by gloo
    alone, is destroyed at a normal exit, while the interpreter is whole. Left to the
    interpreter's teardown, gloo's worker threads could still hold work whose tensors need the
    GIL, and the process then aborted ("terminate called without an active exception", SIGABRT)
    after training had finished: three times in this project's suite, a distributed test's
    rank 1, and torch's own issue (pytorch#190489). A group the user destroyed already, or made
    (``_let_go_at_exit``), is left alone. Gloo's teardown is local; a group with NCCL is not
    destroyed here: torch's ``destroy_process_group`` flushes NCCL's pending collectives, which
    after a failure (a rank gone) would hang the exit instead (pytorch#141510)."""
    try:
        gloo_only = dist.is_available() and dist.is_initialized() and \
            dist.group.WORLD is made() and set(backends_of(None).values()) == {"gloo"}
        if gloo_only:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - at exit there is no caller to raise to
        log.warning("destroying the process group at exit failed: %s", exc)
    _let_go_at_exit(made)


def _drop_default_arguments(group: Any) -> None:
    """At exit, the default arguments of torch.distributed's functions that hold ``group`` (a
    module imported after the group was made: see [Note: a group kept alive by a default
    argument]) are set to None, so the destroyed group, its backend and gloo's threads go now,
    not in the interpreter's teardown. Torch's functions read None as the default group."""
    with warnings.catch_warnings():      # a deprecated name's warning, read by the walk
        warnings.simplefilter("ignore")
        functions = [fn for name, module in list(sys.modules.items())
                     if isinstance(module, types.ModuleType)
                     and name.startswith("torch.distributed")
                     for value in list(vars(module).values())
                     for fn in _functions_in(value, name)]
    for fn in functions:
        if fn.__defaults__ and any(d is group for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if d is group else d for d in fn.__defaults__)
        if fn.__kwdefaults__ and any(d is group for d in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if d is group else d
                                 for k, d in fn.__kwdefaults__.items()}


def _functions_in(value: Any, module_name: str) -> list[types.FunctionType]:
    """``value`` if a function, else the functions of a class the module defines."""
    if isinstance(value, types.FunctionType):
        return [value]
    if isinstance(value, type) and getattr(value, "__module__", None) == module_name:
        return [v for v in vars(value).values() if isinstance(v, types.FunctionType)]
    return []


def current_ranks(group: Any = None) -> RankInfo:
    """This process's rank in ``group`` (None: the default group, when initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not "
                               "initialised")
        return SINGLE
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return RankInfo(dist.get_rank(group), dist.get_world_size(group), local, group)


def use_local_gpu() -> None:
    """Under a launcher (``LOCAL_RANK`` set) on a machine with GPUs, make the rank's own GPU
    the current CUDA device, as DeepSpeed's engine does: an engine whose model has no device
    yet (built under ``zero.Init``, ``from_pretrained``, ``infinity train``) computes on the
    current device, which is GPU 0 in every process until someone sets it, so the ranks of a
    node all took GPU 0 (NCCL: "Duplicate GPU detected")."""
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        return
    local = int(os.environ["LOCAL_RANK"] or 0)
    index = local % torch.cuda.device_count()
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)
        log.info("LOCAL_RANK %d: computing on cuda:%d", local, index)


def join_ranks(process_group: Any = None, timeout_s: float | None = None,
               device: torch.device | None = None) -> RankInfo:
    """The engine's ranks: ``process_group`` when given, else the default group, created from
    the launcher's environment when it is not yet. ``timeout_s`` (the config's
    ``infinity.collective_timeout``, None when the config leaves it unset) bounds every
    collective: a group made here gets it at creation, one the user made (with
    ``init_distributed`` or torch) has its timeout changed to it, so that a lost rank stops
    the others after the configured time however the group was made."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return init_distributed(timeout_s=1800.0 if timeout_s is None else timeout_s,
                                device=device)
    info = current_ranks(process_group)
    if timeout_s is not None and info.world_size > 1:
        set_collective_timeout(info.group, timeout_s)
    world = dist.group.WORLD
    if info.world_size > 1 and world is not None and world not in _LET_GO:
        _LET_GO.add(world)      # a group the user (or transformers) made
        atexit.register(_let_go_at_exit, weakref.ref(world))
    return info


def set_collective_timeout(group: Any, timeout_s: float) -> None:
    """Make every later collective of ``group`` (None: the default group) fail after
    ``timeout_s`` seconds (gloo and NCCL; other backends keep theirs, with a warning)."""
    try:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
    except Exception as exc:  # noqa: BLE001 - a private torch API: keep the group's own timeout
        log.warning("cannot set the collective timeout of the process group to %gs (%s: %s); "
                    "it keeps the timeout it was created with", timeout_s,
                    type(exc).__name__, exc)
        return
    log.info("collective timeout of the process group: %gs", timeout_s)

