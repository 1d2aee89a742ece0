"""transformers' load-time conversions of checkpoint names, as infinity's loads and saves use them.

transformers 5 renames some tensors while it loads a checkpoint and renames them back when it
saves (``conversion_mapping.py``): GPT-NeoX / Pythia's ``embed_out`` is the model's
``lm_head``, Mixtral's ``block_sparse_moe`` its ``mlp``, and old checkpoints' ``LayerNorm.gamma``
its ``weight``. Others it fuses: Mixtral's and Qwen2-MoE's per-expert ``experts.N.w1/w2/w3``
become one ``experts.gate_up_proj`` / ``down_proj`` tensor. infinity reads transformers' own
mapping for the model (``get_model_conversion_mapping``, so a family transformers adds works
here) and applies its renamings to the names (a rename costs nothing while streaming); the
fusions it does not apply yet, and a checkpoint that needs one is refused (by
checkpoint/pretrained.py), since loading the rest and leaving the fused parameters at a
random init would be a model that looks loaded and is not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class HubNames:
    """The conversions of one model's names between a Hub checkpoint and the model."""

    to_model: Callable[[str], str]
    """A checkpoint key -> the model's name for it (transformers' renamings)."""
    fused_into: Callable[[str], str | None]
    """A checkpoint key -> the model tensor transformers fuses it into, None if none does."""
    to_hub: Callable[[str], str]
    """A model name -> the key transformers saves it under (its renamings reversed)."""


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
    reverse = [t.reverse_transform() for t in saving if isinstance(t, WeightRenaming)]

    def to_model(key: str) -> str:
        return rename_source_key(key, renamings, [])[0]

    def fused_into(key: str) -> str | None:
        target, pattern = rename_source_key(key, renamings, converters)
        return target if pattern is not None else None

    def to_hub(name: str) -> str:
        return rename_source_key(name, reverse, [], reverse=True)[0]

    return HubNames(to_model=to_model, fused_into=fused_into, to_hub=to_hub)

