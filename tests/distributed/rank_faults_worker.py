"""One rank of the fault tests (started by tests/integration/ranks.py ``start``/``launch``):
trains TinyLM at stage 3 with a short ``infinity.collective_timeout``, and on the victim rank
injects the fault at step 2, in the forward of the middle block:

- ``kill``: SIGKILL itself (after writing the time to ``killed_at``);
- ``raise``: raise a RuntimeError out of the forward (the script ends with it);
- ``raise-and-hang``: raise it, catch it, and sit idle (alive, never joining a collective);
- ``alone``: the victim calls ``engine.save_checkpoint`` at step 2 while the others go on (the
  habit ``if rank == 0: save``): refused on the victim naming the call, before anything is
  written, and the others' next collective fails naming the victim's error;
- ``skip-step``: the victim skips ``engine.step()`` at step 2 (a rank whose loop went
  another way): the step's agreement refuses on the others naming it, not a gloo abort;
- ``lone-gather``: the victim reads a weight under ``GatheredParameters`` at step 2 alone (it
  paired with the others' training gather and read another unit's values): refused likewise;
- ``lone-eval``: the victim runs an evaluation forward at step 2 alone (validation on rank 0
  only): its gathers paired with the others' training ones, a gloo abort on their sizes;
  refused on every rank naming both forwards;
- ``lr-apart``: the victim sets its lr by hand at step 2: the step refuses on every rank;
- ``differ``: no training; initialize twice with a config (lr) and then a model (width) that
  differ on the victim, writing each refusal's message to ``rank<r>.json``, then once alike.

argv: mode out_dir nvme_dir timeout_s victim
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import infinity
from parity import VOCAB, make_model

MICRO, SEQ, STEPS = 2, 16, 6


def config(nvme_dir: str, timeout_s: float, lr: float = 1e-3) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO,
            "zero_optimization": {"stage": 3,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir},
                                  "offload_param": {"device": "nvme", "nvme_path": nvme_dir}},
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "infinity": {"collective_timeout": timeout_s, "compute_dtype": "fp32"}}


def train(mode: str, out: Path, nvme_dir: str, timeout_s: float, rank: int, victim: int) -> None:
    model = make_model("torch", seed=0, layers=3, width=32)
    step = 0

    def fault(module, inputs):
        if rank != victim or step != 2 or mode not in ("kill", "raise", "raise-and-hang"):
            return
        if mode == "kill":
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure in rank {rank}'s forward")

    model.blocks[1].register_forward_pre_hook(fault)
    engine, *_ = infinity.initialize(model=model, config=config(nvme_dir, timeout_s))
    gen = torch.Generator().manual_seed(1 + rank)
    for step in range(STEPS):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        odd = rank == victim and step == 2
        if mode == "alone" and odd:
            engine.save_checkpoint(out / "ckpt")
        if mode == "lone-gather" and odd:
            with infinity.zero.GatheredParameters([model.blocks[1].up.weight]):
                print("norm", model.blocks[1].up.weight.norm().item(), flush=True)
        if mode == "lone-eval" and odd:      # validation on one rank only
            with torch.no_grad():
                engine(input_ids=x, labels=x)
        if mode == "lr-apart" and odd:
            engine.optimizer.param_groups[0]["lr"] = 2e-3
        try:
            loss = engine(input_ids=x, labels=x)
        except RuntimeError:
            if mode != "raise-and-hang" or rank != victim:
                raise
            (out / "raised_at").write_text(repr(time.time()))
            time.sleep(600)    # alive, never in a collective: the test kills it
        engine.backward(loss)
        if not (mode == "skip-step" and odd):
            engine.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    engine.close()


def differ(out: Path, nvme_dir: str, timeout_s: float, rank: int, victim: int) -> None:
    refusals = {}
    odd = rank == victim
    for case, width, lr in (("config", 32, 2e-3 if odd else 1e-3),
                            ("model", 48 if odd else 32, 1e-3), ("buffer", 32, 1e-3),
                            ("alike", 32, 1e-3)):
        model = make_model("torch", seed=0, layers=2, width=width)
        if case == "buffer":      # the buffers' broadcast would pair different sizes
            model.register_buffer("stats", torch.zeros(3 if odd else 2))
        try:
            engine, *_ = infinity.initialize(model=model, config=config(nvme_dir, timeout_s, lr))
        except RuntimeError as exc:
            refusals[case] = str(exc)
        else:
            engine.close()
            refusals[case] = None
    (out / f"rank{rank}.json").write_text(json.dumps(refusals))


def main() -> None:
    mode, out, nvme_dir, timeout_s, victim = sys.argv[1], Path(sys.argv[2]), sys.argv[3], \
        float(sys.argv[4]), int(sys.argv[5])
    infinity.init_distributed()     # the default timeout: the config's must apply anyway
    import torch.distributed as dist
    rank = dist.get_rank()
    if mode == "differ":
        differ(out, nvme_dir, timeout_s, rank, victim)
    else:
        train(mode, out, nvme_dir, timeout_s, rank, victim)


if __name__ == "__main__":
    main()
