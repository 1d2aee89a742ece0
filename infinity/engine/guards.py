"""What an engine refuses because it cannot honour it, and the messages that say why and what
to do: ranks started differently, backwards the early step cannot take (a second one before
step(), another engine's reaching this one's parameters), and swap paths it cannot use (asked
ahead by ``infinity plan``). Kept out of ``engine.py``, which holds the training logic."""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

import torch

from infinity.base.log import get_logger
from infinity.comm.collectives import Collectives
from infinity.config import InfinityConfig
from infinity.storage.preflight import SwapPathError, check_swap_path

log = get_logger("engine")

FOREIGN_EARLY_BACKWARD = (
    "the backward of another engine (over {other}) reached this engine's parameters "
    "({this}), as a GAN's generator loss goes through its discriminator. Under the early step "
    "(infinity.early_step) this engine steps each unit as its gradients arrive, so it would "
    "take an optimizer step now that its own step() never asked for; nothing was stepped. Set "
    "infinity.early_step \"off\" for this engine (its gradients are then kept until its "
    "step() or dropped by its zero_grad(), as torch does), or keep them out of that loss "
    "(detach the input, or requires_grad_(False) on these parameters around the other step)")


def check_same_on_every_rank(comm: Collectives, config: InfinityConfig,
                             model: torch.nn.Module) -> None:
    """Ranks started with different configs or model structures would shard different layouts
    and pair unrelated collectives (garbage, or a hang): every rank compares its config and
    its parameters' and buffers' names, shapes and dtypes with rank 0's before anything is
    built (the buffers then take rank 0's values in one broadcast), and each
    raises naming the first difference. Swap paths may differ (each node its local NVMe)."""
    if not comm.active:
        return
    settings = config.to_dict()
    for section in ("offload_param", "offload_optimizer"):
        part = settings.get("zero_optimization", {}).get(section)
        if isinstance(part, dict):
            part.pop("nvme_path", None)
    mine = {"config": json.dumps(settings, sort_keys=True, default=str),
            "model": [(name, tuple(p.shape), str(p.dtype), p.requires_grad)
                      for name, p in model.named_parameters()],
            "buffers": [(name, tuple(b.shape), str(b.dtype) + (" on meta" if b.is_meta else ""))
                        for name, b in model.named_buffers()]}
    everyone = comm.all_gather_objects(mine)
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        raise RuntimeError(f"rank {rank} was started differently from rank 0: "
                           f"{_first_difference(everyone[0], theirs)}. Every rank must build "
                           "the same model and read the same config (launch one script with "
                           "one config on every rank)")


# [Note: a forward under grad trains]
# Whether a forward trains is read from grad mode alone, never from ``module.training``, as
# torch's autograd does: a model trained in eval mode (a ``from_pretrained`` model left in it,
# or eval chosen to turn dropout off) gets what any training forward gets -- its activations
# offloaded, weights read through ``.detach()`` watched against the early step, unfrozen
# parameters refused. Taking it for an evaluation trained differently from torch without a word
# (the early step changed a detached-read weight before its backward node read it: 1% off in
# four steps). An evaluation that forgot ``torch.no_grad()`` is then a training forward whose
# graph is dropped: it costs what it costs torch (its saved tensors), plus the Adam states read
# ahead for a backward that does not come, never a wrong value.


def step_settings(lrs: list[float], betas: list[tuple]) -> str:
    """The step's lr and betas as the ranks compare them (``check_same_sequence``): to 9
    significant digits, so that a last-bit difference between ranks computing one schedule
    (another libm, another vector path) is not a refusal, while an lr set on one rank is."""
    def digits(values) -> str:
        return ",".join(f"{float(v):.9g}" for v in values)
    return f"lr {digits(lrs)}, betas {';'.join(digits(b) for b in betas)}"


def _first_difference(a: dict, b: dict) -> str:
    if a["config"] != b["config"]:
        left, right = json.loads(a["config"]), json.loads(b["config"])
        for path, x, y in _walk(left, right, ""):
            return f"config key {path or '<root>'} is {x!r} on rank 0 and {y!r} there"
    for p0, p1 in zip(a["model"], b["model"]):
        if p0 != p1:
            return f"model parameter {_describe(p0)} on rank 0, {_describe(p1)} there"
    if len(a["model"]) != len(b["model"]):
        return f"the model has {len(a['model'])} parameters on rank 0 and {len(b['model'])} there"
    for b0, b1 in zip(a["buffers"], b["buffers"]):
        if b0 != b1:
            return (f"model buffer {b0[0]} of shape {b0[1]}, {b0[2]} on rank 0, "
                    f"{b1[0]} of shape {b1[1]}, {b1[2]} there")
    return f"the model has {len(a['buffers'])} buffers on rank 0 and {len(b['buffers'])} there"


