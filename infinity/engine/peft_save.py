"""``engine.save_pretrained(dir)`` on a PEFT model: its adapters, as ``PeftModel.save_pretrained``
writes them (``adapter_config.json`` and ``adapter_model.safetensors`` under PEFT's names, the
adapter named "default" at the top, each other adapter in a directory of its name), which
``PeftModel.from_pretrained`` / ``load_adapter`` load over the base. Never the wrapper's whole
state under its internal names (transformers loaded that as a model with its weights missing,
and said nothing).

The adapters' parameters are gathered a unit at a time (the frozen base is not read): the
trainable ones and every adapter's own (an added adapter that is not trained is frozen, and
PEFT saves it all the same, from the state it is given). PEFT writes into a hidden staging
directory beside them, and each of its files is renamed to the same place under the directory,
under the directory's save lock (a README of the user's is kept; PEFT's model card is added
only where there is none)."""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infinity.base.log import get_logger

if TYPE_CHECKING:
    from infinity.engine.engine import Engine

log = get_logger("engine")

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
STAGING_PREFIX = ".infinity-adapter-"
CARD = "README.md"


def adapter_parameter_names(model: torch.nn.Module) -> set[str]:
    """The parameters an adapter save reads: the trainable ones, and those of each adapter in
    ``model.peft_config``: PEFT keeps an adapter's modules and parameters in dicts keyed by its
    name (``lora_A[<adapter>]``, ``ia3_l[<adapter>]``, ``modules_to_save[<adapter>]``,
    ``prompt_encoder[<adapter>]``), so those entries' parameters (a name alone would also match
    a base module of the adapter's name: "model")."""
    adapters = set(getattr(model, "peft_config", {}) or {})
    prefixes = [f"{name}.{key}." if name else f"{key}."
                for name, module in model.named_modules()
                if isinstance(module, (torch.nn.ModuleDict, torch.nn.ParameterDict))
                for key in module.keys() if key in adapters]
    # every name of a tied parameter (ensure_weight_tying's alias of a modules_to_save copy):
    # PEFT's save looks each up (KeyError 'modules_to_save.default.weight')
    return {name for name, param in model.named_parameters(remove_duplicate=False)
            if param.requires_grad or any(f"{name}.".startswith(p) for p in prefixes)}


def embeddings_peft_saves(model: torch.nn.Module) -> set[str]:
    """The embedding weights PEFT's save adds to an adapter (``save_embedding_layers="auto"``:
    an embedding among the target modules, or a vocabulary resized since the base model): PEFT
    picks them from the state it is given, and the adapter save gave it the adapters' alone, so
    a resized vocabulary's new rows were silently left out (the adapter loaded over the base
    then met embeddings without them). Asked of PEFT's own selection, over stand-ins of every
    parameter; frozen, so never among ``adapter_parameter_names``."""
    try:
        from peft.utils import get_peft_model_state_dict
    except ImportError:
        return set()
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    probe = {name: torch.empty(0, device="meta") for name in names}
    picked: set[str] = set()
    with warnings.catch_warnings():     # PEFT says why when it saves them for real
        warnings.simplefilter("ignore")
        for adapter in getattr(model, "peft_config", {}) or {}:
            picked |= set(get_peft_model_state_dict(model, state_dict=probe, adapter_name=adapter,
                                                    save_embedding_layers="auto"))
    embeddings = {name for name in picked & names
                  if not model.get_parameter(name).requires_grad}
    if embeddings:
        log.info("the adapter save includes the embedding weights PEFT saves with it: %s",
                 sorted(embeddings))
    return embeddings


