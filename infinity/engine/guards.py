"""What an engine refuses because it cannot honour it, and the messages that say why and what
to do: several ranks (each would train alone), and backwards the early step cannot take (a
second one before step(), another engine's reaching this one's parameters). Kept out of
``engine.py``, which holds the training logic."""
from __future__ import annotations

import os

import torch

FOREIGN_EARLY_BACKWARD = (
    "the backward of another engine (over {other}) reached this engine's parameters "
    "({this}), as a GAN's generator loss goes through its discriminator. Under the early step "
    "(infinity.early_step) this engine steps each unit as its gradients arrive, so it would "
    "take an optimizer step now that its own step() never asked for; nothing was stepped. Set "
    "infinity.early_step \"off\" for this engine (its gradients are then kept until its "
    "step() or dropped by its zero_grad(), as torch does), or keep them out of that loss "
    "(detach the input, or requires_grad_(False) on these parameters around the other step)")


def refuse_multiple_ranks() -> None:
    """One engine trains one rank's model alone: under a launcher with several ranks each would
    train its own copy, never averaging gradients, saving over the others' checkpoints and not
    noticing a rank that died. Refused before anything is built, until the collectives land."""
    world = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    elif os.environ.get("WORLD_SIZE", "1").strip().isdigit():
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if world is not None and world > 1:
        raise RuntimeError(
            f"{world} ranks (torch.distributed / WORLD_SIZE): infinity trains one process per "
            "model for now -- data parallelism over several ranks (gradient averaging, sharded "
            "states, per-rank checkpoints) is not implemented, and each rank would silently "
            "train its own copy. Run a single process (one GPU or CPU-only); ZeRO-Infinity's "
            "NVMe offload is what lets one process hold a model larger than memory")


SECOND_EARLY_BACKWARD = (
    "{call} was called twice without engine.step() in between: the early step "
    "(infinity.early_step) steps each unit during its backward, so a second backward would step "
    "it again instead of adding its gradients up. Call engine.step() after each backward, set "
    "gradient_accumulation_steps to add micro-batches up, or set infinity.early_step \"off\"")