def _describe(param: tuple) -> str:
    name, shape, dtype, requires_grad = param
    return (f"{name} of shape {tuple(shape)}, {dtype}"
            + ("" if requires_grad else ", frozen"))


def _walk(x: Any, y: Any, path: str):
    if isinstance(x, dict) and isinstance(y, dict):
        for key in sorted(set(x) | set(y)):
            yield from _walk(x.get(key), y.get(key), f"{path}.{key}" if path else key)
    elif x != y:
        yield path, x, y


SECOND_EARLY_BACKWARD = (
    "{call} was called twice without engine.step() in between: the early step "
    "(infinity.early_step) steps each unit during its backward, so a second backward would step "
    "it again instead of adding its gradients up. Call engine.step() after each backward (for "
    "several losses of one forward, backward their sum: engine.backward(l1 + l2)), set "
    "gradient_accumulation_steps to add micro-batches up, or set infinity.early_step \"off\"")


SPECULATIVE_SWAP_ROOM = (
    "{exc} (the speculative step keeps second copies of the NVMe parameters and Adam states, "
    "which doubles their room: infinity.speculative_step \"auto\" turns it off when the disk "
    "lacks the room, \"off\" always)")


ZERO_GRAD_UNDER_EARLY_STEP = (
    "zero_grad() between backward() and step() under the early step: each unit was already "
    "stepped during the backward, so its gradients cannot be discarded. Call zero_grad() before "
    "the backward (or after step()), or set infinity.early_step \"off\" to keep gradients until "
    "step()")


BACKWARD_AFTER_BOUNDARY_STEPS = (
    "{call} after the last micro-batch's backward and before engine.step(): with gradient "
    "accumulation and infinity.early_step \"auto\" or \"on\", that backward stepped each "
    "unit (see optim/boundary_steps.py), so another would step them again instead of adding "
    "its gradients up. Call engine.step() after every backward, as with DeepSpeed: step() "
    "counts the micro-batches and updates the weights at each gradient_accumulation_steps-th "
    "(two backwards a step() make each micro-batch two, and an update come every "
    "2 x gradient_accumulation_steps backwards). Only where one micro-batch really has "
    "several backwards (several losses of one batch) set infinity.early_step \"off\"")


FOREIGN_BOUNDARY_BACKWARD = (
    "the backward of another engine (over {other}) reached this engine's parameters ({this}) "
    "where this engine's next backward is the last micro-batch of its accumulation, whose "
    "backward steps each unit (infinity.early_step with gradient accumulation): it would take "
    "an optimizer step now that its own step() never asked for; nothing was stepped and the "
    "gradients collected so far are kept. Set infinity.early_step \"off\" for this engine, or "
    "keep its parameters out of that loss (detach the input, or requires_grad_(False) on them "
    "around the other step)")

# [Note: a boundary under the early step]
# With one micro-batch a step (gradient_accumulation_steps 1) and the early step (the default
# where the optimizer is offloaded, nothing clips and nothing checks fp16 overflow), each
# unit's Adam runs in the backward, as its gradients arrive: there is no gradient kept to add
# the next micro-batch's into. ``set_gradient_accumulation_boundary(False)`` there trained
# every micro-batch as a step of its own while ``global_steps`` and the scheduler counted one
# (0.04 off torch's weights after a three-batch cycle, no word): refused. Under accumulation
# the early step is the last micro-batch's alone (optim/boundary_steps.py) and any boundary
# the caller sets is followed.
NOT_A_BOUNDARY_UNDER_EARLY_STEP = (
    "set_gradient_accumulation_boundary(False) under the early step: with "
    "gradient_accumulation_steps 1 every backward steps each unit as its gradients arrive, so "
    "this micro-batch's gradients cannot wait for a later step. Set "
    "gradient_accumulation_steps to the cycle's length (set_gradient_accumulation_boundary "
    "still ends a cycle early), or infinity.early_step \"off\" to keep gradients until the "
    "boundary")

BOUNDARY_UNSET_AFTER_LAST_BACKWARD = (
    "set_gradient_accumulation_boundary({value}) between backward() and step(): that backward "
    "ran as the last micro-step of its cycle (its gradients were reduced, normed, and under "
    "the early step already stepped for it), so it cannot stop being the last now. Set it "
    "before the micro-batch's forward")

BOUNDARY_SET_AFTER_LAST_BACKWARD = (
    "step() at the end of an accumulation cycle whose last backward ran as not the last "
    "(set_gradient_accumulation_boundary(True) came after it): its gradients were not "
    "reduced and normed for a step, so none is taken; nothing was stepped. Set the boundary "
    "before the last micro-batch's forward (DeepSpeed's rule too), then backward and step()")

