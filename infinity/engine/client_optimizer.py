"""The optimizer a user brings to ``initialize(optimizer=...)``, taken over by the engine.

Why a module: ``transformers.Trainer`` (and many DeepSpeed scripts) build a
``torch.optim.AdamW`` with their own param groups (weight decay on matrices, none on biases and
norms) and hand it over. The engine cannot step that object (its Adam states would have to live
in host memory, whole, next to the parameters), so its param groups and hyperparameters become
the engine's offloaded optimizer instead, with every setting checked here, at ``initialize``:
what infinity's CPU Adam cannot do (amsgrad, maximize) is refused rather than silently dropped.

[Note: the optimizer taken over]
The object passed is never stepped by the engine: its ``state`` stays empty. Its ``step()``
would find no gradient (the engine never leaves them on ``param.grad``) and change nothing, so
the optimizer to call is the engine's, which ``initialize`` returns second; a torch loop still
calling ``opt.step()`` on the object it passed trained nothing without a word, so that step()
now raises saying which to call, and its ``zero_grad``, ``state_dict``, ``load_state_dict`` and
``add_param_group`` are the engine's optimizer's (``take_over``). Its ``param_groups`` become
the engine's groups (as DeepSpeed's ZeRO optimizer shares its client optimizer's): a scheduler
built on it after ``initialize``, or an lr written into its groups, sets the rate the engine
uses (they changed dicts the engine never read: the schedule ran on paper, the engine at the
first lr).
A scheduler built on it before (DeepSpeed's ``initialize(optimizer=opt,
lr_scheduler=LambdaLR(opt, ...))``) is moved onto the engine's (``rebind_scheduler``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from infinity.base.log import get_logger

log = get_logger("engine")

SUPPORTED = "torch.optim.Adam, torch.optim.AdamW (or a callable returning one, given the parameters)"
GROUP_KEYS_CARRIED = ("name", "optimizer_moments", "optimizer_master")
"""The engine's own keys in a passed optimizer's param group, taken as they are (they were
dropped: an embedding group's "optimizer_moments": "fp32" was stored in the config's int8)."""
TORCH_ADAM_KEYS = frozenset({"params", "lr", "betas", "eps", "weight_decay", "amsgrad",
                             "maximize", "foreach", "capturable", "differentiable", "fused",
                             "decoupled_weight_decay"})
"""torch Adam/AdamW's own group keys: read into the engine's (``_group``) or of no meaning to
its CPU Adam; any other key of a group is the group's own, kept."""


