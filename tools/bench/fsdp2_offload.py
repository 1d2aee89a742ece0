#!/usr/bin/env python3
"""PyTorch FSDP2 with CPU offload on the bench model: the reference gpu_profile.py sets beside
the engine's "overlap" setup on a GPU (FSDP2 is one of the two systems this project measures
itself against; DeepSpeed is not in the device machine's image).

Run (from the repository root; one rank, its own process: it sets up torch.distributed):
    python3 tools/bench/fsdp2_offload.py --size 0.49B --mbs 4 --seq 1024 --json
    python3 tools/bench/fsdp2_offload.py --size tiny --mbs 1 --seq 64 --steps 1   # CPU smoke

What runs: the same transformers Llama as tools/bench (``_common.llama_config``), built on the
host in fp32; ``fully_shard`` on each decoder layer and on the whole model, with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and, on a GPU,
``CPUOffloadPolicy(pin_memory=True)``: parameters, gradients and the optimizer state live on the
host, each layer's parameters are copied to the GPU for its forward and backward, and
``torch.optim.AdamW(fused=True)`` (lr 1e-4, weight decay 0.01, as the engine's setups) steps on
the CPU. Fused, because on CPU parameters torch's default AdamW falls back to a loop over the
parameters, ~11x slower than the fused kernel on a 116M model on 2 cores: an unfair reference
against the engine's vectorized CPU Adam.
That is FSDP2's ZeRO-Offload (stage 3, parameters and optimizer on the CPU). On a CPU device
(a smoke run) there is nothing to offload to: the policy is left out and the model trains in
place. Steps are timed as gpu_profile.py times the engine's: the device synchronized at each
step's end, the median of the steps after ``--warmup``.
Prints one line ``fsdp2 median X s ...``; ``--json`` prints the figures as one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size: str, mbs: int, seq: int, warmup: int, steps: int) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of FSDP2 with CPU offload; the figures."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            device_id=device if cuda else None)
    try:
        shape = C.size_shape(size)
        cfg = C.llama_config(shape, seq)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)         # fp32, on the host
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32,
                                  reduce_dtype=torch.float32)
        extra: dict[str, Any] = {"mp_policy": mp}
        if cuda:
            extra["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in model.model.layers:
            fully_shard(layer, **extra)
        fully_shard(model, **extra)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        if cuda:    # fully_shard moved each layer through the GPU on its way back to the host
            torch.cuda.reset_peak_memory_stats(device)
        data = [ids.to(device) for ids in C.token_batches(1234, warmup + steps, cfg.vocab_size,
                                                          seq, mbs)]
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        step_s, losses = [], []
        for ids in data:
            sync()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            step_s.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        return {"reference": "fsdp2", "device": str(device), "size": size, "mbs": mbs,
                "seq": seq, "offload": "cpu" if cuda else "none (a CPU device)",
                "compute_dtype": "bf16" if cuda else "fp32", "adam": "torch AdamW, fused",
                "params_on_cpu": all(p.device.type == "cpu" for p in model.parameters()),
                "step_s": step_s,
                "losses": losses, "median_step_s": statistics.median(step_s[warmup:]),
                "warmup": warmup, "timed_steps": steps, "torch": torch.__version__,
                "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="0.49B", help="a tools/bench size (0.49B, tiny, HxLxAxIxV)")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.mbs < 1 or args.seq < 1:
        raise SystemExit(f"--steps {args.steps}, --warmup {args.warmup}, --mbs {args.mbs}, "
                         f"--seq {args.seq}: each at least 1 (the first step holds FSDP's lazy "
                         "set-up and the optimizer state's creation: a warm-up)")
    res = run(args.size, args.mbs, args.seq, args.warmup, args.steps)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"fsdp2 median {res['median_step_s']:.3f} s of {res['timed_steps']} steps on "
              f"{res['device']}, {res['size']} mbs {res['mbs']} seq {res['seq']} offload "
              f"{res['offload']}; losses {[round(x, 4) for x in res['losses']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
