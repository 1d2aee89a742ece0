"""Steps whose writes land late: stand-ins for the engine's stepper (the coordinator's
``UnitStepper``, zero/protocols.py) that hand out finished steps later than the real ``reap``
would, as a slow or loaded disk does, to check that no unit is released while something still
reads it (see [Note: release during backward] in zero/coordinator.py).

Both keep the one rule of the real ``reap``: a unit is handed out only while no step of it is
pending (a unit held back and stepped again waits for that step too). Used by
tests/integration/test_stage3_features.py (a fixed schedule, and a short random one) and by
tools/landing_fuzz.py (the long random one, over model families and configs).
"""
from __future__ import annotations

import random
from typing import Any

import torch

from parity import VOCAB, make_model


def _pending_units(inner: Any) -> set[int]:
    return {id(job.state.unit) for job in inner.steps.jobs}


def _without(units: list, taken: list) -> list:
    return [u for u in units if not any(u is t for t in taken)]


class StepLandsLate:
    """Unit ``index`` looks held by a step from each forward fetch until the second poll
    (``reap`` without waiting) of the backward that follows, where it lands (its job waited
    for): the deferred step its forward fetch ran, its writes landing late. Waits
    (``Wait.ONE``/``ALL``) and ``drain`` hand it out."""

    def __init__(self, engine: Any, index: int) -> None:
        self.coordinator, self.inner = engine.coordinator, engine.coordinator.stepper
        self.index = index
        self.held: list = []
        self.polls_in_backward = 0
        self.handed_out_in_backward = 0
        engine.coordinator.stepper = self

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def step_fetched(self, unit) -> bool:
        from infinity.zero.pass_state import PassPhase

        stepped = self.inner.step_fetched(unit)
        if unit.index == self.index and self.coordinator._phase is PassPhase.TRAIN_FORWARD:
            if not any(unit is u for u in self.held):
                self.held.append(unit)
            return True
        return stepped

    def _hand_out(self, landed: list) -> list:
        pending = _pending_units(self.inner)
        out = _without(landed, self.held) + [u for u in self.held if id(u) not in pending]
        self.held = [u for u in self.held if id(u) in pending]
        return out

    def reap(self, wait=None) -> list:
        from infinity.zero.pass_state import PassPhase
        from infinity.zero.protocols import Wait

        wait = Wait.NONE if wait is None else wait
        landed = self.inner.reap(wait)
        if wait is not Wait.NONE:
            return self._hand_out(landed)
        if self.coordinator._phase is not PassPhase.BACKWARD:
            self.polls_in_backward = 0
            return _without(landed, self.held)
        self.polls_in_backward += 1
        if self.polls_in_backward < 2:
            return _without(landed, self.held)
        held_before = len(self.held)
        if self.held:
            # the held steps land now, whatever the machine's load: their background jobs are
            # waited for here (a loaded machine had one still running at this poll now and
            # then, and the landing moved to a later call: no longer the case tested)
            landed = landed + _without(self.inner.reap(Wait.ALL), landed)
        out = self._hand_out(landed)
        self.handed_out_in_backward += held_before - len(self.held)
        return out

    def drain(self) -> list:
        return self._hand_out(self.inner.drain())


class RandomLandings:
    """Each poll (``reap`` without waiting) hands out each finished step with probability
    ``p`` (seeded), holding the others back for a later call; waits and ``drain`` hand out
    everything finished."""

    def __init__(self, engine: Any, seed: int, p: float = 0.3) -> None:
        self.inner = engine.coordinator.stepper
        self.rng, self.p = random.Random(seed), p
        self.held: list = []
        self.handed_out_late = 0
        engine.coordinator.stepper = self

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _finished(self, landed: list) -> tuple[list, set[int]]:
        pending, pool = _pending_units(self.inner), []
        for unit in self.held + landed:
            if not any(unit is u for u in pool):
                pool.append(unit)
        return pool, pending

    def reap(self, wait=None) -> list:
        from infinity.zero.protocols import Wait

        wait = Wait.NONE if wait is None else wait
        was_held = list(self.held)
        pool, pending = self._finished(self.inner.reap(wait))
        if wait is Wait.NONE:
            out = [u for u in pool if id(u) not in pending and self.rng.random() < self.p]
        else:
            out = [u for u in pool if id(u) not in pending]
        self.held = _without(pool, out)
        self.handed_out_late += sum(1 for u in out if any(u is h for h in was_held))
        return out

    def drain(self) -> list:
        pool, _ = self._finished(self.inner.drain())
        self.held = []
        return pool


FAMILIES = ("llama", "gpt2", "torch", "llama_tied", "albert", "bert", "t5")


