#!/usr/bin/env python3
"""Pretrained load bench (issue 26): ``infinity.from_pretrained`` of a >= 2 GB Hugging Face
checkpoint into stage 3 with parameters and optimizer on NVMe under a 1 GiB host budget,
against a raw read of the same files plus a raw write of the bytes the engine stores, in one run.

Run (from the repository root):
    python3 tools/bench/hf_load.py                         # 1.24B Llama, bf16 files, 2 rounds
    python3 tools/bench/hf_load.py --size tiny --rounds 1  # a smoke run
Writes JSON lines to --out (default /var/tmp/infinity-bench/hf_load-<time>.jsonl) and a
Markdown table to the screen.

The checkpoint is generated, not downloaded: a Llama of --size (tools/bench/_common.py shapes,
or HxLxAxIxV) built on the meta device names the tensors, and random values (std 0.02, norms
1) are streamed into transformers' sharded layout (--shard-size) by infinity's own writer
(infinity/checkpoint/pretrained_write.py), a piece at a time; it is kept in --scratch for the
next run (--regenerate to write it again). Each measurement is a fresh process, the files'
pages dropped from the page cache first (posix_fadvise DONTNEED; the files were fsync'd):
  ours  infinity.from_pretrained(dir, config) with host_memory_budget --host-budget (1GiB),
        stage 3, offload_param and offload_optimizer on NVMe in --scratch; timed from the call
        to its return (model built on meta, files checked, every unit read, converted and
        written home, optimizer states allocated); peak RSS (VmHWM) against the RSS after
        importing torch, transformers' Llama classes and infinity (the post-import baseline).
  raw   the same files read front to back (8 MiB reads, one buffer), then the number of bytes
        the engine wrote to NVMe in the round before (its tier manager's count) written to a
        file in --scratch with O_DIRECT (8 MiB aligned writes) and fsync'd.
Bars: peak RSS <= budget + baseline + 0.5 GiB; load time <= 1.25 x (raw read + raw write).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

C.LLAMA_SIZES.setdefault("1.24B", (2048, 22, 16, 5504, 32000))
PIECE = 8 << 20


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the checkpoint --------------------------------------------------------------------------
def generate(directory: Path, size: str, dtype_name: str, shard_size: str, seed: int) -> dict:
    """A random Llama checkpoint of ``size`` in transformers' layout, streamed to disk."""
    import torch
    import transformers

    from infinity.checkpoint.pretrained_write import DTYPES, shard_bytes
    from infinity.checkpoint.sharded_writer import ShardedWriter

    dtype = DTYPES[dtype_name]
    cfg = C.llama_config(C.size_shape(size), 2048)
    cfg.dtype = dtype
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    table = [(name, dtype, tuple(p.shape)) for name, p in model.state_dict().items()]
    directory.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(directory, table, shard_bytes(shard_size))
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    step = 16 << 20
    for name, _, shape in table:
        n = 1
        for d in shape:
            n *= d
        for a in range(0, n, step):
            c = min(step, n - a)
            piece = torch.ones(c) if "norm" in name else torch.randn(c, generator=gen) * 0.02
            writer.append(name, piece.to(dtype))
    writer.close()
    cfg.save_pretrained(directory)
    files = _files(directory)
    drop_cache(files)
    return {"params": sum(p.numel() for p in model.parameters()),
            "file_bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "generate_s": round(time.perf_counter() - start, 1)}


# -- workers ---------------------------------------------------------------------------------
def ours_worker(spec: dict) -> None:
    with C.worker_stdout() as emit:
        res: dict = {"bench": "hf_load", "contender": "ours", "ok": False}
        try:
            _ours(spec, res)
            res["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the driver reports it with the log tail
            import traceback

            traceback.print_exc()
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["vm_hwm_bytes"] = C.proc_status()["VmHWM"]
        emit(res)


def _ours(spec: dict, res: dict) -> None:
    import torch
    # the post-import baseline: torch, transformers' Llama classes, infinity's loader
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import infinity
    import infinity.engine.pretrained  # noqa: F401

    torch.set_num_threads(spec["threads"])
    res["baseline_rss_bytes"] = C.proc_status()["VmRSS"]
    src = Path(spec["checkpoint"])
    drop_cache(_files(src))
    swap = Path(tempfile.mkdtemp(prefix="hf-load-", dir=spec["scratch"]))
    ds = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
          "zero_optimization": {"stage": 3,
                                "offload_param": {"device": "nvme", "nvme_path": str(swap)},
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}},
          "infinity": {"host_memory_budget": spec["host_budget"]}}
    if spec.get("device_budget"):
        ds["infinity"]["device_memory_budget"] = spec["device_budget"]
    res["ds_config"] = ds
    sampler = C.RssSampler().start()
    start = time.perf_counter()
    engine, *_ = infinity.from_pretrained(src, config=ds)
    res["load_s"] = round(time.perf_counter() - start, 2)
    res["sampled_peak_rss_bytes"] = sampler.stop()
    res["vm_hwm_after_load_bytes"] = C.proc_status()["VmHWM"]
    counters = engine.manager.counters
    res["nvme_write_bytes"] = counters.nvme_write_bytes
    res["nvme_read_bytes"] = counters.nvme_read_bytes
    res["compute_dtype"] = str(engine.compute_dtype).replace("torch.", "")
    res["units"] = len(engine.units)
    res["largest_unit_bytes"] = max(u.nbytes for u in engine.units)
    res["host_budget_bytes"] = engine.manager.host_budget.limit
    res["host_budget_peak_bytes"] = engine.manager.host_budget.peak
    if spec.get("check"):        # a forward works on what was loaded
        with torch.no_grad():
            out = engine(input_ids=torch.arange(8).reshape(1, 8))
        res["logits_finite"] = bool(torch.isfinite(out.logits).all())
    engine.close()
    swap.rmdir()


