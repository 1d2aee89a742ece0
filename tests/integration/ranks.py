"""Shared helpers of the multi-rank tests: start N processes on localhost as torchrun would (each
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in its environment), run a worker script in
each, and read back what each rank wrote; and the plain-torch reference of a data-parallel run
(one process, the whole batch)."""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
# the rank workers of tests/distributed; this file stays beside the single-process helpers
# (parity.py, hf_common.py) that the workers import, and that a test here may launch with it
DISTRIBUTED = HERE.parent / "distributed"


def script_path(script: str) -> Path:
    """A worker script by name: next to this file, else in tests/distributed."""
    here = HERE / script
    return here if here.is_file() else DISTRIBUTED / script


def worker_pythonpath() -> str:
    """PYTHONPATH of a rank worker: tests/distributed, this directory, then the caller's."""
    return os.pathsep.join([str(DISTRIBUTED), str(HERE), os.environ.get("PYTHONPATH", "")])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, script: str, args: list[str], *, timeout: float = 600.0,
           env_extra: dict[str, str] | None = None, node_rank: int | None = None,
           nnodes: int = 1, port: int | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``script`` (a worker of tests/distributed, or a file next to this one) as
    ``world_size`` ranks; returns each rank's completed process (stdout, stderr, returncode), by
    rank. Torch threads: the cores shared among the local ranks."""
    procs = start(world_size, script, args, env_extra=env_extra, port=port)
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
            err += f"\n[rank {rank} killed after {timeout}s]"
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def start(world_size: int, script: str, args: list[str], *,
          env_extra: dict[str, str] | None = None, port: int | None = None
          ) -> list[subprocess.Popen]:
    """Start ``script`` as ``world_size`` ranks and return their processes, by rank (stdout
    and stderr piped, text)."""
    port = port or free_port()
    threads = max(1, (os.cpu_count() or 2) // world_size)
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(threads), PYTHONPATH=worker_pythonpath(),
                   # a rank that aborts (SIGABRT, SIGSEGV) prints every thread's Python stack
                   PYTHONFAULTHANDLER="1")
        env.update(env_extra or {})
        procs.append(subprocess.Popen([sys.executable, str(script_path(script)), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def check_ranks(results: list[subprocess.CompletedProcess]) -> None:
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} exited {r.returncode}:\n{r.stderr[-4000:]}"


def read_results(directory: Path, world_size: int) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(world_size)]


def mean_losses(per_rank: list[dict], case: str, steps: int) -> list[float]:
    """Case ``case``'s loss at each of ``steps`` steps as one process with the whole batch logs
    it: the mean of the ranks' losses (each rank had as many rows); a rank that logged fewer
    steps raises."""
    return [sum(r[case]["losses"][s] for r in per_rank) / len(per_rank) for s in range(steps)]


def reference_run(model: nn.Module, batches: list[list[torch.Tensor]], *, lr: float,
                  weight_decay: float, clip: float, skip_steps: frozenset[int] = frozenset(),
                  norms: list[float] | None = None,
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch AdamW on the whole batch: ``batches[step][micro]`` is the global micro-batch
    (all ranks' rows); each step averages its micro-batches' gradients (as accumulation does),
    clips to ``clip`` (0: off) and steps, except on ``skip_steps`` (an overflow every rank
    skips). Returns the losses per step (mean over micro-batches) and the final parameters;
    ``norms`` (a list) gets each step's global gradient norm."""
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=lr, weight_decay=weight_decay,
                            foreach=False)
    losses = []
    for step, micros in enumerate(batches):
        total = 0.0
        for x in micros:
            loss = reference(input_ids=x, labels=x)
            (loss / len(micros)).backward()
            total += loss.item()
        if norms is not None:
            norms.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad.double()) for p in reference.parameters()
                 if p.grad is not None]))))
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        if step not in skip_steps:
            opt.step()
        opt.zero_grad()
        losses.append(total / len(micros))
    return losses, {n: p.detach().clone() for n, p in reference.named_parameters()}