def build_family(family: str, seed: int = 0) -> torch.nn.Module:
    """A small random model of ``family`` (VOCAB tokens): the parity families, a Llama with
    tied embeddings, and three whose heads or blocks share weights in other ways (ALBERT's
    one layer at every depth and tied decoder, BERT's tied decoder, T5's encoder-decoder)."""
    import warnings

    import transformers as T

    warnings.filterwarnings("ignore")
    if family in ("llama", "gpt2", "torch"):
        return make_model(family, layers=2, width=64, seed=seed)
    torch.manual_seed(seed)
    if family == "llama_tied":
        return T.LlamaForCausalLM(T.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, vocab_size=VOCAB,
            tie_word_embeddings=True, pad_token_id=0))
    if family == "albert":
        return T.AlbertForMaskedLM(T.AlbertConfig(
            vocab_size=VOCAB, embedding_size=32, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
            pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0))
    if family == "bert":
        return T.BertForMaskedLM(T.BertConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if family == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def stage3_config(model: torch.nn.Module, tier: str, disk_dir: str, reuse: int | None,
                  device_share: float | None, **infinity_section) -> dict:
    """Stage 3 with params and optimizer on ``tier``, every parameter in a unit (no persistence
    threshold); ``reuse``: stage3_max_reuse_distance (None: the default), ``device_share``: a
    device budget of that share of ``model``'s fp32 bytes (None: unlimited)."""
    from parity import zero_config

    if device_share is not None:
        infinity_section["device_memory_budget"] = int(
            sum(p.numel() * 4 for p in model.parameters()) * device_share)
    ds = zero_config(3, tier, tier, disk_dir, **infinity_section)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if reuse is not None:
        ds["zero_optimization"]["stage3_max_reuse_distance"] = reuse
    return ds


def run_case(family: str, tier: str, disk_dir: str, seed: int, reuse: int | None = None,
             device_share: float | None = None, clip: float = 0.0, p: float = 0.3,
             steps: int = 4, engines: list | None = None) -> tuple[float, int]:
    """Train ``family`` at stage 3 with params and optimizer on ``tier`` under
    ``RandomLandings(seed, p)`` beside torch AdamW; ``reuse``: stage3_max_reuse_distance (None:
    the default), ``device_share``: a device budget of that share of the parameters' bytes
    (None: unlimited), ``clip``: gradient_clipping; ``engines``: the engine is appended to it
    (to read its counters after the run). Returns the worst relative loss difference and how
    many landings were handed out late."""
    from parity import run_parity

    model = build_family(family)
    ds = stage3_config(model, tier, disk_dir, reuse, device_share)
    landings: list[RandomLandings] = []

    def prepare(engine) -> None:
        landings.append(RandomLandings(engine, seed, p))
        if engines is not None:
            engines.append(engine)
    result = run_parity(model, ds, steps=steps, clip=clip, prepare=prepare)
    return result.worst_relative, landings[0].handed_out_late


def run_deferred_bf16(family: str, tier: str, disk_dir: str, late_seed: int | None,
                      reuse: int | None = None, device_share: float | None = None,
                      clip: float = 0.0, steps: int = 3,
                      early_step: str = "off") -> tuple[list[float], int, int, int, int]:
    """Train ``family`` at stage 3 with params and optimizer on ``tier`` in bf16 with an fp32
    master, the deferred schedule, 2 micro-batches a step (``reuse``, ``device_share``,
    ``clip`` as in ``run_case``), with late copies seeded ``late_seed`` (None: the immediate
    ones); ``early_step`` "auto": the last micro-batch steps the units whose gradients are in
    host memory (optim/boundary_steps.py). The GPU's other paths must be set by the caller.
    Returns the losses, the steps
    started ahead of their unit's use (zero/steps_ahead.py), the late copies' poisoned and
    lost buffers, and the steps' device-copy writes that overtook the copy filling their
    memory (storage/transfers.py ``write_device``; all 0 with immediate copies)."""
    import os

    from infinity.storage import transfers
    from parity import run_parity

    if late_seed is None:
        os.environ.pop(transfers.LATE_ENV, None)
    else:
        os.environ[transfers.LATE_ENV] = str(late_seed)
    model = build_family(family)
    ds = stage3_config(model, tier, disk_dir, reuse, device_share, compute_dtype="bf16",
                       early_step=early_step)
    try:
        result = run_parity(model, ds, steps=steps, accumulation=2, clip=clip, lr=1e-2)
    finally:
        os.environ.pop(transfers.LATE_ENV, None)
    copies = result.engine.manager.copies
    return (result.losses, result.engine.coordinator.fetch_stats["steps_ahead"],
            getattr(copies, "poisoned", 0), getattr(copies, "lost", 0),
            getattr(copies, "overtaking", 0))
