"""Checkpoints of an ``infinity train`` run: ``--save-dir``, ``--save-interval``, ``--resume``.

Why a module: a resumed run must be the run that was not interrupted, so the checkpoint
carries, beside the engine's states, where the batch sampler stood and what it sampled from
(seed, data, sequence length, micro-batch): a resume with other data or another seed is refused
instead of silently training on a different sequence of batches.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infinity.checkpoint.directory import LATEST, available_tags
from infinity.checkpoint.writer_lock import SaveDirBusyError, SaveLock
from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes
from infinity.storage.preflight import free_bytes
from infinity.train.data import BatchSampler

_log = get_logger("train")
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class RunCheckpoints:
    """Where and how often a run saves, and whether it resumes."""

    save_dir: Path | None
    interval: int | None
    resume: bool
    schedule: Any = None
    """The run's LR schedule section (``infinity train`` sizes it by --steps): saved with each
    checkpoint, and a resume under another one is told that it does not continue the run."""

    @classmethod
    def from_options(cls, save_dir: str | None, interval: int | None, resume: bool,
                     engine_kind: str, schedule: Any = None) -> "RunCheckpoints":
        """Checked before anything is built: a bad flag fails in a moment."""
        if (interval is not None or resume) and save_dir is None:
            raise ValueError("--save-interval and --resume need --save-dir (where checkpoints "
                             "are written and read)")
        if interval is not None and interval < 1:
            raise ValueError(f"--save-interval must be at least 1, got {interval}")
        if save_dir is not None and engine_kind != "infinity":
            raise ValueError("--save-dir needs --engine infinity (the torch baseline does not "
                             "save checkpoints)")
        path = None if save_dir is None else Path(save_dir)
        if path is not None:
            existing = next((p for p in (path, *path.parents) if p.exists()), None)
            if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
                raise ValueError(f"--save-dir {path}: {existing} is not a writable directory; "
                                 "choose another path")
        return cls(path, interval, resume, schedule)

    def check_room(self, n_params: int) -> None:
        """A checkpoint holds 12 bytes a parameter (fp32 weight and two Adam moments): a disk
        without room for one fails the run at its first save, after the training."""
        if self.save_dir is None:
            return
        existing = next(p for p in (self.save_dir, *self.save_dir.parents) if p.exists())
        need = CHECKPOINT_BYTES_PER_PARAM * n_params
        free = free_bytes(existing)
        if free < need:
            raise ValueError(f"--save-dir {self.save_dir}: a checkpoint of this model needs about "
                             f"{format_bytes(need)}, and {existing} has {format_bytes(free)} free; "
                             "choose a larger disk or free some space")

    def check_lock(self) -> None:
        """Rank 0, before training: the save lock is free, or its owner dead (a writer killed
        on another host left one no flock here can judge, and the first save refused it, a
        --save-interval of training later)."""
        if self.save_dir is None or not self.save_dir.is_dir():
            return
        try:
            with SaveLock.acquire(self.save_dir):
                pass
        except SaveDirBusyError as exc:
            raise ValueError(f"--save-dir {self.save_dir}: {exc}") from None

    def resume_into(self, engine: Any, sampler: BatchSampler, identity: dict[str, Any],
                    last_step: int, data_path: str = "") -> int:
        """Load the latest checkpoint (with --resume) and move the sampler on; returns the
        optimizer steps already taken (0 when starting fresh)."""
        if not self.resume:
            return 0
        tags = available_tags(self.save_dir)
        if not tags and not (self.save_dir / LATEST).exists():
            # a first run with --resume (the engine's load would warn, naming its API's tag=)
            _log.info("--resume: no checkpoint in %s yet; starting from step 1", self.save_dir)
            return 0
        path, client = engine.load_checkpoint(self.save_dir)
        if path is None:
            raise ValueError(f"--resume: {self.save_dir} has checkpoints ({', '.join(tags)}) "
                             "but no 'latest' file naming one: write the tag to resume from "
                             f"into {self.save_dir / LATEST}, or use another --save-dir")
        drawn = client.get("batches_drawn") if isinstance(client, dict) else None
        if not isinstance(drawn, int) or isinstance(drawn, bool) or drawn < 0:
            raise ValueError(f"--resume: checkpoint {path} does not say where the batch sampler "
                             f"stood (client_state {client!r}): it was not saved by infinity "
                             "train; use another --save-dir")
        saved = {k: client.get(k) for k in identity}
        if saved.get("data_sha256") is None and "data" in client and "data_sha256" in identity:
            # saved before the data was kept by its digest: by its path then, as it was
            saved["data_sha256"] = identity["data_sha256"] if client["data"] == data_path \
                else client["data"]
        if saved != identity:
            differing = {k: (saved[k], identity[k]) for k in identity if saved[k] != identity[k]}
            raise ValueError(f"--resume: checkpoint {path} was taken from another run "
                             f"(saved, now: {differing}); use the same data, seed, --seq-len "
                             "and micro-batch, or another --save-dir")
        if engine.global_steps > last_step:
            raise ValueError(f"--resume: checkpoint {path} is at step {engine.global_steps} and "
                             f"--steps is {last_step}: it went further; raise --steps")
        if engine.global_steps == last_step:
            # a run killed after its last save (in its export): the same command line, requeued,
            # does what was left (it exited 2, and the export never came)
            _log.info("--resume: checkpoint %s is at step %d, the last: nothing is left to "
                      "train; finishing the run", path, last_step)
            return last_step
        if "schedule" in client and client["schedule"] != self.schedule:
            _log.warning(
                "--resume: checkpoint %s was saved by a run whose learning-rate schedule was %s; "
                "this run's is %s (infinity train sizes it by --steps): the steps from %d on "
                "follow the new one, so they are not the interrupted run's. Resume with that "
                "run's --steps to continue it exactly", path, json.dumps(client["schedule"]),
                json.dumps(self.schedule), engine.global_steps + 1)
        sampler.skip(drawn)
        _log.info("resumed from %s at step %d", path, engine.global_steps)
        return engine.global_steps

    def after_step(self, engine: Any, step: int, last_step: int, sampler: BatchSampler,
                   identity: dict[str, Any]) -> None:
        """Save at every ``interval``-th step and after the last one."""
        if self.save_dir is None:
            return
        if step == last_step or (self.interval is not None and step % self.interval == 0):
            engine.save_checkpoint(self.save_dir,
                                   client_state={**identity, "batches_drawn": sampler.drawn,
                                                 "schedule": self.schedule})