def client_param_groups(optimizer: Any, model_parameters: Iterable | None,
                        trainable: Callable[[], list[torch.nn.Parameter]]
                        ) -> tuple[list[dict], dict[str, Any]]:
    """(param groups in the engine's layout, the optimizer's defaults) of the ``optimizer``
    passed to ``initialize``: a torch Adam or AdamW, or a callable that builds one from
    ``model_parameters`` (the model's trainable parameters when None), as DeepSpeed takes it.
    ``trainable`` gives the model's trainable parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        params = list(model_parameters) if model_parameters is not None else trainable()
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable passed to initialize returned "
                            f"{type(built).__name__}, not an optimizer; supported: {SUPPORTED}")
        optimizer, model_parameters = built, None
    if not isinstance(optimizer, torch.optim.Adam):     # AdamW is an Adam in torch
        raise TypeError(
            f"initialize(optimizer=...) got a {type(optimizer).__module__}."
            f"{type(optimizer).__name__}: the engine steps Adam/AdamW only (its CPU Adam over "
            f"the offloaded states); supported: {SUPPORTED}. Or leave optimizer=None and give "
            "the config an \"optimizer\" section ({\"type\": \"AdamW\", \"params\": {...}})")
    if type(optimizer).step not in (torch.optim.Adam.step, torch.optim.AdamW.step):
        # a subclass's own update (a custom Adam variant) is not what the engine runs
        log.warning("initialize(optimizer=...): %s.%s overrides step(), which the engine never "
                    "calls: its parameters are stepped by infinity's CPU Adam/AdamW with the "
                    "groups' settings. Pass torch.optim.Adam/AdamW if that is what it does, "
                    "or train without the engine's offload", type(optimizer).__module__,
                    type(optimizer).__name__)
    if optimizer.state:
        raise ValueError(
            f"initialize(optimizer=...): the {type(optimizer).__name__} passed has already been "
            f"stepped ({len(optimizer.state)} parameters hold Adam states): the engine starts "
            "its own states at zero and cannot take these over. Pass a fresh optimizer, or "
            "resume with engine.load_checkpoint")
    decoupled_default = isinstance(optimizer, torch.optim.AdamW)
    groups = [_group(g, i, decoupled_default) for i, g in enumerate(optimizer.param_groups)]
    groups = [g for g in groups if g["params"]]           # DeepSpeed drops empty groups too
    if model_parameters is not None:
        _check_same_parameters(groups, model_parameters)
    defaults = _group({**optimizer.defaults, "params": []}, -1, decoupled_default)
    defaults.pop("params")
    return groups, defaults


def _group(group: dict, index: int, decoupled_default: bool) -> dict:
    """One torch Adam param group in the engine's keys (the ``defaults`` when index is -1)."""
    where = "the optimizer's defaults" if index < 0 else f"param group {index}"
    for key, what in (("amsgrad", "amsgrad"), ("maximize", "maximize")):
        if group.get(key):
            raise ValueError(f"initialize(optimizer=...): {where} has {key}=True; infinity's "
                             f"CPU Adam has no {what}: pass {key}=False")
    out = {"params": list(group["params"]),
           "lr": _number(group.get("lr", 1e-3), "lr", where),
           "betas": tuple(_number(b, "betas", where) for b in group.get("betas", (0.9, 0.999))),
           "eps": _number(group.get("eps", 1e-8), "eps", where),
           "weight_decay": _number(group.get("weight_decay", 0.0), "weight_decay", where),
           "adamw_mode": bool(group.get("decoupled_weight_decay", decoupled_default)),
           "bias_correction": True}
    # torch keeps a group's other keys as they are (layer-wise lr decay's "lr_scale", which its
    # schedule reads back: dropped, every layer trained at the full rate); the engine's own
    # per-group keys (the name, the Adam state formats: docs/optimizer-formats.md) apply as
    # they do in model_parameters
    for key, value in group.items():
        if key not in TORCH_ADAM_KEYS and key not in out:
            out[key] = value
    return out


