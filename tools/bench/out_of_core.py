#!/usr/bin/env python3
"""Out-of-core bench (issue 6): stage 3 with parameters and optimizer on NVMe under a 3 GiB host
budget, at two model sizes, against its own rooflines and DeepSpeed ZeRO-3 nvme/nvme.

Run (from the repository root; INFINITY_NATIVE_LIB may point at a fresh native build):
    python3 tools/bench/out_of_core.py                       # 0.49B and 1.04B, both schedules, DeepSpeed
    python3 tools/bench/out_of_core.py --sizes tiny --steps 1 --warmup 1 --io-reps 1 --ds-steps 1
Writes JSON lines to --out (default /var/tmp/infinity-bench/out_of_core-<time>.jsonl) and a
Markdown table beside it (.md), as well as the screen.

Model: Llama width 2048 / 5504 / vocab 32000 with 7 (0.49B) or 18 (1.04B) layers, fp32,
micro-batch 1, seq 128, the token batches of shared/peers/ds_e2e.py. Every run below is a fresh
process, one after another (never two at once), per size in this order:
  ours-<on|off>  infinity.zero.Init + infinity.initialize, ZeRO-3, offload_param and
                 offload_optimizer nvme, host_memory_budget 3GiB, early_step on|off (with
                 --offload-activations nvme: saved activations on NVMe too); median step
                 time after --warmup; engine.step_stats() per step; peak RSS = VmHWM (and a 50 ms
                 RSS sampler thread, and wait4's ru_maxrss). The ds_config is printed.
  compute        the same model in RAM, plain torch forward+backward, no optimizer (skipped, with
                 the reason, when MemAvailable cannot hold params + grads + 1.5 GiB).
  io-<on|off>    I/O alone: the timed steps' median io_read_bytes / io_write_bytes of ours-<s>
                 replayed with infinity.io.AioEngine (the engine's aio block size, queue depth and
                 lanes, O_DIRECT) on a file of the engine's swap size, written first, then
                 fsync + fadvise(DONTNEED) with mincore showing 0 pages before each timed rep
                 (cold reads). Reads and writes are submitted concurrently, --io-inflight requests
                 of --io-chunk bytes per direction, reads walking the file from offset 0 and writes
                 from the middle, wrapping: the fastest the disk moves the step's bytes.
  optimizer      optimizer alone: infinity.optim.cpu_adam.adam_step_flat over the model's
                 parameter count, in chunks of the engine's sub-group size, in RAM (a rotating set
                 of >= 512 MiB of chunks, so caches cannot hold them); median over reps.
  deepspeed      DeepSpeed ZeRO-3 nvme/nvme: shared/peers/ds_e2e.py's own worker (its model
                 definition, deterministic init, config: sub_group_size 1e8, aio 1 MiB / qd 32,
                 pin_memory) run under the peers venv, with this size added to its size table
                 (it only knows 16 layers as "1B"); --ds-steps timed steps after 1 warm-up.
Bars: peak RSS <= 4 GiB at each size and growing < 0.1 byte per parameter between the sizes;
step / max(compute, I/O, optimizer) per schedule; ours / DeepSpeed <= 0.5.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("PEERS_DIR", REPO.parent / "shared" / "peers"))
PEERS_PY = Path(os.environ.get("PEERS_PYTHON", Path.home() / ".venvs" / "peers" / "bin" / "python"))
KINDS = ("ours", "compute", "io", "optimizer", "deepspeed")
RSS_BAR = 4 * C.GiB
GROWTH_BAR = 0.1  # bytes of peak RSS per parameter between the two sizes
DS_TARGET = 0.5


# --schedules: name -> (infinity.early_step, infinity.speculative_step, gradient_clipping)
SCHEDULES = {
    "on": ("on", "auto", 0.0), "auto": ("auto", "auto", 0.0),
    "off": ("off", "auto", 0.0),              # deferred, speculation kept every step
    "nospec": ("off", "off", 0.0),            # deferred without speculation
    "clip": ("auto", "on", 1.0),              # clipping: speculation, kept or rolled back
    "clip-nospec": ("auto", "off", 1.0),      # clipping, deferred without speculation
}


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The settings ``ds_config`` and the workers read, shared with the benches that run this
    one's engine (swap_check.py)."""
    ap.add_argument("--host-budget", default="3GiB")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--aio-block-size", type=int, default=1 << 20)
    ap.add_argument("--aio-queue-depth", type=int, default=32)


def ds_config(nvme_path: str, args: argparse.Namespace, schedule: str) -> dict:
    """Our config: DeepSpeed JSON (ZeRO-3, nvme/nvme) plus the "infinity" section."""
    early, speculative, clipping = SCHEDULES[schedule]
    return {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clipping,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": args.weight_decay}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": nvme_path},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
        "aio": {"block_size": args.aio_block_size, "queue_depth": args.aio_queue_depth,
                "thread_count": 1, "single_submit": False, "overlap_events": True},
        "infinity": {"host_memory_budget": args.host_budget, "early_step": early,
                     "speculative_step": speculative,
                     "offload_activations": args.offload_activations},
    }


# =========================================================================== workers
def worker(kind: str, spec: dict) -> None:
    res: dict = {"bench": "out_of_core", "contender": kind, "size": spec["size"]}
    if "schedule" in spec:
        res["schedule"] = spec["schedule"]

    def body(sampler: C.RssSampler) -> None:
        spec["sampler"] = sampler
        {"ours": _ours, "compute": _compute, "io": _io, "optimizer": _optimizer}[kind](spec, res)

    C.measured_worker(res, body)


