"""``infinity.initialize`` and ``infinity.add_config_arguments``: DeepSpeed's entry points, with
the arguments DeepSpeed scripts pass them (``args`` carrying ``--deepspeed_config``,
``training_data`` to get a data loader back, ``config_params``), so such a script runs with its
``deepspeed`` import swapped for ``infinity``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from infinity.comm.group import launched_world_size
from infinity.config import InfinityConfig
from infinity.engine import Engine


def initialize(args: Any = None, model: nn.Module | None = None,
               optimizer: Any = None, model_parameters: Iterable | None = None,
               training_data: torch.utils.data.Dataset | None = None,
               lr_scheduler: Any = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None,
               config: str | Path | Mapping[str, Any] | InfinityConfig | None = None,
               config_params: Any = None, auto_values: Mapping[str, Any] | None = None,
               process_group: Any = None, **unsupported: Any):
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The config comes from ``config``, or ``config_params`` (DeepSpeed's older name), or
    ``args.deepspeed_config`` (a path, as ``add_config_arguments`` parses it); giving two is an
    error, as in DeepSpeed. ``training_data`` (a torch Dataset) gets a DataLoader of
    ``train_micro_batch_size_per_gpu`` samples in random order (``dataloader_drop_last`` from the
    config) as the third value, else it is None. ``auto_values`` maps key paths
    (``"optimizer.params.lr"``) to the values that replace the config's ``"auto"`` entries, as the
    Hugging Face integration fills them in before it calls DeepSpeed.

    Ranks: ``process_group`` (a torch.distributed group) when given, else the default group,
    which is created from the launcher's environment (``torchrun``) when it is not yet (see
    ``infinity.init_distributed``). Each rank passes its own micro-batches.

    ``optimizer``: a ``torch.optim.Adam`` / ``AdamW`` (or a callable building one from the
    parameters) whose param groups and hyperparameters the engine takes over, for a config
    without an ``"optimizer"`` section (one of the two is needed). The object passed is not
    stepped: use the optimizer returned here (see [Note: the optimizer taken over] in
    engine/client_optimizer.py).
    """
    if unsupported:
        raise TypeError(f"infinity.initialize got unsupported arguments {sorted(unsupported)}; "
                        "supported: args, model, optimizer, model_parameters, "
                        "training_data, lr_scheduler, dist_init_required, collate_fn, config, "
                        "config_params, auto_values, process_group")
    if model is None:
        raise ValueError("infinity.initialize needs model=<the torch.nn.Module to train>")
    if mpu is not None:
        raise ValueError("infinity.initialize: model parallelism (mpu=...) is not supported; "
                         "infinity trains the whole model on each rank with ZeRO")
    refuse_an_adapter_without_values(model)
    source = _config_source(args, config, config_params)
    check_training_data(training_data, process_group=process_group)
    check_loader_batch_named(source, training_data)
    engine = Engine(model, model_parameters, source, lr_scheduler=lr_scheduler,
                    process_group=process_group, auto_values=auto_values, optimizer=optimizer)
    loader = None
    if training_data is not None:
        loader = training_loader(training_data, engine.config, collate_fn,
                                 rank=engine.ranks.rank, world_size=engine.ranks.world_size)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def refuse_an_adapter_without_values(model: Any) -> None:
    """A PEFT model over a base built under ``zero.Init``: PEFT builds its adapter, initialises
    it (lora_B zero) and moves it to the base layer's device, meta, where its values are gone;
    the model's own init would then draw them (lora_B std 0.02: step 0 is not the base). Refused,
    naming the way that keeps them (``from_pretrained(prepare_model=...)`` keeps the values of
    what PEFT moves to meta; see zero/materialize.py)."""
    from infinity.engine.model_methods import is_peft_model
    from infinity.zero.materialize import copied_from, valueless

    if not is_peft_model(model):
        return
    lost = [name for name, p in model.named_parameters()
            if p.requires_grad and copied_from(p) is p and valueless(p)]
    if lost:
        raise ValueError(
            f"the PEFT model's adapter has {len(lost)} parameter(s) on the meta device with no "
            f"value ({', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}): its base was built "
            "under infinity.zero.Init, and PEFT moved the adapter it had initialised to the "
            "base's meta device, which drops the values (LoRA would start from a random "
            "lora_B, not the base model). Load the base with infinity.from_pretrained(dir, "
            "config=..., prepare_model=lambda m: get_peft_model(m, lora_config)), which keeps "
            "them, or build the base outside zero.Init")


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = {name: value for name, value in (("config", config), ("config_params", config_params),
                                             ("args.deepspeed_config", from_args))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"infinity.initialize got the config {len(given)} times "
                         f"({', '.join(given)}): pass exactly one")
    return next(iter(given.values()), None)


