"""``engine.save_pretrained(dir, merged=True)`` on a PEFT LoRA model: the base model with the
adapter merged in, under the base's names, as ``merge_and_unload().save_pretrained`` writes it.

Why here and streamed: ``merge_and_unload`` needs the whole model in memory, which is what an
out-of-core base cannot have. The save streams the units as any save does; each LoRA layer's
``lora_A`` and ``lora_B`` come first in its unit (trainable parameters lead a unit's layout),
so they are kept (small) and its base weight, gathered whole (one matrix), is written as
``W + scaling * B @ A`` (transposed for ``fan_in_fan_out`` layers, GPT-2's Conv1D). The
wrapper's names become the base's: ``base_model.model.`` and ``.base_layer`` removed, a
``modules_to_save`` copy written in place of the layer it copied, the original dropped.
Refused: DoRA (its magnitude rescales the merged weight), several adapters active at once,
adapters other than LoRA, and a LoRA layer over a tied weight (a tied head: merged, the input
embeddings would change with it, which training did not).
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import nn

PREFIX = "base_model.model."


@dataclass(frozen=True)
class _LoraMerge:
    a: str
    b: str
    scaling: float
    transposed: bool


class MergedNames:
    """The names and values of a PEFT LoRA model's merged save (see the module docstring):
    ``rename`` for the tensors written as they are, ``split`` for those merged or dropped
    (the interface of pretrained_write's ``hub_name`` / ``hub_split``)."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer

        active = list(getattr(model, "active_adapters", None) or [])
        if len(active) != 1:
            raise ValueError(f"save_pretrained(merged=True) merges one adapter; this PEFT model "
                             f"has {len(active)} active ({active}): set_adapter(name) first")
        adapter = active[0]
        names_of: dict[int, list[str]] = {}
        for pname, param in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(pname)
        self.merges: dict[str, _LoraMerge] = {}
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            if module.use_dora.get(adapter, False):
                raise ValueError(f"save_pretrained(merged=True) of a DoRA adapter ({name}): its "
                                 "magnitude rescales the merged weight, which is not built "
                                 "here; save the adapter (merged=False) and merge with PEFT")
            base = getattr(getattr(module, "base_layer", None), "weight", None)
            tied = [n for n in names_of.get(id(base), []) if n != f"{name}.base_layer.weight"]
            if tied:
                raise ValueError(
                    f"save_pretrained(merged=True): the LoRA layer {name} adapts a weight tied "
                    f"to {tied[0]} (tie_word_embeddings): merged into the one saved tensor, the "
                    "adapter would change that other use too (the input embeddings), which "
                    "training did not, and a weight saved once under the other name would lose "
                    "it. Save the adapter (merged=False) and load it over the base with PEFT, "
                    "or train the head untied")
            self.merges[f"{name}.base_layer.weight"] = _LoraMerge(
                f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight",
                float(module.scaling[adapter]), bool(getattr(module, "fan_in_fan_out", False)))
        if not self.merges:
            raise ValueError("save_pretrained(merged=True): the model has no LoRA layer of its "
                             f"active adapter {adapter!r} (only LoRA adapters are merged here)")
        self.factors = {m.a for m in self.merges.values()} | {m.b for m in self.merges.values()}
        self._kept: dict[str, torch.Tensor] = {}

    def rename(self, name: str) -> str:
        """A wrapper's name -> the base model's."""
        if name.startswith(PREFIX):
            name = name[len(PREFIX):]
        return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")

    def split(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """[] for a tensor the merged save drops (a LoRA factor, kept for its layer's merge;
        the original of a modules_to_save copy), [(base name, merged weight)] for a LoRA
        layer's base weight, None for every other (written as it is, renamed)."""
        if ".original_module." in name:
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
            a, b = self._kept.pop(merge.a), self._kept.pop(merge.b)
        except KeyError:
            raise RuntimeError(f"save_pretrained(merged=True): {name} came before its LoRA "
                               "factors; this layout is not merged here: save the adapter "
                               "(merged=False)") from None
        delta = (b.float() @ a.float()) * merge.scaling
        if merge.transposed:
            delta = delta.T
        return [(self.rename(name), (value.float() + delta).to(value.dtype))]

