"""``infinity.zero.Init`` and ``GatheredParameters``.

``Init`` builds a model whose parameters are meta tensors (no memory): each parameter, as it is
registered on its module during construction, is replaced by a meta tensor of the same shape,
dtype and ``requires_grad``. Buffers stay real (they are small and often computed at
construction, e.g. rotary frequencies). ``infinity.initialize`` then materialises and initialises
one unit at a time and sends it to its home tier, so peak memory is about one unit.

``GatheredParameters(params, modifier_rank=...)`` fetches the units holding ``params`` so they
can be read (or, with a modifier rank, changed: changes are written back to the home tiers and
the optimizer's fp32 master on exit).

``register_external_parameter(module, param)`` says that ``module``'s forward uses ``param``,
which belongs to another module (``F.linear(h, self.embed.weight)`` in a parent's forward): the
stage-3 hooks then fetch its unit around ``module``'s forward too. DeepSpeed's name and
signature; call it before or after ``infinity.initialize``.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from infinity.base.budget import BudgetExceededError
from infinity.comm.group import launched_world_size
from infinity.config import InfinityConfig
from infinity.zero.materialize import CREATOR_ATTR, KEEP_VALUE_NUMEL, VALUE_ATTR, watch_reset
from infinity.base.sizes import format_bytes

_live_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
# parameters left empty by a closed engine (their values lived in its swap space), by id (a
# WeakSet would compare tensors with ==)
_released_params: dict[int, "weakref.ref[nn.Parameter]"] = {}
# parameters inside a GatheredParameters with a modifier_rank now (their changes are written
# back at its exit), by id, counted for nesting
_modifying: "collections.Counter[int]" = collections.Counter()


def being_modified(params: Iterable[nn.Parameter]) -> bool:
    """Whether every one of ``params`` is inside a ``GatheredParameters(...,
    modifier_rank=...)`` now: a change made to them is kept (without a modifier_rank it is
    dropped at the exit, as DeepSpeed's)."""
    return all(_modifying[id(p)] for p in params)


def register_engine(engine: Any) -> None:
    """Engines register themselves so GatheredParameters can find a parameter's unit."""
    _live_engines.add(engine)


def unregister_engine(engine: Any) -> None:
    """A closed engine holds no unit any more."""
    _live_engines.discard(engine)


def engine_in_backward(besides: Any) -> Any | None:
    """A live engine other than ``besides`` whose ``engine.backward`` is running, if any (its
    backward may reach another engine's parameters: a GAN's generator loss goes through the
    discriminator)."""
    for engine in list(_live_engines):
        coordinator = getattr(engine, "coordinator", None)
        if engine is not besides and coordinator is not None and coordinator.in_tracked_backward:
            return engine
    return None


def remember_released(units: Iterable[Any]) -> None:
    """A closing engine leaves these units' parameters empty (see zero/unit.py)."""
    _remember(entry.param for unit in units for entry in unit.params)


def guard_released(model: nn.Module) -> None:
    """After an engine over ``model`` closed (or its initialize failed part-way) with
    parameters released: the forward and ``state_dict()`` of the model and of each part
    holding one say the values are gone (a forward failed with "'weight' must be 2-D", a state
    dict gave empty tensors that saved without a word, ``model.transformer.state_dict()``
    too). The hooks stay on the modules, which cannot be used again; they say nothing while
    none of their parameters is released."""
    def refusal(module: nn.Module):
        def refuse(*_: Any) -> None:
            empty = [name for name, p in module.named_parameters() if _released(p)]
            if empty:
                raise RuntimeError(
                    f"this model's parameters were released by an engine that closed, or whose "
                    f"initialize failed part-way ({len(empty)} of them, e.g. {empty[0]!r}, "
                    "hold 0 elements): their values lived in its tiers, which are gone. Read "
                    "what you need before engine.close() (model.state_dict(), "
                    "save_pretrained), or build the model again")
        return refuse
    for module in model.modules():      # the model for any, a part for one of its own
        mine = module.parameters() if module is model else module._parameters.values()
        if any(p is not None and _released(p) for p in mine):
            module.register_forward_pre_hook(refusal(module))
            module.register_state_dict_pre_hook(refusal(module))


def _remember(params: Iterable[nn.Parameter]) -> None:
    """Note ``params`` as left empty by an engine, while they live (``check_not_released``)."""
    for param in params:
        _released_params[id(param)] = weakref.ref(
            param, lambda _, key=id(param): _released_params.pop(key, None))


@contextlib.contextmanager
def released_on_failure(model: nn.Module):
    """An initialize that fails part-way has moved parameters' values into tiers it then
    closes, leaving them empty: those are remembered as released, so that initialize on the
    same model again is refused (``check_not_released``) instead of training emptied weights
    (a retry with a larger budget was accepted, and its weights were not the model's)."""
    sizes = {id(p): p.numel() for p in model.parameters()}
    try:
        yield
    except BaseException:
        _remember(p for p in model.parameters() if sizes.get(id(p), 0) > 0 and p.numel() == 0)
        raise


def _released(p: nn.Parameter) -> bool:
    """Whether ``p`` is a parameter an engine left empty when it closed (its values gone)."""
    ref = _released_params.get(id(p))
    return ref is not None and ref() is p and p.numel() == 0


def check_not_released(model: nn.Module) -> None:
    """Refuse a model that a live engine holds, or whose parameters a closed engine left
    empty, before anything is built."""
    mine = {id(p): name for name, p in model.named_parameters()}
    for engine in list(_live_engines):      # a closing engine unregisters itself first
        if getattr(engine, "module", None) is model:
            raise ValueError(
                "this model already belongs to a live engine: two engines over one model would "
                "fight over its parameters (at stage 3 the second would see released, empty "
                "ones). close() the first engine, or build another model")
        shared = [mine[id(p)] for p in engine.module.parameters() if id(p) in mine] \
            if getattr(engine, "module", None) is not None else []
        if shared:
            raise ValueError(
                f"{len(shared)} parameter(s) of this model (e.g. {shared[0]!r}) belong to a "
                f"live engine over another model ({type(engine.module).__name__}): each engine "
                "keeps its own copy of the states of its parameters, so two engines training "
                "one parameter would each overwrite the other's update (and at stage 3 each "
                "releases it after use). Train both parts under one engine (one nn.Module "
                "holding them), or give each model its own copy of the shared module")
    empty = [name for name, p in model.named_parameters() if _released(p)]
    if empty:
        raise ValueError(
            f"{len(empty)} parameter(s) of this model (e.g. {empty[0]!r}) are empty: an engine "
            "released them (closed, or its initialize failed part-way), and their values lived "
            "in its swap space, which was removed. Build the model again (and read what you "
            "need under infinity.zero.GatheredParameters before an engine's close(), e.g. a "
            "state_dict)")


class Init(contextlib.ContextDecorator):
    """Build models inside this context with meta parameters (materialised by initialize)."""

    def __init__(self, config_dict_or_path: str | Path | Mapping[str, Any] | None = None, *,
                 config: str | Path | Mapping[str, Any] | None = None, enabled: bool = True,
                 **deepspeed_only: Any) -> None:
        unknown = sorted(set(deepspeed_only) - _DEEPSPEED_INIT_ARGS)
        if unknown:
            raise TypeError(f"infinity.zero.Init got unknown arguments {unknown}; it takes "
                            "config_dict_or_path (or config) and enabled, and accepts (and does "
                            f"not need) DeepSpeed's {sorted(_DEEPSPEED_INIT_ARGS)}: tiers and "
                            "dtypes come from the config")
        source = config if config is not None else config_dict_or_path
        # read for the ranks the run has (its batch sizes add up only at that world size), for
        # its stage alone: a Hugging Face config's "auto" values are the initialize's to fill
        self.config = InfinityConfig.load(source, world_size=launched_world_size(),
                                          auto_defaults=True) if source is not None else None
        self.enabled = enabled and (self.config is None or self.config.zero.stage == 3)
        # one hook per entry: the same Init may be entered again inside itself (nested
        # ``with``, or a decorated builder that recurses), and each exit removes its own
        self._handles: list[Any] = []

    def __enter__(self) -> "Init":
        self._handles.append(module_mod.register_module_parameter_registration_hook(_to_meta)
                             if self.enabled else None)
        return self

    def __exit__(self, *exc: Any) -> None:
        handle = self._handles.pop() if self._handles else None
        if handle is not None:
            handle.remove()


# deepspeed.zero.Init's other arguments: placement (remote_device, pin_memory), dtype and the
# parallel groups are the config's and the engine's business here
_DEEPSPEED_INIT_ARGS = frozenset({
    "module", "data_parallel_group", "mem_efficient_linear", "remote_device", "pin_memory",
    "dtype", "mpu", "zero_param_parallel_group", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "sequence_data_parallel_group", "param_swapper"})


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None):
    if param is None or param.device.type == "meta":
        return None     # (a meta parameter registered again is a tie, not a creation)
    existing = module._parameters.get(name)
    if existing is not None and existing.device.type == "meta" and _loading():
        raise RuntimeError(LOAD_UNDER_INIT.format(name=f"{type(module).__name__}.{name}"))
    meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                        requires_grad=param.requires_grad)
    if not module.__dict__.get(_COPY_GUARD_ATTR):
        module.__dict__[_COPY_GUARD_ATTR] = True
        module.register_load_state_dict_pre_hook(_refuse_a_copy_into_meta)
        if type(module).__module__.startswith("torch.nn"):
            watch_reset(module)
    # the module that created it initialises it at materialisation, not one it is tied into
    # later; a small one keeps the value it was built with (see infinity/zero/materialize.py)
    setattr(meta, CREATOR_ATTR, weakref.ref(module))
    if param.numel() <= KEEP_VALUE_NUMEL:
        setattr(meta, VALUE_ATTR, param.detach())
    return meta


