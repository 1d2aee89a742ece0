"""Which parameters form which unit, and which modules must fetch which units.

Default rule (DESIGN.md "Units"): one unit per repeated block -- each child of an ``nn.ModuleList``
(or ``nn.Sequential``) whose children include at least two of the same class, or each module
whose class name is listed in ``unit_modules`` -- and every other top-level module that owns
parameters is a unit of its own. "Top-level" is relative to the spine: the modules that contain
blocks. A parameter shared by several modules (tied embeddings) belongs to the first unit that
reaches it and is fetched at each use.

[Note: units too large to stream]
A model without repeated blocks found by that rule -- ALBERT's one shared layer, a network whose
layers are attributes rather than a list, a single-layer model -- would be one or two units
holding nearly all of it: stage 3 would fetch the whole model to run any of it, and a device
budget smaller than the model could not train it at all. So a unit that is not a block, holds
more than half of the model's parameters and has children with parameters joins the spine: its
children become units (its own direct parameters one more), and so on down until no unit
holds more than half, or the big one is a leaf. nn.MultiheadAttention is never split: its
forward reads ``out_proj.weight`` without calling ``out_proj``, which a child unit, fetched only
around its own forward, would not have. Naming the block class in ``infinity.unit_modules``
still takes precedence where it finds blocks.
"""
from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(eq=False)
class UnitSpec:
    """A unit before it is built: its name, root module and parameters (name, param)."""

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]