def raw_worker(spec: dict) -> None:
    with C.worker_stdout() as emit:
        res: dict = {"bench": "hf_load", "contender": "raw", "ok": False}
        try:
            _raw(spec, res)
            res["ok"] = True
        except BaseException as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        emit(res)


def _raw(spec: dict, res: dict) -> None:
    import mmap

    files = _files(Path(spec["checkpoint"]))
    drop_cache(files)
    buf = mmap.mmap(-1, PIECE)          # page-aligned, for the O_DIRECT writes too
    view = memoryview(buf)
    start = time.perf_counter()
    total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [view])
                if n <= 0:
                    break
                total += n
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    res["read_s"] = round(time.perf_counter() - start, 2)
    res["read_bytes"] = total
    nbytes = int(spec["write_bytes"])
    target = Path(tempfile.mkstemp(prefix="hf-load-raw-", dir=spec["scratch"])[1])
    try:
        fd = os.open(target, os.O_WRONLY | os.O_DIRECT)
        try:
            start = time.perf_counter()
            written = 0
            while written < nbytes:
                written += os.pwritev(fd, [view], written)
            os.fsync(fd)
            res["write_s"] = round(time.perf_counter() - start, 2)
            res["write_bytes"] = written
        finally:
            os.close(fd)
    finally:
        target.unlink()


