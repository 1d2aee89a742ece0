#!/usr/bin/env python3
"""Soak: many out-of-core training steps per step schedule; do RSS, open fds and threads stay flat?

Run (from the repository root; INFINITY_NATIVE_LIB may point at a fresh native build):
    python3 tools/soak.py                                  # 1,000 steps, early step on, then off
    python3 tools/soak.py --steps 200 --schedules on       # a quick look at one schedule
    python3 tools/soak.py --report RUN.jsonl --warmup 200  # judge an earlier run again
Writes one JSON line per sample (and one "end" and one "verdict" line per schedule) to --out
(default /var/tmp/infinity-soak/soak-<time>.jsonl) and the table as Markdown beside it (.md), as
well as the screen. Exit status 1 when a schedule is not flat or its loss did not go down.

What runs: a byte-level Llama (``infinity train``'s model and data: infinity.train.models and
infinity.train.data; default 4 layers of hidden 256, 3.3M parameters, so a step takes a tenth of
a second or so on a small CPU) under ZeRO stage 3 with parameters and optimizer states on NVMe
(a private swap directory under --nvme-path), the ``infinity train`` demo config otherwise. Each
schedule runs in a fresh process (so one's memory, fds and threads are not the other's):
  on   infinity.early_step "on": each unit is stepped as its gradient arrives (this needs no
       gradient clipping, so the demo's gradient_clipping is dropped);
  off  infinity.early_step "off": the deferred step, with the demo's gradient_clipping 1.0 and
       speculative_step "auto", so speculations are committed and rolled back as clipping acts.
A checkpoint is saved every --save-every steps into a temporary directory (the save path soaks
too). Every --sample-every steps the worker records: RSS (psutil), open fds (/proc/self/fd),
threads (/proc/self/task, native ones included), the swap directory's file bytes and allocated
blocks, the engine's own NVMe/host accounting, glibc's bytes in use (mallinfo2), the live Python
objects, and the step's loss. On a loaded machine with few cores, run it with
OMP_WAIT_POLICY=PASSIVE: there torch's spinning OpenMP workers made the early-step schedule
8-40x slower (BENCHMARKS.md, "Soak (1,000 steps)").

Verdict: warm-up is the first --warmup steps (default 100: the first step records the module
trace, the first steps fill the buffer pool, the allocator's arenas and torch's thread pools).
A metric is flat when every later sample is within --tolerance (default 2%, the issue's bar) of
the first sample at or after the warm-up; the loss must go down (mean of the last 50 steps below
the mean of the first 50). When something grows, the end line names the Python object types
whose counts grew and the memory mappings whose resident bytes grew (/proc/self/smaps, warm-up
to the last step), and --tracemalloc adds the source lines whose allocations grew.
"""
from __future__ import annotations

import argparse
import collections
import copy
import ctypes
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEDULES = ("on", "off")
FLAT_METRICS = ("rss_bytes", "fds", "threads")
TABLE_STEPS = (100, 500, 1000)
MiB = 1 << 20


# --------------------------------------------------------------------------- the worker
def soak_config(schedule: str, nvme_path: str, steps: int) -> dict[str, Any]:
    """The ``infinity train`` demo ds_config for ``schedule`` (see the module docstring)."""
    from infinity.train.run_config import Overrides, build_ds_config, demo_config

    base = copy.deepcopy(demo_config())
    if schedule == "on":
        base.pop("gradient_clipping", None)
    base["infinity"]["early_step"] = schedule
    ds, _ = build_ds_config(base, Overrides(nvme_path=nvme_path, steps=steps))
    return ds


def model_config(args: argparse.Namespace) -> Any:
    """The byte-level Llama of ``--model-size``, with --hidden/--layers/--intermediate applied."""
    from transformers import LlamaConfig

    from infinity.train.models import preset_kwargs

    kwargs = preset_kwargs(args.model_size, args.seq_len)
    if args.hidden:
        kwargs.update(hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 64))
    if args.layers:
        kwargs["num_hidden_layers"] = args.layers
    if args.intermediate:
        kwargs["intermediate_size"] = args.intermediate
    config = LlamaConfig(**kwargs)
    config._attn_implementation = "sdpa"
    return config


def swap_usage(path: Path) -> dict[str, int]:
    """Files, apparent bytes and allocated bytes (st_blocks) of the files in ``path``."""
    files = apparent = allocated = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            files += 1
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return {"swap_files": files, "swap_file_bytes": apparent, "swap_alloc_bytes": allocated}


