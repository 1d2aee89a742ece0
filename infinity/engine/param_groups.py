"""The optimizer's param groups from ``initialize``'s ``model_parameters`` and the config.

Why a module: what a user passes (``model.parameters()``, a generator, param-group dicts with
their own learning rates) is checked here, at ``initialize``, with the group's index in the
message, rather than at the first step; the config's optimizer settings are the defaults of
every group (torch's layout).
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.config import InfinityConfig
from infinity.config.optimizer import MISSING_OPTIMIZER
from infinity.engine.client_optimizer import client_param_groups
from infinity.planner.state_format import MASTER_FORMATS, MOMENTS_FORMATS

log = get_logger("engine")


def optimizer_groups(model: nn.Module, model_parameters: Iterable | None,
                     config: InfinityConfig, client: Any = None) -> tuple[list[dict], dict[str, Any]]:
    """(param groups, optimizer defaults) of a run: from the config's ``"optimizer"`` section
    and ``model_parameters``, or from the optimizer passed to ``initialize`` (``client``,
    taken over: see engine/client_optimizer.py). Neither, or both, is an error naming what to
    do: a run never trains with hyperparameters nobody chose."""
    if client is not None:
        if config.optimizer is not None:
            raise ValueError(
                f"initialize got an optimizer ({type(client).__name__}) and the config has an "
                f"\"optimizer\" section ({config.optimizer.type}, lr {config.optimizer.lr:g}): "
                "which settings to train with is unclear. Remove the section from the config, "
                "or pass optimizer=None")
        trainable = lambda: [p for p in model.parameters() if p.requires_grad]   # noqa: E731
        raw, defaults = client_param_groups(client, model_parameters, trainable)
        log.info("taking over the %s passed to initialize: %d param group(s), lr %s, weight "
                 "decay %s (that object is not stepped: use the optimizer initialize returns)",
                 type(client).__name__, len(raw), sorted({g["lr"] for g in raw}),
                 sorted({g["weight_decay"] for g in raw}))
        return param_groups(model, raw, config, defaults=defaults, named_groups=True), defaults
    if config.optimizer is None:
        if model_parameters is None and not any(p.requires_grad for p in model.parameters()):
            # DeepSpeed's ZeRO-Inference habit (a frozen teacher, a model to evaluate): no
            # optimizer, nothing to train; its settings are no one's, and no state is made
            log.info("no optimizer and no parameter that requires a gradient: an engine for "
                     "forwards alone (step() has nothing to update)")
            return param_groups(model, None, config, defaults=INFERENCE_DEFAULTS), \
                dict(INFERENCE_DEFAULTS)
        raise ValueError(MISSING_OPTIMIZER.format(call="initialize(optimizer=...)"))
    return param_groups(model, model_parameters, config), optimizer_defaults(config)


INFERENCE_DEFAULTS = {"lr": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                      "bias_correction": True, "adamw_mode": True}
"""The optimizer settings of an engine with nothing to train (no optimizer, every parameter
frozen): its empty group's, which no step uses."""


def optimizer_defaults(config: InfinityConfig) -> dict[str, Any]:
    """The config's optimizer settings: every group's defaults, and the optimizer's
    ``defaults`` (torch's OneCycleLR and CyclicLR look there for betas)."""
    opt = config.optimizer
    if opt is None:
        raise ValueError(MISSING_OPTIMIZER.format(call="initialize(optimizer=...)"))
    return {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps,
            "weight_decay": opt.weight_decay, "bias_correction": opt.bias_correction,
            "adamw_mode": opt.adam_w_mode}


