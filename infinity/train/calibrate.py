"""Measure what the planner's step-time and memory model takes as inputs, on this machine, and
run one engine configuration to compare its prediction with (``infinity.planner.calibration``).

Why here (the top layer, beside the main job): the measurements use the I/O engine, the CPU Adam
and torch, which the pure planner must not import; ``tools/bench/plan_calibration.py`` and the
CI test of the 85M main job call the same functions, so "measured in the same run" means the
same thing in both.

* ``measure_compute``: FLOP/s of the matrix products one transformer block's forward and
  backward make (input x weight, grad x weight, grad^T x input, each linear of the block at the
  run's token count), in the compute dtype: the planner's compute rate.
* ``measure_disk``: cold read and write GB/s of the swap path with the engine's aio settings
  (one point of ``infinity nvme-tune``'s sweep).
* ``measure_adam``: parameters per second of the CPU Adam over sub-groups in RAM.
* ``measure_runtime_rss``: the resident set of a process that has imported torch, transformers
  and infinity and built nothing yet (what the engine's pools and the activations come on top of).
* ``engine_steps``: a fresh engine on a Llama model trained for a few steps: step times, peak
  RSS (VmHWM and a sampler), the tier manager's peak bytes per tier, bytes moved per step.
* ``compute_alone``: the same model's forward + backward in plain torch, in RAM (no optimizer):
  the seconds the compute efficiency is fitted to.
* ``measure_layer_memory``: the resident bytes one more block adds to a forward + backward's
  peak, parameter gradients aside (the activations autograd saves, and what the allocator keeps
  of the backward's temporaries), from the same model at two depths in one fresh process.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

__all__ = ["measure_compute", "measure_disk", "measure_adam", "measure_runtime_rss",
           "measure_layer_memory", "engine_steps", "compute_alone", "vm_bytes", "main"]


def _torch_dtype(name: str):
    from infinity.engine.sizing import COMPUTE_DTYPES     # torch, imported when first needed

    return COMPUTE_DTYPES[name]


def vm_bytes(key: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_runtime_rss() -> int:
    """RSS of this process after the imports a run needs (call before building anything)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import infinity  # noqa: F401
    return vm_bytes("VmRSS")


def _timed(fn, min_s: float, reps: int = 3) -> float:
    """Median seconds of ``fn`` over ``reps`` rounds of at least ``min_s`` each (per call)."""
    fn()   # warm: allocations, kernel choice
    per_call = []
    for _ in range(reps):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        per_call.append(elapsed / calls)
    return statistics.median(per_call)