def _setup(spec: dict):
    import torch

    torch.set_num_threads(spec["threads"])
    shape = C.size_shape(spec["size"])
    cfg = C.llama_config(shape, spec["seq"])
    data = C.token_batches(spec["seed"], spec["warmup"] + spec["steps"], cfg.vocab_size,
                           spec["seq"], spec["mbs"])
    return torch, cfg, data


def _ours(spec: dict, res: dict) -> None:
    import transformers

    import infinity

    torch, cfg, data = _setup(spec)
    nvme = tempfile.mkdtemp(prefix="out-of-core-", dir=spec["scratch"])
    dsc = json.loads(json.dumps(spec["ds_config"]).replace(spec["nvme_placeholder"], nvme))
    res["ds_config"] = dsc
    t0 = time.perf_counter()
    torch.manual_seed(spec["seed"])
    with infinity.zero.Init(config=dsc):
        model = transformers.LlamaForCausalLM(cfg)
    res["n_params"] = sum(p.numel() for p in model.parameters())
    engine, *_ = infinity.initialize(model=model, config=dsc)
    try:
        res["init_s"] = time.perf_counter() - t0
        res["rss_after_init_bytes"] = C.proc_status()["VmRSS"]
        res["vm_hwm_after_init_bytes"] = C.proc_status()["VmHWM"]
        res["engine_sizes"] = {k: (v.name if hasattr(v, "name") else v)
                               for k, v in vars(engine.sizes).items()}
        aio = engine.config.aio
        res["aio"] = {"block_size": aio.block_size, "queue_depth": aio.queue_depth,
                      "thread_count": aio.thread_count, "single_submit": aio.single_submit,
                      "overlap_events": aio.overlap_events, "backend": aio.backend}
        res["early_step_in_use"] = bool(engine.optimizer.early_step)
        res["speculation_in_use"] = engine.optimizer.speculation
        res["swap_bytes_after_init"] = C.dir_bytes(nvme)
        losses, steps, stats = [], [], []
        io0 = C.proc_io()
        fetch0 = dict(engine.coordinator.fetch_stats)
        sampler, rss = spec["sampler"], []
        threads0 = {}
        for ids in data:
            ids = ids.to(engine.device)     # a GPU engine computes there; a no-op on a CPU
            if len(steps) == spec["warmup"]:
                threads0 = C.thread_cpu()
            sampler.take_peak()
            ta, usage0 = time.perf_counter(), C.cpu_usage()
            out = engine(input_ids=ids, labels=ids)
            r_fwd = (C.proc_status(("VmRSS",))["VmRSS"], sampler.take_peak())
            engine.backward(out.loss)
            r_bwd = (C.proc_status(("VmRSS",))["VmRSS"], sampler.take_peak())
            engine.step()
            steps.append(time.perf_counter() - ta)
            r_opt = (C.proc_status(("VmRSS",))["VmRSS"], sampler.take_peak())
            losses.append(float(out.loss))
            stats.append(engine.step_stats())
            stats[-1].update(C.cpu_usage_since(usage0))
            # where in the step RSS peaks: (RSS at the end of the phase, sampler peak during it)
            rss.append({"fwd": r_fwd, "bwd": r_bwd, "step": r_opt})
            # step_stats' prefetch_hit_ratio counts from the engine's start (the coordinator never
            # resets its counters); this step's own ratio from the same counters' deltas:
            fetch1 = dict(engine.coordinator.fetch_stats)
            n = fetch1["nvme_fetches"] - fetch0["nvme_fetches"]
            stats[-1]["prefetch_hit_ratio_step"] = \
                (fetch1["prefetch_hits"] - fetch0["prefetch_hits"]) / n if n else 1.0
            stats[-1]["nvme_fetches_step"] = n
            fetch0 = fetch1
            print(f"[ours {spec['schedule']}] step {len(steps) - 1} loss {losses[-1]:.6f} "
                  f"{steps[-1]:.2f}s {json.dumps({k: round(v, 3) for k, v in stats[-1].items()})}",
                  file=sys.stderr, flush=True)
        res["thread_cpu_per_step"] = C.thread_cpu_since(threads0, len(steps) - spec["warmup"])
        print(f"[ours {spec['schedule']}] cpu per step by thread (user, sys): "
              f"{json.dumps(res['thread_cpu_per_step'])}", file=sys.stderr, flush=True)
        io1 = C.proc_io()
        res["proc_io_per_step"] = {k: (io1.get(k, 0) - io0.get(k, 0)) / max(1, len(steps))
                                   for k in ("read_bytes", "write_bytes")}
        res["swap_bytes_end"] = C.dir_bytes(nvme)
        res["speculation_stats"] = dict(engine.optimizer.speculation_stats)
        room = getattr(engine.optimizer, "held_room", None)
        if room is not None:   # the early step's held gradients (optim/held_room.py)
            res["held_room"] = {"capacity": room.capacity, "peak": room.peak}
        res["grad_norms"] = engine.optimizer.last_grad_norm
        res["native_info"] = infinity.native_info()
        if engine.activation_swapper is not None:
            res["activation_swap"] = engine.activation_swapper.describe()
    finally:
        engine.close()
        os.rmdir(nvme)  # ours (mkdtemp above); engine.close removed its swap files
    res["losses"], res["step_s"], res["stats"], res["rss_phases"] = losses, steps, stats, rss
    timed = stats[spec["warmup"]:]
    res["median_step_s"] = C.median(steps[spec["warmup"]:])
    res["median_stats"] = {k: C.median([s[k] for s in timed]) for k in timed[0]} if timed else {}


