"""transformers' load-time conversions of checkpoint names, as infinity's loads and saves use them.

transformers 5 renames some tensors while it loads a checkpoint and renames them back when it
saves (``conversion_mapping.py``): GPT-NeoX / Pythia's ``embed_out`` is the model's
``lm_head``, Mixtral's ``block_sparse_moe`` its ``mlp``, and old checkpoints' ``LayerNorm.gamma``
its ``weight``. Others it fuses: Mixtral's and Qwen2-MoE's per-expert ``experts.N.w1/w2/w3``
become one ``experts.gate_up_proj`` / ``down_proj`` tensor. infinity reads transformers' own
mapping for the model (``get_model_conversion_mapping``, so a family transformers adds works
here) and applies its renamings to the names (a rename costs nothing while streaming), and its
fusions with its own operations (``WeightConverter.convert``): a fused tensor is built from its
parts when the unit holding it is placed, so memory holds about one unit's experts, as
transformers holds them. Saves write the Hub layout back, as transformers does: the renamings
reversed, a fused tensor split into its parts again (the reverse operations).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class HubNames:
    """The conversions of one model's names between a Hub checkpoint and the model."""

    to_model: Callable[[str], str]
    """A checkpoint key -> the model's name for it (transformers' renamings)."""
    to_hub: Callable[[str], str]
    """A model name -> the key transformers saves it under (its renamings reversed)."""
    fusions: Callable[[Iterable[str]], dict[str, "Fusion"]] = field(default=lambda keys: {})
    """Renamed checkpoint keys -> the model tensors transformers fuses from them."""
    split: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]] | None] = \
        field(default=lambda name, value: None)
    """A model tensor (its name, its values) -> the tensors transformers saves it as, under
    their Hub names (a fused experts tensor back into one per expert); None where it saves it
    whole. Values on the meta device give the names and shapes."""


@dataclass(frozen=True)
class Fusion:
    """A model tensor transformers builds while loading from several checkpoint tensors."""

    target: str
    parts: tuple[str, ...]
    """The (renamed) checkpoint keys it is built from, in transformers' order."""
    build: Callable[[Callable[[str], torch.Tensor]], torch.Tensor]
    """The tensor, from a function giving each part's values (transformers' operations)."""


def hub_names(model: nn.Module) -> HubNames | None:
    """The conversions transformers applies to ``model``'s checkpoints, None for a model that
    has none (or is not a transformers model, or an older transformers without them)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    loading = get_model_conversion_mapping(model)
    if not loading:
        return None
    renamings = [t for t in loading if isinstance(t, WeightRenaming)]
    converters = [t for t in loading if isinstance(t, WeightConverter)]
    # saving, as transformers' revert_weight_conversion: no legacy renamings (LayerNorm.gamma),
    # no prefix changes, in reverse order, each transform reversed
    saving = [t for t in get_model_conversion_mapping(model, add_legacy=False)
              if not isinstance(t, PrefixChange)][::-1]
    reversed_all = [t.reverse_transform() for t in saving]
    reverse = [t for t in reversed_all if isinstance(t, WeightRenaming)]
    unfuse = [t for t in reversed_all if isinstance(t, WeightConverter)]

    def to_model(key: str) -> str:
        return rename_source_key(key, renamings, [])[0]

    def to_hub(name: str) -> str:
        return rename_source_key(name, reverse, [], reverse=True)[0]

    def fusions(keys: Iterable[str]) -> dict[str, Fusion]:
        return _fusions(keys, converters)

    def split(name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        for converter in unfuse:                   # as transformers saves: converter first
            target, pattern = converter.rename_source_key(name)
            if pattern is None:
                continue
            converted = _convert(converter, target, [(name, pattern, lambda: value)])
            return [(to_hub(key), part) for key, part in converted.items()]
        return None

    return HubNames(to_model=to_model, to_hub=to_hub, fusions=fusions, split=split)


def _fusions(keys: Iterable[str], converters: list) -> dict[str, Fusion]:
    from transformers.core_model_loading import dot_natural_key

    grouped: dict[str, tuple[object, list[tuple[str, str]]]] = {}
    for key in sorted(keys, key=dot_natural_key):   # the order transformers collects them in
        for converter in converters:
            target, pattern = converter.rename_source_key(key)
            if pattern is not None:
                grouped.setdefault(target, (converter, []))[1].append((key, pattern))
                break

    def builder(target: str, converter, parts: list[tuple[str, str]]):
        def build(load: Callable[[str], torch.Tensor]) -> torch.Tensor:
            out = _convert(converter, target, [(key, pattern, lambda key=key: load(key))
                                               for key, pattern in parts])
            if target not in out:
                raise ValueError(f"transformers' conversion of {len(parts)} tensor(s) into "
                                 f"{target} gave {sorted(out)}: not the tensor the model has")
            return out[target]
        return build

    return {target: Fusion(target, tuple(k for k, _ in parts), builder(target, conv, parts))
            for target, (conv, parts) in grouped.items()}


def _convert(converter, target: str,
             sources: list[tuple[str, str, Callable[[], torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """transformers' ``converter`` run on ``sources`` ((key, the pattern it matched, its
    values)) into ``target``, as its loader and saver run it: the tensors it makes, by name.
    A copy of the converter collects them, so the mapping's own stays empty."""
    fresh = copy.deepcopy(converter)
    for key, pattern, values in sources:
        fresh.add_tensor(target, key, pattern, values)
    return fresh.convert(target)


def hub_names_of_config(config_text: str) -> HubNames | None:
    """The conversions of the model a ``config.json`` describes (built on the meta device, no
    memory): for an export, which has a checkpoint and its config but no model. None where
    transformers cannot build it (no conversions are applied then)."""
    import json

    try:
        import transformers
    except ImportError:
        return None
    try:
        values = json.loads(config_text)
        config = transformers.AutoConfig.for_model(**values)
        names = [a for a in values.get("architectures") or [] if hasattr(transformers, a)]
        model_class = getattr(transformers, names[0]) if names else \
            transformers.AutoModelForCausalLM
        with torch.device("meta"):
            model = model_class._from_config(config) if names else model_class.from_config(config)
    except (ValueError, TypeError, KeyError, AttributeError, json.JSONDecodeError):
        return None
    return hub_names(model)
