#!/usr/bin/env python3
"""Adam state formats (issue 38 a, b): training loss of each format against fp32 Adam's.

Run (from the repository root; the whole study is one command):
    nice -n 10 python3 tools/bench/adam_formats_accuracy.py --study all --steps 300 \
        --out /var/tmp/infinity-bench/adam-formats-accuracy
Another seed of study a: ``--study a --seed 1 --out <another dir>``; another fine-tune setting of
study b's pretrained models: ``--study b --reuse --b-name b_lr1e-3 --finetune-lr 1e-3
--finetune-steps 300`` (same --out). A rerun with ``--reuse`` and nothing left to run rewrites
the report and plots from the stored runs.

Formats (``"infinity": {"optimizer_moments": ..., "optimizer_master": ...}``, see
docs/optimizer-formats.md), as moments/master: fp32/fp32 (the reference), bf16/fp32,
int8/fp32, int8/bf16 and bf16/bf16 (``--formats`` picks some). Every run computes in bf16
(``"compute_dtype": "bf16"``): a bf16 master needs bf16 compute, so with it for all the only
difference between two runs is the format of the optimizer's states. Same seed, same init, same
batches for every format. A control run beside them: plain PyTorch AdamW over fp32 masters (the
torch baseline of ``infinity train --engine torch``), same init and batches: a second fp32 Adam,
so its distance to the fp32 run is the spread rounding order alone gives (the noise floor).

Study a: the main job's model from scratch. ``infinity train`` (a subprocess per format) with
the demo config (the 85M byte-level Llama, AdamW lr 2e-3, warm-up 10 then cosine to 0.1,
clipping 1.0, micro-batch 2 x 128 bytes of the shipped corpus, seed 0) plus
``"compute_dtype": "bf16"``, parameters and optimizer states in host memory (``"device": "cpu"``:
a format stores and steps the same on every tier; NVMe only slows the run), ``--steps`` steps;
the losses come from its ``--metrics`` file.

Study b: a fine-tune. A small Llama (LlamaForCausalLM) and a small GPT-2 (GPT2LMHeadModel),
``--layers`` x ``--width``, byte vocabulary (256), are first trained with plain PyTorch AdamW in
fp32 for ``--pretrain-steps`` steps on the first half of the shipped corpus and saved with
``save_pretrained``; then, for each format, ``infinity.from_pretrained`` loads the save into the
engine (ZeRO 3, params and optimizer on the host) and fine-tunes it ``--finetune-steps`` steps on
the second half (AdamW lr ``--finetune-lr``, weight decay 0.01, warm-up 10 then cosine to 0.1,
clipping 1.0), the same batches for every format.

Per run: the final loss (mean of the last 10% of steps), its ratio to fp32's, and the issue's
bar: |ratio - 1| <= 1% for bf16 moments, <= 2% for int8 moments (either master); the margin is
the bar minus |ratio - 1| (negative: missed by that much). Writes ``results.json`` (every
loss), ``study_a.png`` / ``study_b.png`` (loss curves and their difference to fp32's; needs
matplotlib, else the curves are only in the JSON and ``curves_*.csv``) and a Markdown table
(``results.md``) to ``--out``. ``--reuse`` keeps study a's finished runs (a metrics file with
all its steps) instead of running them again.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FORMATS: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "fp32"),
    "int8": ("int8", "fp32"),
    "int8+bf16master": ("int8", "bf16"),
    "bf16+bf16master": ("bf16", "bf16"),
}
"""Run name -> (optimizer_moments, optimizer_master)."""

REFERENCE = "fp32"
CONTROL = "torch"
"""The control run: plain PyTorch AdamW (``infinity train --engine torch``: fused AdamW over fp32
masters of the bf16 parameters, the engine's recipe), the same init and batches. It is a second
implementation of fp32 Adam, so its distance to the fp32 run is the spread that rounding order
alone makes over the run: the noise floor the formats' distances are read against."""
BARS = {"fp32": 0.0, "bf16": 0.01, "int8": 0.02}
"""The issue's bar on |final / fp32 final - 1|, by moments format (either master)."""


def final_loss(losses: list[float]) -> float:
    """Mean of the last 10% of steps (at least one)."""
    k = max(1, round(0.1 * len(losses)))
    return statistics.fmean(losses[-k:])


def judge(runs: dict[str, dict]) -> None:
    """Add final, ratio, bar, margin and verdict to each run of ``runs`` (in place)."""
    ref = final_loss(runs[REFERENCE]["losses"])
    control = final_loss(runs[CONTROL]["losses"]) if CONTROL in runs else None
    for name, run in runs.items():
        fin = final_loss(run["losses"])
        ratio = fin / ref
        run["vs_control"] = None if control is None else fin / control
        if name == CONTROL:
            run.update(final=fin, ratio=ratio, bar=None, margin=None, verdict="control")
            continue
        bar = BARS[run["moments"]]
        run.update(final=fin, ratio=ratio, bar=bar, margin=bar - abs(ratio - 1.0))
        run["verdict"] = "reference" if name == REFERENCE else (
            "pass" if abs(ratio - 1.0) <= bar else "miss")


# --------------------------------------------------------------------------- study a
def study_a_config() -> dict[str, Any]:
    """The main job's demo config, bf16 compute, states in host memory."""
    from infinity.train.run_config import demo_config

    ds = demo_config()
    ds["infinity"]["compute_dtype"] = "bf16"
    ds["zero_optimization"]["offload_param"] = {"device": "cpu"}
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return ds


def _read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_study_a(args, out: Path, names: list[str]) -> dict:
    cfg_path = out / "study_a_config.json"
    cfg_path.write_text(json.dumps(study_a_config(), indent=1))
    runs: dict[str, dict] = {}
    for name in names:
        moments, master = FORMATS.get(name, ("fp32", "fp32"))
        metrics = out / f"a_{name}.jsonl"
        log = out / f"a_{name}.log"
        cmd = [sys.executable, "-m", "infinity.cli", "train", "--config", str(cfg_path),
               "--steps", str(args.steps), "--seed", str(args.seed),
               "--host-budget", args.host_budget, "--metrics", str(metrics), "--plot", "off",
               "--progress-every", "25"]
        cmd += ["--engine", "torch"] if name == CONTROL else \
            ["--optimizer-moments", moments, "--optimizer-master", master]
        done = metrics.is_file() and len(_read_metrics(metrics)) == args.steps
        if not (args.reuse and done):
            print(f"[a] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            started = time.perf_counter()
            with log.open("w") as fh:
                rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
            if rc != 0:
                tail = log.read_text()[-3000:]
                raise SystemExit(f"[a] {name} failed (exit {rc}); the end of {log}:\n{tail}")
            print(f"[a] {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr,
                  flush=True)
        recs = _read_metrics(metrics)
        runs[name] = {
            "moments": moments, "master": master, "command": "infinity " + " ".join(cmd[3:]),
            "losses": [r["loss"] for r in recs],
            "step_s_median": statistics.median(r["step_s"] for r in recs[1:]),
            "optimizer_s_median": statistics.median(r["optimizer_s"] for r in recs[1:]),
        }
        print(f"[a] {name}: final {final_loss(runs[name]['losses']):.4f}", file=sys.stderr,
              flush=True)
    judge(runs)
    return {"model": "the main job's 85M byte-level Llama (--model-size 85M), random init",
            "steps": args.steps, "seed": args.seed, "config": study_a_config(), "runs": runs}


# --------------------------------------------------------------------------- study b
def make_model(family: str, layers: int, width: int, seq_len: int):
    """A small random-init transformers causal LM with the byte vocabulary."""
    import transformers

    common = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                       intermediate_size=(8 * width // 3 + 63) // 64 * 64,
                                       num_attention_heads=width // 64,
                                       num_key_value_heads=width // 64,
                                       max_position_embeddings=seq_len, use_cache=False, **common)
        return transformers.LlamaForCausalLM(cfg)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                      n_positions=seq_len, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False, **common)
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(family)


def corpus_halves():
    """The shipped corpus's bytes, split in two halves (Corpus objects the sampler reads)."""
    from infinity.train.data import Corpus, load_corpus

    whole = load_corpus()
    n = int(whole.tokens.numel()) // 2
    assert int(whole.tokens.max()) < 256, "the shipped corpus should be plain bytes"
    return (Corpus(tokens=whole.tokens[:n].clone(), source=whole.source + " [first half]",
                   documents=1),
            Corpus(tokens=whole.tokens[n:].clone(), source=whole.source + " [second half]",
                   documents=1))


def _cosine_schedule(steps: int) -> dict:
    return {"type": "WarmupCosineLR",
            "params": {"warmup_min_ratio": 0.0, "warmup_num_steps": min(10, steps),
                       "warmup_type": "linear", "cos_min_ratio": 0.1,
                       "total_num_steps": steps}}


def pretrain(family: str, args, half, save_dir: Path) -> list[float]:
    """Plain PyTorch AdamW (fp32) on ``half``; saves the model with save_pretrained."""
    import torch

    from infinity.config import InfinityConfig
    from infinity.optim.schedules import build_scheduler
    from infinity.train.data import BatchSampler

    torch.manual_seed(args.seed)
    model = make_model(family, args.layers, args.width, args.seq_len)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.01)
    sched = build_scheduler(InfinityConfig.from_dict(
        {"scheduler": _cosine_schedule(args.pretrain_steps)}), opt, None)
    sampler = BatchSampler(half, args.seq_len, args.micro_batch, args.seed + 1)
    losses = []
    for _ in range(args.pretrain_steps):
        x = sampler.next_batch()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(float(loss.detach()))
    model.save_pretrained(save_dir, safe_serialization=True)
    return losses