def _compute(spec: dict, res: dict) -> None:
    import transformers

    torch, cfg, data = _setup(spec)
    t0 = time.perf_counter()
    torch.manual_seed(spec["seed"])
    model = transformers.LlamaForCausalLM(cfg).float().train()
    res["n_params"] = sum(p.numel() for p in model.parameters())
    res["init_s"] = time.perf_counter() - t0
    steps, splits, losses = [], [], []
    res["saved_activation_bytes"] = _saved_activation_bytes(torch, model, data[0])
    threads0 = {}
    for ids in data:
        if len(steps) == spec["warmup"]:
            threads0 = C.thread_cpu()
        ta, usage0 = time.perf_counter(), C.cpu_usage()
        out = model(input_ids=ids, labels=ids)
        tb = time.perf_counter()
        out.loss.backward()
        tc = time.perf_counter()
        model.zero_grad(set_to_none=True)
        steps.append(tc - ta)
        splits.append({"fwd_s": tb - ta, "bwd_s": tc - tb, **C.cpu_usage_since(usage0)})
        losses.append(float(out.loss))
        print(f"[compute] step {len(steps) - 1} {steps[-1]:.2f}s {json.dumps(splits[-1])}",
              file=sys.stderr, flush=True)
    res["thread_cpu_per_step"] = C.thread_cpu_since(threads0, len(steps) - spec["warmup"])
    print(f"[compute] cpu per step by thread (user, sys): "
          f"{json.dumps(res['thread_cpu_per_step'])}", file=sys.stderr, flush=True)
    res["losses"], res["step_s"], res["splits"] = losses, steps, splits
    res["median_step_s"] = C.median(steps[spec["warmup"]:])
    timed = splits[spec["warmup"]:]
    res["median_split"] = {k: C.median([s[k] for s in timed]) for k in timed[0]} if timed else {}