ZERO_GRAD_AFTER_BOUNDARY_STEPS = (
    "zero_grad() between the last micro-batch's backward and step(): that backward already "
    "stepped its units (infinity.early_step with gradient accumulation), so their gradients "
    "cannot be discarded. Call zero_grad() before the backward (or after step()), or set "
    "infinity.early_step \"off\" to keep gradients until step()")


def check_edit_before_step(early_step: bool, backwards_since_step: int, modifying: bool) -> None:
    """Raise when the weights are about to be changed (``GatheredParameters`` with a
    ``modifier_rank``, ``model.load_state_dict``) between a backward and step() under the
    early step: that backward already stepped each unit, so the change would land on the
    updated weights and the update would never apply to the changed ones (torch applies the
    step to the weights as they are at step())."""
    if modifying and early_step and backwards_since_step:
        raise RuntimeError(
            "changing the weights between a backward and step() under the early step "
            "(infinity.early_step): that backward already updated each unit, so the change "
            "would replace the update instead of being updated by it. Change them after "
            "step() or before the backward, or set infinity.early_step \"off\" to keep "
            "gradients until step()")


def check_cycle_discardable(micro_steps: int, accumulation: int) -> None:
    """Raise when zero_grad() would discard more than the backwards since the last step.

    [Note: what zero_grad discards]
    Under gradient accumulation each micro-batch's gradients are added into one sum per unit
    (on the host, or NVMe) as its backward runs; step() at the end of a micro-batch that does
    not end the cycle only counts it. So zero_grad() right after a step() has nothing of its
    own to discard and keeps the cycle (a torch loop's ``step(); zero_grad()`` after every
    micro-batch, under DeepSpeed's gradient_accumulation_steps, accumulates as DeepSpeed's ZeRO
    does: it discarded the earlier micro-batches, training each step on the last alone). After
    a backward, the sum holds that backward's gradients and the earlier micro-batches' alike:
    with earlier ones in the cycle they cannot be told apart, and it refuses rather than
    dropping them too; at the first micro-batch of a cycle it discards, as torch does."""
    if micro_steps % accumulation:
        raise RuntimeError(
            f"zero_grad() after a backward, in micro-batch {micro_steps % accumulation + 1} of "
            f"{accumulation} (gradient_accumulation_steps): the engine adds each micro-batch's "
            "gradients into one sum, so those of this backward cannot be discarded without the "
            "earlier micro-batches'. Call zero_grad() only right after step() or before the "
            "backward (the engine starts each cycle clean), or accumulate yourself with "
            "gradient_accumulation_steps 1 and one step() per cycle")


def schedule_label(optimizer: Any) -> str:
    """The optimizer's step schedule, as the engine's ready line names it."""
    if optimizer.early_step:
        return "early-step"
    if optimizer.boundary.enabled:
        return "deferred-step (the last micro-batch steps early)"
    return f"deferred-step (speculative {optimizer.speculation})"


def pass_hooks(engine: Any, training: bool) -> contextlib.ExitStack:
    """What a forward runs under: in training, the saved-tensor hooks (the activation swapper's,
    or those noting detached reads); at stage 3 with several ranks, the agreement that every
    rank runs this forward (each forward gathers: a forward one rank ran alone -- validation
    on rank 0 only, an evaluation batch more, a rank that caught its forward's error and went
    on -- paired its gathers with another rank's collectives, and gloo aborted the process on
    their sizes, "Received data size doesn't match expected size"). Agreed once, at the
    forward's first collective ([Note: calls every rank makes] in comm/watchdog.py)."""
    from infinity.zero.detached_reads import saved_tensor_hooks

    hooks = contextlib.ExitStack()
    if engine.stage == 3:
        hooks.enter_context(engine.comm.every_rank(
            "a training forward" if training else "an evaluation forward (no_grad)"))
    if training:
        hooks.enter_context(saved_tensor_hooks(engine.coordinator.detached_reads,
                                               engine.activation_swapper))
    return hooks


