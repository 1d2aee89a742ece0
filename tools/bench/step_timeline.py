#!/usr/bin/env python3
"""Where a stage-3 step's time goes: a per-thread timeline of the engine's blocking calls.

Not a contender-vs-reference benchmark: a profiler for the out-of-core step (tools/bench/
out_of_core.py measures it). It wraps the engine's waits and copies (I/O waits, slot acquires,
fetch copies, Adam kernels, gradient adds, write-backs) with timers, runs a few steps of the same
model and config, and prints, per step, the wall time of forward / backward / step, the CPU
seconds each phase used (this process, the whole machine, and what the hypervisor stole) and,
per thread, the seconds inside each wrapped call.

    python3 tools/bench/step_timeline.py --size 0.49B --steps 3 [--early-step off]
    python3 tools/bench/step_timeline.py --main-job --steps 8    # `infinity train`'s own run

``--main-job`` builds what ``infinity train`` with no arguments builds (the 85M preset, the
demo ds_config: 512 MiB budget, clipping 1.0, deferred schedule with speculation, the shipped
corpus's batches) so that the main job's per-step fixed costs can be seen; the other flags but
--steps, --threads and --scratch are then ignored.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

EVENTS: list[tuple[str, str, float, float]] = []   # (thread, what, start, end)
_LOCK = threading.Lock()


def _wrap(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            with _LOCK:
                EVENTS.append((threading.current_thread().name, label, start, time.perf_counter()))

    setattr(owner, name, timed)


def instrument() -> None:
    """Wrap the calls whose time matters; nested wrapped calls are reported separately."""
    from infinity.optim import gradients, kernel, partitioned, step_stream
    from infinity.storage import buffer_pool, manager
    from infinity.zero import coordinator, unit

    _wrap(manager.TierManager, "wait", "io wait")
    _wrap(buffer_pool.BufferPool, "acquire", "slot acquire")
    _wrap(unit.Unit, "finish_fetch", "fetch (incl. wait+copy)")
    _wrap(unit.Unit, "write_home", "write_home")
    _wrap(kernel.AdamKernel, "run", "adam kernel")
    _wrap(gradients.GradientCollector, "on_grad", "grad add")
    _wrap(partitioned.PartitionedOptimizer, "on_unit_backward_done", "unit grads done")
    _wrap(partitioned, "sum_of_squares", "grad norm")
    _wrap(step_stream, "sum_of_squares", "grad norm")
    _wrap(partitioned.PartitionedOptimizer, "reap", "reap")
    _wrap(coordinator.Coordinator, "_prefetch", "prefetch issue")
    _wrap(partitioned.PartitionedOptimizer, "step_fetched", "deferred step at fetch")
    _wrap(partitioned.PartitionedOptimizer, "step", "optimizer.step")


def cpu_mark() -> tuple[float, float, float, float]:
    """(wall, process CPU seconds, machine busy CPU seconds, steal seconds): on 2 vCPUs the
    step is CPU-bound, and a virtual disk's I/O shows up as time stolen by the host."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(v) - v[3] - v[4]          # all but idle and iowait (steal included)
    return time.perf_counter(), sum(os.times()[:2]), busy / hz, v[7] / hz


