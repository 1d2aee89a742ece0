#!/usr/bin/env python3
"""The out-of-core bench model on a GPU under torch.profiler, beside the dry run's prediction
for the same machine: what issue 36 asks of the first GPU lent (tools/gpu_check.sh runs it).

Run (from the repository root, on a machine with a CUDA device):
    python3 tools/bench/gpu_profile.py --out /tmp/gpu_profile                # 0.49B, three setups
    python3 tools/bench/gpu_profile.py --size tiny --warmup 1 --steps 1     # smoke (CPU too)
    python3 tools/bench/gpu_profile.py --predict /tmp/gpu_profile/profile.json   # no GPU needed
(``--predict``: only the dry run's predictions, for the rates of an earlier run or a JSON object
of them; what BENCHMARKS.md records for the next GPU pass.)
Writes ``profile.json`` (every figure), ``trace.json.gz`` (the profiled step of the first setup:
open it in https://ui.perfetto.dev; ``trace-accumulate.json.gz`` for that setup) under --out, and
a table on the screen.

Setups (each a fresh engine; ``--setups`` picks):
  overlap   parameters and optimizer offloaded to host memory, micro-batch 4 x seq 1024, the
            early step: a unit's host-to-device copy has its neighbours' compute to hide behind,
            but the CPU Adam of the whole model (~0.3 s on the first H200 machine) is the step,
            and compute waits for it, with nothing left to hide a copy behind;
  accumulate  host memory, micro-batch 32 x seq 1024, 4 micro-batches a step (the deferred
            step, the last micro-batch stepping each unit in its backward). In "overlap" a unit's copy (101 MB, ~1.8 ms at 55 GB/s) outlasts its
            forward (~0.5 ms for 4k tokens), so no prefetch could hide it; at 32k tokens the
            forward of a unit takes longer than the copy of the next, and 4 micro-batches'
            compute outweighs the CPU Adam: here the share of copy time hidden behind compute
            is the engine's prefetch, not the model's shape or the optimizer's wait;
  bench     tools/bench/out_of_core.py's config (parameters and optimizer on NVMe, host budget
            3 GiB, micro-batch 1 x seq 128): the step the CPU benches measure.
Per setup: ``--warmup`` steps, ``--steps`` timed steps (wall clock, the device synchronized at
each step's end; no profiler), then one step under torch.profiler. From the profiled step's
trace: the union of compute kernels, and the host-to-device (and device-to-host) copies' time
and the part of it that runs while a compute kernel runs ("hidden"), beside the same share on
the dry run's clock (its copy rows under its compute row, the last simulated step). The dry run's
compute is one busy span a unit: where the GPU is launch-bound (kernels sparse, "overlap") it
predicts more hidden than a profile can show. MFU: model FLOPs a step
(6 x the parameters that multiply x tokens, plus attention's 12 x layers x hidden x seq x
tokens) over the median step, against the GPU preset's datasheet peak and against the bf16
matmul rate measured in this run.

The reference: after the setups, PyTorch FSDP2 with CPU offload trains the "overlap" setup's
model and batch (tools/bench/fsdp2_offload.py, its own process; ``--no-fsdp2`` skips it), once,
not interleaved with the engine's run; the summary gives the ratio of the two steps.

The dry run's prediction (tools/bench/gpu_predict.py): ``infinity plan --hf-config --config
--dry-run --json`` for this machine as a target (one GPU of the preset its name matches, with the matmul rate, the pinned
host-to-device rate and the swap directory's read and write rates measured in this run, the
host's memory and cores), so the comparison is of the engine's schedule, not of datasheets.
On a CPU-only machine the tool still runs (no kernels or copies in the trace: those shares are
None) and the dry run plans this machine.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from gpu_predict import gpu_preset, predict, read_rates  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# the interval arithmetic the dry run's own share (``hidden_share``) uses, so the measured and
# the predicted figures are counted alike
from infinity.commands.dry_run_trace import covered, union  # noqa: E402
Interval = tuple[float, float]

SETUPS: dict[str, dict[str, Any]] = {
    "overlap": {"offload": "cpu", "seq": 1024, "mbs": 4, "accumulate": 1, "host_budget": None},
    "accumulate": {"offload": "cpu", "seq": 1024, "mbs": 32, "accumulate": 4,
                   "host_budget": None},
    "bench": {"offload": "nvme", "seq": 128, "mbs": 1, "accumulate": 1, "host_budget": "3GiB"},
}
TRACED = ("accumulate",)
"""Setups whose profiled step is written as ``trace-<setup>.json.gz`` beside the first's."""


