#!/usr/bin/env python3
"""The host budget as a memory cap (issue 28, part 2): peak RSS of a run under a host budget with
infinity.offload_activations "auto" against "none", same run, fresh process each.

Run (from the repository root):
    nice python3 tools/bench/activation_budget.py                    # Qwen2 0.66B, 2 x 256, auto and none
    nice python3 tools/bench/activation_budget.py --model llama-3b --mbs 1 --seq 128 --modes auto
    python3 tools/bench/activation_budget.py --model demo-85m --mbs 2 --seq 128 \
        --host-budget 512MiB --modes keep,auto --rounds 2 --steps 8     # infinity train's reserve
    python3 tools/bench/activation_budget.py --model tiny --steps 2  # smoke
Writes JSON lines to --out (default /var/tmp/infinity-bench/activation_budget-<time>.jsonl) and a
Markdown table beside it (.md), as well as the screen.

Every run: a "baseline" worker (RSS after ``import torch, infinity``: what the budget cannot
cover), then per round one "ours" worker per --modes entry ("keep": "auto" with the
``infinity.activation_reserve`` that ``infinity train`` sets for the model and batch), the order alternating between rounds:
the model built in infinity.zero.Init, ZeRO-3 with parameters and optimizer on NVMe, the host
budget, gradient clipping 1.0, compute dtype "auto", --steps steps (the first included) of
engine(input_ids, labels) + backward + step on random tokens. Reported: VmHWM (the kernel's
high-water mark of RSS), the bar (budget + baseline + 0.25 GiB), what "auto" predicted and chose,
the engine's planned host bytes, the step times and losses.
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

SLACK = C.GiB // 4
"""The bar: peak RSS <= host budget + the post-import baseline + this."""

# name -> (family, hidden, layers, heads, kv heads, intermediate, vocab)
MODELS = {
    "qwen2-0.66b": ("qwen2", 1536, 12, 12, 2, 8960, 32000),
    "llama-3b": ("llama", 3072, 28, 24, 8, 8192, 32000),
    "tiny": ("qwen2", 256, 2, 4, 2, 704, 1000),
    "demo-85m": None,      # infinity train's default model (infinity.train.models)
}


def model_config(name: str):
    """The transformers config of ``name`` (untied embeddings, no cache, sdpa)."""
    import transformers

    if MODELS[name] is None:
        from infinity.train import models
        return models.model_config("85M", None, 4096)
    family, h, layers, heads, kv, inter, vocab = MODELS[name]
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[family]
    cfg = cls(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
              max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def ds_config(nvme: str, args: argparse.Namespace, mode: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "infinity": {"host_memory_budget": args.host_budget,
                     "offload_activations": "auto" if mode == "keep" else mode},
    }


# =========================================================================== workers
def worker(kind: str, spec: dict) -> None:
    """One measured process: ``baseline`` (imports only) or ``ours``."""
    res: dict = {"bench": "activation_budget", "contender": kind, **{k: spec[k] for k in (
        "model", "mode", "mbs", "seq") if k in spec}}

    def body(sampler: C.RssSampler) -> None:
        import torch

        import infinity  # noqa: F401 - the baseline is RSS after this import

        res["rss_after_import_bytes"] = C.proc_status()["VmRSS"]
        spec["sampler"] = sampler
        if kind == "ours":
            torch.set_num_threads(spec["threads"])
            _ours(spec, res)

    C.measured_worker(res, body)


def _ours(spec: dict, res: dict) -> None:
    import torch
    import transformers

    import infinity

    cfg = model_config(spec["model"])
    nvme = tempfile.mkdtemp(prefix="activation-budget-", dir=spec["scratch"])
    dsc = json.loads(json.dumps(spec["ds_config"]).replace("@NVME@", nvme))
    if spec["mode"] == "keep":
        # "auto" with the reserve ``infinity train`` sets for this model and batch
        from infinity.config import InfinityConfig
        from infinity.train import host_budget, models

        config = InfinityConfig.from_dict(dsc)
        host_budget.keep_activations(config, dsc, models.model_stats(
            cfg, config.infinity.unit_modules), cfg, spec["seq"])
    res["ds_config"] = dsc
    torch.manual_seed(spec["seed"])
    with infinity.zero.Init(config=dsc):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    res["n_params"] = sum(p.numel() for p in model.parameters())
    res["rss_before_engine_bytes"] = C.proc_status()["VmRSS"]
    try:
        engine, *_ = infinity.initialize(model=model, config=dsc)
    except BaseException:
        os.rmdir(nvme)      # ours (mkdtemp above); a failed initialize left nothing in it
        raise
    sampler = spec["sampler"]
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    try:
        res["vm_hwm_after_init_bytes"] = C.proc_status()["VmHWM"]
        res["engine_sizes"] = {k: (v.name if hasattr(v, "name") else v)
                               for k, v in vars(engine.sizes).items()}
        losses, steps, hwm, phases = [], [], [], []
        for _ in range(spec["steps"]):
            ids = torch.randint(0, cfg.vocab_size, (spec["mbs"], spec["seq"]), generator=gen)
            start = time.perf_counter()
            sampler.take_peak()
            out = engine(input_ids=ids, labels=ids)
            fwd = sampler.take_peak()
            engine.backward(out.loss)
            bwd = sampler.take_peak()
            engine.step()
            steps.append(time.perf_counter() - start)
            # the sampler's RSS peak (50 ms samples) in each phase
            phases.append({"fwd": fwd, "bwd": bwd, "step": sampler.take_peak()})
            losses.append(float(out.loss))
            del out
            hwm.append(C.proc_status()["VmHWM"])
            print(f"[{spec['mode']}] step {len(steps) - 1} loss {losses[-1]:.5f} "
                  f"{steps[-1]:.2f} s, VmHWM {hwm[-1] / C.GiB:.3f} GiB", file=sys.stderr,
                  flush=True)
        swapper = engine.activation_swapper
        res["activations"] = swapper.describe() if swapper is not None else "kept in memory"
        choice = getattr(swapper, "choice", None)
        if choice is not None:
            res["auto_choice"] = choice.as_dict()
        res["host_describe"] = engine.manager.describe()
        # what the budgets held at most (bytes reserved), beside what the process held
        res["budget_peaks"] = {"host": engine.manager.host_budget.peak,
                               "device": engine.manager.device_budget.peak}
        res["native_info"] = infinity.native_info()
    finally:
        engine.close()
        os.rmdir(nvme)
    res.update(losses=losses, step_s=steps, vm_hwm_per_step=hwm, rss_phases=phases)


# =========================================================================== driver
def run(args: argparse.Namespace, out: Path, kind: str, tag: str, spec: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--spec", json.dumps(spec)]
    load = os.getloadavg()
    res = C.run_worker(cmd, log_path=out.with_suffix(".logs") / f"{tag}.log",
                       timeout_s=args.timeout)
    res.update(tag=tag, loadavg_before=load, loadavg_after=os.getloadavg())
    C.append_jsonl(out, res)
    peak = res.get("vm_hwm_bytes")
    print(f"{tag}: {'ok' if res.get('ok') else 'FAILED ' + str(res.get('error'))}, "
          f"VmHWM {C.gib(peak)} GiB ({res['process_wall_s']:.0f} s wall)", flush=True)
    return res


def report(args: argparse.Namespace, machine: dict, baseline: dict, rounds: list[dict],
           budget: int) -> str:
    base = baseline.get("rss_after_import_bytes") or 0
    bar = budget + base + SLACK
    rows = []
    for rnd, runs in enumerate(rounds):
        for mode, res in runs.items():
            choice = res.get("auto_choice") or {}
            peak = res.get("vm_hwm_bytes")
            held = res.get("budget_peaks") or {}
            phase = res.get("rss_phases") or []
            where = max(("fwd", "bwd", "step"), key=lambda k: max(
                (p[k] for p in phase), default=0)) if phase else "-"
            rows.append([rnd, mode, C.gib(peak), C.gib(bar),
                         ("yes" if peak <= bar else "no") if res.get("ok") and peak else
                         "failed: " + str(res.get("error"))[:80],
                         choice.get("decision", "-"), C.gib(choice.get("predicted_bytes")),
                         C.gib(choice.get("room_bytes")),
                         C.gib(res.get("rss_before_engine_bytes")),
                         C.gib(sum(held.values())) if held else None, where,
                         C.median(res.get("step_s", [])[1:]),
                         " ".join(f"{x:.6f}" for x in res.get("losses", []))])
    lines = [f"activation_budget: {args.model}, micro-batch {args.mbs} x {args.seq} tokens, "
             f"host budget {args.host_budget}, {args.steps} steps (the first included), "
             f"CPU {machine['cpu_lscpu']} ({machine['cpus']} cores), load before "
             f"{machine['loadavg']}",
             f"post-import baseline (RSS after `import torch, infinity`): {C.gib(base)} GiB; "
             f"bar = budget + baseline + 0.25 GiB = {C.gib(bar)} GiB",
             f"native_info: {json.dumps(machine.get('native_info'))}", "",
             C.markdown_table(["round", "offload_activations", "peak RSS GiB", "bar GiB",
                               "within", "auto chose", "predicted GiB", "room GiB",
                               "RSS before the engine GiB", "budgets' peak held GiB",
                               "peak in",
                               "median step s (after the first)", "losses"], rows)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-0.66b", choices=sorted(MODELS))
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default="auto,none")
    ap.add_argument("--host-budget", default="3GiB")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench")
    ap.add_argument("--out")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--worker")
    ap.add_argument("--spec")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0
    from infinity.config.values import check_size

    budget = check_size("--host-budget", args.host_budget)
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or scratch / f"activation_budget-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.with_suffix(".logs").mkdir(parents=True, exist_ok=True)
    machine = C.machine_info()
    machine["cpu_lscpu"] = C.lscpu_model()
    import infinity

    machine["native_info"] = infinity.native_info()
    C.append_jsonl(out, {"bench": "activation_budget", "kind": "header", "machine": machine,
                         "argv": sys.argv})
    common = {"model": args.model, "mbs": args.mbs, "seq": args.seq, "steps": args.steps,
              "seed": args.seed, "threads": args.threads, "scratch": str(scratch)}
    baseline = run(args, out, "baseline", "baseline", common)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rounds = []
    for rnd in range(args.rounds):
        runs = {}
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            runs[mode] = run(args, out, "ours", f"{mode}-r{rnd}", {
                **common, "mode": mode, "ds_config": ds_config("@NVME@", args, mode)})
        rounds.append(runs)
    text = report(args, machine, baseline, rounds, budget)
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0 if baseline.get("ok") and all(r.get("ok") for x in rounds for r in x.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