def summarize(events, t0: float, t1: float) -> dict[str, dict[str, float]]:
    per = collections.defaultdict(lambda: collections.defaultdict(float))
    for thread, what, a, b in events:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            per[thread][what] += b - a
    return {t: dict(sorted(d.items())) for t, d in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.49B")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--early-step", default="on")
    ap.add_argument("--host-budget", default="3GiB")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--malloc-mmap-threshold", default="4MiB",
                    help='the "infinity" section key; "none" leaves malloc alone')
    ap.add_argument("--moments", default="fp32", choices=("fp32", "bf16", "int8"),
                    help='"optimizer_moments" (Adam state formats: docs/optimizer-formats.md)')
    ap.add_argument("--master", default="fp32", choices=("fp32", "bf16"),
                    help='"optimizer_master" ("bf16" needs bf16 compute)')
    ap.add_argument("--compute-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench")
    ap.add_argument("--main-job", action="store_true",
                    help="the run of `infinity train` with no arguments (see the docstring)")
    args = ap.parse_args()

    import torch
    import transformers

    import infinity

    torch.set_num_threads(args.threads)
    instrument()
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    nvme = tempfile.mkdtemp(prefix="timeline-", dir=args.scratch)
    if args.main_job:
        model, config, data = _main_job(args.steps, nvme)
    else:
        cfg = C.llama_config(C.size_shape(args.size), args.seq)
        data = C.token_batches(1234, args.steps, cfg.vocab_size, args.seq, 1)
        config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": nvme},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
            "infinity": {"host_memory_budget": args.host_budget, "early_step": args.early_step,
                         "malloc_mmap_threshold": None if args.malloc_mmap_threshold == "none"
                         else args.malloc_mmap_threshold, "compute_dtype": args.compute_dtype,
                         "optimizer_moments": args.moments, "optimizer_master": args.master},
        }
        with infinity.zero.Init(config=config):
            model = transformers.LlamaForCausalLM(cfg)
    engine, *_ = infinity.initialize(model=model, config=config)
    steady: dict = {}
    walls: list[float] = []
    try:
        for i, ids in enumerate(data):
            if i == 1:   # the first step warms up (allocations, the trace): not counted
                steady = {"threads": C.thread_cpu(), "cpu": cpu_mark(), "usage": C.cpu_usage()}
            EVENTS.clear()
            ma = cpu_mark()
            out = engine(input_ids=ids, labels=ids)
            mb = cpu_mark()
            engine.backward(out.loss)
            mc = cpu_mark()
            engine.step()
            md = cpu_mark()
            (ta, tb, tc, td) = (ma[0], mb[0], mc[0], md[0])
            phases = {"forward": (ta, tb), "backward": (tb, tc), "step": (tc, td)}
            marks = {"forward": (ma, mb), "backward": (mb, mc), "step": (mc, md)}
            status = C.proc_status()
            print(f"step {i}: {td - ta:.2f}s = forward {tb - ta:.2f} + backward {tc - tb:.2f} "
                  f"+ step {td - tc:.2f}; RSS {status['VmRSS'] / C.GiB:.2f} GiB, peak "
                  f"{status['VmHWM'] / C.GiB:.2f} GiB, device cache "
                  f"{engine.manager.device_cache.cached_bytes / C.GiB:.2f} GiB; stats {json.dumps({k: round(v, 3) for k, v in engine.step_stats().items() if k.endswith('_s')})}; "
                  f"I/O read {engine.step_stats()['io_read_bytes'] / 1e9:.3f} GB, written "
                  f"{engine.step_stats()['io_write_bytes'] / 1e9:.3f} GB")
            print("  cpu: " + "; ".join(
                f"{phase} process {b[1] - a[1]:.2f} s, machine busy {b[2] - a[2]:.2f} of "
                f"{os.cpu_count() * (b[0] - a[0]):.2f} (steal {b[3] - a[3]:.2f})"
                for phase, (a, b) in marks.items()))
            for phase, (a, b) in phases.items():
                for thread, sums in summarize(list(EVENTS), a, b).items():
                    print(f"  {phase:9s} {thread[:22]:22s} " + ", ".join(
                        f"{k} {v:.2f}" for k, v in sums.items()))
            if i >= 1:
                walls.append(td - ta)
        print(f"speculation: {engine.optimizer.speculation_stats}")
        if steady:
            n = len(data) - 1
            end = cpu_mark()
            faults = C.cpu_usage_since(steady["usage"])["minor_faults"] / n
            print(f"steps 2..{len(data)}: median {sorted(walls)[len(walls) // 2]:.3f} s wall; "
                  f"process CPU {(end[1] - steady['cpu'][1]) / n:.3f} s a step, "
                  f"{faults:,.0f} minor page faults a step; per thread "
                  f"(user, system) s a step: {C.thread_cpu_since(steady['threads'], n)}")
    finally:
        engine.close()
        Path(nvme).rmdir()


def _main_job(steps: int, nvme: str):
    """(model, ds_config, batches) of ``infinity train`` with no arguments, swap under ``nvme``."""
    import infinity
    from infinity.train import data as data_mod
    from infinity.train import models
    from infinity.train.defaults import DEFAULT_SEQ_LEN
    from infinity.train.run_config import Overrides, build_ds_config, demo_config

    import torch

    ds, config = build_ds_config(demo_config(), Overrides(nvme_path=nvme, steps=steps))
    sampler = data_mod.BatchSampler(data_mod.load_corpus(None, None), DEFAULT_SEQ_LEN,
                                    config.train_micro_batch_size_per_gpu, 0)
    torch.manual_seed(0)
    model = models.build_model(models.model_config(None, None, DEFAULT_SEQ_LEN),
                               infinity.zero.Init(config=config))
    return model, ds, [sampler.next_batch() for _ in range(steps)]


if __name__ == "__main__":
    main()
