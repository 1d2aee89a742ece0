"""``engine.save_pretrained(dir, merged=True)`` on a PEFT LoRA model: the base model with the
adapter merged in, under the base's names, as ``merge_and_unload().save_pretrained`` writes it.

Why here and streamed: ``merge_and_unload`` needs the whole model in memory, which is what an
out-of-core base cannot have. The save streams the units as any save does; each LoRA layer's
factors come first in its unit (trainable parameters lead a unit's layout), so they are kept
(small) and its base weight, gathered whole (one matrix), is written as ``W + scaling * B @ A``
(transposed for ``fan_in_fan_out`` layers, GPT-2's Conv1D, and for embeddings, whose factors
are ``lora_embedding_A/B``); with ``lora_bias`` the base bias gets ``scaling * b``, as PEFT
merges it. The wrapper's names become the base's: ``base_model.model.`` and ``.base_layer``
removed, the active adapter's ``modules_to_save`` copy written in place of the layer it copied
(the original where only another adapter copied it), every other adapter's factors and copies
dropped.
Refused: DoRA (its magnitude rescales the merged weight), several adapters active at once,
LoRA layers other than linear and embedding ones (convolutions, attention, quantized layers),
``lora_bias`` over a layer without a bias, adapters other than LoRA, and a LoRA layer over a
tied weight (a tied head: merged, the input embeddings would change with it, which training
did not).

[Note: nothing of the wrapper is written as it is]
A tensor whose name still holds a part of PEFT's wrapper after the renaming (a kind of adapter
this module does not know) is refused, never written beside the base's tensors, where
transformers would load the directory with the unmerged base and only an "unexpected keys"
note.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import nn

PREFIX = "base_model.model."
ADAPTER_DICTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                           "lora_magnitude_vector", "modules_to_save"})
"""The parts of a PEFT model's names followed by an adapter's name."""
WRAPPER_PARTS = ADAPTER_DICTS | {"base_layer", "original_module", "token_adapter",
                                 "trainable_tokens_delta", "trainable_tokens_original"}
"""Parts of a name that belong to PEFT's wrapper, not to the base model."""


@dataclass(frozen=True)
class _LoraMerge:
    """A base tensor's merge: a weight's ``+ scaling * B @ A`` (``b`` set; ``transposed``:
    the product's transpose), or a bias's ``+ scaling * a`` (``b`` None: ``a`` is lora_B's
    bias)."""

    a: str
    b: str | None
    scaling: float
    transposed: bool = False