def finetune_config(args, moments: str, master: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.finetune_lr,
                                                  "betas": [0.9, args.finetune_beta2],
                                                  "eps": 1e-8, "weight_decay": 0.01}},
        "scheduler": _cosine_schedule(args.finetune_steps),
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
        "infinity": {"compute_dtype": "bf16", "optimizer_moments": moments,
                     "optimizer_master": master, "host_memory_budget": "4GiB"},
    }


def finetune(save_dir: Path, args, half, moments: str, master: str, *,
             control: bool = False) -> dict:
    """The fine-tune of the model in ``save_dir`` on ``half`` with the engine in this format
    (``control``: with the torch baseline, plain fused AdamW over fp32 masters, instead)."""
    import infinity
    from infinity.train.data import BatchSampler

    ds = finetune_config(args, moments, master)
    if control:
        import torch
        from transformers import AutoModelForCausalLM

        from infinity.config import InfinityConfig
        from infinity.train.baseline import TorchBaselineEngine

        model = AutoModelForCausalLM.from_pretrained(str(save_dir), dtype=torch.float32)
        engine = TorchBaselineEngine(model, InfinityConfig.from_dict(ds))
    else:
        engine, _, _, _ = infinity.from_pretrained(str(save_dir), config=ds)
    engine.train()
    sampler = BatchSampler(half, args.seq_len, args.micro_batch, args.seed + 2)
    losses, step_s = [], []
    try:
        for _ in range(args.finetune_steps):
            started = time.perf_counter()
            x = sampler.next_batch()
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            step_s.append(time.perf_counter() - started)
    finally:
        engine.close()
    return {"losses": losses, "step_s_median": statistics.median(step_s[1:] or step_s)}


