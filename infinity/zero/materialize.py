"""Materialise parameters built on the meta device, one unit at a time, with the model's own init.

Used for models built under ``infinity.zero.Init``: their parameters are meta tensors until the
engine adopts each unit. A meta tensor cannot be given CPU storage in place, so each meta
parameter is replaced by a new ``nn.Parameter`` (same shape, dtype, requires_grad) in every
module that holds it (``module._parameters``, the FSDP2 way; tied weights stay tied), then the
owning modules are initialised by the model's own initialisation (``_init_weights`` of a
``transformers`` model, applied as ``post_init`` does, or ``reset_parameters``). Peak memory is
about one unit.

A parameter of up to ``KEEP_VALUE_NUMEL`` elements starts from the value its constructor gave
it (``nn.Parameter(torch.randn(r, n) * 0.1)``, a LoRA factor that no init method covers), so
only the model's init methods change it, as in a plain build; a larger one starts from zeros.

A parameter tied into another module (``self.head.weight = self.embed.weight`` in the model's
``__init__``) is initialised by the module that created it only (``zero.Init`` records it), as
in a plain build, where the other module's init ran on the parameter the tie replaced.

What zero.Init cannot keep: initialisation a module's ``__init__`` does by hand on parameters
already registered (``nn.init.zeros_(self.head.weight)`` in the parent's constructor) happens
while they are meta, so it is lost; the model's own init methods run instead. Where a module has
none, and a parameter it kept the value of was written after registration (its meta stand-in's
version counter moved), that is refused (``_reset``): the kept value is the one before the write.

A library that wraps a model already on the meta device (``from_pretrained``'s
``prepare_model``, a PEFT ``get_peft_model``) builds its own parameters with real values and
then moves them to the device of the layer they wrap, meta: ``values_kept_through_meta_moves``
keeps each moved parameter's value on its meta stand-in (``FINAL_VALUE_ATTR``), and notes a
meta parameter deep-copied from another (PEFT's ``modules_to_save`` copies a head) as a copy of
it (``COPY_OF_ATTR``); such a parameter is materialised with that value and never initialised
again (a LoRA ``lora_B`` re-initialised by the model's ``_init_weights`` gets std 0.02 instead
of the 0 PEFT gave it: step 0 is no longer the base model).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

CREATOR_ATTR = "_infinity_created_by"   # on a meta parameter: weakref to its creating module
VALUE_ATTR = "_infinity_built_value"     # on a meta parameter: the value it was built with
# parameters up to this size keep the value their constructor gave them (1M elements: LoRA
# factors, norms, biases); a larger one's (torch.empty's, for torch's own modules) is dropped
KEEP_VALUE_NUMEL = 1 << 20
FINAL_VALUE_ATTR = "_infinity_final_value"   # on a meta parameter: its value, initialised
COPY_OF_ATTR = "_infinity_copy_of"           # on a meta parameter: the one it was copied from
RESET_RAN_ATTR = "_infinity_reset_ran"       # on a module: its reset_parameters ran under Init


def watch_reset(module: nn.Module) -> None:
    """Note (``RESET_RAN_ATTR``) whether a torch module's ``reset_parameters`` runs while it is
    built under Init: ``nn.Embedding(_weight=...)`` (``from_pretrained``) never runs it, its
    parameter keeping the values given, which the materialising reset replaced with
    ``normal_``, silently. Installed when its first parameter is registered, before its
    ``__init__`` calls the reset."""
    method = getattr(type(module), "reset_parameters", None)
    if not callable(method) or "reset_parameters" in module.__dict__:
        return

    def reset_parameters(*args, **kwargs):
        module.__dict__[RESET_RAN_ATTR] = True
        return method(module, *args, **kwargs)
    module.__dict__["reset_parameters"] = reset_parameters


@contextlib.contextmanager
def values_kept_through_meta_moves() -> Iterator[None]:
    """Within the block, a parameter a module moves from real memory to the meta device
    (``Module.to("meta")``, any ``_apply``) keeps its value on the meta parameter that replaces
    it, and a meta parameter deep-copied records what it was copied from (see the module
    docstring), and a state dict loaded into a meta parameter (an adapter PEFT loads) keeps
    what it gave. Patches ``nn.Module._apply``, ``_load_from_state_dict`` and
    ``nn.Parameter.__deepcopy__`` process-wide for the block: a model preparation, one
    thread."""
    apply, deepcopy = nn.Module._apply, nn.Parameter.__deepcopy__

    def keeping_apply(module: nn.Module, fn, *args, **kwargs):
        before = {(id(m), key): p for m in module.modules() for key, p in m._parameters.items()
                  if p is not None and p.device.type != "meta"}
        out = apply(module, fn, *args, **kwargs)
        for m in module.modules():
            for key, p in m._parameters.items():
                moved = before.get((id(m), key))
                if p is not None and moved is not None and p.device.type == "meta":
                    setattr(p, FINAL_VALUE_ATTR, moved.detach())
        return out

    def noting_deepcopy(param: nn.Parameter, memo):
        copy = deepcopy(param, memo)
        if param.device.type == "meta":
            setattr(copy, COPY_OF_ATTR, param)
        return copy

    load = nn.Module._load_from_state_dict

    def keeping_load(module: nn.Module, state_dict, prefix, local_metadata, *rest):
        # a load into a meta parameter (PeftModel.from_pretrained's adapter, load_adapter)
        # copies nothing: the values it was given are kept as the parameter's (they were
        # lost, and the adapter trained from a fresh init)
        if not local_metadata.get("assign_to_params_buffers", False):
            for key, p in module._parameters.items():
                value = state_dict.get(prefix + key)
                if p is not None and p.device.type == "meta" and \
                        isinstance(value, torch.Tensor) and not value.is_meta and \
                        tuple(value.shape) == tuple(p.shape):
                    setattr(p, FINAL_VALUE_ATTR, value.detach().to(p.dtype).clone())
        return load(module, state_dict, prefix, local_metadata, *rest)

    set_item = nn.ParameterDict.__setitem__

    def keeping_set_item(params: nn.ParameterDict, key: str, value) -> None:
        # PEFT moves a ParameterDict's entries one by one (IA3's ia3_l, LoHa's factors:
        # ``adapter_layer[name] = item.to(device)``), not by _apply
        before = params[key] if key in params else None
        set_item(params, key, value)
        after = params[key]
        if isinstance(before, torch.Tensor) and not before.is_meta and after.is_meta and \
                before.shape == after.shape:
            setattr(after, FINAL_VALUE_ATTR, before.detach())

    nn.Module._apply, nn.Parameter.__deepcopy__ = keeping_apply, noting_deepcopy
    nn.Module._load_from_state_dict = keeping_load
    nn.ParameterDict.__setitem__ = keeping_set_item
    try:
        yield
    finally:
        nn.Module._apply, nn.Parameter.__deepcopy__ = apply, deepcopy
        nn.Module._load_from_state_dict = load
        nn.ParameterDict.__setitem__ = set_item


def copied_from(param: nn.Parameter) -> nn.Parameter:
    """The parameter ``param`` is a copy of (through copies of copies), else itself."""
    while getattr(param, COPY_OF_ATTR, None) is not None:
        param = getattr(param, COPY_OF_ATTR)
    return param


def valueless(param: nn.Parameter) -> bool:
    """A meta parameter that nothing gives a value to (neither it nor what it copies kept
    one): materialised, the model's own init would draw it."""
    source = copied_from(param)
    return param.device.type == "meta" and getattr(source, FINAL_VALUE_ATTR, None) is None \
        and getattr(source, VALUE_ATTR, None) is None


