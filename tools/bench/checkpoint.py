#!/usr/bin/env python3
"""Checkpoint bench: save and load of a ZeRO-3 nvme/nvme training state, ours against
DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` on the same model, in one run.

Run (from the repository root):
    python3 tools/bench/checkpoint.py                      # 0.49B, ours then DeepSpeed, twice
    python3 tools/bench/checkpoint.py --size tiny --rounds 1
Writes JSON lines to --out (default /var/tmp/infinity-bench/checkpoint-<time>.jsonl), and a
Markdown table to the screen.

Each contender is a fresh process (one at a time, alternating ours / DeepSpeed for --rounds):
the Llama of tools/bench/out_of_core.py (--size), fp32, built under zero.Init with parameters
and optimizer states on NVMe, one training step (so the Adam states exist), then a save to a
fresh directory on --scratch, a load of it into the same engine, and the directory removed.
  ours       infinity, host_memory_budget 3GiB (out_of_core.py's config, early step);
             load with verify_checksums on (sha256 of every file read first) and off.
  deepspeed  shared/peers/ds_e2e.py's own DeepSpeed worker and config (run by the peers venv);
             its engine is taken from deepspeed.initialize and saved/loaded with DeepSpeed's
             defaults (torch.save files per rank).
Reported: seconds, checkpoint bytes, write/read rate, and the RSS a save or load adds over the
RSS before it (a 50 ms sampler), which is what limits checkpointing a model larger than memory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("PEERS_DIR", REPO.parent / "shared" / "peers"))
PEERS_PY = Path(os.environ.get("PEERS_PYTHON", Path.home() / ".venvs" / "peers" / "bin" / "python"))


def ours_worker(spec: dict) -> None:
    with C.worker_stdout() as emit:
        res: dict = {"bench": "checkpoint", "contender": "ours", "size": spec["size"], "ok": False,
                     "git": C.git_state()}
        sampler = C.RssSampler().start()
        try:
            _ours(spec, res, sampler)
            res["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - the driver reports it with the log tail
            import traceback

            traceback.print_exc()
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        sampler.stop()
        res["vm_hwm_bytes"] = C.proc_status()["VmHWM"]
        emit(res)


def _ours(spec: dict, res: dict, sampler: C.RssSampler) -> None:
    import torch
    import transformers

    import infinity

    torch.set_num_threads(spec["threads"])
    shape = C.size_shape(spec["size"])
    cfg = C.llama_config(shape, spec["seq"])
    ids = C.token_batches(spec["seed"], 1, cfg.vocab_size, spec["seq"], 1)[0]
    scratch = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=spec["scratch"]))
    nvme = scratch / "swap"
    nvme.mkdir()
    dsc = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3,
                                 "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
           "infinity": {"host_memory_budget": "3GiB"}}
    res["ds_config"] = dsc
    torch.manual_seed(spec["seed"])
    with infinity.zero.Init(config=dsc):
        model = transformers.LlamaForCausalLM(cfg)
    res["n_params"] = sum(p.numel() for p in model.parameters())
    engine, *_ = infinity.initialize(model=model, config=dsc)
    try:
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        engine.flush()
        target = scratch / "ckpt"
        res["save"] = C.timed_call(sampler, lambda: engine.save_checkpoint(target, tag="t"))
        res["checkpoint_bytes"] = C.dir_bytes(target)
        res["load"] = C.timed_call(sampler, lambda: engine.load_checkpoint(target, tag="t"))
        res["load_unverified"] = C.timed_call(
            sampler, lambda: engine.load_checkpoint(target, tag="t", verify_checksums=False))
    finally:
        engine.close()
        shutil.rmtree(scratch, ignore_errors=True)   # ours: made above


# DeepSpeed: ds_e2e.py's worker builds, inits and trains one step; its engine is taken from
# deepspeed.initialize and checkpointed here (run by the peers python).
DS_WRAPPER = r"""
import json, os, sys, time, shutil
peers, bench, name, shape, target = sys.argv[1:6]
sys.path[:0] = [peers, bench]
import ds_e2e, deepspeed
import _common as C
ds_e2e.SIZES[name] = tuple(int(x) for x in shape.split(","))
taken = {}
initialize = deepspeed.initialize
def keep(*a, **k):
    out = initialize(*a, **k)
    taken["engine"] = out[0]
    return out
deepspeed.initialize = keep