def run_study_b(args, out: Path, names: list[str]) -> dict:
    first, second = corpus_halves()
    models = {}
    for family in args.families:
        save_dir = out / f"b_{family}_pretrained"
        started = time.perf_counter()
        pre_file = save_dir / "pretrain_losses.json"
        if args.reuse and pre_file.is_file():
            pre = json.loads(pre_file.read_text())
        else:
            pre = pretrain(family, args, first, save_dir)
            pre_file.write_text(json.dumps(pre))
        n_params = sum(p.numel() for p in make_model(family, args.layers, args.width,
                                                     args.seq_len).parameters())
        print(f"[b] {family}: {n_params / 1e6:.2f}M params, pretrained {args.pretrain_steps} "
              f"steps in {time.perf_counter() - started:.0f} s, final {final_loss(pre):.4f}",
              file=sys.stderr, flush=True)
        runs = {}
        for name in names:
            moments, master = FORMATS.get(name, ("fp32", "fp32"))
            started = time.perf_counter()
            runs[name] = {"moments": moments, "master": master,
                          **finetune(save_dir, args, second, moments, master,
                                     control=name == CONTROL)}
            print(f"[b] {family} {name}: final {final_loss(runs[name]['losses']):.4f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        judge(runs)
        models[family] = {"params": n_params, "pretrain_losses": pre,
                          "pretrain_final": final_loss(pre), "runs": runs}
    return {"layers": args.layers, "width": args.width, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "pretrain_steps": args.pretrain_steps,
            "pretrain_lr": args.pretrain_lr, "finetune_steps": args.finetune_steps,
            "finetune_lr": args.finetune_lr, "finetune_beta2": args.finetune_beta2,
            "seed": args.seed,
            "finetune_config": finetune_config(args, "<moments>", "<master>"),
            "models": models}


# --------------------------------------------------------------------------- report
def _smooth(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


_COLORS = {"fp32": "black", "torch": "tab:gray", "bf16": "tab:blue", "int8": "tab:orange",
           "int8+bf16master": "tab:red", "bf16+bf16master": "tab:green"}


def plot(panels: list[tuple[str, dict]], path: Path, window: int) -> bool:
    """One column per (title, runs): the smoothed loss of every format above, its difference to
    fp32's below (relative, %), with the bars' bands."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    width = 7.5 if len(panels) == 1 else 5.6 * len(panels)
    fig, axes = plt.subplots(2, len(panels), figsize=(width, 6.0), squeeze=False,
                             sharex="col", gridspec_kw={"height_ratios": [3, 2]})
    for col, (title, runs) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        ref = _smooth(runs[REFERENCE]["losses"], window)
        top.plot(range(1, len(ref) + 1), runs[REFERENCE]["losses"], color="0.8", lw=0.6,
                 label="fp32, per step")
        for name, run in runs.items():
            s = _smooth(run["losses"], window)
            steps = range(1, len(s) + 1)
            shown = "torch AdamW (control)" if name == CONTROL else name
            label = f"{shown} ({run['final']:.4f}, {100 * (run['ratio'] - 1):+.2f}%)"
            ls = "--" if name == CONTROL else "-"
            top.plot(steps, s, color=_COLORS.get(name), lw=1.1, ls=ls, label=label)
            bottom.plot(steps, [100 * (a / b - 1) for a, b in zip(s, ref)],
                        color=_COLORS.get(name), lw=1.0, ls=ls)
        for bar, style in ((1, ":"), (2, "--")):
            for sign in (1, -1):
                bottom.axhline(sign * bar, color="0.5", ls=style, lw=0.7)
        tail = [v for run in runs.values()
                for v in _smooth(run["losses"], window)[len(ref) // 10:]]
        top.set_ylim(min(tail) * 0.98, max(tail) * 1.02)
        top.set_title(title, fontsize=9)
        top.set_ylabel(f"loss ({window}-step mean)", fontsize=8)
        top.legend(fontsize=7, title="format (final, vs fp32)", title_fontsize=7)
        bottom.set_ylabel("vs fp32 (%); bars ±1 (dotted), ±2 (dashed)", fontsize=7)
        bottom.set_xlabel("step", fontsize=8)
        lim = max(3.0, min(10.0, max(abs(100 * (r["ratio"] - 1)) for r in runs.values()) * 2))
        bottom.set_ylim(-lim, lim)
        for ax in (top, bottom):
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3, lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    try:        # a palette of 128 colours: a third of the bytes, the same picture (docs/ keeps it)
        from PIL import Image

        with Image.open(path) as im:
            small = im.convert("RGB").quantize(colors=128)
        small.save(path, optimize=True)
    except ImportError:
        pass
    return True


def write_csv(runs: dict, path: Path) -> None:
    names = list(runs)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", *names])
        for i in range(len(runs[names[0]]["losses"])):
            w.writerow([i + 1, *(f"{runs[n]['losses'][i]:.6f}" for n in names)])


def table(runs: dict, extra: str | None = None) -> list[str]:
    head = "| format (moments / master) | final loss | vs fp32 | bar | margin | result | vs control |"
    if extra:
        head += f" {extra} |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in runs.items():
        bar = "-" if r["bar"] is None or name == REFERENCE else f"±{100 * r['bar']:.0f}%"
        margin = "-" if r["margin"] is None or name == REFERENCE else f"{100 * r['margin']:+.2f} pt"
        label = "torch AdamW, fp32 states (control)" if name == CONTROL else \
            f"{name} ({r['moments']} / {r['master']})"
        row = (f"| {label} | {r['final']:.4f} | "
               f"{100 * (r['ratio'] - 1):+.2f}% | {bar} | {margin} | {r['verdict']} | "
               + ("-" if r.get("vs_control") is None or name == CONTROL
                  else f"{100 * (r['vs_control'] - 1):+.2f}%") + " |")
        if extra == "step / optimizer (median s)":
            row += f" {r['step_s_median']:.2f} / {r['optimizer_s_median']:.2f} |"
        elif extra == "step (median s)":
            row += f" {r['step_s_median']:.3f} |"
        lines.append(row)
    return lines


def seeds_table(dirs: list[str]) -> list[str]:
    """Study a over several seeds (one --out directory each): each run's final loss against
    the same seed's fp32 run, and the mean over the seeds of the final losses."""
    studies = [json.loads((Path(d) / "results.json").read_text())["a"] for d in dirs]
    for a in studies:
        judge(a["runs"])
    seeds = [a["seed"] for a in studies]
    head = ("| format (moments / master) | "
            + " | ".join(f"seed {s}: final, vs fp32" for s in seeds)
            + " | mean final | mean vs fp32's mean | bar | seeds within the bar |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ref_mean = statistics.fmean(a["runs"][REFERENCE]["final"] for a in studies)
    for name in studies[0]["runs"]:
        runs = [a["runs"][name] for a in studies]
        mean = statistics.fmean(r["final"] for r in runs)
        cells = [f"{r['final']:.4f}, {100 * (r['ratio'] - 1):+.2f}%" for r in runs]
        if name == REFERENCE:
            bar, within = "-", "reference"
        elif name == CONTROL:
            bar, within = "-", "control"
        else:
            bar = f"±{100 * runs[0]['bar']:.0f}%"
            within = f"{sum(r['verdict'] == 'pass' for r in runs)} of {len(runs)}"
        label = "torch AdamW, fp32 states (control)" if name == CONTROL else \
            f"{name} ({runs[0]['moments']} / {runs[0]['master']})"
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {mean:.4f} | {100 * (mean / ref_mean - 1):+.2f}% | {bar} | {within} |")
    return lines


def machine() -> dict:
    import torch

    import infinity

    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh
                          if line.startswith("model name")), "")
    except OSError:
        pass
    info = infinity.native_info()
    return {"cpu": model, "cores": os.cpu_count(), "adam_kernel": info.get("adam_kernel"),
            "torch": torch.__version__, "python": platform.python_version()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", choices=("a", "b", "all"), default="all")
    p.add_argument("--steps", type=int, default=300, help="study a's steps per format")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS),
                   help="runs to make (fp32, the reference, is always made)")
    p.add_argument("--no-control", action="store_true",
                   help="skip the control run (plain PyTorch AdamW, fp32 states: the noise floor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-budget", default="8GiB", help="study a's --host-budget")
    p.add_argument("--reuse", action="store_true",
                   help="keep study a's finished metrics files and study b's pretrained models "
                        "(from this --out) instead of making them again")
    p.add_argument("--families", nargs="+", choices=("llama", "gpt2"), default=["llama", "gpt2"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="study b's micro-batch")
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--pretrain-lr", type=float, default=2e-3)
    p.add_argument("--finetune-steps", type=int, default=100)
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--finetune-beta2", type=float, default=0.95,
                   help="the fine-tune's Adam beta2 (the demo's 0.95; 0.999 shows bf16 v's "
                        "stall, see docs/optimizer-formats.md)")
    p.add_argument("--b-name", default="b",
                   help="study b's key in results.json and its files' names (b, or b_<tag> "
                        "for another fine-tune setting of the same pretrained models)")
    p.add_argument("--seeds-of", nargs="+", metavar="DIR", default=None,
                   help="only print study a's table over several seeds: the --out directories "
                        "of runs with different --seed")
    p.add_argument("--window", type=int, default=10, help="steps of the plots' moving mean")
    p.add_argument("--out", default="/var/tmp/infinity-bench/adam-formats-accuracy")
    args = p.parse_args()
    if args.seeds_of:
        print("\n".join(seeds_table(args.seeds_of)))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [REFERENCE] + [n for n in args.formats if n != REFERENCE] + \
        ([] if args.no_control else [CONTROL])
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results.update(machine=machine(), date=time.strftime("%Y-%m-%d"), formats=FORMATS,
                   bars=BARS)
    md: list[str] = []
    if args.study in ("a", "all"):
        results["a"] = run_study_a(args, out, names)
        results_path.write_text(json.dumps(results, indent=1))
    if args.study in ("b", "all"):
        results[args.b_name] = run_study_b(args, out, names)
        results_path.write_text(json.dumps(results, indent=1))
    if "a" in results:
        a = results["a"]
        judge(a["runs"])                # again: a report of an earlier results.json
        write_csv(a["runs"], out / "curves_a.csv")
        title = (f"a: 85M byte Llama from scratch, {a['steps']} steps, seed {a['seed']}, "
                 "bf16 compute")
        plot([(title, a["runs"])],
             out / "study_a.png", args.window)
        md += [f"Study a: 85M byte-level Llama, {a['steps']} steps, seed {a['seed']}", "",
               *table(a["runs"], "step / optimizer (median s)"), ""]
    for key in [k for k in results if k == "b" or k.startswith("b_")]:
        b = results[key]
        panels = []
        for family, m in b["models"].items():
            judge(m["runs"])
            write_csv(m["runs"], out / f"curves_{key}_{family}.csv")
            title = (f"b: {family} {m['params'] / 1e6:.1f}M fine-tune, "
                     f"{b['finetune_steps']} steps, lr {b['finetune_lr']:g}, "
                     f"beta2 {b.get('finetune_beta2', 0.95):g}")
            panels.append((title, m["runs"]))
            head = (f"Study {key}: {family} ({m['params'] / 1e6:.2f}M params, pretrained "
                    f"{b['pretrain_steps']} steps to {m['pretrain_final']:.4f}), fine-tune "
                    f"{b['finetune_steps']} steps")
            head += f", lr {b['finetune_lr']:g}, beta2 {b.get('finetune_beta2', 0.95):g}"
            md += [head, "", *table(m["runs"], "step (median s)"), ""]
        plot(panels, out / f"study_{key}.png", args.window)
    (out / "results.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"results: {results_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