def check_pass_start(engine: Any) -> None:
    """Before a forward: the engine is open (``check_open``), and, for a forward under grad, no
    parameter frozen when it was built requires a gradient now. Which parameters train is
    fixed at ``initialize`` (their optimizer states, their place in the units' trainable
    ranges): one unfrozen later was silently never updated (torch would train it)."""
    check_open(engine, "forward")
    if not torch.is_grad_enabled():   # [Note: a forward under grad trains], eval mode too
        return
    unfrozen = [e.name for unit in engine.units for e in unit.params
                if e.frozen_at_build and e.param.requires_grad]
    if unfrozen:
        raise RuntimeError(
            f"{len(unfrozen)} parameter(s) frozen when the engine was built now require a "
            f"gradient ({', '.join(unfrozen[:3])}{' ...' if len(unfrozen) > 3 else ''}): the "
            "engine trains the parameters that required a gradient at initialize, and would "
            "leave these as they are. Unfreeze them before infinity.initialize (for a staged "
            "fine-tune: save_checkpoint, then build a new engine with them unfrozen and "
            "load_checkpoint(..., load_optimizer_states=False)), or freeze them again")


def check_open(engine: Any, what: str) -> None:
    """Raise when ``engine`` cannot take ``engine.<what>()`` now: it was closed, a load failed
    part-way (until a load completes), or an optimizer step failed (its states may be
    half-written)."""
    if getattr(engine, "_closed", False):
        raise RuntimeError(f"engine.{what}() after engine.close(): the engine's states and "
                           "swap files are gone; build a new engine with infinity.initialize")
    failure = getattr(engine, "_load_failure", None)
    if failure is not None and what not in ("load_checkpoint", "flush"):
        raise RuntimeError(
            f"engine.{what}(): a load_checkpoint failed part-way ({type(failure).__name__}: "
            f"{failure}), so some units hold the checkpoint's values and others this "
            "engine's: load_checkpoint again (this checkpoint or another) before going on") \
            from failure
    failure = engine.optimizer.step_failure
    if failure is not None:
        raise RuntimeError(
            f"engine.{what}(): an optimizer step failed earlier ({type(failure).__name__}: "
            f"{failure}), so some units' states may be half-written and this engine cannot "
            "go on. close() it, build a new engine with infinity.initialize and "
            "load_checkpoint the last checkpoint") from failure


def warn_if_hyperparameters_moved(engine: Any) -> list[dict]:
    """Under the early step the units were stepped during the backward, with the lr and betas
    of then: a change made between backward() and step() applies from the next step only
    (said once per engine). Returns each group's values this step uses (the backward's, where
    it stepped: the monitors logged the changed lr for a step that never used it)."""
    now = engine.optimizer.hyperparameters()     # checked: refused before any unit steps
    before, engine._hyper_at_backward = getattr(engine, "_hyper_at_backward", None), None
    if before is None or engine._warned_hyper_moved or before == now:
        return now if before is None else before
    engine._warned_hyper_moved = True
    log.warning("the optimizer's param groups (lr, betas, ...) changed between backward() and "
                "step(): under the early step each unit was stepped during the backward with "
                "the values of then; the change applies from the next step. Change them "
                "before the backward, or set infinity.early_step \"off\"")
    return before


def unusable_swap_paths(config: InfinityConfig) -> tuple[str, ...]:
    """The existing swap paths of ``config`` that the engine would refuse at ``initialize``
    (``storage.preflight.check_swap_path``: a directory on a disk, writable, O_DIRECT where the
    aio backend needs it), each as its refusal's message; a path that does not exist yet is
    left to the caller (``infinity plan`` notes it: ``infinity train`` does not create it).

    Why here: ``infinity plan`` reports a plan on such a path (tmpfs, a regular file) as not
    fitting, and asks the engine's layer, which applies storage's rule, instead of keeping a
    copy of which paths are checked and how."""
    problems = []
    sections = (config.zero.offload_param, config.zero.offload_optimizer)
    for path in dict.fromkeys(s.nvme_path for s in sections if s.device == "nvme" and s.nvme_path):
        if not Path(path).exists():
            continue
        try:
            check_swap_path(path, 0, direct_io=config.aio.backend != "mmap")
        except SwapPathError as exc:
            problems.append(str(exc))
    return tuple(problems)


def every_rank_call(label: str):
    """Decorate an engine method that gathers the whole model (a save, a load, a full state
    dict): every rank must call it, and its first collective waits until each has (raising,
    naming ``label``, when a rank went on without it: see [Note: calls every rank makes] in
    comm/watchdog.py). A call that issues no collective (a state dict at stages 1-2 with no
    step pending, where each rank holds every parameter) stays one rank's."""
    def decorate(method):
        @functools.wraps(method)
        def wrapped(self, *args: Any, **kwargs: Any) -> Any:
            return call_on_every_rank(self, label, method, self, *args, **kwargs)
        return wrapped
    return decorate


def call_on_every_rank(engine: Any, label: str, function, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, a call every rank makes (see ``every_rank_call``).
    ``label`` names what it does, the same whichever name the call came by (the model's or
    the engine's): ranks that called it by two names made the same call."""
    with engine.comm.every_rank(label):
        return function(*args, **kwargs)