def check_loader_batch_named(source: Any, dataset: Any) -> None:
    """``training_data`` with a config (a dict or a JSON file) that names no batch size: the
    loader gave batches of one sample without a word, where DeepSpeed refuses the config
    (the engine alone takes 1 for its planning, and goes on)."""
    if dataset is None:
        return
    raw = source
    if isinstance(source, (str, os.PathLike)):
        try:
            raw = json.loads(Path(source).read_text())
        except (OSError, ValueError):
            return                     # reading the config says what is wrong with it
    if isinstance(raw, Mapping) and all(raw.get(key) is None for key in
                                        ("train_batch_size", "train_micro_batch_size_per_gpu")):
        raise ValueError("initialize(training_data=...) with a config that names no batch size: "
                         "the loader would give batches of one sample. Set "
                         "train_micro_batch_size_per_gpu (or train_batch_size), as DeepSpeed "
                         "requires")


def check_training_data(dataset: Any, world_size: int | None = None,
                        process_group: Any = None) -> None:
    """Refuse ``training_data`` the engine cannot load, before the engine is built (at stage 3
    a refusal after it leaves the model without its weights). ``world_size`` None: the
    group's, or the launcher's (``WORLD_SIZE``) before the group exists."""
    if dataset is None:
        return
    if not isinstance(dataset, torch.utils.data.Dataset):
        raise TypeError("training_data must be a torch.utils.data.Dataset, got "
                        f"{type(dataset).__name__}")
    if world_size is None:
        world_size = (dist.get_world_size(process_group) if process_group is not None
                      else launched_world_size())
    if world_size > 1 and isinstance(dataset, torch.utils.data.IterableDataset):
        # torch's DistributedSampler (DeepSpeed's) cannot split a stream: every rank would
        # train on the same samples, the global batch N copies of one, without a word
        raise ValueError(
            f"training_data is an IterableDataset ({type(dataset).__name__}) at {world_size} "
            "ranks: it cannot be split into each rank's share, so every rank would train on "
            "the same samples. Yield each rank its own (e.g. every world_size-th sample from "
            "torch.distributed.get_rank(), each rank as many) and build the DataLoader "
            "yourself, or pass a map-style Dataset")


def training_loader(dataset: torch.utils.data.Dataset, config: InfinityConfig,
                    collate_fn: Callable | None = None, rank: int = 0,
                    world_size: int = 1) -> torch.utils.data.DataLoader:
    """The loader DeepSpeed returns for ``training_data``: micro-batches in random order
    (torch's global generator, so ``torch.manual_seed`` fixes it); with several ranks each
    rank's share of the samples, as DeepSpeed's DistributedSampler gives (call
    ``loader.sampler.set_epoch(epoch)`` each epoch for a new order; its seed is 0 on every
    rank, as DeepSpeed's, so the shares never overlap)."""
    check_training_data(dataset, world_size)
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if world_size > 1:
        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0,
            drop_last=config.dataloader_drop_last)
        return torch.utils.data.DataLoader(
            dataset, batch_size=config.train_micro_batch_size_per_gpu, sampler=sampler,
            collate_fn=collate_fn, drop_last=config.dataloader_drop_last)
    return torch.utils.data.DataLoader(
        dataset, batch_size=config.train_micro_batch_size_per_gpu,
        shuffle=False if iterable else True, collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``add_config_arguments``: ``--deepspeed`` and ``--deepspeed_config PATH`` (and
    the old ``--deepscale_config``), which ``initialize(args=...)`` reads."""
    group = parser.add_argument_group("infinity", "infinity (DeepSpeed-compatible) configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="accepted for DeepSpeed scripts; infinity is always on")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the ds_config.json to train with")
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