def save_adapter(engine: "Engine", directory: Path) -> Path:
    """Every rank calls it; rank 0 writes (see the module's docstring)."""
    from infinity.checkpoint.pretrained_write import trainable_masters
    from infinity.checkpoint.weights_dir import fsync_dir
    from infinity.engine.checkpointing import training_state
    from infinity.checkpoint.writer_lock import SaveLock
    from infinity.engine.model_methods import parts_as_torch_gives_them
    from infinity.zero.init import GatheredParameters

    model = engine.module
    wanted = adapter_parameter_names(model) | embeddings_peft_saves(model)
    names: dict[int, list[str]] = {}        # a tied parameter under each of its names
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in wanted:
            names.setdefault(id(p), []).append(name)
    # the trainable ones from their fp32 masters under 16-bit compute, as PEFT keeps and saves
    # adapters in fp32 on a bf16 base (the compute copies wrote them rounded, 1e-3 off)
    masters = trainable_masters(training_state(engine), set(names), "save_pretrained")
    state: dict[str, torch.Tensor] = {}
    for unit in engine.units:          # one unit fetched at a time
        params = [e.param for e in unit.params if id(e.param) in names]
        if not params:
            continue
        with GatheredParameters(params):
            for param in params:
                value = masters.get(id(param))
                value = param.detach().to("cpu", copy=True) if value is None else value
                for name in names[id(param)]:
                    state[name] = value
    # a prompt-learning adapter's saved tensor is its prompt encoder's output, which PEFT's
    # save computes by a forward: at stage 3 that forward gathers, so every rank runs it here
    # (on rank 0 alone it waited for the others: a hang or a gloo abort)
    prompts = {adapter: model.get_prompt_embedding_to_save(adapter)
               for adapter, config in (getattr(model, "peft_config", {}) or {}).items()
               if getattr(config, "is_prompt_learning", False) and not config.inference_mode}
    for adapter, prompt in prompts.items():
        # prompt tuning's saved tensor is its embedding's weight row by row (PEFT's forward of
        # the prompt tokens, 0..n-1): its fp32 master where there is one, as for the others
        encoders = getattr(model, "prompt_encoder", None)
        encoder = encoders[adapter] if encoders is not None and adapter in encoders else None
        embedding = getattr(encoder, "embedding", None)
        master = masters.get(id(getattr(embedding, "weight", None)))
        if master is not None and master.shape == prompt.shape and \
                str(getattr(model.peft_config[adapter], "peft_type", "")).endswith("PROMPT_TUNING"):
            prompts[adapter] = master
    if not any(model.get_parameter(n).requires_grad for n in state):
        raise ValueError("save_pretrained on a PEFT model with no trainable parameters: there "
                         "is no adapter to save")
    if engine.ranks.rank != 0:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with SaveLock.acquire(directory):
        _remove_stale_staging(directory)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
        try:
            if prompts:
                model.get_prompt_embedding_to_save = prompts.__getitem__
            try:
                with parts_as_torch_gives_them(engine):     # rank 0 alone: nothing gathered
                    type(model).save_pretrained(model, str(staging), state_dict=state,
                                                safe_serialization=True, is_main_process=True)
            finally:
                model.__dict__.pop("get_prompt_embedding_to_save", None)
            moves = _files_to_carry(staging, directory)
            for source, _ in moves:
                with open(source, "rb") as f:
                    os.fsync(f.fileno())
            # the weights first: a config names them
            for source, target in sorted(moves, key=lambda m: m[0].name != ADAPTER_FILES[0]):
                target.parent.mkdir(exist_ok=True)
                os.replace(source, target)
            for parent in {target.parent for _, target in moves} | {directory}:
                fsync_dir(parent)       # the directory too: it holds the adapters' new ones
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("saved the PEFT adapters %s (%d tensors) to %s",
             sorted(getattr(model, "peft_config", {}) or {}), len(state), directory)
    return directory


def _files_to_carry(staging: Path, directory: Path) -> list[tuple[Path, Path]]:
    """(PEFT's file, where it goes) for each adapter PEFT wrote: the top level's, and each
    adapter directory's (``staging/<adapter>/``); its model card only where the directory has
    none."""
    moves: list[tuple[Path, Path]] = []
    for folder in [staging, *sorted(p for p in staging.iterdir() if p.is_dir())]:
        relative = folder.relative_to(staging)
        have = [name for name in ADAPTER_FILES if (folder / name).is_file()]
        if not have:
            continue
        if len(have) < len(ADAPTER_FILES):
            raise RuntimeError(f"PeftModel.save_pretrained wrote {have} in {relative or '.'} "
                               f"without {sorted(set(ADAPTER_FILES) - set(have))}: this PEFT "
                               "version saves otherwise; save with model.save_pretrained")
        moves += [(folder / name, directory / relative / name) for name in ADAPTER_FILES]
        if (folder / CARD).is_file() and not (directory / relative / CARD).exists():
            moves.append((folder / CARD, directory / relative / CARD))
    if not moves:
        written = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
        raise RuntimeError(f"PeftModel.save_pretrained wrote no {', '.join(ADAPTER_FILES)} (it "
                           f"wrote {written}): this PEFT version saves otherwise; save with "
                           "model.save_pretrained")
    return moves


def _remove_stale_staging(directory: Path) -> None:
    """A killed save's staging directories, removed only where they hold nothing but what PEFT
    writes (the adapter files and a model card, at the top or in an adapter's directory); any
    other file there is not this engine's, and the directory is left as it is, with a warning."""
    for stale in directory.glob(STAGING_PREFIX + "*"):
        if stale.is_symlink() or not stale.is_dir():
            continue
        ours = {*ADAPTER_FILES, CARD}
        entries = list(stale.rglob("*"))
        foreign = [p for p in entries if p.is_symlink()
                   or (p.is_file() and p.name not in ours)
                   or (p.is_dir() and p.parent != stale)]
        if foreign:
            log.warning("left %s as it is: it holds %s, which an adapter save does not write",
                        stale, foreign[0])
            continue
        for path in sorted(entries, key=lambda p: len(p.parts), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        stale.rmdir()