# DeepSpeed's custom-init pattern (GatheredParameters(..., modifier_rank=0) inside zero.Init):
# there the gathered parameter is real; here it is a meta tensor until initialize, so the write
# would go nowhere and the model's init (or the value it was built with) would train instead.
GATHER_BEFORE_INITIALIZE = (
    "GatheredParameters(..., modifier_rank=...) on {count} parameter(s) built under "
    "infinity.zero.Init and not yet given to an engine: they are meta tensors (no values) until "
    "initialize materialises them, so a value written here would be lost, silently. Give the "
    "value when building the module (nn.Parameter(torch.full(shape, 7.0))), or in its "
    "reset_parameters(), or write it under GatheredParameters after infinity.initialize")

# A value given to a parameter that Init already made meta: a load (transformers' from_pretrained
# assigns each checkpoint tensor so, as does load_state_dict(assign=True)). Init keeps no values,
# so the weights would be lost and replaced by a random init at materialisation, silently.
LOAD_UNDER_INIT = (
    "a value was assigned to parameter {name} inside infinity.zero.Init after it was built: "
    "that is a load (transformers' from_pretrained, or load_state_dict(assign=True)), and Init "
    "keeps no values (the model is built on the meta device, materialised by initialize), so "
    "the loaded weights would be lost to a random init. Load a transformers directory with "
    "infinity.from_pretrained(dir, config=ds_config) instead: it builds the model on the meta "
    "device and reads each unit's weights straight into its tier (memory holds about two "
    "units); or build the model outside zero.Init (from_pretrained then needs host memory for "
    "the model once; initialize moves it to its tiers)")