def _saved_activation_bytes(torch, model, ids) -> int:
    """Bytes autograd saves for backward in one forward (parameters excluded): the part of peak
    RSS that grows with the layer count whatever the engine does (no activation checkpointing)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    del out
    return total


def _io(spec: dict, res: dict) -> None:
    """Replay one step's bytes (see the module docstring), --io-reps times."""
    from collections import deque

    import torch

    from infinity.io import AioConfig, AioEngine, aligned_empty, drop_cached, resident_pages

    chunk = spec["chunk"]
    depth = spec["inflight"]
    file_bytes = max(4 * chunk, math.ceil(spec["file_bytes"] / chunk) * chunk)
    reads = math.ceil(spec["read_bytes"] / 4096) * 4096
    writes = math.ceil(spec["write_bytes"] / 4096) * 4096
    cfg = AioConfig(**spec["aio"])
    res.update({"file_bytes": file_bytes, "read_bytes": reads, "write_bytes": writes,
                "chunk": chunk, "inflight": depth, "aio": spec["aio"]})
    tmp = tempfile.mkdtemp(prefix="io-replay-", dir=spec["scratch"])
    path = os.path.join(tmp, "replay.swap")
    eng = AioEngine(cfg)
    res["backend"] = eng.backend
    try:
        f = eng.open(path, "rw", create=True)
        try:
            wbuf = aligned_empty(chunk)
            wbuf.view(torch.int64).copy_(torch.arange(chunk // 8, dtype=torch.int64) * 2654435761)
            rbufs = [aligned_empty(chunk) for _ in range(depth)]
            t0 = time.perf_counter()
            fill = deque()
            for off in range(0, file_bytes, chunk):  # lay the file out (untimed)
                fill.append(eng.write(wbuf, f, off))
                if len(fill) >= depth:
                    fill.popleft().wait()
            for r in fill:
                r.wait()
            res["fill_s"] = time.perf_counter() - t0
            times, resident = [], []
            for rep in range(spec["reps"]):
                drop_cached(path)
                resident.append(resident_pages(path))
                times.append(_replay(eng, f, wbuf, rbufs, reads, writes, chunk, file_bytes))
                print(f"[io] rep {rep} {times[-1]:.2f}s ({(reads + writes) / times[-1] / 1e9:.2f} GB/s, "
                      f"resident pages before {resident[-1]})", file=sys.stderr, flush=True)
        finally:
            f.close()
    finally:
        eng.close()
        os.unlink(path)  # ours (created above)
        os.rmdir(tmp)
    res["rep_s"] = times
    res["resident_pages_before"] = resident
    res["median_step_s"] = C.median(times)
    res["gb_per_s"] = (reads + writes) / res["median_step_s"] / 1e9 if res["median_step_s"] else None


def _replay(eng, f, wbuf, rbufs, reads: int, writes: int, chunk: int, file_bytes: int) -> float:
    from collections import deque

    r_left, w_left = reads, writes
    r_off, w_off = 0, (file_bytes // 2) // chunk * chunk
    inflight: deque = deque()
    free = list(rbufs)
    n_r = n_w = 0
    t0 = time.perf_counter()
    while r_left or w_left or inflight:
        submitted = False
        if r_left and free and n_r < len(rbufs):
            n = min(chunk, r_left)
            if r_off + n > file_bytes:
                r_off = 0
            buf = free.pop()
            inflight.append(("r", buf, eng.read(buf, f, r_off, n)))
            r_off, r_left, n_r, submitted = r_off + n, r_left - n, n_r + 1, True
        if w_left and n_w < len(rbufs):
            n = min(chunk, w_left)
            if w_off + n > file_bytes:
                w_off = 0
            inflight.append(("w", None, eng.write(wbuf, f, w_off, n)))
            w_off, w_left, n_w, submitted = w_off + n, w_left - n, n_w + 1, True
        if not submitted and inflight:
            kind, buf, req = inflight.popleft()
            req.wait()
            if kind == "r":
                free.append(buf)
                n_r -= 1
            else:
                n_w -= 1
    return time.perf_counter() - t0


def _optimizer(spec: dict, res: dict) -> None:
    import torch

    from infinity.base.native_info import native_info
    from infinity.optim.cpu_adam import adam_step_flat

    torch.set_num_threads(spec["threads"])
    numel, sub = spec["numel"], spec["sub_group_numel"]
    sub = max(1, min(sub, numel))
    chunks = math.ceil(numel / sub)
    n_sets = min(chunks, max(2, math.ceil(512 * C.MiB / (16 * sub))))
    g = torch.Generator().manual_seed(0)
    sets = []
    for _ in range(n_sets):
        p = torch.randn(sub, generator=g).mul_(0.02)
        grad = torch.randn(sub, generator=g).mul_(1e-3)
        sets.append((p, grad, torch.zeros(sub), torch.zeros(sub)))
    res.update({"numel": numel, "sub_group_numel": sub, "chunks": chunks, "rotating_sets": n_sets,
                "rotating_bytes": n_sets * 16 * sub})
    times = []
    for rep in range(spec["warmup"] + spec["reps"]):
        t0 = time.perf_counter()
        left = numel
        for i in range(chunks):
            n = min(sub, left)
            p, grad, m, v = (t[:n] for t in sets[i % n_sets])
            adam_step_flat(p, grad, m, v, step=rep + 1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.01)
            left -= n
        times.append(time.perf_counter() - t0)
        print(f"[optimizer] rep {rep} {times[-1]:.2f}s", file=sys.stderr, flush=True)
    res["rep_s"] = times
    res["median_step_s"] = C.median(times[spec["warmup"]:])
    res["gparams_per_s"] = numel / res["median_step_s"] / 1e9
    res["kernel"] = native_info().get("adam_kernel")


# DeepSpeed: ds_e2e.py's own worker, with our size added to its table (run by the peers python).
DS_WRAPPER = """
import sys
peers, name, shape = sys.argv[1], sys.argv[2], tuple(int(x) for x in sys.argv[3].split(","))
sys.path.insert(0, peers)
import ds_e2e
ds_e2e.SIZES[name] = shape
sys.argv = [ds_e2e.__file__] + sys.argv[4:]
ds_e2e.main()
"""


def ds_command(size: str, nvme_dir: str, args: argparse.Namespace) -> list[str]:
    h, layers, heads, inter, vocab = C.size_shape(size)
    shape = ",".join(str(x) for x in (h, layers, heads, inter, vocab))
    return [str(PEERS_PY), "-c", DS_WRAPPER, str(PEERS), size, shape,
            "--worker", "--mode", "ds", "--offload-param", "nvme", "--offload-optimizer", "nvme",
            "--nvme-dir", nvme_dir, "--pin-memory", "--size", size, "--dtype", "fp32",
            "--seq", str(args.seq), "--mbs", str(args.mbs), "--steps", str(1 + args.ds_steps),
            "--warmup", "1", "--seed", str(args.seed), "--lr", str(args.lr),
            "--weight-decay", str(args.weight_decay), "--threads", str(args.threads),
            "--param-buffer-count", str(args.ds_param_buffer_count)]


# =========================================================================== driver
class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scratch = Path(args.scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.out = Path(args.out or self.scratch / f"out_of_core-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.logs = self.out.with_suffix(".logs")
        self.logs.mkdir(exist_ok=True)
        self.results: list[dict] = []

    def spec(self, size: str, **extra) -> dict:
        a = self.args
        return {"size": size, "steps": a.steps, "warmup": a.warmup, "seq": a.seq, "mbs": a.mbs,
                "seed": a.seed, "threads": a.threads, "scratch": str(self.scratch), **extra}

    def run(self, kind: str, size: str, spec: dict | None = None, cmd: list[str] | None = None,
            tag: str | None = None, env: dict | None = None) -> dict:
        tag = tag or kind
        if cmd is None:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--spec", json.dumps(spec)]
        load, avail = os.getloadavg(), C.mem_available()
        res = C.run_worker(cmd, log_path=self.logs / f"{size}-{tag}.log", timeout_s=self.args.timeout,
                           env=env)
        res.update({"bench": "out_of_core", "tag": tag, "size_name": size, "loadavg_before": load,
                    "mem_available_before": avail,
                    "loadavg_after": os.getloadavg()})
        C.append_jsonl(self.out, res)
        self.results.append(res)
        if res.get("ok"):
            extra = f", peak RSS {C.gib(res.get('vm_hwm_bytes') or res.get('wait4_maxrss_bytes'))} GiB" \
                if kind in ("ours", "deepspeed", "compute") else ""
            print(f"{size} {tag}: median {res.get('median_step_s') or 0:.2f} s{extra} "
                  f"({res['process_wall_s']:.0f} s wall)", flush=True)
        else:
            print(f"{size} {tag}: FAILED: {res.get('error') or res.get('skipped')} (log {res['log']})",
                  flush=True)
        return res

    def size(self, size: str) -> dict:
        a = self.args
        shape = C.size_shape(size)
        n_params = C.llama_params(shape)
        got: dict = {"size": size, "n_params": n_params}
        got["rounds"] = []
        for rnd in range(a.rounds):
            ours, compute = {}, None
            for i, schedule in enumerate(a.schedules if "ours" in a.only else []):
                dsc = ds_config("@NVME@", a, schedule)
                if rnd == 0:
                    print(f"ds_config (ours, {size}, early_step {schedule}):\n"
                          f"{json.dumps(dsc, indent=1)}", flush=True)
                ours[schedule] = self.run("ours", size, self.spec(
                    size, schedule=schedule, ds_config=dsc, nvme_placeholder="@NVME@"),
                    tag=round_tag(f"ours-{schedule}", rnd))
                if i == 0 and "compute" in a.only:
                    compute = self.compute(size, n_params, rnd)
            if not ours and "compute" in a.only:
                compute = self.compute(size, n_params, rnd)
            got["rounds"].append({"ours": ours, "compute": compute})
        got["ours"], got["compute"] = got["rounds"][0]["ours"], got["rounds"][0]["compute"]
        got["io"] = {}
        replayed: dict = {}
        for schedule, res in ours.items():
            if not res.get("ok") or "io" not in a.only:
                continue
            st = res["median_stats"]
            key = (round(st["io_read_bytes"] / 2**20), round(st["io_write_bytes"] / 2**20))
            if key in replayed:  # the same bytes: one replay serves both schedules
                got["io"][schedule] = replayed[key]
                continue
            sub_bytes = res["engine_sizes"]["sub_group_numel"] * 4
            chunk = a.io_chunk or min(64 * C.MiB, max(4 * C.MiB, sub_bytes // 4096 * 4096))
            spec = self.spec(size, read_bytes=int(st["io_read_bytes"]),
                             write_bytes=int(st["io_write_bytes"]),
                             file_bytes=int(max(st["nvme_bytes"], res["engine_sizes"]["nvme_bytes"])),
                             aio={k: v for k, v in res["aio"].items()}, chunk=chunk,
                             inflight=a.io_inflight, reps=a.io_reps)
            got["io"][schedule] = replayed[key] = self.run("io", size, spec, tag=f"io-{schedule}")
        ok = [r for r in ours.values() if r.get("ok")]
        if ok and "optimizer" in a.only:
            sub = ok[0]["engine_sizes"]["sub_group_numel"]
            got["optimizer"] = self.run("optimizer", size, self.spec(
                size, numel=ok[0]["n_params"], sub_group_numel=sub, reps=a.io_reps))
        else:
            got["optimizer"] = None
        got["deepspeed"] = self.deepspeed(size) if "deepspeed" in a.only else None
        return got

    def compute(self, size: str, n_params: int, rnd: int = 0) -> dict:
        need = n_params * 8 + int(1.5 * C.GiB)  # params + grads + activations and slack
        avail = C.mem_available()
        if need > 0.92 * avail:
            res = {"ok": False, "contender": "compute", "tag": round_tag("compute", rnd),
                   "size_name": size,
                   "skipped": f"needs ~{need / C.GiB:.1f} GiB, MemAvailable is {avail / C.GiB:.1f} GiB"}
            C.append_jsonl(self.out, res)
            print(f"{size} compute: SKIPPED: {res['skipped']}", flush=True)
            return res
        self.wait_for_memory(need, f"{size} compute")
        return self.run("compute", size, self.spec(size), tag=round_tag("compute", rnd))

    def wait_for_memory(self, need: int, what: str) -> None:
        """Wait up to --mem-wait s for MemAvailable >= need (the machine is shared; a run that
        does not fit is killed by the OOM killer). Runs anyway afterwards: the estimate may be off."""
        deadline = time.monotonic() + self.args.mem_wait
        avail = C.mem_available()
        if avail < need:
            print(f"{what}: waiting up to {self.args.mem_wait:.0f} s for {need / C.GiB:.1f} GiB of "
                  f"MemAvailable ({avail / C.GiB:.1f} GiB now)", flush=True)
        while avail < need and time.monotonic() < deadline:
            time.sleep(10)
            avail = C.mem_available()

    def deepspeed(self, size: str) -> dict:
        if not PEERS_PY.exists() or not (PEERS / "ds_e2e.py").exists():
            res = {"ok": False, "contender": "deepspeed", "tag": "deepspeed", "size_name": size,
                   "skipped": f"no DeepSpeed peer kit ({PEERS_PY}, {PEERS / 'ds_e2e.py'}); run "
                              "shared/peers/setup.sh or pass --skip-deepspeed"}
            C.append_jsonl(self.out, res)
            print(f"{size} deepspeed: SKIPPED: {res['skipped']}", flush=True)
            return res
        env = dict(os.environ, DS_ACCELERATOR="cpu")
        env.pop("INFINITY_NATIVE_LIB", None)
        # DeepSpeed's peak RSS: 17.9 GiB for 0.94B nvme/nvme (peers/DS_E2E.md); at 0.49B it was
        # OOM-killed here above 13.8 GiB, so much of it is fixed-size buffers
        need = max(16 * C.GiB, int(19.5 * C.llama_params(C.size_shape(size))))
        self.wait_for_memory(need, f"{size} deepspeed")
        with tempfile.TemporaryDirectory(prefix="ds-nvme-", dir=self.scratch) as nvme:
            res = self.run("deepspeed", size, cmd=ds_command(size, nvme, self.args), env=env)
        if res.get("ok"):
            res["vm_hwm_bytes"] = int(res.get("vm_hwm_gib", 0) * C.GiB)
            print(f"ds_config (DeepSpeed, {size}):\n{json.dumps(res.get('ds_config'), indent=1)}",
                  flush=True)
        return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.49B,1.04B", help="comma list: 0.49B, 1.04B, tiny, HxLxAxIxV")
    ap.add_argument("--schedules", default="on,off",
                    help=f"schedules to run, of {', '.join(SCHEDULES)} (see SCHEDULES)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps of ours and compute")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of ours (each schedule) and compute alone, alternating, each in a "
                         "fresh process: the step / compute ratio is also given per round, which "
                         "pairs runs minutes apart instead of a whole bench apart (host drift)")
    ap.add_argument("--ds-steps", type=int, default=3, help="timed DeepSpeed steps (after 1 warm-up)")
    ap.add_argument("--io-reps", type=int, default=3, help="timed reps of the I/O and optimizer replays")
    ap.add_argument("--io-chunk", type=int, default=None,
                    help="bytes per replayed request (default: the sub-group bytes, 4-64 MiB)")
    ap.add_argument("--io-inflight", type=int, default=2, help="replayed requests in flight per direction")
    ap.add_argument("--ds-param-buffer-count", type=int, default=5,
                    help="DeepSpeed offload_param buffer_count (ds_e2e.py's default 5 fails its "
                         "swapper assertion at 18 layers)")
    ap.add_argument("--offload-activations", choices=("none", "nvme"), default="none",
                    help="ours: infinity.offload_activations (saved activations to NVMe)")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--skip-compute", action="store_true")
    ap.add_argument("--only", default=",".join(KINDS),
                    help="runs to do, comma list of ours,compute,io,optimizer,deepspeed (io and "
                         "optimizer need ours); e.g. --only deepspeed to redo a killed peer run")
    ap.add_argument("--mem-wait", type=float, default=900,
                    help="seconds to wait for enough MemAvailable before compute / DeepSpeed runs")
    add_run_arguments(ap)
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench",
                    help="directory on the disk under test (each run uses a fresh subdir)")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per worker")
    ap.add_argument("--out", default=None, help="results .jsonl (the table goes beside it as .md)")
    ap.add_argument("--report", metavar="JSONL", nargs="+",
                    help="print the tables of earlier results and exit; with several files a later "
                         "file's runs replace the same runs of an earlier one (a re-run with --only)")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap


def _lists(args: argparse.Namespace) -> None:
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = sorted(set(args.only) - set(KINDS))
    if bad:
        raise SystemExit(f"--only: unknown runs {bad}; choose from {','.join(KINDS)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give at least 1")
    if args.skip_deepspeed:
        args.only = [k for k in args.only if k != "deepspeed"]
    if args.skip_compute:
        args.only = [k for k in args.only if k != "compute"]


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0
    if args.report:
        print(report_file([Path(p) for p in args.report]))
        return 0
    _lists(args)
    for s in args.schedules:
        if s not in SCHEDULES:
            ap.error(f"--schedules: {s!r} is not one of {', '.join(SCHEDULES)}")
    for s in args.sizes:
        C.size_shape(s)
    drv = Driver(args)
    machine = C.machine_info()
    C.append_jsonl(drv.out, {"bench": "out_of_core", "kind": "header", "machine": machine,
                             "argv": sys.argv})
    per_size = [drv.size(s) for s in args.sizes]
    text = report(per_size, args, machine)
    print(text)
    drv.out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {drv.out} and {drv.out.with_suffix('.md')}")
    return 0 if all(r.get("ok") or r.get("skipped") for r in drv.results) else 1


# =========================================================================== report
def report_file(paths: list[Path]) -> str:
    """The tables of results files (rebuilt from their JSON lines, with this version's report).

    The first file's header gives the settings; a later file's run replaces the same (size, run)
    of an earlier file unless it failed where the earlier one succeeded."""
    records, headers = [], []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                (headers if r.get("kind") == "header" else records).append(r)
    args = parser().parse_args(headers[0]["argv"][1:])
    _lists(args)
    sizes = list(args.sizes)
    for h in headers[1:]:
        more = parser().parse_args(h["argv"][1:])
        _lists(more)
        sizes += [s for s in more.sizes if s not in sizes]
        args.schedules += [s for s in more.schedules if s not in args.schedules]
    per_size = []
    for size in sizes:
        mine: dict = {}
        for r in records:
            if r.get("size_name") == size and "tag" in r:
                old = mine.get(r["tag"])
                if old is None or r.get("ok") or not old.get("ok"):
                    mine[r["tag"]] = r
        rounds = []
        for rnd in range(max(1, getattr(args, "rounds", 1))):
            ours = {s: mine[round_tag(f"ours-{s}", rnd)] for s in args.schedules
                    if round_tag(f"ours-{s}", rnd) in mine}
            compute = mine.get(round_tag("compute", rnd))
            if ours or compute:
                rounds.append({"ours": ours, "compute": compute})
        rounds = rounds or [{"ours": {}, "compute": None}]
        got = {"size": size, "n_params": C.llama_params(C.size_shape(size)),
               "ours": rounds[0]["ours"], "compute": rounds[0]["compute"], "rounds": rounds,
               "optimizer": mine.get("optimizer"), "deepspeed": mine.get("deepspeed"), "io": {}}
        ios = [r for t, r in mine.items() if t.startswith("io-")]
        for schedule, res in got["ours"].items():
            io = mine.get(f"io-{schedule}")
            if io is None and res.get("ok"):  # one replay served schedules with the same bytes
                st = res["median_stats"]
                io = next((r for r in ios if abs(r.get("read_bytes", -1) - st["io_read_bytes"]) < 2**20
                           and abs(r.get("write_bytes", -1) - st["io_write_bytes"]) < 2**20), None)
            if io is not None:
                got["io"][schedule] = io
        per_size.append(got)
    return report(per_size, args, headers[0]["machine"])


def round_tag(tag: str, rnd: int) -> str:
    """The tag of a run in round ``rnd`` (0-based): the first round keeps the plain tag, so
    results of one round read as before."""
    return tag if rnd == 0 else f"{tag}@{rnd + 1}"


def paired_ratios(got: dict, schedule: str) -> list[float]:
    """Per round, ours' median step over that round's compute-alone median (both ok)."""
    out = []
    for r in got.get("rounds") or []:
        ours, compute = r["ours"].get(schedule), r["compute"]
        if _med(ours) and _med(compute):
            out.append(ours["median_step_s"] / compute["median_step_s"])
    return out


def _med(res: dict | None) -> float | None:
    return res.get("median_step_s") if res and res.get("ok") else None


def _hit_ratio(res: dict) -> str:
    """This step's prefetch hit ratio (median of the timed steps) and the engine's cumulative one.

    Results from before the per-step counters were recorded: the per-step value is derived from
    the cumulative ratios r_k as (k+1) r_k - k r_(k-1), which assumes every step makes the same
    number of NVMe fetches (marked ~; steps 1.. only, step 0 records the trace)."""
    st, stats = res["median_stats"], res["stats"]
    cum = f"cum. {stats[-1]['prefetch_hit_ratio']:.2f}"
    if "prefetch_hit_ratio_step" in st:
        return f"{st['prefetch_hit_ratio_step']:.2f} ({cum})"
    r = [s["prefetch_hit_ratio"] for s in stats]
    per = [(k + 1) * r[k] - k * r[k - 1] for k in range(1, len(r))]
    return f"~{C.median(per):.2f} ({cum})" if per else cum


def _cpu_split(stats: dict) -> str:
    """'; cpu user / sys s' of a step's median stats, when recorded (on 2 cores the step is
    bound by the CPU whenever user + sys approaches twice its wall time)."""
    if "cpu_user_s" not in stats:
        return ""
    return f"; cpu {stats['cpu_user_s']:.1f} + {stats['cpu_sys_s']:.1f} sys"


def _round_rows(size: str, r: dict, label: str) -> list[list]:
    """Table rows of one round's runs of ours (each schedule) and compute alone."""
    rows: list[list] = []
    for schedule, res in r["ours"].items():
        if not res.get("ok"):
            rows.append([size, f"ours {schedule}{label}", "FAILED: " + str(res.get("error"))[:80]]
                        + [None] * 6)
            continue
        st = res["median_stats"]
        split = (f"compute {st['compute_s']:.1f} / opt {st['optimizer_s']:.1f} "
                 f"(bg {st.get('optimizer_background_s', 0):.1f}, grad wait "
                 f"{st.get('grad_wait_s', 0):.1f}) / io wait {st['io_wait_s']:.1f}"
                 f"{_cpu_split(st)}")
        rows.append([size, f"ours {schedule}{label}", round(res["median_step_s"], 2),
                     ", ".join(f"{x:.1f}" for x in res["step_s"]), split,
                     f"{st['io_read_bytes'] / C.GiB:.2f} / {st['io_write_bytes'] / C.GiB:.2f}",
                     _hit_ratio(res), C.gib(res["vm_hwm_bytes"]),
                     C.gib(res["sampler_peak_rss_bytes"])])
    c = r["compute"]
    if c is not None:
        if c.get("ok"):
            sp = c["median_split"]
            rows.append([size, f"compute alone (torch fwd+bwd, RAM){label}",
                         round(c["median_step_s"], 2),
                         ", ".join(f"{x:.1f}" for x in c["step_s"]),
                         f"fwd {sp['fwd_s']:.1f} / bwd {sp['bwd_s']:.1f}{_cpu_split(sp)}",
                         "-", "-",
                         C.gib(c["vm_hwm_bytes"]), C.gib(c["sampler_peak_rss_bytes"])])
        else:
            rows.append([size, f"compute alone{label}",
                         "SKIPPED/FAILED: " + str(c.get("skipped") or c.get("error"))[:80]]
                        + [None] * 6)
    return rows


def report(per_size: list[dict], args: argparse.Namespace, machine: dict) -> str:
    rows, bars = [], []
    for got in per_size:
        size = got["size"]
        rounds = got.get("rounds") or [{"ours": got["ours"], "compute": got.get("compute")}]
        for rnd, r in enumerate(rounds):
            rows += _round_rows(size, r, f" (round {rnd + 1})" if len(rounds) > 1 else "")
        c = got.get("compute")
        seen = set()
        for schedule, io in got["io"].items():
            if id(io) in seen:
                continue
            seen.add(id(io))
            label = f"I/O alone (replay of {'/'.join(s for s, r in got['io'].items() if r is io)})"
            if io.get("ok"):
                rows.append([size, label, round(io["median_step_s"], 2),
                             ", ".join(f"{x:.1f}" for x in io["rep_s"]),
                             f"{io['gb_per_s']:.2f} GB/s, chunk {io['chunk'] >> 20} MiB x {io['inflight']}/dir, "
                             f"resident before {max(io['resident_pages_before'])}",
                             f"{io['read_bytes'] / C.GiB:.2f} / {io['write_bytes'] / C.GiB:.2f}", "-", "-", "-"])
            else:
                rows.append([size, label, "FAILED: " + str(io.get("error"))[:80]] + [None] * 6)
        o = got.get("optimizer")
        if o is not None:
            if o.get("ok"):
                rows.append([size, "optimizer alone (adam_step_flat, RAM)", round(o["median_step_s"], 2),
                             ", ".join(f"{x:.2f}" for x in o["rep_s"]),
                             f"{o['gparams_per_s']:.2f} Gparam/s, {o['kernel']}, sub-group {o['sub_group_numel']:,}",
                             "-", "-", "-", "-"])
            else:
                rows.append([size, "optimizer alone", "FAILED: " + str(o.get("error"))[:80]] + [None] * 6)
        d = got.get("deepspeed")
        if d is not None:
            if d.get("ok"):
                w = d.get("wall_clock_breakdown_median_ms") or {}
                io = d.get("io_steps_bytes") or {}
                nsteps = max(1, len(d.get("step_s") or []))
                rows.append([size, "DeepSpeed ZeRO-3 nvme/nvme", round(d["median_step_s"], 2),
                             ", ".join(f"{x:.1f}" for x in d["step_s"]),
                             f"fwd {w.get('fwd', 0) / 1e3:.1f} / bwd {w.get('bwd', 0) / 1e3:.1f} / "
                             f"step {w.get('step', 0) / 1e3:.1f}",
                             f"{io.get('read_bytes', 0) / nsteps / C.GiB:.2f} / "
                             f"{io.get('write_bytes', 0) / nsteps / C.GiB:.2f}", "-",
                             d.get("vm_hwm_gib"), "-"])
            else:
                rows.append([size, "DeepSpeed ZeRO-3 nvme/nvme",
                             "SKIPPED/FAILED: " + str(d.get("skipped") or d.get("error"))[:80]] + [None] * 6)
        # bars
        floors = {"compute": _med(c), "optimizer": _med(o)}
        for schedule, res in got["ours"].items():
            if not res.get("ok"):
                continue
            fl = dict(floors, io=_med(got["io"].get(schedule)))
            known = {k: v for k, v in fl.items() if v}
            line = (f"{size} schedule {schedule}: peak RSS {C.gib(res['vm_hwm_bytes'])} GiB "
                    f"({'<=' if res['vm_hwm_bytes'] <= RSS_BAR else 'OVER'} 4 GiB)")
            if known:
                top = max(known, key=known.get)
                line += (f"; step / max(floors) = {res['median_step_s']:.1f} / {known[top]:.1f} ({top}) = "
                         f"{res['median_step_s'] / known[top]:.2f}"
                         + ("" if len(known) == 3 else f" [missing: {sorted(set(fl) - set(known))}]"))
            if res.get("held_room"):
                line += f"; held gradients peak {res['held_room']['peak'] / C.MiB:.0f} MiB " \
                        f"(room {res['held_room']['capacity'] / C.MiB:.0f} MiB)"
            if res.get("rss_phases"):
                peaks = {ph: max(r[ph][1] for r in res["rss_phases"]) for ph in ("fwd", "bwd", "step")}
                line += "; sampler peak by phase fwd / bwd / step " + " / ".join(
                    f"{C.gib(v):.2f}" for v in peaks.values()) + " GiB"
            paired = paired_ratios(got, schedule)
            if len(paired) > 1:
                line += ("; step / compute alone by round " + ", ".join(f"{x:.2f}" for x in paired)
                         + f" (median {C.median(paired):.2f})")
            if _med(d):
                ratio = res["median_step_s"] / d["median_step_s"]
                line += f"; ours / DeepSpeed = {ratio:.2f} ({'meets' if ratio <= DS_TARGET else 'misses'} <= 0.5)"
            bars.append(line)
    if len(per_size) >= 2:
        a, b = per_size[0], per_size[-1]
        for schedule in args.schedules:
            ra, rb = a["ours"].get(schedule, {}), b["ours"].get(schedule, {})
            if ra.get("ok") and rb.get("ok") and b["n_params"] != a["n_params"]:
                dn = b["n_params"] - a["n_params"]
                g = (rb["vm_hwm_bytes"] - ra["vm_hwm_bytes"]) / dn
                line = (f"schedule {schedule}: peak RSS growth {a['size']} -> {b['size']} = "
                        f"{g:.4f} B/param ({'<' if g < GROWTH_BAR else 'NOT <'} {GROWTH_BAR})")
                ca, cb = a.get("compute") or {}, b.get("compute") or {}
                if ra.get("activation_swap") and rb.get("activation_swap"):
                    line += "; saved activations on NVMe (infinity.offload_activations)"
                elif ca.get("saved_activation_bytes") and cb.get("saved_activation_bytes"):
                    act = (cb["saved_activation_bytes"] - ca["saved_activation_bytes"]) / dn
                    line += (f"; of which activations saved for backward {act:.4f} B/param "
                             f"(compute runs), the rest {g - act:.4f} B/param")
                bars.append(line)
    head = (f"Out-of-core bench (fp32, mbs {args.mbs}, seq {args.seq}, host budget {args.host_budget}, "
            f"{args.warmup} warm-up + {args.steps} timed steps, DeepSpeed 1 + {args.ds_steps}); "
            f"{machine['cpu']}, {machine['cpus']} CPUs, {machine['mem_total_gib']} GiB, "
            f"load avg at start {tuple(round(x, 1) for x in machine['loadavg'])}")
    table = C.markdown_table(["size", "run", "median s", "steps / reps s", "split (median s) / detail",
                              "I/O read / write GiB per step", "prefetch hit", "peak RSS GiB (VmHWM)",
                              "sampler peak GiB"], rows)
    return "\n".join([head, "", table, "", *bars])


if __name__ == "__main__":
    sys.exit(main())
