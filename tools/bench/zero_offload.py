#!/usr/bin/env python3
"""ZeRO-Offload bench (issue 5): our stage 2 with the optimizer on NVMe vs plain PyTorch.

Run (from the repository root; INFINITY_NATIVE_LIB may point at a fresh native build):
    python3 tools/bench/zero_offload.py                       # 0.49B, 2 rounds, 1 warm-up + 3 steps
    python3 tools/bench/zero_offload.py --size tiny --steps 1 --rounds 1   # seconds, a smoke test
Writes JSON lines to --out (default /var/tmp/infinity-bench/zero_offload-<time>.jsonl) and a
Markdown table beside it (.md), as well as the screen.

Model: Llama width 2048 / 5504 / vocab 32000, 7 layers (0.49B), fp32, micro-batch 1, seq 128;
the same seeded init and token batches for both contenders. Contenders, each in a fresh process,
interleaved round by round (torch, ours, torch, ours, ...):
  torch  model in RAM, torch.optim.AdamW(fused=True)
  ours   infinity.initialize with ZeRO stage 2, offload_optimizer nvme (parameters on the device,
         which is RAM here); the ds_config is printed and stored in the results
A run's figure is its median step time after --warmup steps; peak RSS is VmHWM (and a 50 ms RSS
sampler thread, and wait4's ru_maxrss). The ratio ours / torch is taken per round (two runs
seconds apart) and its median reported, which is robust to drifts in machine load.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

CONTENDERS = ("torch", "ours")


def ds_config(nvme_path: str, args: argparse.Namespace) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": args.weight_decay}},
        "zero_optimization": {"stage": 2,
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
        "aio": {"block_size": args.aio_block_size, "queue_depth": args.aio_queue_depth,
                "thread_count": 1, "single_submit": False, "overlap_events": True},
    }
    inf = {"early_step": args.early_step}
    if args.host_budget:
        inf["host_memory_budget"] = args.host_budget
    cfg["infinity"] = inf
    return cfg


# --------------------------------------------------------------------------- worker
def worker(kind: str, spec: dict) -> None:
    res: dict = {"bench": "zero_offload", "contender": kind, "size": spec["size"]}
    C.measured_worker(res, lambda sampler: _work(kind, spec, res))


def _work(kind: str, spec: dict, res: dict) -> None:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    shape = C.size_shape(spec["size"])
    cfg = C.llama_config(shape, spec["seq"])
    data = C.token_batches(spec["seed"], spec["warmup"] + spec["steps"], cfg.vocab_size,
                           spec["seq"], spec["mbs"])
    t0 = time.perf_counter()
    torch.manual_seed(spec["seed"])
    model = transformers.LlamaForCausalLM(cfg).float().train()
    res["n_params"] = sum(p.numel() for p in model.parameters())
    losses, steps, splits = [], [], []
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=spec["weight_decay"], fused=True)
        res["init_s"] = time.perf_counter() - t0
        res["rss_after_init_bytes"] = C.proc_status()["VmRSS"]
        for ids in data:
            ta = time.perf_counter()
            out = model(input_ids=ids, labels=ids)
            tb = time.perf_counter()
            out.loss.backward()
            tc = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            td = time.perf_counter()
            losses.append(float(out.loss))
            steps.append(td - ta)
            splits.append({"fwd_s": tb - ta, "bwd_s": tc - tb, "optimizer_s": td - tc})
            print(f"[torch] step {len(steps) - 1} loss {losses[-1]:.6f} {steps[-1]:.2f}s",
                  file=sys.stderr, flush=True)
    else:
        import infinity

        nvme = tempfile.mkdtemp(prefix="zero-offload-", dir=spec["scratch"])
        res["ds_config"] = copy.deepcopy(spec["ds_config"])
        res["ds_config"]["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme
        engine, *_ = infinity.initialize(model=model, config=res["ds_config"])
        try:
            res["init_s"] = time.perf_counter() - t0
            res["rss_after_init_bytes"] = C.proc_status()["VmRSS"]
            res["engine_sizes"] = {k: (v.name if hasattr(v, "name") else v)
                                   for k, v in vars(engine.sizes).items()}
            res["early_step"] = bool(engine.optimizer.early_step)
            for ids in data:
                ta = time.perf_counter()
                out = engine(input_ids=ids, labels=ids)
                engine.backward(out.loss)
                engine.step()
                td = time.perf_counter()
                losses.append(float(out.loss))
                steps.append(td - ta)
                splits.append(engine.step_stats())
                print(f"[ours] step {len(steps) - 1} loss {losses[-1]:.6f} {steps[-1]:.2f}s "
                      f"{json.dumps({k: round(v, 3) for k, v in splits[-1].items()})}",
                      file=sys.stderr, flush=True)
            res["native_info"] = infinity.native_info()
        finally:
            engine.close()
            os.rmdir(nvme)  # ours (mkdtemp above); the engine removed its swap files
    res["losses"] = losses
    res["step_s"] = steps
    res["splits"] = splits
    timed = slice(spec["warmup"], None)
    res["median_step_s"] = C.median(steps[timed])
    res["median_split"] = {k: C.median([s[k] for s in splits[timed]]) for k in splits[0]} \
        if splits[timed] else {}


# --------------------------------------------------------------------------- driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.49B", help="0.49B (default), tiny, or HxLxAxIxV")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (torch, ours), order alternating")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--early-step", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--host-budget", default=None, help='infinity.host_memory_budget, e.g. "6GiB"')
    ap.add_argument("--aio-block-size", type=int, default=1 << 20)
    ap.add_argument("--aio-queue-depth", type=int, default=32)
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench",
                    help="directory on the NVMe/disk under test (swap files go in a fresh subdir)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    ap.add_argument("--out", default=None, help="results .jsonl (the table goes beside it as .md)")
    ap.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0

    C.size_shape(args.size)  # fail early on a bad size
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or scratch / f"zero_offload-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_suffix(".logs")
    logs.mkdir(exist_ok=True)
    dsc = ds_config("<fresh dir under --scratch>", args)
    print("ds_config (ours):", json.dumps(dsc, indent=1), flush=True)
    machine = C.machine_info()
    C.append_jsonl(out, {"bench": "zero_offload", "kind": "header", "machine": machine,
                         "argv": sys.argv, "ds_config": dsc})
    spec = {"size": args.size, "steps": args.steps, "warmup": args.warmup, "seq": args.seq,
            "mbs": args.mbs, "seed": args.seed, "lr": args.lr, "weight_decay": args.weight_decay,
            "threads": args.threads, "scratch": str(scratch), "ds_config": dsc}
    rounds = []
    for r in range(args.rounds):
        order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
        row: dict = {"round": r}
        for kind in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind,
                   "--spec", json.dumps(spec)]
            res = C.run_worker(cmd, log_path=logs / f"r{r}-{kind}.log", timeout_s=args.timeout)
            res["round"] = r
            res["loadavg"] = os.getloadavg()
            C.append_jsonl(out, res)
            row[kind] = res
            print(f"round {r} {kind}: " + (
                f"median step {res['median_step_s']:.2f} s, peak RSS {C.gib(res['vm_hwm_bytes'])} GiB"
                if res.get("ok") else f"FAILED: {res.get('error')} (log {res['log']})"), flush=True)
        rounds.append(row)
    table = report(rounds, args, machine)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0 if all(row[k].get("ok") for row in rounds for k in CONTENDERS) else 1


def report(rounds: list[dict], args: argparse.Namespace, machine: dict) -> str:
    rows, ratios, rss_ratios, dloss = [], [], [], []
    for row in rounds:
        t, o = row["torch"], row["ours"]
        for kind in CONTENDERS:
            res = row[kind]
            if not res.get("ok"):
                rows.append([row["round"], kind, "FAILED: " + str(res.get("error"))[:60]] + [None] * 8)
                continue
            sp = res["median_split"]
            if kind == "torch":
                split = f"fwd {sp['fwd_s']:.2f} / bwd {sp['bwd_s']:.2f} / opt {sp['optimizer_s']:.2f}"
                io = "-"
            else:
                split = (f"compute {sp['compute_s']:.2f} / opt {sp['optimizer_s']:.2f} / "
                         f"io wait {sp['io_wait_s']:.2f}")
                io = f"{sp['io_read_bytes'] / C.GiB:.2f} / {sp['io_write_bytes'] / C.GiB:.2f}"
            rows.append([row["round"], kind, round(res["median_step_s"], 2),
                         ", ".join(f"{x:.2f}" for x in res["step_s"]), split, io,
                         C.gib(res["vm_hwm_bytes"]), C.gib(res["sampler_peak_rss_bytes"]),
                         C.gib(res["rss_after_init_bytes"]), round(res["init_s"], 1),
                         f"{res['losses'][-1]:.6f}"])
        if t.get("ok") and o.get("ok"):
            ratios.append(o["median_step_s"] / t["median_step_s"])
            rss_ratios.append(o["vm_hwm_bytes"] / t["vm_hwm_bytes"])
            dloss.append(max(abs(a - b) for a, b in zip(t["losses"], o["losses"])))
    head = (f"ZeRO-Offload bench ({args.size}, fp32, mbs {args.mbs}, seq {args.seq}, "
            f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds); "
            f"{machine['cpu']}, {machine['cpus']} CPUs, {machine['mem_total_gib']} GiB, "
            f"load avg at start {machine['loadavg']}")
    table = C.markdown_table(
        ["round", "contender", "median step s", "steps s", "split (median s)",
         "I/O read / write GiB per step", "peak RSS GiB (VmHWM)", "sampler peak GiB",
         "RSS after init GiB", "init s", "last loss"], rows)
    summary = []
    if ratios:
        summary.append(f"step time ours / torch per round: {', '.join(f'{x:.2f}' for x in ratios)} "
                       f"(median {C.median(ratios):.2f})")
        summary.append(f"peak RSS ours / torch per round: {', '.join(f'{x:.2f}' for x in rss_ratios)}")
        summary.append(f"max |loss ours - loss torch| over all steps, per round: "
                       f"{', '.join(f'{x:.2e}' for x in dloss)}")
    return "\n".join([head, "", table, "", *summary])


if __name__ == "__main__":
    sys.exit(main())
