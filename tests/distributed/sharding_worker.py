"""One rank of the "sharding is real" test (started by tests/integration/ranks.py ``launch``, or
as a plain process for world size 1): trains an untied TinyLM at stage 3 with parameters and
optimizer states on NVMe, and writes what this rank holds and moves to ``rank<r>.json``:

- per unit: its flat and shard numel, whether it is persistent, its param store's numel;
- per optimizer state: its range [lo, hi) and its stores' numel (master, moments, gradients);
- the tier manager's bytes and the swap files' allocated blocks after the first step;
- per step: NVMe bytes read and written, bytes the collectives wrapper sent and received,
  and the buffers of its all-gathers and reduce-scatters (counted around the wrapper, to tell
  which collective moved what when the totals disagree with the formula).

One engine per schedule (early step; deferred with clipping), one after the other.

argv: out_dir nvme_dir
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import infinity
from parity import VOCAB, TinyLM

WIDTH, DEPTH, MICRO, SEQ, STEPS = 512, 2, 2, 16, 4


def main() -> None:
    out, nvme_dir = Path(sys.argv[1]), sys.argv[2]
    info = infinity.init_distributed()
    results = {schedule: run(schedule, nvme_dir, info.rank, info.world_size)
               for schedule in ("early", "deferred")}
    (out / f"rank{info.rank}.json").write_text(json.dumps(results))


def run(schedule: str, nvme_dir: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM(width=WIDTH, depth=DEPTH, tie=False)
    model_numel = sum(p.numel() for p in model.parameters())
    deferred = schedule == "deferred"
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "gradient_clipping": 1.0 if deferred else 0.0,
              "zero_optimization": {
                  "stage": 3,
                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir},
                  "offload_param": {"device": "nvme", "nvme_path": nvme_dir}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              # several ranks never speculate: one rank does not either, so that both hold
              # the same states (a speculative step doubles the NVMe ones)
              "infinity": {"collective_timeout": 120, "compute_dtype": "fp32",
                           "speculative_step": "off",
                           "early_step": "off" if deferred else "on"}}
    engine, *_ = infinity.initialize(model=model, config=config)
    calls: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}
    comm = engine.comm
    gather, reduce_scatter = comm.all_gather, comm.reduce_scatter_mean
    gather_ahead = comm.all_gather_async

    def counted_gather(output, tag=None):
        calls["all_gather"].append(output.numel() * output.element_size())
        gather(output, tag=tag)

    def counted_gather_ahead(output, tag=None):
        # issued ahead of use (overlap_comm): the same bytes, counted at the issue
        calls["all_gather"].append(output.numel() * output.element_size())
        return gather_ahead(output, tag=tag)

    def counted_reduce_scatter(output, source, tag=None):
        calls["reduce_scatter"].append(source.numel() * source.element_size())
        reduce_scatter(output, source, tag=tag)

    comm.all_gather, comm.reduce_scatter_mean = counted_gather, counted_reduce_scatter
    comm.all_gather_async = counted_gather_ahead

    def numel(store):
        return None if store is None else store.numel

    units = [{"name": u.name, "numel": u.numel, "flat_numel": u.flat_numel,
              "shard_numel": u.shard_numel, "trainable_numel": u.trainable_numel,
              "persistent": u.persistent, "nbytes": u.nbytes,
              "param_numel": sum(e.numel for e in u.params),
              "param_store_numel": numel(u.param_store)} for u in engine.units]
    states = [{"unit": s.unit.name, "lo": s.lo, "hi": s.hi, "exp_avg": numel(s.exp_avg),
               "exp_avg_sq": numel(s.exp_avg_sq), "master": numel(s.master),
               "grad_store": numel(s.grad_store)} for s in engine.optimizer.states]
    # every NVMe byte read from the first forward to the end of the last step (engine.flush
    # runs the deferred steps still waiting): the counters are reset at each step's first
    # forward, so add up what each reset drops
    counters = engine.manager.counters
    counters.reset()
    dropped = [0]
    reset = counters.reset

    def counted_reset():
        dropped[0] += counters.nvme_read_bytes
        reset()

    counters.reset = counted_reset
    gen = torch.Generator().manual_seed(1)
    steps, held = [], None
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=gen)
        mine = x[rank * MICRO:(rank + 1) * MICRO]
        for v in calls.values():
            v.clear()
        loss = engine(input_ids=mine, labels=mine)
        engine.backward(loss)
        engine.step()
        s = engine.step_stats()
        steps.append({k: s[k] for k in ("io_read_bytes", "io_write_bytes", "comm_sent_bytes",
                                        "comm_received_bytes")}
                     | {k: list(v) for k, v in calls.items()})
        if held is None:
            swap = engine.manager.swap
            held = {"tier_bytes": engine.manager.tier_bytes(),
                    "swap_allocated": swap.bytes_allocated,
                    "swap_blocks": sum(os.stat(f).st_blocks * 512 for f in swap.files)}
    engine.flush()
    read_total = dropped[0] + counters.nvme_read_bytes
    engine.close()
    return {"world": world, "units": units, "states": states, "steps": steps, "held": held,
            "model_numel": model_numel, "read_total": read_total}


if __name__ == "__main__":
    main()