# A load that copies values into the parameters (load_state_dict without assign=True, PEFT's
# set_peft_model_state_dict) while they are Init's meta tensors: a copy into a meta tensor
# writes nothing (torch only warns), and torch reports every key matched, so the model would
# train from a random init, silently. Refused by a load_state_dict pre-hook on each module
# Init gave a meta parameter (_refuse_a_copy_into_meta).
COPY_UNDER_INIT = (
    "load_state_dict would copy values (into {name}, and maybe more) into parameters built "
    "under infinity.zero.Init, which are meta tensors until initialize (no storage: a copy into them "
    "writes nothing, and torch reports every key matched), so the model would train from a "
    "random init. Load a transformers directory with infinity.from_pretrained(dir, "
    "config=ds_config); or pass assign=True after the Init block (the loaded tensors become the "
    "parameters; initialize then moves them to their tiers); or load after initialize (the "
    "engine's parameters are real then), or build the model outside zero.Init")
_COPY_GUARD_ATTR = "_infinity_copy_guard"


def _refuse_a_copy_into_meta(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                             local_metadata: Mapping[str, Any], *args: Any) -> None:
    """A load_state_dict pre-hook: see COPY_UNDER_INIT. ``assign=True`` replaces the
    parameters instead (refused inside the Init block by ``_to_meta``, a load like
    from_pretrained's; after it, the loaded tensors are the values)."""
    if local_metadata.get("assign_to_params_buffers"):
        return
    meta = [prefix + name for name, p in module._parameters.items()
            if p is not None and p.device.type == "meta" and prefix + name in state_dict]
    if meta:
        raise RuntimeError(COPY_UNDER_INIT.format(name=meta[0]))


# functions on the stack when a parameter is given a value by a load rather than by a module's
# construction (which may replace a parameter too: a subclass's __init__ redefining weight)
_LOADERS = frozenset({"from_pretrained", "_load_from_state_dict", "load_state_dict"})