# =========================================================================== trace analysis
KINDS = ("compute", "side", "nccl", "h2d", "d2h")


def _stream(event: dict[str, Any]) -> int | None:
    stream = event.get("args", {}).get("stream")
    return None if stream is None else int(stream)


def _device_events(trace: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(kind, event) of each device event of a torch.profiler Chrome trace: ``compute`` (the
    kernels on the compute stream: the stream with the most non-NCCL kernel time), ``side``
    (other kernels off it: a dtype conversion inside a copy runs on the copy's stream),
    ``nccl`` (a collective's kernels), ``h2d`` and ``d2h`` (memcpy events, by the direction in
    their name)."""
    found: list[tuple[str, dict[str, Any]]] = []
    kernel_us: dict[int | None, float] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or "dur" not in event:
            continue
        cat, name = event.get("cat", ""), event.get("name", "")
        if cat == "kernel" and name.lower().startswith("nccl"):
            found.append(("nccl", event))
        elif cat == "kernel":
            found.append(("compute", event))
            kernel_us[_stream(event)] = kernel_us.get(_stream(event), 0.0) + float(event["dur"])
        elif cat == "gpu_memcpy" and "HtoD" in name:
            found.append(("h2d", event))
        elif cat == "gpu_memcpy" and "DtoH" in name:
            found.append(("d2h", event))
    main = max(kernel_us, key=kernel_us.__getitem__) if kernel_us else None
    return [("side" if kind == "compute" and _stream(event) != main else kind, event)
            for kind, event in found]


def _span(event: dict[str, Any]) -> Interval:
    return float(event["ts"]), float(event["ts"]) + float(event["dur"])


def trace_intervals(trace: dict[str, Any]) -> dict[str, list[Interval]]:
    """The device's busy intervals (microseconds), by kind (``_device_events``)."""
    kinds: dict[str, list[Interval]] = {kind: [] for kind in KINDS}
    for kind, event in _device_events(trace):
        kinds[kind].append(_span(event))
    return kinds


def trace_streams(trace: dict[str, Any]) -> dict[str, list[int]]:
    """The CUDA streams each kind ran on: copies on the compute stream cannot overlap it."""
    streams: dict[str, set[int]] = {kind: set() for kind in KINDS}
    for kind, event in _device_events(trace):
        if _stream(event) is not None:
            streams[kind].add(_stream(event))
    return {kind: sorted(ids) for kind, ids in streams.items()}


def length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in union(intervals))


WAIT_SLACK_US = 30.0
"""A compute kernel that starts this soon after a copy ends, the compute stream idle until
then, waited for that copy: a stream wait starts it within microseconds of the copy's end,
while a kernel the host happens to launch then is rare (the first H200 profile's forward
launched one every ~100 µs or more)."""


def stalled(copies: Iterable[Interval], compute: Iterable[Interval],
            slack: float = WAIT_SLACK_US) -> list[Interval]:
    """The parts of ``copies`` that the compute stream sat idle waiting for: for a copy after
    whose end the next compute kernel starts within ``slack``, with no compute kernel running
    at that end, the span from the later of the copy's start and the last compute kernel's end
    before it to the copy's end. A copy the compute stream did not wait for stalls nothing,
    however little compute ran beside it (compute waiting on the host or on the CPU Adam)."""
    busy = union(compute)
    starts = sorted(start for start, _ in busy)
    out: list[Interval] = []
    for start, end in copies:
        i = bisect.bisect_left(starts, end)
        if i == len(starts) or starts[i] - end > slack:
            continue
        last = busy[i - 1][1] if i > 0 else float("-inf")   # busy[i - 1] starts before end
        if last >= end:
            continue          # a kernel ran when the copy ended: compute was not waiting
        out.append((max(start, last), end))
    return out


def longest_gap(compute: Iterable[Interval], every: Iterable[Interval]) -> float | None:
    """The longest span of the window (``every`` event's) in which no compute kernel ran (None:
    no compute): where the device waited on the host. The fourth H200 pass's "accumulate" step:
    163 ms of 1046 at its end, the step stream behind the last backward."""
    busy, every = union(compute), list(every)
    if not busy:
        return None
    edges = [min(s for s, _ in every)] + [x for span in busy for x in span] + \
        [max(e for _, e in every)]
    return max(edges[i + 1] - edges[i] for i in range(0, len(edges) - 1, 2))


def overlap_figures(trace: dict[str, Any]) -> dict[str, Any]:
    """What a profiled step says of the overlap: each kind's busy time (µs, their union), the
    window from the first to the last device event, the streams, and for each copy direction
    the share of its time during which a compute-stream kernel ran ("hidden"), the share
    issued on the compute stream itself (which can never be hidden), and the share the compute
    stream sat waiting for (``stalled``: what a copy costs the step; a copy beside idle compute
    is not hidden, yet costs nothing when compute waits on something else); None where there
    were no such copies; and the longest span without compute (``longest_gap``)."""
    events = _device_events(trace)
    kinds = trace_intervals(trace)
    streams = trace_streams(trace)
    every = [span for spans in kinds.values() for span in spans]
    window = (max(e for _, e in every) - min(s for s, _ in every)) if every else 0.0
    out: dict[str, Any] = {"window_us": window,
                           "compute_gap_us": longest_gap(kinds["compute"], every),
                           **{f"{kind}_us": length(spans) for kind, spans in kinds.items()},
                           "events": {kind: len(spans) for kind, spans in kinds.items()},
                           "streams": streams}
    main = streams["compute"][0] if streams["compute"] else None
    for kind in ("h2d", "d2h"):
        busy = out[f"{kind}_us"]
        on_main = [_span(e) for k, e in events if k == kind and _stream(e) == main]
        out[f"{kind}_hidden_share"] = (covered(kinds[kind], kinds["compute"]) / busy
                                       if busy > 0 else None)
        out[f"{kind}_on_compute_stream_share"] = length(on_main) / busy if busy > 0 else None
        out[f"{kind}_stalling_share"] = (length(stalled(kinds[kind], kinds["compute"])) / busy
                                         if busy > 0 else None)
    return out


def model_flops_per_step(shape: Sequence[int], seq: int, mbs: int) -> float:
    """Training FLOPs a step of the Llama ``shape``: 6 x the parameters that multiply (all but
    the input embedding) x tokens, plus attention's scores and values (12 x layers x hidden x
    seq per token): the usual count (PaLM's appendix B), forward + backward, no recomputation."""
    h, layers, _, _, vocab = shape
    tokens = seq * mbs
    multiplying = C.llama_params(shape) - vocab * h
    return 6.0 * multiplying * tokens + 12.0 * layers * h * seq * tokens


# =========================================================================== measurement
def _config(setup: dict[str, Any], nvme: str, compute_dtype: str) -> dict[str, Any]:
    offload = setup["offload"]
    where = {"device": offload, **({"nvme_path": nvme} if offload == "nvme" else {})}
    # "on": the early step; with accumulation the last micro-batch's backward steps each unit
    # (optim/boundary_steps.py)
    infinity: dict[str, Any] = {"early_step": "on",
                                "compute_dtype": compute_dtype}
    if setup["host_budget"]:
        infinity["host_memory_budget"] = setup["host_budget"]
    return {"train_micro_batch_size_per_gpu": setup["mbs"],
            "gradient_accumulation_steps": setup["accumulate"],
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_param": where,
                                  "offload_optimizer": dict(where)},
            "infinity": infinity}