def materialize_params(model: nn.Module, params: list[tuple[str, nn.Parameter]],
                       device: torch.device, full_shapes: Mapping[int, torch.Size] | None = None,
                       provided: Callable[[str], bool] | None = None,
                       ) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """Replace the meta parameters among ``params``; returns (name, old, new) for each.
    ``full_shapes``: by ``id``, the shapes of parameters already offloaded (released, 0
    elements), which an init reading another module's weight sees in their stand-ins.
    ``provided(name)``: the parameter's values come from elsewhere (a pretrained checkpoint,
    see ``UnitValues`` in zero/protocols.py), read into the unit's buffer when it is adopted:
    it is neither initialised nor given memory here (a stand-in of its shape whose elements
    all view one zero)."""
    meta = [(name, p) for name, p in params if p.device.type == "meta"]
    if not meta:
        return []
    _refuse_parametrized(model, {id(p) for _, p in meta})
    replaced: list[tuple[str, nn.Parameter, nn.Parameter]] = []
    valued: set[int] = set()      # new parameters that got the value they were built with
    skipped: set[int] = set()     # new parameters whose values come from ``provided``
    for name, old in meta:
        if provided is not None and provided(name):
            stand_in = torch.zeros((), dtype=old.dtype, device=device).expand(old.shape)
            new = nn.Parameter(stand_in, requires_grad=old.requires_grad)
            replaced.append((name, old, new))
            skipped.add(id(new))
            continue
        final = getattr(copied_from(old), FINAL_VALUE_ATTR, None)
        if final is not None:       # initialised already: never again
            new = nn.Parameter(final.to(device=device, dtype=old.dtype, copy=True),
                               requires_grad=old.requires_grad)
            replaced.append((name, old, new))
            skipped.add(id(new))
            continue
        built = getattr(copied_from(old), VALUE_ATTR, None)
        value = torch.zeros(old.shape, dtype=old.dtype, device=device) if built is None else \
            built.to(device=device, dtype=old.dtype, copy=True)
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        replaced.append((name, old, new))
        if built is not None:
            valued.add(id(new))
    by_old = {id(old): new for _, old, new in replaced}
    # written in place after they were made meta (an init in the module's own __init__ after
    # registering it, a GatheredParameters write): the value kept is from before that write
    written = {id(new) for _, old, new in replaced if old._version > 0}
    # each new parameter is initialised by one module: its creator, else its first holder
    initialiser: dict[int, nn.Module] = {}
    owners: list[nn.Module] = []
    for module in model.modules():
        touched = False
        for key, value in list(module._parameters.items()):
            if value is not None and id(value) in by_old:
                creator = getattr(value, CREATOR_ATTR, None)
                creator = creator() if creator is not None else None
                initialiser.setdefault(id(by_old[id(value)]), creator or module)
                module._parameters[key] = by_old[id(value)]
                touched = True
        if touched:
            owners.append(module)
    new_ids = {id(new) for _, _, new in replaced} - skipped
    if not new_ids:
        return replaced
    init_weights = getattr(model, "_init_weights", None)
    shapes = full_shapes or {}
    with torch.no_grad():
        if callable(init_weights):
            _init_like_transformers(model, init_weights, new_ids, shapes, initialiser)
        else:
            for module in owners:
                mine = {id(p) for p in module._parameters.values()
                        if p is not None and initialiser.get(id(p)) is module} - skipped
                if mine:
                    with _foreign_params_on_meta([module], mine, shapes):
                        _reset(module, all_built=mine <= valued,
                               written=[n for n, p in module._parameters.items()
                                        if p is not None and id(p) in mine & written])
            _reset_torch_composites(model, new_ids, shapes)
    for module in owners:        # the reset watch (watch_reset), where no _reset took it off
        module.__dict__.pop("reset_parameters", None)
        module.__dict__.pop(RESET_RAN_ATTR, None)
    return replaced