def find_blocks(model: nn.Module, unit_modules: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` (name, module), outermost first, none nested in another."""
    blocks: list[tuple[str, nn.Module]] = []
    wanted = set(unit_modules or [])

    def visit(prefix: str, module: nn.Module) -> None:
        if wanted and type(module).__name__ in wanted and prefix:
            blocks.append((prefix, module))
            return
        if not wanted and isinstance(module, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(child) for child in module.children())
            if counts and counts.most_common(1)[0][1] >= 2:
                for name, child in module.named_children():
                    if counts[type(child)] >= 2 and _has_params(child):
                        blocks.append((_join(prefix, name), child))
                    else:
                        visit(_join(prefix, name), child)
                return
        for name, child in module.named_children():
            visit(_join(prefix, name), child)

    visit("", model)
    unknown = wanted - {type(m).__name__ for m in model.modules()}
    if unknown:
        classes = sorted({type(m).__name__ for m in model.modules() if _has_params(m)})
        close = {name: difflib.get_close_matches(name, classes, n=1) for name in sorted(unknown)}
        hints = "; ".join(f"{name!r}" + (f" (did you mean {match[0]!r}?)" if match else "")
                          for name, match in close.items())
        raise ValueError(f"infinity.unit_modules names module classes this model does not have: "
                         f"{hints}. Classes with parameters in it: {', '.join(classes[:20])}")
    return blocks


def partition(model: nn.Module, unit_modules: list[str] | None = None) -> list[UnitSpec]:
    """Split ``model``'s parameters into units, in module registration order."""
    _refuse_parameter_dtypes(model)
    _refuse_sparse_gradients(model)
    blocks = find_blocks(model, unit_modules)
    block_ids = {id(m) for _, m in blocks}
    spine = {""}
    for name, _ in blocks:
        parts = name.split(".")
        for i in range(len(parts)):
            spine.add(".".join(parts[:i]))
    total = _numel(model)
    while True:
        roots = _roots(model, block_ids, spine)
        # see [Note: units too large to stream]
        too_large = [name for name, module in roots
                     if name not in spine and id(module) not in block_ids
                     and 2 * _numel(module) > total and any(map(_has_params, module.children()))
                     and not isinstance(module, _READS_CHILD_WEIGHTS)]
        if not too_large:
            break
        spine.update(too_large)
    seen: set[nn.Parameter] = set()
    specs: list[UnitSpec] = []
    for name, module in roots:
        direct_only = name in spine and id(module) not in block_ids
        named = module.named_parameters(recurse=not direct_only)
        params = []
        for pname, param in named:
            if param in seen:
                continue
            seen.add(param)
            params.append((_join(name, pname), param))
        if params:
            specs.append(UnitSpec(name or "<root>", module, params))
    missing = [n for n, p in model.named_parameters() if p not in seen]
    if missing:
        raise RuntimeError(f"partition left parameters without a unit: {missing[:5]}")
    return specs


def _refuse_parameter_dtypes(model: nn.Module) -> None:
    """A unit keeps its parameters in one flat buffer of the compute dtype (fp32, bf16 or
    fp16), so the engine casts every parameter to it: an integer or bool parameter (an index
    table) or a float64 model would come back in another dtype and break the forward that
    relies on it. Refused before anything is moved, with the fix. (Mixed float dtypes are
    cast: a frozen bf16 base with fp32 adapters trains, its forward casting as it would.)"""
    def dtype_name(p: nn.Parameter) -> str:
        return str(p.dtype).replace("torch.", "")

    named = list(model.named_parameters())
    odd = [f"{name} ({dtype_name(p)})" for name, p in named if not p.is_floating_point()]
    if odd:
        raise TypeError(
            f"{len(odd)} parameter(s) of {type(model).__name__} are not floating point: "
            f"{', '.join(odd[:5])}. The engine keeps parameters in the compute dtype, which would "
            "turn them into floats; register such tensors as buffers instead "
            "(module.register_buffer(name, tensor)), which the engine leaves as they are")
    wide = [name for name, p in named if p.dtype == torch.float64]
    if wide:
        raise TypeError(
            f"{len(wide)} parameter(s) of {type(model).__name__} are float64 (e.g. {wide[0]}): the "
            "engine computes in fp32, bf16 or fp16 and would cast them, so a float64 forward "
            "would meet float32 weights. Convert the model first (model.float()), and its inputs")


def _refuse_sparse_gradients(model: nn.Module) -> None:
    """An embedding with ``sparse=True`` makes sparse gradients, which the engine's flat
    gradient path cannot take (torch's AdamW refuses them too): said at initialize, not as an
    internal error at the first backward."""
    sparse = [name for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
              and m.weight.requires_grad]
    if sparse:
        raise TypeError(
            f"{len(sparse)} embedding(s) of {type(model).__name__} make sparse gradients "
            f"(sparse=True: {', '.join(sparse[:5])}); Adam over offloaded states takes dense "
            "gradients only, as torch.optim.AdamW does. Build them with sparse=False (the "
            "default), or freeze them (requires_grad_(False))")


def modules_needing(model: nn.Module, specs: list[UnitSpec]) -> list[tuple[nn.Module, list[int]]]:
    """Each module that must fetch units before it runs, with the indices of those units.

    A unit's root module fetches its unit. A root that is never called -- a block that is an
    ``nn.ModuleDict`` -- has each of its children fetch it instead, and a unit rooted at a
    parameter container (indexed by its parent's forward) is fetched by that parent. A module
    outside a unit's root that uses one of its parameters directly (a tied head) fetches it too.
    """
    owner: dict[nn.Parameter, int] = {}
    for index, spec in enumerate(specs):
        for _, param in spec.params:
            owner[param] = index
    root_of = {id(spec.module): index for index, spec in enumerate(specs)}
    hooked: dict[int, tuple[nn.Module, list[int]]] = {}

    def hook(module: nn.Module, unit: int) -> None:
        entry = hooked.setdefault(id(module), (module, []))[1]
        if unit not in entry:
            entry.append(unit)

    def visit(module: nn.Module, covered: frozenset[int],
              inherited: tuple[int, ...] = ()) -> list[int]:
        """Hook ``module`` and below; returns the units only its caller can fetch (rooted at
        a parameter container, which is indexed, never called)."""
        own = root_of.get(id(module))
        wanted = [u for u in (*inherited, *([own] if own is not None else [])) if u not in covered]
        if isinstance(module, (nn.ParameterDict, nn.ParameterList)):
            held = [owner[p] for p in module.parameters(recurse=False) if owner[p] not in covered]
            return list(dict.fromkeys(wanted + held))
        if isinstance(module, (nn.ModuleDict, nn.ModuleList)) and wanted:
            # never called either: each of its children fetches the unit instead
            orphans = [u for child in module.children() for u in visit(child, covered, tuple(wanted))]
            return list(dict.fromkeys(orphans))
        for unit in wanted:
            hook(module, unit)
        covered = covered | set(wanted)
        for param in module.parameters(recurse=False):
            if owner[param] not in covered:
                hook(module, owner[param])
        for child in module.children():
            for unit in visit(child, covered):
                hook(module, unit)
        return []

    visit(model, frozenset())
    return list(hooked.values())


def _roots(model: nn.Module, block_ids: set[int], spine: set[str]) -> list[tuple[str, nn.Module]]:
    """The root module of each unit: every block, each spine module with direct parameters
    (those only), and each module with parameters whose parent is on the spine."""
    roots: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if id(module) in block_ids:
            roots.append((name, module))
        elif name in spine:
            if any(True for _ in module.parameters(recurse=False)):
                roots.append((name, module))  # the spine module's own direct parameters
        else:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            if parent in spine and _has_params(module):
                roots.append((name, module))
    return roots


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# torch modules whose forward reads a child's weights without calling the child
_READS_CHILD_WEIGHTS = (nn.MultiheadAttention,)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
