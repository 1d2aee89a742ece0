"""What the engine puts on the user's model besides hooks, and takes off at ``close()``.

Why apart from engine.py: these are the model's own methods answering for the engine (a torch
loop calls ``model.zero_grad()``, Hugging Face's Trainer ``model.load_state_dict``), kept as
instance attributes that shadow the class's, so removing them restores the model as it was.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.comm.collectives import NO_COMM, Collectives
from infinity.comm.group import use_local_gpu
from infinity.engine.guards import call_on_every_rank
from infinity.engine.model_casts import CAST_METHODS, casts_of
from infinity.engine.module_state import full_state_dict, load_module_state_dict

if TYPE_CHECKING:
    from infinity.engine import Engine

log = get_logger("engine")

ROUTED = ("zero_grad", "load_state_dict", "state_dict", "save_pretrained", *CAST_METHODS,
          "resize_token_embeddings", "generate", "load_adapter", "add_adapter",
          "num_parameters", "get_nb_trainable_parameters")


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first materialised parameter, else this machine's default."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    use_local_gpu()        # the rank's own GPU under a launcher, as DeepSpeed's engine
    return torch.device("cuda", torch.cuda.current_device())


def place_buffers(model: nn.Module, device: torch.device, comm: Collectives = NO_COMM) -> int:
    """Move the model's buffers (persistent or not) to the engine's ``device``, holding rank 0's
    values (``comm``); returns how many moved. A model built under ``zero.Init`` or by
    ``infinity.from_pretrained`` has meta parameters, which the units place, but real buffers
    on the CPU (a position-id table, a rotary frequency table, a causal mask): on a GPU the
    first forward would mix devices and fail. Each buffer is replaced by its moved copy, as
    ``model.to(device)`` replaces them; a buffer two modules share stays one tensor. A meta
    buffer is refused, naming it (nothing would give it values: the first forward failed on
    a device mismatch), except where ``device`` is meta itself."""
    on_meta = [name for name, buf in model.named_buffers() if buf.is_meta]
    if on_meta and device.type != "meta":
        raise ValueError(
            f"model buffer(s) {', '.join(on_meta[:3])}{' ...' if len(on_meta) > 3 else ''} "
            "are on the meta device, with no values: the engine gives meta parameters memory "
            "and their init, but a buffer has none to take (one made from a parameter under "
            "zero.Init, which holds no values there, or a model built on the meta device). "
            "Register such a buffer after initialize (reading the parameter under "
            "infinity.zero.GatheredParameters), compute it in forward, or build the buffers "
            "outside the meta device")
    moved = replace_buffers(model, lambda _, buf: buf.to(device)
                            if buf.device != device and buf.device.type != "meta" else None)
    _buffers_from_rank0(model, comm)
    return moved


def replace_buffers(model: nn.Module,
                    change: Callable[[str, torch.Tensor], torch.Tensor | None]) -> int:
    """Replace each buffer ``change(qualified name, buffer)`` gives a new tensor for (None:
    kept), as ``model.to`` replaces them: a buffer two modules share stays one tensor.
    Returns how many tensors were replaced."""
    new: dict[int, torch.Tensor | None] = {}
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if id(buf) not in new:
                new[id(buf)] = change(f"{module_name}.{name}" if module_name else name, buf)
            if new[id(buf)] is not None:
                module._buffers[name] = new[id(buf)]
    return sum(v is not None for v in new.values())


def _buffers_from_rank0(model: nn.Module, comm: Collectives) -> None:
    """Every rank's buffers take rank 0's values, as DDP makes them agree when it wraps a
    model: a buffer each rank drew on its own (a rank-seeded init, statistics only rank 0
    loaded) would otherwise stay different, and each rank would compute with its own. The
    parameters are made to agree as their units are placed (``Unit.adopt``, from_rank0).
    One broadcast of all the buffers' bytes (the ranks' buffers have the same names, shapes
    and dtypes: ``check_same_on_every_rank`` compared them first)."""
    if not comm.active:
        return
    # an expanded buffer (a stride 0: ``torch.ones(1).expand(8)``) has one element under many
    # indices and cannot be written whole: left as it is (a constant, in practice)
    real = [buf for _, buf in model.named_buffers()
            if buf.device.type != "meta" and buf.numel()
            and not any(step == 0 and size > 1 for step, size in zip(buf.stride(), buf.shape))]
    if not real:
        return
    with torch.no_grad():
        packed = torch.cat([buf.contiguous().view(-1).view(torch.uint8) for buf in real])
        comm.broadcast(packed, 0)
        offset = 0
        for buf in real:
            nbytes = buf.numel() * buf.element_size()
            # a copy: a byte slice viewed as a wider dtype needs an aligned start
            buf.copy_(packed[offset:offset + nbytes].clone().view(buf.dtype).reshape(buf.shape))
            offset += nbytes


def route_module_methods(model: nn.Module, engine: "Engine") -> None:
    """``model.zero_grad()`` (what a torch loop, or Hugging Face's Trainer, calls) discards the
    engine's pending gradients too, as it would discard the .grad torch keeps;
    ``model.load_state_dict(sd)`` writes every unit's homes (``zero.module_state``);
    ``model.state_dict()`` reads the current full weights (``full_state_dict``) and a
    transformers model's ``save_pretrained(dir)`` is the engine's. Instance attributes, which
    close() removes."""
    module_zero_grad = model.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        engine.zero_grad(set_to_none)
        module_zero_grad(set_to_none)

    def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        engine._check_open("load_state_dict")
        return load_module_state_dict(engine, state_dict, strict=strict, assign=assign)

    def state_dict(*args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        engine._check_open("state_dict")
        if args:        # torch's deprecated positional form
            destination, prefix, keep_vars = (*args, prefix, keep_vars)[:3] \
                if len(args) == 1 else (*args, keep_vars)[:3]
        return full_state_dict(engine, destination, prefix, keep_vars)

    routed = {"zero_grad": zero_grad, "load_state_dict": load_state_dict,
              "state_dict": state_dict, **casts_of(model, engine, "model")}
    sizes = {id(e.param): e.numel for unit in engine.units for e in unit.params}
    if _is_transformers_model(model):
        routed["num_parameters"] = _counted_parameters(model, sizes)
        routed["save_pretrained"] = _routed_save_pretrained(model, engine)
        if engine.stage == 3 and engine.world_size > 1 and callable(getattr(model, "generate",
                                                                               None)):
            routed["generate"] = _routed_generate(model)
        routed["resize_token_embeddings"] = _routed_resize(model)
    elif is_peft_model(model):
        routed["save_pretrained"] = _routed_adapter_save(model, engine)
        for name in ("load_adapter", "add_adapter"):
            routed[name] = _refused_new_adapter(name)
        routed["get_nb_trainable_parameters"] = _counted_trainable(model, sizes)
        if engine.stage == 3 and engine.world_size > 1:
            routed["generate"] = _routed_generate(model)
        base = model.get_base_model()
        if _is_transformers_model(base):
            base.__dict__["num_parameters"] = _counted_parameters(base, sizes)
    for name, function in routed.items():     # a state dict or a load: a call every rank makes
        label = f"{name}()" if name in ("state_dict", "load_state_dict") else None
        setattr(model, name, _bound(model, engine, name, function, label))
    tuner = getattr(model, "base_model", None) if is_peft_model(model) else None
    if tuner is not None and engine.stage == 3:
        for name in MERGES:
            if callable(getattr(type(tuner), name, None)):
                setattr(tuner, name, _refused_merge(name, tuner))
    # a part's own state_dict() (``model.lm_head.state_dict()``): current values too, where it
    # gave released parameters as empty tensors (and a unit still fetched its values before a
    # pending step), saved as such without a word
    held = set(sizes)           # the parameters the engine holds, by id
    model.__dict__[_PART_HOOKS] = [
        module.register_state_dict_post_hook(_current_values(engine, held))
        for module in model.modules() if module is not model and
        any(p is not None and id(p) in held for p in module._parameters.values())]
    # and a part's load_state_dict (``model.classifier.load_state_dict(head)``) writes its
    # units' homes as the whole model's does: torch's copy into the parameters reached a
    # released one's empty tensor (a size mismatch), or, where the parameter was whole, the
    # compute-dtype copy only, which the next step overwrote from the fp32 master (in bf16 the
    # loaded head was gone after one step, "All keys matched" said)
    for name, module in model.named_modules(remove_duplicate=True):
        if module is not model and any(id(p) in held for p in module.parameters()):
            module.load_state_dict = _bound(module, engine, "load_state_dict",
                                            _part_load(engine, module),
                                            f"{name}.load_state_dict()")
            model.__dict__.setdefault(_PART_LOADS, []).append(module)
    for name, module in model.named_modules(remove_duplicate=True):
        if module is model or any(id(p) in held for p in module.parameters()):
            module.__dict__.update(_routed_copies(module, f"model.{name}" if name else "model",
                                                  sizes))
        if module is not model and any(id(p) in held for p in module.parameters()):
            module.__dict__.update(casts_of(module, engine, f"model.{name}"))


COPIES = ("__deepcopy__", "__reduce_ex__")
"""A held module's copies (``copy.deepcopy``, ``torch.save(model)``): ``_routed_copies``."""


def _routed_copies(model: nn.Module, name: str, sizes: dict[int, int]
                   ) -> dict[str, Callable[..., Any]]:
    """``copy.deepcopy`` and pickling (``torch.save(model)``) of a module the engine holds
    (``sizes``: each held parameter's element count, by id). Pickling failed on "Can't pickle
    local object" (its hooks and routed methods are this engine's closures); a deep copy of
    released parameters (stage 3) had empty weights and its forward failed on "mat2 must be a
    matrix". Both are refused naming the way to a copy with values (an EMA model, a frozen
    teacher); a deep copy of whole weights (stages 0-2, or under ``GatheredParameters``) is
    torch's (the copy runs on its own: the engine's hooks pass over modules not its own)."""
    what = f"{name} after infinity.initialize: the engine holds its parameters in its own stores"

    def refuse(kind: str, why: str) -> TypeError:
        return TypeError(
            f"{kind} of {what}{why}. For a copy with values (an EMA model, a teacher) build "
            "the model again and load `model.state_dict()` into it (every rank calls "
            "state_dict(): it gathers the current values), or deep-copy it inside "
            "`with infinity.zero.GatheredParameters(model.parameters()):`; to save, use "
            "torch.save(model.state_dict()), model.save_pretrained or "
            "engine.save_checkpoint; or copy the model before infinity.initialize")

    def reduce_ex(protocol: int) -> Any:
        if sys._getframe(1).f_code is copy.copy.__code__:   # a shallow copy shares the
            return object.__reduce_ex__(model, protocol)      # weights: torch's
        raise refuse("pickling (torch.save(model))",
                     " and its hooks are this engine's, which do not pickle")

    def deepcopy(memo: dict) -> nn.Module:
        released = [n for n, p in model.named_parameters()
                    if id(p) in sizes and p.numel() != sizes[id(p)]]
        if released:
            raise refuse("copy.deepcopy", f" and {released[0]} is released (ZeRO stage 3 "
                         "empties the module's tensors between uses), so a copy would have "
                         "no weights")
        routed = [(m, n, m.__dict__.pop(n)) for m in model.modules() for n in COPIES
                  if n in m.__dict__]
        try:
            twin = copy.deepcopy(model, memo)        # torch's copy, without these two
        finally:
            for m, n, f in routed:
                m.__dict__[n] = f
        return _without_engine_parts(twin)
    return {"__reduce_ex__": reduce_ex, "__deepcopy__": deepcopy}


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
_HOOK_SIDE_TABLES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called")


def _ours(function: Any) -> bool:
    """A hook or method this package defined (the engine's closures, routed methods)."""
    function = getattr(function, "__func__", function)
    module = getattr(function, "__module__", None) or ""
    return module == "infinity" or module.startswith("infinity.")


def _without_engine_parts(twin: nn.Module) -> nn.Module:
    """A deep copy of a held model (made with whole weights: ``GatheredParameters``, or stages
    0-2) without the engine's hooks and routed methods. The copy is the user's own model (an
    EMA, a teacher): it carried the engine's closures, so it did not pickle ("Can't pickle
    local object") and kept the engine and its stores alive after ``close()``; its calls were
    already its own (the hooks pass over modules not the engine's). Hooks the user registered
    stay, as torch copies them."""
    for module in twin.modules():
        for table in _HOOK_DICTS:
            hooks = module.__dict__.get(table)
            for key in [k for k, f in (hooks or {}).items() if _ours(f)]:
                del hooks[key]
                for side in _HOOK_SIDE_TABLES:
                    module.__dict__.get(side, {}).pop(key, None)
        for name in [n for n, f in vars(module).items() if callable(f) and _ours(f)]:
            del module.__dict__[name]
    return twin


def _routed_generate(model: nn.Module):
    """transformers' ``generate`` on a model held at stage 3 by several ranks: ``synced_gpus``
    on unless the caller says otherwise, as transformers sets it under DeepSpeed ZeRO-3 (it
    cannot tell infinity's stage 3). Without it a rank whose generation ended first (its eos,
    a shorter max_new_tokens) went on to its next pass while the others were still decoding:
    their gathers paired with its collectives, a hang to the collective timeout or a gloo
    abort. With it every rank runs a forward per step until all are done."""
    generate = model.generate

    def routed(*args: Any, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
        return generate(*args, synced_gpus=True if synced_gpus is None else synced_gpus,
                        **kwargs)
    return routed


def _routed_resize(model: nn.Module):
    """transformers' ``resize_token_embeddings`` on a model the engine holds: the embedding's
    shape is its units' layout, fixed at initialize, so a new size is refused (at stage 3
    transformers failed on the released weight, "not enough values to unpack"; at stage 2 the
    next forward did). The getter form (no size) and the current size change nothing: they
    return the input embeddings, as transformers' does."""
    def resize_token_embeddings(new_num_tokens: int | None = None,
                                pad_to_multiple_of: int | None = None, *args: Any,
                                **kwargs: Any) -> nn.Module:
        embeddings = model.get_input_embeddings()
        have = getattr(embeddings, "num_embeddings", None)
        want = have if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of and want is not None:
            want = -(-want // pad_to_multiple_of) * pad_to_multiple_of
        if want == have:
            return embeddings
        raise RuntimeError(
            f"resize_token_embeddings({want}) after infinity.initialize (the embedding has "
            f"{have} rows): the engine holds the embedding in its own stores, laid out at "
            "initialize, so a new shape cannot reach them. Resize before: load the model with "
            "transformers, resize_token_embeddings, then infinity.initialize "
            "(infinity.from_pretrained streams the checkpoint's shapes only)")
    return resize_token_embeddings


_PART_HOOKS = "_infinity_part_state_dict_hooks"
_PART_LOADS = "_infinity_part_loads"
MERGES = ("merge_and_unload", "merge_adapter")
"""PEFT's merges into the base weights, refused at stage 3 (``_refused_merge``)."""


def _counted_parameters(model: nn.Module, sizes: dict[int, int]):
    """transformers' ``num_parameters`` counting the engine's sizes (``sizes``, by id): a
    released parameter has 0 elements, and the count was 0 (transformers and PEFT look for
    DeepSpeed's ``ds_numel``, which the engine does not set)."""
    def num_parameters(only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        skip = {id(m.weight) for m in model.modules()
                if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
        return sum(sizes.get(id(p), p.numel()) for p in model.parameters()
                   if id(p) not in skip and (p.requires_grad or not only_trainable))
    return num_parameters


def _counted_trainable(model: nn.Module, sizes: dict[int, int]):
    """PEFT's ``get_nb_trainable_parameters`` (``print_trainable_parameters`` reads it) counting
    the engine's sizes: (0, 0) at stage 3, and a ZeroDivisionError printing them."""
    def get_nb_trainable_parameters() -> tuple[int, int]:
        counts = [(sizes.get(id(p), p.numel()), p.requires_grad) for p in model.parameters()]
        return sum(n for n, trains in counts if trains), sum(n for n, _ in counts)
    return get_nb_trainable_parameters


def _refused_new_adapter(name: str):
    """PEFT's ``load_adapter`` / ``add_adapter`` on a model the engine holds: the adapter's new
    parameters are in no unit, so the engine neither loads nor trains them (``load_adapter``
    returned normally, its values never loaded: the adapter evaluated at its fresh init)."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{name}() after infinity.initialize: the engine laid out its units and states "
            "at initialize, so a new adapter's parameters are in none of them and would be "
            "neither loaded nor trained. Add or load every adapter before initialize "
            "(PeftModel.from_pretrained, load_adapter, add_adapter on the model you pass), "
            "then set_adapter as you need")
    return refuse


def _refused_merge(name: str, tuner: nn.Module):
    """PEFT's ``name`` on a stage-3 model: it adds B @ A into ``weight.data``, released (0
    elements) outside its unit's forward, so the merge changed nothing and a merged model
    saved after it was the base without the adapter, without a word. Under
    ``GatheredParameters`` of every parameter with a ``modifier_rank`` the weights are whole and
    the merge is written back at its exit: PEFT's own merge runs (without one the merge was
    dropped at the exit, the same loss)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        from infinity.zero.init import being_modified

        if being_modified(tuner.parameters()):      # whole, and written back at the exit
            return getattr(type(tuner), name)(tuner, *args, **kwargs)
        raise RuntimeError(
            f"{name}() on a PEFT model an infinity engine holds at ZeRO stage 3: the base "
            "weights are released outside their unit's forward (0 elements), so the merge "
            "would change nothing and the adapter would be lost. Save the merged model "
            "streamed with engine.save_pretrained(dir, merged=True), merge under "
            "infinity.zero.GatheredParameters(list(model.parameters()), modifier_rank=0) (the "
            "whole model in memory, the merge written back), or save the adapter "
            "(model.save_pretrained(dir)) and merge it without the engine: "
            "PeftModel.from_pretrained(base, dir).merge_and_unload()")
    refuse.__name__ = name
    return refuse


@contextlib.contextmanager
def parts_as_torch_gives_them(engine: "Engine") -> Iterator[None]:
    """Within: a part's ``state_dict()`` as torch gives it (released parameters empty), not
    gathered. PEFT's adapter save reads a ``modules_to_save`` part's state dict for its keys
    alone, on rank 0 alone (the values come from the state it is given): gathering there was
    a collective the other ranks never joined (gloo's abort at two ranks)."""
    engine.__dict__[_AS_TORCH] = True
    try:
        yield
    finally:
        engine.__dict__.pop(_AS_TORCH, None)


_AS_TORCH = "_infinity_parts_as_torch"


def _part_load(engine: "Engine", part: nn.Module):
    """``part.load_state_dict``: the engine's load of that part, its own names."""
    def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        engine._check_open("load_state_dict")
        return load_module_state_dict(engine, state_dict, strict=strict, assign=assign,
                                      module=part)
    return load_state_dict


def _current_values(engine: "Engine", held: set[int]):
    """A state-dict post-hook giving a part of the model its parameters' current full values
    (read under ``GatheredParameters``, as the whole model's state dict reads them; every rank
    calls it where units are sharded)."""
    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        from infinity.zero.init import GatheredParameters

        if engine.__dict__.get(_AS_TORCH):
            return
        own = [(prefix + name, p) for name, p in module._parameters.items()
               if p is not None and id(p) in held and prefix + name in state_dict
               and state_dict[prefix + name] is not p]        # keep_vars: the parameter itself
        if not own:
            return
        engine._check_open("state_dict")
        with engine.comm.every_rank(f"{type(module).__name__}.state_dict()"), \
                GatheredParameters([p for _, p in own]):
            for key, p in own:
                state_dict[key] = p.detach().clone()
    return hook


def _bound(module: nn.Module, engine: "Engine", name: str, function, label: str | None):
    """``function`` as ``module``'s method ``name``, which a copy of it (``copy.deepcopy``,
    which rebinds methods to the copy) does not share: the copy gets its class's own. With a
    ``label`` it is a call every rank makes (a state dict or a load: one label whichever name
    the call came by, the model's or the engine's)."""
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self is not module:
            return getattr(type(self), name)(self, *args, **kwargs)
        if label is None:
            return function(*args, **kwargs)
        return call_on_every_rank(engine, label, function, *args, **kwargs)

    method.__name__ = name
    return types.MethodType(method, module)


def _is_transformers_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (not a PEFT wrapper, whose save_pretrained writes
    its adapter from ``state_dict()``); transformers is loaded when such a model exists."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return base is not None and isinstance(model, base)


def _routed_save_pretrained(model: nn.Module, engine: "Engine"):
    """``model.save_pretrained(dir)`` on a model the engine holds: the engine's streamed save
    of its current weights (see ``Engine.save_pretrained``), where transformers' own would
    read released parameters (0 elements) or a unit that lags a pending step. A
    ``state_dict=`` given is the caller's whole dict, saved by transformers' method."""
    own = type(model).save_pretrained

    def save_pretrained(save_directory: Any, is_main_process: bool = True,
                        state_dict: Mapping[str, Any] | None = None, push_to_hub: bool = False,
                        max_shard_size: int | str = "5GB", variant: str | None = None,
                        safe_serialization: bool = True, **kwargs: Any) -> None:
        if push_to_hub:
            raise ValueError("model.save_pretrained(push_to_hub=True) on a model an infinity "
                             "engine holds: save to a directory, then upload it")
        if variant is not None or safe_serialization is False:
            raise ValueError("model.save_pretrained on a model an infinity engine holds writes "
                             "model.safetensors (or its shards) only: no variant, no pickle")
        if state_dict is not None:
            return own(model, save_directory, is_main_process=is_main_process,
                       state_dict=state_dict, max_shard_size=max_shard_size, **kwargs)
        if kwargs.get("save_original_format") is True:    # what the engine's save does
            del kwargs["save_original_format"]
        if kwargs:      # never dropped without a word
            log.warning("model.save_pretrained: %s not honoured by the engine's save, which "
                        "writes the current weights as model.safetensors (or its shards) under "
                        "the checkpoint's own (Hub) names, as transformers' default "
                        "save_original_format=True", ", ".join(f"{k}={v!r}"
                                                              for k, v in kwargs.items()))
        # every rank takes part (units are gathered over the ranks); rank 0 writes
        engine.save_pretrained(save_directory, max_shard_size=max_shard_size)
        return None

    return save_pretrained


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT ``PeftModel`` (peft is imported where such a model exists)."""
    peft = sys.modules.get("peft")
    base = getattr(peft, "PeftModel", None) if peft is not None else None
    return base is not None and isinstance(model, base)


def _routed_adapter_save(model: nn.Module, engine: "Engine"):
    """``model.save_pretrained(dir)`` on a PEFT model the engine holds: the engine's adapter
    save (its trainable parameters gathered a unit at a time, not the whole model's state
    dict); PEFT's own method for what that does not cover (another adapter, a state_dict)."""
    own = type(model).save_pretrained

    def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> None:
        plain = not args and set(kwargs) <= {"is_main_process", "safe_serialization"} and \
            kwargs.get("safe_serialization", True)
        if not plain:
            return own(model, save_directory, *args, **kwargs)
        engine.save_pretrained(save_directory)
        return None

    return save_pretrained


def unroute_module_methods(model: nn.Module) -> None:
    """The module's own methods again (``close()``)."""
    for name in ROUTED:
        model.__dict__.pop(name, None)
    for handle in model.__dict__.pop(_PART_HOOKS, []):
        handle.remove()
    for part in model.__dict__.pop(_PART_LOADS, []):
        part.__dict__.pop("load_state_dict", None)
    for module in model.modules():
        for name in COPIES + (CAST_METHODS if module is not model else ()):
            module.__dict__.pop(name, None)
    tuner = model.__dict__.get("_modules", {}).get("base_model")
    for name in MERGES if tuner is not None else ():
        tuner.__dict__.pop(name, None)
    if is_peft_model(model):
        model.get_base_model().__dict__.pop("num_parameters", None)