def _number(value: Any, key: str, where: str) -> float:
    """A hyperparameter as a float (torch allows a tensor lr and betas)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"initialize(optimizer=...): {where}: {key} is a tensor of shape "
                             f"{tuple(value.shape)}, expected one number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"initialize(optimizer=...): {where}: {key} = {value!r} is not a "
                         "finite number")
    return float(value)


def _check_same_parameters(groups: list[dict], model_parameters: Iterable) -> None:
    """``model_parameters`` and an optimizer object both given: they must name the same
    parameters (the optimizer's groups are the ones used), else the intent is unclear."""
    given = list(model_parameters)
    flat = [p for item in given for p in (item["params"] if isinstance(item, dict) else [item])]
    named = {id(p) for p in flat if getattr(p, "requires_grad", False)}
    taken = {id(p) for g in groups for p in g["params"] if p.requires_grad}
    if named != taken:
        raise ValueError(
            f"initialize got both model_parameters ({len(named)} trainable parameters) and an "
            f"optimizer whose param groups hold {len(taken)} others or more: the optimizer's "
            "groups are what the engine trains. Pass one of them (optimizer=... alone is "
            "enough)")


def take_over(passed: Any, engine_optimizer: torch.optim.Optimizer) -> None:
    """The torch optimizer passed to ``initialize`` after the engine took it over (see [Note:
    the optimizer taken over]): its groups are the engine's, and its step() raises."""
    if not isinstance(passed, torch.optim.Optimizer):
        return      # None, or a factory the engine called itself
    passed.param_groups = engine_optimizer.param_groups

    def refuse(*_: Any) -> None:
        raise RuntimeError(
            f"step() of the {type(passed).__name__} passed to infinity.initialize: the engine "
            "took it over and steps the offloaded states itself, so this step would change "
            "nothing. Call the optimizer initialize returned (engine, optimizer, _, _ = "
            "infinity.initialize(...)), or engine.step(); its param_groups are the engine's, so "
            "a scheduler built on either sets the same rates")
    passed.register_step_pre_hook(refuse)
    # its other calls are the engine's too: torch's own acted on an object the engine never
    # reads (zero_grad() kept the engine's gradients, state_dict() gave no state, a
    # load_state_dict() broke the shared groups, add_param_group() added a group never stepped)
    for name in ("zero_grad", "state_dict", "load_state_dict", "add_param_group"):
        setattr(passed, name, getattr(engine_optimizer, name))
    # torch's schedulers warn "lr_scheduler.step() before optimizer.step()" unless their
    # optimizer's step() ran: this one's never does, the engine's takes its place
    passed._opt_called = True


def check_scheduler_groups(scheduler: Any, passed: Any, engine_groups: int) -> None:
    """Refuse a scheduler built on the optimizer passed whose groups the engine cannot drive
    one for one (empty groups are dropped): before anything is built, since at stage 3 a
    failure after the model's weights moved into the engine leaves the model without them."""
    if scheduler is None or passed is None or getattr(scheduler, "optimizer", None) is not passed:
        return
    if len(passed.param_groups) != engine_groups:
        raise ValueError(
            f"lr_scheduler is built on the optimizer passed to initialize, whose "
            f"{len(passed.param_groups)} param groups became {engine_groups} "
            "in the engine (empty groups are dropped): pass a factory instead, "
            "lr_scheduler=lambda opt: ..., which the engine calls with its own optimizer")


def rebind_scheduler(scheduler: Any, passed: Any, engine_optimizer: torch.optim.Optimizer) -> Any:
    """A torch LR scheduler built on the optimizer passed to ``initialize`` now drives the
    engine's optimizer instead (see [Note: the optimizer taken over]); anything else is returned
    unchanged."""
    if scheduler is None or passed is None or getattr(scheduler, "optimizer", None) is not passed:
        return scheduler
    check_scheduler_groups(scheduler, passed, len(engine_optimizer.param_groups))
    # torch's schedulers wrap their optimizer's step() at construction, to warn when they are
    # stepped before it: a scheduler of no effect made on the engine's optimizer wraps it the
    # same way (then the rates are set from the user's scheduler)
    torch.optim.lr_scheduler.LambdaLR(engine_optimizer, lambda _: 1.0)
    for ours, theirs in zip(engine_optimizer.param_groups, passed.param_groups):
        # what the scheduler keeps in the groups it drives: initial_lr, and OneCycleLR's
        # max_lr, min_lr, base_momentum, max_momentum (without them its first step raised
        # KeyError 'max_lr')
        for key in set(theirs) - set(passed.defaults) - {"params", *GROUP_KEYS_CARRIED}:
            ours[key] = theirs[key]
        ours["lr"] = float(theirs["lr"])
    _drive(scheduler, passed, engine_optimizer)
    return scheduler


def _drive(scheduler: Any, passed: Any, engine_optimizer: torch.optim.Optimizer) -> None:
    """``scheduler`` and the schedulers inside it (SequentialLR's, ChainedScheduler's, built
    on the same optimizer) set the engine's rates: only the outer one was moved, and a
    SequentialLR's children went on setting the passed optimizer's, the engine's rate fixed."""
    if getattr(scheduler, "optimizer", None) is passed:
        scheduler.optimizer = engine_optimizer
    for child in getattr(scheduler, "_schedulers", None) or ():
        _drive(child, passed, engine_optimizer)