def process_usage() -> dict[str, int]:
    """RSS, open fds and threads (kernel tasks, so native threads count) of this process."""
    import psutil

    return {"rss_bytes": psutil.Process().memory_info().rss,
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")), **malloc_usage()}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_usage() -> dict[str, int | None]:
    """glibc's own count: bytes handed out by malloc (heap + mmapped chunks) and free in its
    arenas; a native leak grows the first, fragmentation the second (None off glibc)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {"malloc_in_use": None, "malloc_free": None}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"malloc_in_use": info.uordblks + info.hblkhd, "malloc_free": info.fordblks}


def rss_by_mapping() -> collections.Counter:
    """Resident bytes per mapping of /proc/self/smaps ([heap], [anon], a library's name, ...)."""
    out: collections.Counter = collections.Counter()
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields:
                continue
            if not fields[0].endswith(":"):          # a mapping's header: address perms ... [path]
                name = Path(fields[5]).name if len(fields) > 5 and fields[5].startswith("/") \
                    else (fields[5] if len(fields) > 5 else "[anon]")
            elif fields[0] == "Rss:":
                out[name] += int(fields[1]) * 1024
    return out


def object_counts() -> collections.Counter:
    """Live Python objects tracked by the garbage collector, by type name."""
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def source_state() -> dict[str, Any]:
    """The commit measured, and the package's files that differ from it (a shared tree)."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True,
                                  timeout=30, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    import infinity
    return {"commit": git("rev-parse", "HEAD"), "package": str(Path(infinity.__file__).parent),
            "uncommitted": git("status", "--porcelain", "--", "infinity", "native").splitlines()}


def take_sample(schedule: str, step: int, loss: float | None, engine: Any,
                started: float) -> dict[str, Any]:
    swap = engine.manager.swap
    stats = engine.step_stats() if step else {}
    return {"kind": "sample", "schedule": schedule, "step": step, "loss": loss,
            "elapsed_s": round(time.perf_counter() - started, 2), **process_usage(),
            **swap_usage(swap.path),
            "engine_nvme_allocated": swap.bytes_allocated,
            "engine_nvme_on_disk": swap.bytes_on_disk,
            "engine_host_bytes": stats.get("host_bytes"),
            "engine_device_bytes": stats.get("device_bytes"),
            "step_s": stats.get("step_s"), "py_objects": len(gc.get_objects())}


def run_worker(args: argparse.Namespace) -> int:
    """One schedule in this process: train, sample, save; JSON lines to ``args.out``."""
    import torch

    import infinity
    from infinity.train import data as data_mod
    from infinity.train.models import build_model, count_parameters, describe

    schedule = args.worker
    ds = soak_config(schedule, args.nvme_path, args.steps)
    config = model_config(args)
    corpus = data_mod.load_corpus(None)
    sampler = data_mod.BatchSampler(corpus, args.seq_len, ds["train_micro_batch_size_per_gpu"],
                                    args.seed)
    trace = None
    if args.tracemalloc:
        import tracemalloc
        trace = tracemalloc
    def emit(record: dict[str, Any]) -> None:
        with open(args.out, "a") as out:       # one line at a time: a killed run keeps its samples
            out.write(json.dumps(record) + "\n")

    # a kill (SIGTERM) unwinds like Ctrl-C, so the engine's close removes its swap directory
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.manual_seed(args.seed)
    model = build_model(config, infinity.zero.Init(config=ds))
    engine, *_ = infinity.initialize(model=model, config=ds)
    engine.train()
    started = time.perf_counter()
    losses: list[float] = []
    saved: list[int] = []
    warm_counts = warm_snapshot = None
    maps_at: dict[int, collections.Counter] = {}
    try:
        emit({"kind": "start", "schedule": schedule, **source_state(),
              "model": describe(config, count_parameters(config)),
              "early_step": bool(engine.optimizer.early_step),
              "torch_threads": torch.get_num_threads(),
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "swap_dir": str(engine.manager.swap.path), "ds_config": ds})
        first = take_sample(schedule, 0, None, engine, started)
        emit(first)
        with tempfile.TemporaryDirectory(prefix="infinity-soak-ckpt-", dir=args.nvme_path) as ckpt:
            for step in range(1, args.steps + 1):
                batch = sampler.next_batch()
                output = engine(input_ids=batch, labels=batch)
                engine.backward(output.loss)
                engine.step()
                losses.append(float(output.loss.detach()))
                del output
                if step % args.save_every == 0:
                    path = engine.save_checkpoint(ckpt, client_state={"step": step})
                    saved.append(sum(p.stat().st_size for p in Path(path).rglob("*")
                                     if p.is_file()))
                if step in (args.warmup, args.steps):
                    # resident bytes per mapping, at the same point of the step as the sample
                    # (taken first: a sample's gc lists are heap the maps would count)
                    maps_at[step] = rss_by_mapping()
                if step % args.sample_every == 0:
                    record = take_sample(schedule, step, losses[-1], engine, started)
                    emit(record)
                    print(f"[{schedule}] step {step:5d}  loss {record['loss']:.3f}  "
                          f"rss {record['rss_bytes'] / MiB:7.1f} MiB  fds {record['fds']:3d}  "
                          f"threads {record['threads']:3d}  "
                          f"swap {record['swap_alloc_bytes'] / MiB:6.1f} MiB  "
                          f"{record['elapsed_s']:7.1f} s", flush=True)
                if step == args.warmup:
                    warm_counts = object_counts()
                    if trace is not None:
                        trace.start(10)
                        warm_snapshot = trace.take_snapshot()
        end: dict[str, Any] = {
            "kind": "end", "schedule": schedule, "steps": args.steps,
            "wall_s": round(time.perf_counter() - started, 1),
            "loss_first50": statistics.fmean(losses[:50]),
            "loss_last50": statistics.fmean(losses[-50:]),
            "checkpoints": len(saved), "checkpoint_bytes": saved[-1] if saved else 0,
            "speculation": dict(getattr(engine.optimizer, "speculation_stats", {}) or {}),
            "fd_targets": _tally(_fd_kind(fd) for fd in os.listdir("/proc/self/fd")),
            "thread_names": _tally(_thread_name(t) for t in os.listdir("/proc/self/task"))}
        if warm_counts is not None:
            grown = object_counts() - warm_counts
            end["objects_grown_since_warmup"] = grown.most_common(15)
        if len(maps_at) == 2:
            before, after = maps_at[args.warmup], maps_at[args.steps]
            end["rss_grown_by_mapping"] = [(k, after[k] - before[k]) for k in sorted(
                set(after) | set(before), key=lambda k: -abs(after[k] - before[k]))[:8]
                if after[k] != before[k]]
        if warm_snapshot is not None:
            diff = trace.take_snapshot().compare_to(warm_snapshot, "lineno")
            end["tracemalloc_top"] = [str(s) for s in diff[:15]]
            trace.stop()
        emit(end)
    finally:
        engine.close()
    return 0


def _tally(names: Any) -> list[tuple[str, int]]:
    return sorted(collections.Counter(names).items())


def _fd_kind(fd: str) -> str:
    """What an open fd points at, with numbers and this run's paths folded (for counting)."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "gone"
    if target.startswith("/"):
        return str(Path(target).parent) + "/*"
    return re.sub(r"\[\d+\]", "[N]", target)   # socket:[123] -> socket:[N]; anon_inode:[x] stays


def _thread_name(tid: str) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return "gone"


# --------------------------------------------------------------------------- the driver
def verdict(samples: list[dict[str, Any]], end: dict[str, Any], warmup: int,
            tolerance: float) -> dict[str, Any]:
    """Per metric: the baseline (first sample at or after ``warmup``), the largest deviation from
    it afterwards (fraction) and whether that is within ``tolerance``; and whether the loss fell."""
    after = [s for s in samples if s["step"] >= warmup]
    if not after:
        raise ValueError(f"no sample at or after the warm-up (step {warmup})")
    base = after[0]
    out: dict[str, Any] = {"kind": "verdict", "schedule": end["schedule"],
                           "baseline_step": base["step"]}
    flat = True
    for key in (*FLAT_METRICS, "swap_alloc_bytes", "engine_nvme_allocated"):
        worst = max(after, key=lambda s: abs(s[key] - base[key]))
        dev = abs(worst[key] - base[key]) / base[key] if base[key] else float(worst[key] != 0)
        ok = dev <= tolerance
        out[key] = {"base": base[key], "worst": worst[key], "worst_step": worst["step"],
                    "last": after[-1][key], "max_dev": dev, "flat": ok}
        flat = flat and ok
    out["loss_down"] = end["loss_last50"] < end["loss_first50"]
    out["flat"] = flat
    out["ok"] = flat and out["loss_down"]
    return out


def render(samples: list[dict[str, Any]], verdicts: list[dict[str, Any]],
           ends: list[dict[str, Any]], tolerance: float) -> str:
    lines = [("| schedule | step | loss | RSS MiB | fds | threads | swap files MiB (apparent / "
              "allocated) | engine NVMe allocated MiB | malloc in use MiB | Python objects |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    steps = set(TABLE_STEPS) | {max((s["step"] for s in samples), default=0)}
    for s in samples:
        if s["step"] in steps:
            lines.append(f"| {s['schedule']} | {s['step']} | {s['loss']:.3f} | "
                         f"{_mib(s['rss_bytes'])} | {s['fds']} | {s['threads']} | "
                         f"{_mib(s['swap_file_bytes'])} / {_mib(s['swap_alloc_bytes'])} | "
                         f"{_mib(s['engine_nvme_allocated'])} | {_mib(s.get('malloc_in_use'))} | "
                         f"{s['py_objects']} |")
    lines.append("")
    for v, e in zip(verdicts, ends):
        parts = [f"{k.split('_')[0]} {100 * v[k]['max_dev']:.2f}% "
                 f"({'flat' if v[k]['flat'] else 'GROWS'})"
                 for k in (*FLAT_METRICS, "swap_alloc_bytes")]
        lines.append(f"- **{v['schedule']}**: {'FLAT' if v['flat'] else 'NOT FLAT'} after warm-up "
                     f"(max deviation from step {v['baseline_step']}, bar {100 * tolerance:g}%: "
                     f"{', '.join(parts)}); loss {e['loss_first50']:.3f} -> {e['loss_last50']:.3f} "
                     f"(mean of first / last 50 steps) {'down' if v['loss_down'] else 'NOT DOWN'}; "
                     f"{e['checkpoints']} checkpoints of {e['checkpoint_bytes'] / MiB:.1f} MiB; "
                     f"{e['wall_s']:.0f} s")
    return "\n".join(lines)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.1f}"


def run_driver(args: argparse.Namespace, argv: list[str]) -> int:
    """Each schedule in a fresh worker process, then the report (verdict lines appended)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = Path(args.out or f"/var/tmp/infinity-soak/soak-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    for schedule in [s.strip() for s in args.schedules.split(",") if s.strip()]:
        if schedule not in SCHEDULES:
            raise SystemExit(f"--schedules: {schedule!r} is not one of {', '.join(SCHEDULES)}")
        worker = subprocess.Popen([sys.executable, __file__, *argv, "--worker", schedule,
                                   "--out", str(out)])
        try:
            rc = worker.wait()
        except BaseException:     # Ctrl-C reaches the worker too; a kill of the driver is passed on
            worker.terminate()
            worker.wait()
            raise
        if rc != 0:
            print(f"schedule {schedule}: worker exited {rc}", file=sys.stderr)
            return rc
    return report(out, args, append=True)


def report(out: Path, args: argparse.Namespace, append: bool) -> int:
    """Judge the samples in ``out``; print the table and write it beside ``out`` (.md)."""
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    samples = [r for r in records if r["kind"] == "sample"]
    ends = [r for r in records if r["kind"] == "end"]
    if not ends:
        raise SystemExit(f"{out}: no finished schedule (no \"end\" line)")
    verdicts = []
    for end in ends:
        v = verdict([s for s in samples if s["schedule"] == end["schedule"]], end,
                    args.warmup, args.tolerance)
        verdicts.append(v)
        for key in ("objects_grown_since_warmup", "rss_grown_by_mapping", "tracemalloc_top",
                    "fd_targets", "thread_names", "speculation"):
            if key in end:
                print(f"[{end['schedule']}] {key}: {end[key]}")
    if append:
        with out.open("a") as f:
            for v in verdicts:
                f.write(json.dumps(v) + "\n")
    table = render(samples, verdicts, ends, args.tolerance)
    start = next(r for r in records if r["kind"] == "start")
    dirty = start.get("uncommitted") or []
    head = (f"soak: {ends[0]['steps']} steps per schedule, {start['model']}, stage 3, params and "
            f"optimizer on NVMe under {Path(start['swap_dir']).parent}; commit "
            f"{start.get('commit', '?')[:10]}"
            + (f" with {len(dirty)} uncommitted package files" if dirty else ""))
    out.with_suffix(".md").write_text(head + "\n\n" + table + "\n")
    print("\n" + head + "\n\n" + table)
    print(f"\nresults: {out} and {out.with_suffix('.md')}")
    return 0 if all(v["ok"] for v in verdicts) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--schedules", default="on,off",
                        help="comma-separated: on (early step), off")
    parser.add_argument("--model-size", default="tiny",
                        help="an infinity train preset (the base shape)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (0: the preset's)")
    parser.add_argument("--layers", type=int, default=4, help="layers (0: the preset's)")
    parser.add_argument("--intermediate", type=int, default=688, help="MLP size (0: the preset's)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nvme-path", default="/var/tmp", help="parent of the swap directory")
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--tracemalloc", action="store_true",
                        help="trace allocations after warm-up (slow)")
    parser.add_argument("--out", default=None, help="JSON lines file (.md is written beside it)")
    parser.add_argument("--report", metavar="JSONL", help="judge the samples of an earlier run "
                        "again (e.g. with another --warmup or --tolerance); runs nothing")
    parser.add_argument("--worker", choices=SCHEDULES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args)
    if args.report:
        return report(Path(args.report), args, append=False)
    argv = [a for a in sys.argv[1:]]
    argv = _drop_flag(argv, "--out")
    return run_driver(args, argv)


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
