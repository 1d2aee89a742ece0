"""Which of a Trainer's ``checkpoint-N`` directories a run can resume from.

Why: transformers' ``resume_from_checkpoint=True`` takes the newest ``checkpoint-N``
directory whatever it holds, and a run killed while saving one (a preempted job: the engine's
part of a save, the Adam states, is most of its time) left a directory without the engine's
state. The resume then failed with a message blaming ``save_only_model``, which the user never
set. transformers writes ``trainer_state.json`` after everything else of a save, and the
engine's own save leaves its staging directory until it commits (checkpoint/directory.py):
either tells a save that stopped part-way."""
from __future__ import annotations

import os
import re
from pathlib import Path

from infinity.base.log import get_logger
from infinity.checkpoint.directory import staging_dirs

__all__ = ["check_resumable", "last_whole_checkpoint"]

log = get_logger("integrations")

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")      # transformers' PREFIX_CHECKPOINT_DIR-<step>


def save_interrupted(checkpoint: str) -> bool:
    """Whether a save of the Trainer's ``checkpoint-N`` directory stopped part-way."""
    if staging_dirs(Path(checkpoint)):
        return True
    return _CHECKPOINT.fullmatch(Path(checkpoint).name) is not None and \
        not os.path.isfile(os.path.join(checkpoint, "trainer_state.json"))


def last_whole_checkpoint(output_dir: str) -> str:
    """The newest ``checkpoint-N`` of ``output_dir`` whose save finished, warning about newer
    ones that did not; ValueError where there is none (transformers' words). One that finished
    without the engine's state (saved with save_only_model) is taken as transformers takes it,
    and ``check_resumable`` says why it cannot be resumed: an older one would drop steps."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    found = sorted((int(m.group(1)), name) for name in names
                   if (m := _CHECKPOINT.fullmatch(name))
                   and os.path.isdir(os.path.join(output_dir, name)))
    unfinished = []
    for _, name in reversed(found):
        if not save_interrupted(os.path.join(output_dir, name)):
            if unfinished:
                log.warning("resume_from_checkpoint=True: %s did not finish saving (the run "
                            "stopped while saving): resuming from %s", ", ".join(unfinished),
                            name)
            return os.path.join(output_dir, name)
        unfinished.append(name)
    raise ValueError(f"No valid checkpoint found in output directory ({output_dir})"
                     + (f": {', '.join(unfinished)} did not finish saving" if unfinished
                        else ""))


def check_resumable(checkpoint: str) -> None:
    """Refuse a ``resume_from_checkpoint`` path the engine cannot go on from, saying why,
    before the engine is built."""
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"resume_from_checkpoint={checkpoint!r} does not exist (or is "
                                "not a directory)")
    if save_interrupted(checkpoint):
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint!r}: its save did not finish (the run stopped "
            "while saving it: no trainer_state.json, or the engine's checkpoint was being "
            "written). Resume from an earlier checkpoint (resume_from_checkpoint=True takes "
            "the newest whole one), or remove this directory")
    if not os.path.isfile(os.path.join(checkpoint, "latest")):
        weights_only = any(os.path.isfile(os.path.join(checkpoint, name))
                           for name in ("model.safetensors", "model.safetensors.index.json",
                                        "adapter_model.safetensors"))
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint!r} holds no infinity checkpoint ('latest')"
            + (": it holds the model's weights but no engine state (saved with "
               "save_only_model=True, or by transformers' own Trainer), so the run cannot go "
               "on from it as it stood. Resume from a checkpoint infinity's Trainer saved "
               "without save_only_model, or start a new run from these weights "
               "(infinity.from_pretrained, or the model loaded from them)"
               if weights_only else ": resume from a checkpoint this Trainer saved"))