class MergedNames:
    """The names and values of a PEFT LoRA model's merged save (see the module docstring):
    ``rename`` for the tensors written as they are, ``split`` for those merged or dropped
    (the interface of pretrained_write's ``hub_name`` / ``hub_split``)."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.lora import Embedding, Linear, LoraLayer

        active = list(getattr(model, "active_adapters", None) or [])
        if len(active) != 1:
            raise ValueError(f"save_pretrained(merged=True) merges one adapter; this PEFT model "
                             f"has {len(active)} active ({active}): set_adapter(name) first")
        adapter = self.adapter = active[0]
        names_of: dict[int, list[str]] = {}
        for pname, param in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(pname)
        self.merges: dict[str, _LoraMerge] = {}
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or (adapter not in module.lora_A and
                                                     adapter not in module.lora_embedding_A):
                continue
            if not isinstance(module, (Linear, Embedding)):
                raise ValueError(f"save_pretrained(merged=True): the LoRA layer {name} is a "
                                 f"{type(module).__module__}.{type(module).__name__}; only "
                                 "linear and embedding LoRA layers are merged here: save the "
                                 "adapter (merged=False) and merge with PEFT")
            if module.use_dora.get(adapter, False):
                raise ValueError(f"save_pretrained(merged=True) of a DoRA adapter ({name}): its "
                                 "magnitude rescales the merged weight, which is not built "
                                 "here; save the adapter (merged=False) and merge with PEFT")
            base_layer = getattr(module, "base_layer", None)
            base = getattr(base_layer, "weight", None)
            tied = [n for n in names_of.get(id(base), []) if n != f"{name}.base_layer.weight"]
            if tied:
                raise ValueError(
                    f"save_pretrained(merged=True): the LoRA layer {name} adapts a weight tied "
                    f"to {tied[0]} (tie_word_embeddings): merged into the one saved tensor, the "
                    "adapter would change that other use too (the input embeddings), which "
                    "training did not, and a weight saved once under the other name would lose "
                    "it. Save the adapter (merged=False) and load it over the base with PEFT, "
                    "or train the head untied")
            scaling = float(module.scaling[adapter])
            if isinstance(module, Embedding):
                self.merges[f"{name}.base_layer.weight"] = _LoraMerge(
                    f"{name}.lora_embedding_A.{adapter}", f"{name}.lora_embedding_B.{adapter}",
                    scaling, transposed=True)
                continue
            self.merges[f"{name}.base_layer.weight"] = _LoraMerge(
                f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight", scaling,
                bool(getattr(module, "fan_in_fan_out", False)))
            if getattr(module, "lora_bias", {}).get(adapter, False):
                if getattr(base_layer, "bias", None) is None:
                    raise ValueError(f"save_pretrained(merged=True): the LoRA layer {name} has "
                                     "lora_bias=True over a layer without a bias, which no "
                                     "merged weights can hold (PEFT refuses to merge it too): "
                                     "save the adapter (merged=False)")
                self.merges[f"{name}.base_layer.bias"] = _LoraMerge(
                    f"{name}.lora_B.{adapter}.bias", None, scaling)
        if not self.merges:
            raise ValueError("save_pretrained(merged=True): the model has no LoRA layer of its "
                             f"active adapter {adapter!r} (only LoRA adapters are merged here)")
        self.factors = {m.a for m in self.merges.values()} | \
            {m.b for m in self.merges.values() if m.b is not None}
        # modules_to_save wrappers: where the active adapter has its own copy, that copy is
        # the layer; elsewhere (only another adapter copied it) the original is what the
        # forward uses, and is written as the layer
        from peft.utils import ModulesToSaveWrapper

        self.own_copy = {name for name, module in model.named_modules()
                         if isinstance(module, ModulesToSaveWrapper)
                         and adapter in module.modules_to_save}
        self._kept: dict[str, torch.Tensor] = {}

    def rename(self, name: str) -> str:
        """A wrapper's name -> the base model's; a name that keeps a part of the wrapper is
        refused ([Note: nothing of the wrapper is written as it is])."""
        wrapped = name
        if name.startswith(PREFIX):
            name = name[len(PREFIX):]
        name = name.replace(".base_layer.", ".").replace(f".modules_to_save.{self.adapter}.",
                                                         ".").replace(".original_module.", ".")
        left = [part for part in name.split(".") if part in WRAPPER_PARTS]
        if left:
            raise ValueError(f"save_pretrained(merged=True): {wrapped} is a part of the PEFT "
                             f"model ({left[0]}) that is not merged here, and written as it is "
                             "it would load as an unexpected key beside an unmerged base: "
                             "save the adapter (merged=False) and merge with PEFT")
        return name

    def _dropped(self, name: str) -> bool:
        """The original of a modules_to_save copy, and every tensor of another adapter."""
        parts = name.split(".")
        if "original_module" in parts:
            # the original of a copy the active adapter trains; kept where it has none
            return ".".join(parts[:parts.index("original_module")]) in self.own_copy
        return any(part in ADAPTER_DICTS and i + 1 < len(parts) and parts[i + 1] != self.adapter
                   for i, part in enumerate(parts))

    def split(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """[] for a tensor the merged save drops (a LoRA factor, kept for its layer's merge;
        the original of the active adapter's modules_to_save copy; another adapter's), [(base name, merged
        tensor)] for a LoRA layer's base weight or bias, None for every other (written as it
        is, renamed)."""
        if self._dropped(name):
            return []
        if name in self.factors:
            if not value.is_meta:
                self._kept[name] = value.clone()
            return []
        merge = self.merges.get(name)
        if merge is None:
            return None
        if value.is_meta:
            return [(self.rename(name), value)]
        try:
            a = self._kept.pop(merge.a)
            b = self._kept.pop(merge.b) if merge.b is not None else None
        except KeyError:
            raise RuntimeError(f"save_pretrained(merged=True): {name} came before its LoRA "
                               "factors; this layout is not merged here: save the adapter "
                               "(merged=False)") from None
        delta = a.float() * merge.scaling if b is None else (b.float() @ a.float()) * merge.scaling
        if merge.transposed:
            delta = delta.T
        return [(self.rename(name), (value.float() + delta).to(value.dtype))]