def param_groups(model: nn.Module, model_parameters: Iterable | None,
                 config: InfinityConfig, defaults: dict[str, Any] | None = None,
                 named_groups: bool = False) -> list[dict]:
    """Param groups with the config's hyperparameters (or ``defaults``) as defaults (torch
    optimizer layout). ``named_groups``: the groups were named explicitly (an optimizer's),
    so trainable parameters left out of them are worth a warning."""
    defaults = optimizer_defaults(config) if defaults is None else defaults
    # the state formats are group settings too (see [Note: a unit's state format] in
    # planner/state_format.py): the config's are every group's default
    defaults = {**defaults, "optimizer_moments": config.infinity.optimizer_moments,
                "optimizer_master": config.infinity.optimizer_master}
    if model_parameters is None:
        raw: list = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        raw = list(model_parameters)
        if raw and not isinstance(raw[0], dict):
            raw = [{"params": raw}]
    groups = []
    seen: dict[nn.Parameter, int] = {}     # parameter -> its group
    in_model = {id(p) for p in model.parameters()}
    for i, group in enumerate(raw):
        params = _group_params(group, i)
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p in seen:
                where = f"twice in param group {i}" if seen[p] == i else \
                    f"in param groups {seen[p]} and {i}"
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is listed {where}: "
                                 "each parameter belongs to one group, once (torch refuses "
                                 "this too)")
            if id(p) not in in_model:
                # the engine keeps states for the model's parameters only: it would never
                # step this one (torch would)
                raise ValueError(
                    f"param group {i} holds a parameter of shape {tuple(p.shape)} that is not "
                    f"in the model ({type(model).__name__}): the engine trains the model's "
                    "parameters only. Register it on the model (e.g. as an attribute of a "
                    "module, so it appears in model.parameters()) or leave it out")
            seen[p] = i
        _check_own_keys(group, i, defaults)
        merged = {**defaults, **{k: v for k, v in group.items() if k != "params"}}
        _check_hyperparameters(merged, i)
        groups.append({**merged, "params": params})
    left_out = [n for n, p in model.named_parameters() if p.requires_grad and p not in seen]
    if left_out and (model_parameters is not None or named_groups):
        log.warning("%d trainable parameters are in no param group and will not be updated "
                    "(e.g. %s)", len(left_out), left_out[:3])
    return groups


OTHER_OPTIMIZERS_KEYS = frozenset({"momentum", "nesterov", "dampening", "rho", "lr_decay",
                                   "initial_accumulator_value", "momentum_decay", "centered",
                                   "amsgrad", "maximize", "trust_coefficient"})
"""Group keys of other optimizers (SGD, RMSprop, Adagrad, NAdam, LARS): the engine's Adam has
no such setting, so a group giving one is refused rather than trained without it."""


def _check_own_keys(group: Mapping, index: int, defaults: Mapping) -> None:
    """A group's keys besides the engine's settings are its own and kept as they are, as torch
    and DeepSpeed keep them: layer-wise lr decay writes ``lr_scale`` or ``layer_id`` there and
    its schedule reads them back (refused, they could not be given). Refused: another
    optimizer's setting, and a close misspelling of a setting (``weight_decy``), which would
    train without what it meant."""
    known = ("params", *defaults, "name")
    for key in group:
        if key in known:
            continue
        if key in OTHER_OPTIMIZERS_KEYS and (key not in ("amsgrad", "maximize") or group[key]):
            raise ValueError(f"param group {index} sets {key}={group[key]!r}, a setting of "
                             "another optimizer: the engine steps Adam/AdamW, which has none. "
                             "Remove it")
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.85)
        if close:
            raise ValueError(f"param group {index} has the key {key!r}: did you mean "
                             f"{close[0]!r}? (a group's own keys are kept as they are, unused "
                             "by the engine)")


def _group_params(group: Any, index: int) -> list:
    """A param group's parameters, or a ValueError that says what was passed instead."""
    if not isinstance(group, Mapping) or "params" not in group:
        raise ValueError(f"param group {index} must be a dict with a \"params\" list, got "
                         f"{type(group).__name__}")
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for p in params:
        if isinstance(p, tuple):
            raise ValueError(f"param group {index} holds (name, parameter) pairs: pass "
                             "model.parameters(), not model.named_parameters()")
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"param group {index} holds a {type(p).__name__}, not a parameter")
    return params


def _check_hyperparameters(group: dict, index: int) -> None:
    """Adam's settings of a param group, checked at initialize rather than at the first step."""
    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value < 0:
            raise ValueError(f"param group {index}: {key} must be a finite number >= 0, got "
                             f"{value!r}")
        return float(value)

    for key in ("lr", "eps", "weight_decay"):
        number(key, group[key])
    for key in ("adamw_mode", "bias_correction"):      # "false" is truthy: AdamW silently
        if key in group and not isinstance(group[key], bool):
            raise ValueError(f"param group {index}: {key} must be true or false, got "
                             f"{group[key]!r}")
    for key, choices in (("optimizer_moments", MOMENTS_FORMATS),
                         ("optimizer_master", MASTER_FORMATS)):
        if key in group and group[key] not in choices:
            raise ValueError(f"param group {index}: {key} must be one of "
                             f"{', '.join(map(repr, choices))}, got {group[key]!r}")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
            not all(0 <= number("betas", b) < 1 for b in betas):
        raise ValueError(f"param group {index}: betas must be two numbers in [0, 1), got {betas!r}")