def measure_rates(device, scratch: str, disk: bool) -> dict[str, Any]:
    """The dry run's inputs for this machine, measured now: the bf16 matmul rate and the pinned
    host-to-device rate of the GPU, the host memory bandwidth, the swap directory's cold read
    and write rates; beside them the engine's CPU Adam kernel alone (reported, not an input:
    the dry run derives it from the cores and the memory bandwidth)."""
    import torch

    rates: dict[str, Any] = {"cpu_cores": len(os.sched_getaffinity(0)),
                             "host_total_bytes": os.sysconf("SC_PAGE_SIZE")
                             * os.sysconf("SC_PHYS_PAGES"),
                             **host_rates()}
    if device.type == "cuda":
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        start, reps = time.perf_counter(), 10
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        rates["matmul_tflops"] = 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12
        host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        dev = torch.empty_like(host, device=device)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        start, reps = time.perf_counter(), 5
        for _ in range(reps):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        rates["h2d_GBps"] = host.numel() * reps / (time.perf_counter() - start) / 1e9
        rates["gpu_name"] = torch.cuda.get_device_name(device)
        rates["gpu_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
        del a, b, host, dev
    if disk:
        from infinity.train.calibrate import measure_disk

        got = measure_disk(scratch, size=512 << 20, repeats=1)
        rates["nvme_read_GBps"], rates["nvme_write_GBps"] = got["read_GBps"], got["write_GBps"]
        st = os.statvfs(scratch)
        rates["disk_free_bytes"] = st.f_bavail * st.f_frsize
    return rates


def host_rates(numel: int = 64 << 20) -> dict[str, float]:
    """The host memory bandwidth (a float32 copy of ``numel`` elements, bytes read plus
    written, the best of three) and the CPU Adam kernel's parameters per second over ``numel``
    (``infinity.train.calibrate.measure_adam``, the engine's threads, fp32 states: the rate the
    planner's per-core figure stands for)."""
    import torch

    from infinity.train.calibrate import measure_adam

    src, dst = torch.rand(numel), torch.empty(numel)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return {"host_memory_GBps": 2 * 4 * numel / best / 1e9,
            "adam_params_per_s": measure_adam(numel, sub_group=numel)["params_per_s"]}


def run_setup(name: str, args: argparse.Namespace, device, out: Path,
              write_trace: bool) -> dict[str, Any]:
    """One setup: the engine's timed steps, one profiled step, the trace's figures."""
    import torch
    import transformers

    import infinity

    setup = dict(SETUPS[name])
    if args.seq:
        setup["seq"] = args.seq
    shape = C.size_shape(args.size)
    cfg = C.llama_config(shape, setup["seq"])
    every = C.token_batches(1234, (args.warmup + args.steps + 1) * setup["accumulate"],
                            cfg.vocab_size, setup["seq"], setup["mbs"])
    k = setup["accumulate"]      # a step's micro-batches
    data = [[ids.to(device) for ids in every[i:i + k]] for i in range(0, len(every), k)]
    nvme = tempfile.mkdtemp(prefix="gpu-profile-", dir=args.scratch)
    compute_dtype = "bf16" if device.type == "cuda" else "fp32"
    dsc = _config(setup, nvme, compute_dtype)
    res: dict[str, Any] = {"setup": name, **setup, "size": args.size, "ds_config": dsc,
                           "compute_dtype": compute_dtype}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    with infinity.zero.Init(config=dsc):
        model = transformers.LlamaForCausalLM(cfg)
    engine, *_ = infinity.initialize(model=model, config=dsc)
    try:
        res["engine_device"] = str(engine.device)

        def step(micro_batches) -> float:
            """One optimizer step: each micro-batch's forward, backward and ``engine.step()``
            (the engine steps at the accumulation boundary); the mean loss, read once at the
            end (a read per micro-batch would make the host wait for the device each time)."""
            losses_ = []
            for ids in micro_batches:
                out_ = engine(input_ids=ids, labels=ids)
                engine.backward(out_.loss)
                engine.step()
                losses_.append(out_.loss.detach())
            return float(sum(losses_)) / len(losses_)

        steps, losses = [], []
        for i, ids in enumerate(data[:-1]):
            sync()
            start = time.perf_counter()
            losses.append(step(ids))
            sync()
            steps.append(time.perf_counter() - start)
            print(f"[{name}] step {i} {steps[-1]:.3f} s loss {losses[-1]:.4f}", flush=True)
        res["step_s"], res["losses"] = steps, losses
        res["median_step_s"] = statistics.median(steps[args.warmup:])
        res["warmup"], res["timed_steps"] = args.warmup, len(steps) - args.warmup
        res["step_stats"] = engine.step_stats()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with tempfile.TemporaryDirectory() as tmp:
            with torch.profiler.profile(activities=activities) as prof:
                step(data[-1])
                sync()
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            trace = json.loads(raw.read_text())
            if write_trace or name in TRACED:
                traced = "trace.json.gz" if write_trace else f"trace-{name}.json.gz"
                with gzip.open(out / traced, "wt") as f:
                    json.dump(trace, f)
        res["profiled"] = overlap_figures(trace)
    finally:
        engine.close()
        # ours (mkdtemp above); close removed the engine's swap files, unless it failed first
        shutil.rmtree(nvme, ignore_errors=True)
    res["model_flops_per_step"] = model_flops_per_step(shape, setup["seq"], setup["mbs"]) * \
        setup["accumulate"]
    res["model_tflops"] = res["model_flops_per_step"] / res["median_step_s"] / 1e12
    return res


def predictions(rates: dict[str, Any], names: Sequence[str], args: argparse.Namespace) -> str:
    """The dry run's step and copy shares hidden behind compute for each setup, on ``rates``."""
    lines = []
    for name in names:
        setup = SETUPS[name]
        seq = args.seq or setup["seq"]
        res = {**setup, "seq": seq, "ds_config": _config(setup, args.scratch, "bf16")}
        dry = predict(res, rates, args.size, args.scratch)
        hidden = dry.get("hidden_behind_compute") or {}
        lines.append(f"dry run [{name}] {args.size} mbs {setup['mbs']} x {setup['accumulate']} "
                     f"seq {seq}: predicted {_fmt(dry.get('simulated_step_s'))} s (analytical "
                     f"{_fmt(dry.get('analytical_step_s'))} s; CPU Adam busy "
                     f"{_fmt(dry.get('busy_s', {}).get('CPU Adam'))} s), copies hidden behind "
                     f"compute: h2d {_fmt(hidden.get('H2D'))}, d2h {_fmt(hidden.get('D2H'))}"
                     + (f" {dry['error']}" if "error" in dry else ""))
    return "\n".join(lines)


def fsdp2_reference(args: argparse.Namespace, ours: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 with CPU offload on the "overlap" setup's model and batch
    (tools/bench/fsdp2_offload.py, in its own process: it sets up torch.distributed), after the
    engine's run, not interleaved with it (a lent GPU's minutes are few); its figures, or the
    error."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).with_name("fsdp2_offload.py")), "--json",
           "--size", args.size, "--mbs", str(ours["mbs"]), "--seq", str(ours["seq"]),
           "--warmup", str(max(1, args.warmup)), "--steps", str(args.steps)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.fsdp2_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.fsdp2_timeout} s", "command": cmd}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exited {done.returncode}: {done.stderr.strip()[-600:]}",
                "command": cmd}
    return json.loads(lines[-1])