# -- driver ----------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("ours", "raw"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="1.24B")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                    help="dtype of the generated files")
    ap.add_argument("--shard-size", default="1GB")
    ap.add_argument("--host-budget", default="1GiB")
    ap.add_argument("--device-budget", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.spec)
        (ours_worker if args.worker == "ours" else raw_worker)(spec)
        return 0

    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or scratch / f"hf_load-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    checkpoint = scratch / f"hf-{args.size}-{args.dtype}"
    info_file = checkpoint / "bench_checkpoint.json"
    if args.regenerate or not info_file.is_file():
        print(f"generating {checkpoint} ...", file=sys.stderr)
        info = generate(checkpoint, args.size, args.dtype, args.shard_size, args.seed)
        info_file.write_text(json.dumps(info))
    info = json.loads(info_file.read_text())
    machine = C.machine_info()
    C.append_jsonl(out, {"bench": "hf_load", "machine": machine, "checkpoint": info,
                         "args": vars(args)})
    spec = {"checkpoint": str(checkpoint), "scratch": str(scratch), "threads": args.threads,
            "host_budget": args.host_budget, "device_budget": args.device_budget, "check": True}
    rows, loads, raws = [], [], []
    for round_ in range(args.rounds):
        ours = C.run_worker([sys.executable, __file__, "--worker", "ours", "--spec",
                             json.dumps(spec)], log_path=out.with_suffix(f".ours{round_}.log"),
                            timeout_s=3600)
        ours["round"] = round_
        C.append_jsonl(out, ours)
        if not ours.get("ok"):
            print(json.dumps(ours, indent=1), file=sys.stderr)
            return 1
        raw = C.run_worker([sys.executable, __file__, "--worker", "raw", "--spec",
                            json.dumps({**spec, "write_bytes": ours["nvme_write_bytes"]})],
                           log_path=out.with_suffix(f".raw{round_}.log"), timeout_s=3600)
        raw["round"] = round_
        C.append_jsonl(out, raw)
        if not raw.get("ok"):
            print(json.dumps(raw, indent=1), file=sys.stderr)
            return 1
        from infinity.base.sizes import parse_bytes

        budget = parse_bytes(args.host_budget)   # the configured budget (device pool inside)
        rss_bar = budget + ours["baseline_rss_bytes"] + C.GiB // 2
        raw_s = raw["read_s"] + raw["write_s"]
        verdict = {"round": round_, "load_s": ours["load_s"], "raw_read_s": raw["read_s"],
                   "raw_write_s": raw["write_s"], "time_ratio": round(ours["load_s"] / raw_s, 3),
                   "peak_rss_gib": C.gib(ours["vm_hwm_bytes"]),
                   "baseline_rss_gib": C.gib(ours["baseline_rss_bytes"]),
                   "rss_bar_gib": C.gib(rss_bar), "rss_ok": ours["vm_hwm_bytes"] <= rss_bar,
                   "time_ok": ours["load_s"] <= 1.25 * raw_s}
        C.append_jsonl(out, {"bench": "hf_load", "verdict": verdict})
        loads.append(ours["load_s"])
        raws.append(raw_s)
        rows.append([round_, info["file_bytes"] / 1e9, ours["nvme_write_bytes"] / 1e9,
                     ours["load_s"], raw["read_s"], raw["write_s"], verdict["time_ratio"],
                     verdict["baseline_rss_gib"], verdict["peak_rss_gib"],
                     verdict["rss_bar_gib"], "yes" if verdict["rss_ok"] and
                     verdict["time_ok"] else "NO"])
    print(f"{machine['cpu']}, {machine['cpus']} CPUs, load {machine['loadavg']}; "
          f"{info['params'] / 1e9:.2f}B params, {info['files']} files of {args.dtype}; "
          f"host budget {args.host_budget}")
    print(C.markdown_table(["round", "file GB", "stored GB", "load s", "raw read s",
                            "raw write s", "load / raw", "baseline GiB", "peak RSS GiB",
                            "RSS bar GiB", "bars met"], rows))
    median_ratio = C.median([a / b for a, b in zip(loads, raws)])
    print(f"median load {C.median(loads):.2f} s, median raw read + write {C.median(raws):.2f} s, "
          f"median per-round ratio {median_ratio:.3f} (bar 1.25)")
    C.append_jsonl(out, {"bench": "hf_load", "summary": {
        "median_load_s": C.median(loads), "median_raw_s": C.median(raws),
        "median_ratio": median_ratio}})
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