def worker(args):
    with C.worker_stdout() as emit:
        res = {"bench": "checkpoint", "contender": "deepspeed", "size": name, "ok": False}
        sampler = C.RssSampler().start()
        try:
            ds_e2e._run_worker(args, res)
            engine = taken["engine"]
            res["save"] = C.timed_call(sampler, lambda: engine.save_checkpoint(target, tag="t"))
            res["checkpoint_bytes"] = C.dir_bytes(target)
            res["load"] = C.timed_call(sampler, lambda: engine.load_checkpoint(target, tag="t"))
            res["ok"] = True
        except BaseException as exc:
            import traceback
            traceback.print_exc()
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        sampler.stop()
        res["vm_hwm_bytes"] = C.proc_status()["VmHWM"]
        for key in ("fingerprint", "wall_clock_breakdown_ms", "wall_clock_breakdown_init_ms"):
            res.pop(key, None)
        shutil.rmtree(target, ignore_errors=True)
        emit(res)
    os._exit(0)

ds_e2e.run_worker = worker
sys.argv = [ds_e2e.__file__] + sys.argv[6:]
ds_e2e.main()
"""


def ds_command(args: argparse.Namespace, scratch: Path) -> list[str]:
    shape = ",".join(str(x) for x in C.size_shape(args.size))
    return [str(PEERS_PY), "-c", DS_WRAPPER, str(PEERS), str(Path(__file__).resolve().parent),
            args.size, shape, str(scratch / "ckpt"),
            "--worker", "--mode", "ds", "--offload-param", "nvme", "--offload-optimizer", "nvme",
            "--nvme-dir", str(scratch / "swap"), "--pin-memory", "--size", args.size,
            "--dtype", "fp32", "--seq", str(args.seq), "--mbs", "1", "--steps", "1",
            "--warmup", "0", "--seed", str(args.seed), "--threads", str(args.threads)]


def _rate(res: dict, phase: str) -> str:
    if not res.get("ok") or phase not in res:
        return "-"
    return f"{res['checkpoint_bytes'] / res[phase]['s'] / C.GiB:.2f}"


def report(results: list[dict]) -> str:
    rows = ["| contender | round | save s | save GiB/s | save +RSS GiB | load s | load GiB/s | "
            "load +RSS GiB | load s (no sha256) | checkpoint GiB | peak RSS GiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        if not res.get("ok"):
            rows.append(f"| {res['contender']} | {res['round']} | failed: "
                        f"{res.get('error', '?')[:120]} |")
            continue
        gib = lambda b: f"{b / C.GiB:.2f}"  # noqa: E731
        rows.append(
            f"| {res['contender']} | {res['round']} | {res['save']['s']} | {_rate(res, 'save')} | "
            f"{gib(res['save']['rss_added_bytes'])} | {res['load']['s']} | {_rate(res, 'load')} | "
            f"{gib(res['load']['rss_added_bytes'])} | "
            f"{res.get('load_unverified', {}).get('s', '-')} | {gib(res['checkpoint_bytes'])} | "
            f"{gib(res['vm_hwm_bytes'])} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.49B")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        ours_worker(json.loads(args.spec))
        return 0
    scratch_root = Path(args.scratch)
    scratch_root.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or scratch_root / f"checkpoint-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    logs = out.with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    spec = {"size": args.size, "seq": args.seq, "seed": args.seed, "threads": args.threads,
            "scratch": str(scratch_root)}
    results = []
    for rnd in range(args.rounds):
        runs = [("ours", [sys.executable, os.path.abspath(__file__), "--worker", "--spec",
                          json.dumps(spec)], None)]
        if not args.skip_deepspeed:
            ds_scratch = Path(tempfile.mkdtemp(prefix="checkpoint-ds-", dir=scratch_root))
            runs.append(("deepspeed", ds_command(args, ds_scratch), ds_scratch))
        for name, cmd, to_remove in runs:
            print(f"[round {rnd}] {name} ...", file=sys.stderr, flush=True)
            res = C.run_worker(cmd, log_path=logs / f"{name}-{rnd}.log", timeout_s=args.timeout)
            res.setdefault("contender", name)
            res["round"] = rnd
            if to_remove is not None:
                shutil.rmtree(to_remove, ignore_errors=True)
            results.append(res)
            with open(out, "a") as f:
                f.write(json.dumps(res) + "\n")
            print(report([res]).splitlines()[-1], file=sys.stderr, flush=True)
    print(f"checkpoint bench, size {args.size}; {out}")
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