def _reset_torch_composites(model: nn.Module, new_ids: set[int],
                            shapes: Mapping[int, torch.Size]) -> None:
    """torch's modules whose ``_reset_parameters`` initialises their children's parameters too
    (nn.MultiheadAttention zeroes ``out_proj.bias``, nn.Transformer draws every matrix
    xavier-uniform), called again, children first, as their constructors ran them: under Init
    those writes went to meta tensors and each child's own reset won (a random out_proj bias,
    kaiming matrices, silently). Only the new parameters below them are written."""
    for module in _post_order(model):
        if not (callable(getattr(type(module), "_reset_parameters", None)) and
                type(module).__module__.startswith("torch.nn")):
            continue    # the sets below only for the few modules that qualify
        below = {id(p) for p in module.parameters()} & new_ids
        if below - {id(p) for p in module.parameters(recurse=False)}:
            with _foreign_params_on_meta([module], below, shapes):
                module._reset_parameters()


def _refuse_parametrized(model: nn.Module, meta_ids: set[int]) -> None:
    """A parametrization (weight_norm's g and v, say) computes its original tensors from the
    weight it is given at build time, which is meta under zero.Init: they would come out as
    zeros (a transformers init writes the computed weight, a temporary), and the forward as
    NaN, silently (Wav2Vec2's positional convolution)."""
    from torch.nn.utils.weight_norm import WeightNorm

    for name, module in model.named_modules():
        for hook in module._forward_pre_hooks.values():    # the old-style weight_norm's g, v
            if isinstance(hook, WeightNorm) and any(
                    id(module._parameters.get(hook.name + end)) in meta_ids for end in ("_g", "_v")):
                raise ValueError(
                    f"{name} has torch.nn.utils.weight_norm applied under infinity.zero.Init: "
                    "its g and v are computed from the weight at build time, a meta tensor "
                    "there, so they would be zeros and the forward NaN. Build this model "
                    "outside zero.Init (initialize then moves it to its tiers)")
        if type(module).__name__ == "ParametrizationList" and \
                any(id(p) in meta_ids for p in module.parameters(recurse=False)):
            raise ValueError(
                f"{name} is a parametrization (e.g. nn.utils.parametrizations.weight_norm) built "
                "under infinity.zero.Init: its original tensors are computed from the weight at "
                "build time, which is a meta tensor there, so they cannot be initialised. Build "
                "this model outside zero.Init (initialize then moves it to its tiers)")


