"""infinity: train models whose states do not fit in device (or host) memory.

Model states live in tiers (device, pinned host, NVMe swap files) moved by a native async I/O
engine; a ZeRO stage-3 coordinator fetches each unit's parameters just before use; a vectorized
CPU Adam steps the offloaded optimizer states. The entry point mirrors DeepSpeed:
``engine, optimizer, _, scheduler = infinity.initialize(model=..., config=ds_config)``.
"""
from __future__ import annotations

import importlib
from typing import Any

from infinity.base.native_info import native_info

__version__ = "0.1.0"

# Public names served lazily, so `import infinity` stays cheap and each layer loads on first use.
_LAZY = {
    "initialize": "infinity.engine.entry",
    "from_pretrained": "infinity.engine.pretrained",
    "init_distributed": "infinity.comm",
    "add_config_arguments": "infinity.engine.entry",
    "Engine": "infinity.engine",
    "InfinityConfig": "infinity.config",
    "CPUAdam": "infinity.optim.cpu_adam",
    "zero": "infinity.zero",
    "checkpoint": "infinity.checkpoint",
}

__all__ = ["native_info", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None and name == "checkpointing":     # deepspeed.checkpointing's habit
        raise AttributeError(
            "module 'infinity' has no attribute 'checkpointing': activation checkpointing is "
            "torch's (torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False), or a "
            "Hugging Face model's gradient_checkpointing_enable()), and what DeepSpeed's "
            "partition_activations / cpu_checkpointing save is infinity.offload_activations "
            "(docs/memory.md); infinity.checkpoint saves and loads training checkpoints")
    if module is None:
        raise AttributeError(f"module 'infinity' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    return loaded if module.endswith("." + name) else getattr(loaded, name)