def fsdp2_line(ref: dict[str, Any], ours: dict[str, Any]) -> str:
    """The summary's line for the FSDP2 reference beside the engine's "overlap" step."""
    if "error" in ref:
        return f"fsdp2 [overlap] failed: {ref['error']}"
    return (f"fsdp2 [overlap] median {ref['median_step_s']:.3f} s of {ref['timed_steps']} steps "
            f"on {ref['device']}, offload {ref['offload']} (parameters on the host: "
            f"{ref.get('params_on_cpu')}), {ref.get('adam', '-')}, peak device "
            f"{_fmt(ref['peak_device_bytes'] and ref['peak_device_bytes'] / C.GiB, '.2f')} GiB; "
            f"infinity / fsdp2 {ours['median_step_s'] / ref['median_step_s']:.2f} "
            "(one run each, not interleaved)")


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1e3


def report(results: dict[str, Any]) -> str:
    """The table gpu_check.sh's summary greps: one line per figure and setup."""
    rates = results["rates"]
    lines = [f"rates host memory {_fmt(rates.get('host_memory_GBps'), '.1f')} GB/s, CPU Adam "
             f"kernel {_fmt(rates.get('adam_params_per_s', 0) / 1e9, '.2f')} G params/s on "
             f"{rates['cpu_cores']} cores, h2d {_fmt(rates.get('h2d_GBps'), '.1f')} GB/s, "
             f"matmul {_fmt(rates.get('matmul_tflops'), '.0f')} TFLOPS"]
    peak = results.get("peak_tflops")
    for name, res in results["setups"].items():
        prof = res["profiled"]
        dry = res.get("dry_run", {})
        predicted = dry.get("hidden_behind_compute") or {}
        mfu_peak = res["model_tflops"] / peak if peak else None
        mfu_measured = (res["model_tflops"] / rates["matmul_tflops"]
                        if rates.get("matmul_tflops") else None)
        error = f" {dry['error']}" if "error" in dry else ""
        lines += [
            f"step [{name}] median {res['median_step_s']:.3f} s of {res['timed_steps']} steps "
            f"after {res['warmup']} warm-up on {res['engine_device']}, {res['size']} mbs "
            f"{res['mbs']} x {res['accumulate']} seq {res['seq']} offload {res['offload']}; "
            f"optimizer {_fmt(res['step_stats'].get('optimizer_s'))} s a step (step stream: "
            f"busy {_fmt(res['step_stats'].get('optimizer_background_s'))} s, kernels "
            f"{_fmt(res['step_stats'].get('optimizer_kernel_s'))} s, device-copy writes waited "
            f"{_fmt(res['step_stats'].get('device_write_wait_s'))} s)",
            f"mfu [{name}] {_fmt(mfu_peak)} of the datasheet peak ({peak} TFLOPS), "
            f"{_fmt(mfu_measured)} of the measured matmul rate "
            f"({_fmt(rates.get('matmul_tflops'), '.0f')} TFLOPS); {res['model_tflops']:.2f} "
            "model TFLOPS",
            f"h2d [{name}] hidden behind compute {_fmt(prof['h2d_hidden_share'])} of "
            f"{prof['h2d_us'] / 1e3:.2f} ms copies, {_fmt(prof['h2d_on_compute_stream_share'])} "
            f"on the compute stream, {_fmt(prof.get('h2d_stalling_share'))} stalling it "
            f"(profiled step: compute {prof['compute_us'] / 1e3:.2f} ms "
            f"busy of a {prof['window_us'] / 1e3:.2f} ms window, the longest without "
            f"compute {_fmt(_ms(prof.get('compute_gap_us')), '.2f')} ms; the dry run "
            "predicts "
            f"{_fmt(predicted.get('H2D'))} hidden)",
            f"d2h [{name}] hidden behind compute {_fmt(prof['d2h_hidden_share'])} of "
            f"{prof['d2h_us'] / 1e3:.2f} ms copies, {_fmt(prof['d2h_on_compute_stream_share'])} "
            f"on the compute stream (the dry run predicts {_fmt(predicted.get('D2H'))} hidden)",
            f"dry run [{name}] predicted {_fmt(dry.get('simulated_step_s'))} s (analytical "
            f"{_fmt(dry.get('analytical_step_s'))} s; CPU Adam busy "
            f"{_fmt(dry.get('busy_s', {}).get('CPU Adam'))} s){error}",
        ]
        if dry.get("simulated_step_s"):
            lines.append(f"ratio [{name}] measured / predicted "
                         f"{res['median_step_s'] / dry['simulated_step_s']:.2f} (bar: within 30%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="0.49B", help="a tools/bench size (0.49B, tiny, HxLxAxIxV)")
    ap.add_argument("--setups", default="overlap,accumulate,bench", help=f"comma list of {sorted(SETUPS)}")
    ap.add_argument("--seq", type=int, default=None, help="override every setup's seq")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--scratch", default="/var/tmp", help="swap directory's parent")
    ap.add_argument("--out", default="/tmp/gpu_profile")
    ap.add_argument("--no-fsdp2", dest="fsdp2", action="store_false",
                    help="skip FSDP2 with CPU offload on the overlap setup's model "
                         "(tools/bench/fsdp2_offload.py), run after the setups")
    ap.add_argument("--fsdp2-timeout", type=float, default=150.0, metavar="S")
    ap.add_argument("--predict", metavar="RATES", default=None,
                    help="run nothing: the dry run's prediction for each setup on a machine "
                         "described by RATES, a JSON object of measure_rates' keys or the path "
                         "of a run's profile.json (its rates); needs no GPU")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps {args.steps} / --warmup {args.warmup}: at least one timed "
                         "step and no negative warm-up")
    names = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(names) - set(SETUPS))
    if unknown:
        raise SystemExit(f"--setups: unknown {unknown}; choose from {sorted(SETUPS)}")
    if args.predict is not None:
        print(predictions(read_rates(args.predict), names, args))
        return 0
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    disk = any(SETUPS[n]["offload"] == "nvme" for n in names)
    results: dict[str, Any] = {"machine": C.machine_info(), "git": C.git_state(),
                               "argv": sys.argv, "rates": measure_rates(device, args.scratch, disk),
                               "setups": {}}
    from infinity.planner.target import GPU_PRESETS

    preset = gpu_preset(results["rates"].get("gpu_name", ""))
    results["peak_tflops"] = GPU_PRESETS[preset].peak_tflops if preset else None
    path = out / "profile.json"
    for i, setup in enumerate(names):
        res = run_setup(setup, args, device, out, write_trace=i == 0)
        res["dry_run"] = predict(res, results["rates"], args.size, args.scratch)
        results["setups"][setup] = res
        path.write_text(json.dumps(results, indent=1, default=str))   # kept as each ends
        print(report({**results, "setups": {setup: res}}), flush=True)  # a later one may not end
    if args.fsdp2 and "overlap" in results["setups"]:
        ours = results["setups"]["overlap"]
        results["fsdp2"] = fsdp2_reference(args, ours)
        path.write_text(json.dumps(results, indent=1, default=str))
        print(fsdp2_line(results["fsdp2"], ours), flush=True)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