def measure_compute(hidden: int, intermediate: int, tokens: int, dtype: str = "fp32",
                    threads: int | None = None, min_s: float = 0.3) -> dict[str, float]:
    """FLOP/s of one Llama block's matrix products (q, k, v, o: h x h; gate, up: h x i; down:
    i x h) at ``tokens`` rows, forward and both backward products: 6 x tokens x the block's
    weight count FLOPs per round."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    dt = _torch_dtype(dtype)
    g = torch.Generator().manual_seed(0)
    shapes = [(hidden, hidden)] * 4 + [(hidden, intermediate)] * 2 + [(intermediate, hidden)]
    mats = []
    for k, n in shapes:
        x = torch.randn(tokens, k, generator=g).to(dt)
        w = torch.randn(n, k, generator=g).mul_(0.02).to(dt)
        gy = torch.randn(tokens, n, generator=g).to(dt)
        mats.append((x, w, gy))

    def block() -> None:
        for x, w, gy in mats:
            torch.mm(x, w.t())            # forward
            torch.mm(gy, w)               # grad of the input
            torch.mm(gy.t(), x)           # grad of the weight

    seconds = _timed(block, min_s)
    flops = 6.0 * tokens * sum(k * n for k, n in shapes)
    return {"flops_per_s": flops / seconds, "block_s": seconds, "dtype": dtype,
            "tokens": tokens, "threads": torch.get_num_threads()}


def measure_disk(path: str, size: int = 1 << 30, block_size: int = 1 << 20,
                 queue_depth: int = 32, backend: str = "auto",
                 repeats: int = 2) -> dict[str, Any]:
    """Cold read and write GB/s of ``path`` (a private file of ``size`` bytes, O_DIRECT), at
    the engine's aio settings: ``infinity nvme-tune``'s measurement of one point. Then reads of
    one half of the file and writes of the other, submitted together (a step's traffic):
    ``mixed_s``, against the ``serial_s`` and ``parallel_s`` the two rates predict for them."""
    from infinity.io import AioConfig, AioEngine, aligned_empty, backend_available, drop_cached
    from infinity.train.nvme_tune import TuneFile, TunePoint

    if backend == "auto":
        backend = next((b for b in ("io_uring", "libaio") if backend_available(b)), "auto")
    point = TunePoint(backend, block_size, queue_depth)
    reads, writes, mixed = [], [], []
    with TuneFile(path, size) as tf:
        for _ in range(repeats):
            used, write, read, _ = tf.measure(point)
            reads.append(read)
            writes.append(write)
        chunk = min(16 << 20, tf.size // 2)
        half = tf.size // 2 // chunk * chunk
        rbuf = aligned_empty(chunk)
        cfg = AioConfig(backend=used, block_size=block_size, queue_depth=queue_depth)
        with AioEngine(cfg) as engine, engine.open(tf.file_path, "rw") as f:
            for _ in range(repeats):
                drop_cached(tf.file_path)
                start = time.perf_counter()
                pending = []
                for off in range(0, half, chunk):
                    pending.append(engine.read(rbuf, f, off, chunk))
                    pending.append(engine.write(tf.buf, f, half + off, chunk))
                for request in pending:
                    request.wait()
                mixed.append(time.perf_counter() - start)
    r, w = statistics.median(reads), statistics.median(writes)
    return {"read_GBps": r, "write_GBps": w, "read_samples": reads, "write_samples": writes,
            "backend": used, "size": tf.size, "mixed_bytes_each_way": half,
            "mixed_s": statistics.median(mixed), "serial_s": half / r / 1e9 + half / w / 1e9,
            "parallel_s": max(half / r, half / w) / 1e9}


def measure_adam(numel: int, sub_group: int, threads: int | None = None,
                 reps: int = 3) -> dict[str, float]:
    """Parameters per second of ``adam_step_flat`` over ``numel`` elements in ``sub_group``
    chunks, rotating over >= 512 MiB of states so caches cannot hold them (in RAM: the step
    stream's reads and writes are the disk's, not counted here)."""
    import torch

    from infinity.optim.cpu_adam import adam_step_flat

    if threads:
        torch.set_num_threads(threads)
    sub = max(2048, min(sub_group, numel))
    chunks = math.ceil(numel / sub)
    n_sets = min(chunks, max(2, math.ceil((512 << 20) / (16 * sub))))
    g = torch.Generator().manual_seed(0)
    sets = [(torch.randn(sub, generator=g).mul_(0.02), torch.randn(sub, generator=g).mul_(1e-3),
             torch.zeros(sub), torch.zeros(sub)) for _ in range(n_sets)]
    times = []
    for rep in range(1 + reps):
        start, left = time.perf_counter(), numel
        for i in range(chunks):
            n = min(sub, left)
            p, grad, m, v = (t[:n] for t in sets[i % n_sets])
            adam_step_flat(p, grad, m, v, step=rep + 1, lr=1e-4, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.01)
            left -= n
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    return {"params_per_s": numel / seconds, "seconds": seconds, "numel": numel,
            "sub_group": sub}


class _Sampler:
    """VmRSS every 20 ms on a thread; ``peak`` the largest."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, vm_bytes("VmRSS"))
            self._stop.wait(0.02)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def engine_steps(model_kwargs: dict[str, Any], ds_config: dict[str, Any], *, seq: int,
                 micro_batch: int, steps: int, warmup: int, seed: int = 1234,
                 threads: int | None = None, scratch: str = "/var/tmp",
                 probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train a fresh ``LlamaForCausalLM(**model_kwargs)`` under ``infinity.zero.Init`` with
    ``ds_config`` (its nvme_path, if "@NVME@", a fresh directory under ``scratch``) for
    ``warmup + steps`` steps; what the calibration compares with the plan. Run it in a fresh
    process: the peak RSS is the process's. ``probe``: ``measure_compute``'s arguments, timed
    just before each step (``probe_flops_per_s``), so a shared machine's load at that moment
    is in the rate the step is predicted from."""
    import torch

    runtime_rss = measure_runtime_rss()
    import transformers

    import infinity

    if threads:
        torch.set_num_threads(threads)
    cfg, batches = _llama(model_kwargs, seq, micro_batch, warmup + steps, seed)
    nvme = tempfile.mkdtemp(prefix="plan-calibration-", dir=scratch)
    dsc = json.loads(json.dumps(ds_config).replace("@NVME@", nvme))
    res: dict[str, Any] = {"runtime_rss_bytes": runtime_rss, "ds_config": dsc}
    try:
        with _Sampler() as sampler:
            torch.manual_seed(seed)
            with infinity.zero.Init(config=dsc):
                model = transformers.LlamaForCausalLM(cfg)
            res["n_params"] = sum(p.numel() for p in model.parameters())
            engine, *_ = infinity.initialize(model=model, config=dsc)
            try:
                res["rss_after_init_bytes"] = vm_bytes("VmRSS")
                res["compute_dtype"] = str(engine.compute_dtype).replace("torch.", "")
                res["early_step"] = bool(engine.optimizer.early_step)
                res["speculation"] = engine.optimizer.speculation
                res["engine_sizes"] = {k: (v.name if hasattr(v, "name") else v)
                                       for k, v in vars(engine.sizes).items()}
                manager = engine.manager
                res["budget_limits"] = {"host": manager.host_budget.limit,
                                        "device": manager.device_budget.limit}
                res["tier_bytes_after_init"] = manager.tier_bytes()
                step_s, stats, phases, probes = [], [], [], []
                for ids in batches:
                    ids = ids.to(engine.device)     # a no-op on a CPU device
                    if probe:
                        probes.append(measure_compute(**probe)["flops_per_s"])
                    sampler_phase = {}
                    start = time.perf_counter()
                    out = engine(input_ids=ids, labels=ids)
                    sampler_phase["fwd"] = vm_bytes("VmRSS")
                    engine.backward(out.loss)
                    sampler_phase["bwd"] = vm_bytes("VmRSS")
                    engine.step()
                    step_s.append(time.perf_counter() - start)
                    sampler_phase["step"] = vm_bytes("VmRSS")
                    phases.append(sampler_phase)
                    stats.append(engine.step_stats())
                    print(f"[engine] step {len(step_s) - 1} loss {out.loss.detach().item():.4f} "
                          f"{step_s[-1]:.2f}s", file=sys.stderr, flush=True)
                res["tier_peak_bytes"] = {"host": manager.host_budget.peak,
                                          "device": manager.device_budget.peak}
                res["device_cache_bytes"] = manager.device_cache.cached_bytes
                res["fetch_stats"] = dict(engine.coordinator.fetch_stats)
                res["held_room_peak"] = getattr(getattr(engine.optimizer, "held_room", None),
                                                "peak", None)
            finally:
                engine.close()
        res["sampler_peak_rss_bytes"] = sampler.peak
    finally:
        os.rmdir(nvme)   # ours (mkdtemp above); engine.close removed its swap files
    res["vm_hwm_bytes"] = vm_bytes("VmHWM")
    res["step_s"] = step_s
    if probes:
        res["probe_flops_per_s"] = probes
        res["median_probe_flops_per_s"] = statistics.median(probes[warmup:])
    res["rss_phases"] = phases
    res["stats"] = stats
    timed = stats[warmup:]
    res["median_step_s"] = statistics.median(step_s[warmup:])
    res["median_stats"] = {k: statistics.median(s[k] for s in timed) for k in timed[0]}
    return res


def _llama(model_kwargs: dict[str, Any], seq: int, micro_batch: int, count: int, seed: int):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**model_kwargs)
    cfg._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(seed + 12345)
    batches = [torch.randint(0, cfg.vocab_size, (micro_batch, seq), generator=g)
               for _ in range(count)]
    return cfg, batches


def compute_alone(model_kwargs: dict[str, Any], *, seq: int, micro_batch: int, steps: int,
                  warmup: int, seed: int = 1234, threads: int | None = None,
                  probe: dict[str, Any] | None = None, dtype: str = "fp32") -> dict[str, Any]:
    """Median seconds of the model's forward + backward in plain torch (in ``dtype``, in RAM,
    no optimizer) over ``steps`` after ``warmup``; ``probe`` as in ``engine_steps``."""
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    cfg, batches = _llama(model_kwargs, seq, micro_batch, warmup + steps, seed)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(_torch_dtype(dtype)).train()
    step_s, probes = [], []
    for ids in batches:
        if probe:
            probes.append(measure_compute(**probe)["flops_per_s"])
        start = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        step_s.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        print(f"[compute] step {len(step_s) - 1} {step_s[-1]:.2f}s", file=sys.stderr, flush=True)
    res = {"step_s": step_s, "median_step_s": statistics.median(step_s[warmup:]),
           "n_params": sum(p.numel() for p in model.parameters())}
    if probes:
        res["probe_flops_per_s"] = probes
        res["median_probe_flops_per_s"] = statistics.median(probes[warmup:])
    return res


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_layer_memory(model_kwargs: dict[str, Any], *, seq: int, micro_batch: int,
                         depths: tuple[int, int] = (1, 3), threads: int | None = None,
                         mmap_threshold: int | None = 4 << 20, seed: int = 1234,
                         dtype: str = "fp32") -> dict[str, Any]:
    """Peak resident bytes one block adds to a plain forward + backward (in ``dtype``) of
    ``model_kwargs``' Llama (its own layer count replaced by ``depths``), less its parameters'
    gradients: (peak added at the deeper depth - at the shallower - 4 B x the parameters
    between them) / the blocks between them. Run in a fresh process, with the engine's glibc
    mmap threshold (``infinity.malloc_mmap_threshold``), which decides what the heap keeps."""
    import gc

    import torch

    from infinity.base.malloc_tuning import set_mmap_threshold, trim

    if threads:
        torch.set_num_threads(threads)
    if mmap_threshold:
        set_mmap_threshold(mmap_threshold)
    added, params = {}, {}
    for depth in depths:
        cfg, batches = _llama(dict(model_kwargs, num_hidden_layers=depth), seq, micro_batch, 2,
                              seed)
        import transformers

        model = transformers.LlamaForCausalLM(cfg).to(_torch_dtype(dtype)).train()
        params[depth] = sum(p.numel() for p in model.parameters())
        out = model(input_ids=batches[0], labels=batches[0])    # warm: kernels, workspaces
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        del out
        gc.collect()
        trim()
        before = vm_bytes("VmRSS")
        if not _reset_peak_rss():
            raise OSError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only")
        out = model(input_ids=batches[1], labels=batches[1])
        out.loss.backward()
        added[depth] = vm_bytes("VmHWM") - before
        del out, model
        gc.collect()
        trim()
    low, high = depths
    grad_bytes = torch.empty((), dtype=_torch_dtype(dtype)).element_size()
    per_layer = (added[high] - added[low] - grad_bytes * (params[high] - params[low])) / (high - low)
    return {"layer_rss_bytes": int(per_layer), "added_bytes": added, "params": params,
            "depths": list(depths), "mmap_threshold": mmap_threshold, "dtype": dtype}


def main(argv: list[str] | None = None) -> int:
    """Worker entry: ``python -m infinity.train.calibrate KIND`` with a JSON spec on stdin, one
    JSON result line on stdout (everything else on stderr). KIND: engine, compute_alone, compute,
    disk, adam, layer_memory, runtime."""
    argv = sys.argv[1:] if argv is None else argv
    kind = argv[0]
    spec = json.loads(sys.stdin.read() or "{}")
    out = os.dup(1)
    os.dup2(2, 1)      # transformers and C code print to stdout: keep the result line alone
    try:
        fn = {"engine": engine_steps, "compute": measure_compute, "disk": measure_disk,
              "adam": measure_adam, "compute_alone": compute_alone,
              "layer_memory": measure_layer_memory}.get(kind)
        if kind == "runtime":
            res: dict[str, Any] = {"runtime_rss_bytes": measure_runtime_rss()}
        elif fn is None:
            raise SystemExit(f"unknown kind {kind!r}")
        else:
            res = fn(**spec)
        res["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the driver with the log
        import traceback

        traceback.print_exc()
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    os.write(out, (json.dumps(res) + "\n").encode())
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