def _init_like_transformers(model: nn.Module, init_weights, new_ids: set[int],
                            shapes: Mapping[int, torch.Size],
                            initialiser: Mapping[int, nn.Module]) -> None:
    """What ``model.apply(model._init_weights)`` does to the new parameters: every module whose
    subtree holds one, children before parents (a parent may re-initialise its children: GPT-2's
    scaled ``c_proj``, T5's attention and feed-forward weights). Every other parameter those
    calls could reach -- another unit's, already offloaded (no storage), or still meta -- is
    stood in for by a meta tensor meanwhile, so the calls cannot write to it. A tied parameter
    is initialised by its ``initialiser`` alone (its creator, else its first holder: the input
    embedding, not the head tied to it): transformers initialises and then ties, so the
    embedding's init holds (its padding row zero), where the head's, run last here, won."""
    holders = [m for m in model.modules()
               if any(id(p) in new_ids for p in m.parameters())]
    order = [m for m in _post_order(model) if any(m is h for h in holders)]
    with _foreign_params_on_meta(order, new_ids, shapes):
        for module in order:
            tied = {id(p) for p in module._parameters.values()
                    if p is not None and initialiser.get(id(p), module) is not module}
            with _foreign_params_on_meta([module], new_ids - tied, shapes) if tied & new_ids \
                    else contextlib.nullcontext():
                init_weights(module)


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


class _foreign_params_on_meta:
    """Within the block, parameters of ``modules`` (and below) not in ``keep`` are meta tensors
    of their full shape (``shapes`` by id for released ones: Whisper's init reads its position
    table's shape, Funnel's a tied embedding's)."""

    def __init__(self, modules: list[nn.Module], keep: set[int],
                 shapes: Mapping[int, torch.Size]) -> None:
        self.modules, self.keep, self.shapes = modules, keep, shapes
        self.saved: list[tuple[nn.Module, str, nn.Parameter]] = []

    def __enter__(self) -> None:
        seen: set[int] = set()
        for top in self.modules:
            for module in top.modules():
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for key, value in list(module._parameters.items()):
                    if value is None or id(value) in self.keep:
                        continue
                    self.saved.append((module, key, value))
                    module._parameters[key] = nn.Parameter(
                        torch.empty(self.shapes.get(id(value), value.shape), dtype=value.dtype,
                                    device="meta"),
                        requires_grad=value.requires_grad)

    def __exit__(self, *exc) -> None:
        for module, key, value in reversed(self.saved):
            module._parameters[key] = value
        self.saved.clear()


def _reset(module: nn.Module, all_built: bool = False, written: list[str] = ()) -> None:
    # torch's own modules: reset_parameters, or _reset_parameters (nn.MultiheadAttention); their
    # kept values are torch.empty's, which the reset replaces -- where their __init__ ran it
    watched = module.__dict__.pop("reset_parameters", None) is not None
    if watched and not module.__dict__.pop(RESET_RAN_ATTR, False):
        if all_built:
            return      # built from values (Embedding.from_pretrained): they are kept
        raise ValueError(
            f"{type(module).__name__} was built from values (nn.Embedding.from_pretrained, "
            f"_weight=...) under infinity.zero.Init, and its parameters are larger than the "
            f"{KEEP_VALUE_NUMEL:,} elements whose built values Init keeps: they would be "
            "re-initialised, silently. Build it outside zero.Init, or load its values after "
            "infinity.initialize (model.load_state_dict)")
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, name, None)):
            getattr(module, name)()
            return
    if all_built and written:
        # the value kept is the one given at registration (torch.empty's, say), not the one
        # written after it (nn.init.ones_(self.weight) in the module's __init__): refused
        raise ValueError(
            f"parameters {written} of {type(module).__name__} were written in place after "
            "they were registered under infinity.zero.Init (an init in the module's own "
            "__init__, or a GatheredParameters write before initialize): Init builds them on "
            "the meta device, so that write was lost, and the value they were registered with "
            "(torch.empty's memory, say) would train. Give the value when creating the "
            "parameter (nn.Parameter(torch.ones(n))), or add a reset_parameters() that "
            "initialises the module, or build the model outside zero.Init")
    if all_built:
        return      # no init method, but every parameter kept the value it was built with (a
        # LoRA wrapper's factors): nothing to initialise
    names = [n for n, _ in module.named_parameters(recurse=False)]
    raise ValueError(
        f"cannot initialise parameters {names} of {type(module).__name__} built under "
        "infinity.zero.Init: the module has no reset_parameters() and the model no "
        "_init_weights(); build this model outside zero.Init or add one")