def _loading() -> bool:
    """Whether a load (transformers' from_pretrained, torch's load_state_dict) is running in this
    thread; read only when a built parameter is replaced, so its cost is rare."""
    frame = sys._getframe(1)
    while frame is not None:
        # (infinity.from_pretrained builds the model under Init: a construction, not a load)
        if frame.f_code.co_name in _LOADERS and \
                not str(frame.f_globals.get("__name__", "")).startswith("infinity."):
            return True
        frame = frame.f_back
    return False


EXTERNAL_PARAMS_ATTR = "_infinity_external_params"


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """``module``'s forward uses ``parameter``, owned by another module: fetch it around
    ``module``'s forward (see the module docstring)."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter expects an nn.Parameter, got "
                        f"{type(parameter).__name__}")
    external = module.__dict__.setdefault(EXTERNAL_PARAMS_ATTR, [])
    if any(p is parameter for p in external):
        return          # hooked already (by initialize, or an earlier call: one more a call,
        #                 from a forward that declares it, grew by a pair of hooks a step)
    external.append(parameter)
    for engine in list(_live_engines):
        engine.hook_external_parameter(module, parameter)


def _agreed(units: list[tuple[Any, Any]], call: str) -> contextlib.ExitStack:
    """``call`` agreed by every rank of each engine holding ``units`` before its first
    collective ([Note: calls every rank makes] in comm/watchdog.py)."""
    stack = contextlib.ExitStack()
    for engine in dict.fromkeys(engine for engine, _ in units):
        stack.enter_context(engine.comm.every_rank(call))
    return stack


class GatheredParameters(contextlib.ContextDecorator):
    """Fetch the units of ``params`` for the block; write changes back when modifier_rank is set."""

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[tuple[Any, Any]] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for engine in list(_live_engines):
            for unit in engine.units:
                if any(e.param is p for e in unit.params for p in self.params):
                    self._units.append((engine, unit))
        owned = {id(e.param) for _, unit in self._units for e in unit.params}
        if any(_released(p) for p in self.params if id(p) not in owned):
            raise ValueError(
                "GatheredParameters on parameters an engine released when it closed (or when its "
                "initialize failed part-way): their values lived in its tiers, which are gone, "
                "so these hold 0 elements (a state dict read now would be empty tensors). Read "
                "what you need before engine.close(), or build the model again")
        unbuilt = [p for p in self.params if p.device.type == "meta" and id(p) not in owned]
        if unbuilt and self.modifier_rank is not None:
            raise RuntimeError(GATHER_BEFORE_INITIALIZE.format(count=len(unbuilt)))
        pinned = []
        try:
            # every rank gathers (each unit's shards are the ranks'): a gather on one rank
            # alone paired with another rank's training all-gather and read that unit's values
            # under these names, without a word. Agreed first, as a save is ([Note: calls every
            # rank makes] in comm/watchdog.py): a rank gone on without it is named
            with _agreed(self._units, "GatheredParameters()"):
                for engine, unit in self._units:
                    engine.pin_unit(unit, modifying=self.modifier_rank is not None)
                    pinned.append((engine, unit))
            if self.modifier_rank is not None:
                _modifying.update(id(p) for p in self.params)
        except BaseException as exc:
            for engine, unit in pinned:
                engine.unpin_unit(unit, modified=False)
            if not isinstance(exc, BudgetExceededError):
                self._units.clear()
                raise
            need = sum(unit.nbytes for _, unit in self._units)
            count = len(self._units)
            self._units.clear()
            raise BudgetExceededError(
                f"GatheredParameters needs the units of these parameters fetched at once "
                f"({count} units, {format_bytes(need)}) and the device budget "
                f"does not hold them ({exc}). Gather fewer parameters at a time (e.g. one "
                "module's), or raise infinity.device_memory_budget") from exc
        return self

    def __exit__(self, *exc: Any) -> None:
        units, self._units = self._units, []
        if self.enabled and self.modifier_rank is not None:
            _modifying.subtract(id(p) for p in self.params)
            for key in [k for k, n in _modifying.items() if n <= 0]:
                del _modifying[key]
        errors = []
        # a write-back is a broadcast: every rank's too
        with _agreed(units if self.modifier_rank is not None else [],
                     "GatheredParameters(modifier_rank=...)"):
            for engine, unit in units:      # every unit is unpinned; the first error is raised
                try:
                    engine.unpin_unit(unit, source_rank=self.modifier_rank,
                                      modified=self.modifier_rank is not None and exc[0] is None)
                except Exception as error:  # noqa: BLE001 - re-raised below
                    errors.append(error)
        if errors:
            raise errors[0]
