#!/usr/bin/env python3
"""Adam state formats (issue 38 c): how far each format's updates are from fp32 Adam's, over 1,000 steps.

Run (from the repository root):
    python3 tools/bench/adam_formats_agreement.py --steps 1000 --numel 1048576 \
        --out /var/tmp/infinity-bench/adam-formats/agree-run2.json \
        --plot /var/tmp/infinity-bench/adam-formats/agree-run2.png
~5 minutes on 2 quiet cores (52 on the loaded VM); results in docs/optimizer-formats.md
("Update agreement (c)") and BENCHMARKS.md.

Formats (``infinity/optim/adam_formats.py``, bytes in its [Note: Adam state formats]), each
against fp32 Adam (``cpu_adam.adam_step_flat``, fp32 master, m and v) on the same gradients and
from the same (bf16-representable) initial params: moments "bf16" and "int8" with an fp32
master, and the same with a bf16 stochastically rounded master (param tensor bfloat16, ``seed``).
AdamW, lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01, bias correction; the whole flat
range is one call at offset 0.

Gradients: one flat range of ``--numel`` elements made of rows of ``--hidden`` as in a model:
  norm       ~1% of rows, params 1.0, gradient scale 1e-1 (per row x 10^U(-0.25, 0.25))
  embedding  35% of rows, params N(0, 0.02), scale 1e-2; only 10% of the rows (drawn anew each
             step) get a gradient, the others get 0
  matrix     the rest, params N(0, 0.02), scale 1e-3 (per row x 10^U(-0.5, 0.5): an int8 block
             of two rows spans up to a decade of gradient scale, two of v)
Each element's gradient is a slowly varying mean (its scale x 0.5 (a cos(2 pi t / 1000) +
b sin(2 pi t / 1000)), a, b fixed N(0, 1) per element) plus N(0, 1) noise times its scale; in
the shrink phase (steps in [0.5, 0.8) of the run) every gradient is 10x smaller, which shows
bf16 v's decay stall (a step moves v by 1e-3 of the way to g^2, below half a bf16 ulp).

Measured each step, for each format (the first four also per part):
  same_state  from the format's own current state: its update against the update fp32 Adam makes
              from the dequantized same state (params, m, v). The kernels step in fp32 registers
              from the dequantized moments, so with an fp32 master this is exact (max |diff|
              reported); with a bf16 master it is the stochastic rounding's noise.
  fresh       one step's storage rounding: from the fp32 run's current state, quantized into the
              format (moments rounded as the format stores them; a bf16 master rounded to
              nearest), the format's update against fp32 Adam's from the unrounded moments.
  trajectory  the format's own run against the fp32 run: per-step update cosine (the issue's
              bar: mean >= 0.99, as tests/unit/test_adam_formats.py), relative error
              |u_f - u_32| / |u_32| and norm ratio |u_f| / |u_32|; the cumulative update's
              cosine (p_f - p0 vs p_32 - p0), its relative error |p_f - p_32| / |p_32 - p0|, and
              the relative param distance |p_f - p_32| / |p_32|.
  window      every --window steps, the update of the last window against the fp32 run's
              (stochastic rounding's noise cancels over steps).
  v_ratio     mean of the format's (dequantized) v over the fp32 run's, per part.
Writes a JSON of the summaries and per-step series (--out), optionally a plot (--plot, needs
matplotlib).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infinity.optim import adam_formats as F
from infinity.optim.cpu_adam import adam_step_flat

HP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01,
      "adamw_mode": True, "bias_correction": True}
FORMATS = {  # name: (moments, param dtype)
    "bf16": ("bf16", torch.float32),
    "int8": ("int8", torch.float32),
    "bf16+bf16_sr": ("bf16", torch.bfloat16),
    "int8+bf16_sr": ("int8", torch.bfloat16),
}
PARTS = ("all", "matrix", "norm", "embedding")
MEAN_PERIOD = 1000      # steps of one turn of the gradients' slowly varying mean
SHRINK = (0.5, 0.8)     # the fraction of the run where gradients are 10x smaller


# ---------------------------------------------------------------- vector measures (float64)
def _from_sums(dot: float, na2: float, nb2: float, nd2: float) -> dict[str, float]:
    """cos(a, b) clamped to [-1, 1] (1.0 if both are zero, 0.0 if one is), rel = |a - b| / |b|
    (0.0 if both are zero, inf if only b is), ratio = |a| / |b| (nan if b is zero)."""
    if na2 == 0.0 or nb2 == 0.0:
        cos = 1.0 if na2 == nb2 else 0.0
    else:
        cos = max(-1.0, min(1.0, dot / math.sqrt(na2 * nb2)))
    if nb2 == 0.0:
        return {"cos": cos, "rel": 0.0 if nd2 == 0.0 else math.inf, "ratio": math.nan}
    return {"cos": cos, "rel": math.sqrt(nd2 / nb2), "ratio": math.sqrt(na2 / nb2)}


def compare(a: torch.Tensor, b: torch.Tensor, slices: dict[str, slice]) -> dict[str, dict]:
    """Per part (``slices``: disjoint parts covering the range, plus "all"): cos, rel, ratio of
    a against b, in float64 (each vector converted once; "all" from the parts' sums)."""
    a64, b64 = a.double(), b.double()
    d64 = a64 - b64
    out, tot = {}, [0.0, 0.0, 0.0, 0.0]
    for part, s in slices.items():
        if part == "all":
            continue
        sums = [float(torch.dot(a64[s], b64[s])), float(torch.dot(a64[s], a64[s])),
                float(torch.dot(b64[s], b64[s])), float(torch.dot(d64[s], d64[s]))]
        tot = [x + y for x, y in zip(tot, sums)]
        out[part] = _from_sums(*sums)
    out["all"] = _from_sums(*tot)
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two vectors in float64, clamped to [-1, 1]; 1.0 if both are zero, 0.0 if one is."""
    return compare(a, b, {"all": slice(None), "x": slice(None)})["all"]["cos"]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """|a - ref| / |ref| in float64 (0.0 if both are zero, inf if only ref is)."""
    return compare(a, ref, {"all": slice(None), "x": slice(None)})["all"]["rel"]


# ---------------------------------------------------------------- the synthetic model
class Gradients:
    """The flat range's parts, initial params and per-step gradients (see the module docstring)."""

    def __init__(self, numel: int, hidden: int, steps: int, seed: int) -> None:
        self.n, self.steps = numel, steps
        gen = torch.Generator().manual_seed(seed)
        rows = numel // hidden
        if rows < 3:
            raise ValueError(f"--numel {numel} holds {rows} rows of --hidden {hidden}; need >= 3")
        norm_rows = max(1, rows // 100)
        emb_rows = max(1, int(rows * 0.35))
        # layout: [matrix rows + tail | embedding rows | norm rows]
        emb0 = numel - (emb_rows + norm_rows) * hidden
        norm0 = numel - norm_rows * hidden
        self.slices = {"all": slice(0, numel), "matrix": slice(0, emb0),
                       "embedding": slice(emb0, norm0), "norm": slice(norm0, numel)}
        self.hidden, self.emb_rows, self.emb0, self.norm0 = hidden, emb_rows, emb0, norm0
        scale = torch.empty(numel)
        row_of = lambda k: (k + hidden - 1) // hidden
        scale[:emb0] = 1e-3 * (10 ** (torch.rand(row_of(emb0), generator=gen) - 0.5)
                               ).repeat_interleave(hidden)[:emb0]
        scale[emb0:norm0] = 1e-2 * (10 ** (torch.rand(emb_rows, generator=gen) * 0.5 - 0.25)
                                    ).repeat_interleave(hidden)
        scale[norm0:] = 1e-1 * (10 ** (torch.rand(norm_rows, generator=gen) * 0.5 - 0.25)
                                ).repeat_interleave(hidden)
        self.scale = scale
        self.a = torch.randn(numel, generator=gen) * scale * 0.5
        self.b = torch.randn(numel, generator=gen) * scale * 0.5
        p0 = torch.randn(numel, generator=gen) * 0.02
        p0[norm0:] = 1.0
        self.p0 = p0.bfloat16().float()   # every run starts from the same bf16-exact point
        self.gen = gen
        self.shrink = (int(SHRINK[0] * steps) + 1, int(SHRINK[1] * steps) + 1)

    def in_shrink(self, t: int) -> bool:
        return self.shrink[0] <= t < self.shrink[1]

    def grad(self, t: int) -> torch.Tensor:
        w = 2 * math.pi * t / MEAN_PERIOD
        g = torch.randn(self.n, generator=self.gen).mul_(self.scale)
        g.add_(self.a, alpha=math.cos(w)).add_(self.b, alpha=math.sin(w))
        keep = torch.rand(self.emb_rows, generator=self.gen) < 0.1
        emb = g[self.emb0:self.norm0].view(self.emb_rows, self.hidden)
        emb[~keep] = 0.0
        if self.in_shrink(t):
            g.mul_(0.1)
        return g


# ---------------------------------------------------------------- format states
def dequant(moments: str, st: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of a format state's m and v (what the kernel reads)."""
    if moments == "bf16":
        return st["exp_avg"].float(), st["exp_avg_sq"].float()
    return (F.dequantize_blockwise(st["exp_avg"], st["exp_avg_absmax"], True),
            F.dequantize_blockwise(st["exp_avg_sq"], st["exp_avg_sq_absmax"], False))


def quantize(moments: str, m: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 moments stored as the format stores them (bf16: round to nearest even)."""
    if moments == "bf16":
        return {"exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16()}
    mc, ma = F.quantize_blockwise(m, True)
    vc, va = F.quantize_blockwise(v, False)
    return {"exp_avg": mc, "exp_avg_sq": vc, "exp_avg_absmax": ma, "exp_avg_sq_absmax": va}


def fmt_step(moments: str, param: torch.Tensor, g: torch.Tensor, st: dict, t: int,
             seed: int, threads: int | None) -> None:
    fn = F.step_bf16_moments if moments == "bf16" else F.step_int8_moments
    fn(param, g, **st, step=t, **HP, offset=0, seed=seed, threads=threads)


def ref_step(param: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int,
             threads: int | None) -> None:
    adam_step_flat(param, g, m, v, step=t, **HP, threads=threads)


# ---------------------------------------------------------------- the run
def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(steps: int, numel: int, hidden: int, seed: int, threads: int | None,
        fresh_every: int, window_every: int, log_every: int) -> dict:
    G = Gradients(numel, hidden, steps, seed)
    sl = G.slices
    p32, m32, v32 = G.p0.clone(), torch.zeros(numel), torch.zeros(numel)
    runs = {name: {"param": G.p0.to(dt).clone(), "moments": mom, "snap": G.p0.clone(),
                   "state": F.new_moments(numel, mom)} for name, (mom, dt) in FORMATS.items()}
    snap32 = G.p0.clone()
    series: dict[str, dict[str, list]] = {name: {} for name in FORMATS}

    def rec(name: str, key: str, value: float) -> None:
        series[name].setdefault(key, []).append(value)

    exact_max = {name: 0.0 for name in FORMATS}
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        g = G.grad(t)
        fresh = fresh_every > 0 and (t - 1) % fresh_every == 0
        # (fresh) one step's storage rounding, from the fp32 run's state before its step; the
        # reference of an fp32-master format is the fp32 run's own step (u32 below)
        fresh_u: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if fresh:
            quant = {mom: quantize(mom, m32, v32) for mom in ("bf16", "int8")}
            p_bf = p32.bfloat16()
            ref_bf = p_bf.float()
            ref_step(ref_bf, g, m32.clone(), v32.clone(), t, threads)
            u_ref_bf = ref_bf - p_bf.float()
            for name, (mom, dt) in FORMATS.items():
                st = {k: v.clone() for k, v in quant[mom].items()}
                pf = p32.clone() if dt == torch.float32 else p_bf.clone()
                start = pf.to(torch.float32, copy=True)
                fmt_step(mom, pf, g, st, t, seed + 1, threads)
                fresh_u[name] = (pf.float() - start, None if dt == torch.float32 else u_ref_bf)
        before32 = p32.clone()
        ref_step(p32, g, m32, v32, t, threads)
        u32 = p32 - before32
        window = window_every > 0 and t % window_every == 0
        if window:
            w32 = p32 - snap32
            snap32 = p32.clone()
        for name, r in runs.items():
            mom = r["moments"]
            if fresh:
                u_f, u_ref = fresh_u[name]
                for part, d in compare(u_f, u32 if u_ref is None else u_ref, sl).items():
                    rec(name, f"fresh_cos_{part}", d["cos"])
                    rec(name, f"fresh_rel_{part}", d["rel"])
                rec(name, "fresh_step", t)
            # (same_state) the format's update vs fp32 Adam's from the dequantized same state
            param, st = r["param"], r["state"]
            start = param.to(torch.float32, copy=True)
            m_d, v_d = dequant(mom, st)
            ref_p = start.clone()
            ref_step(ref_p, g, m_d, v_d, t, threads)
            u_ref = ref_p - start
            fmt_step(mom, param, g, st, t, seed, threads)
            u_f = param.float() - start
            if param.dtype == torch.float32:
                exact_max[name] = max(exact_max[name], float((u_f - u_ref).abs().max()))
            for part, d in compare(u_f, u_ref, sl).items():
                rec(name, f"same_cos_{part}", d["cos"])
                rec(name, f"same_rel_{part}", d["rel"])
            # (trajectory) the format's own run against the fp32 run
            pf = param.float()
            m_now, v_now = dequant(mom, st)
            for part, d in compare(u_f, u32, sl).items():
                rec(name, f"traj_cos_{part}", d["cos"])
                rec(name, f"traj_rel_{part}", d["rel"])
                rec(name, f"traj_ratio_{part}", d["ratio"])
            for part, d in compare(m_now, m32, sl).items():
                rec(name, f"m_rel_{part}", d["rel"])
            for part, s in sl.items():
                rec(name, f"v_ratio_{part}", float(v_now[s].sum(dtype=torch.float64) /
                                                   v32[s].sum(dtype=torch.float64)))
            cum = compare(pf - G.p0, p32 - G.p0, sl)
            rec(name, "cum_cos", cum["all"]["cos"])
            rec(name, "cum_rel", cum["all"]["rel"])
            rec(name, "param_rel", rel_err(pf, p32))
            if window:
                for part, d in compare(pf - r["snap"], w32, sl).items():
                    rec(name, f"window_cos_{part}", d["cos"])
                    rec(name, f"window_rel_{part}", d["rel"])
                rec(name, "window_step", t)
                r["snap"] = pf.clone()
        if log_every and (t % log_every == 0 or t == steps):
            el = time.perf_counter() - t0
            line = "  ".join(f"{n} {series[n]['traj_cos_all'][-1]:.4f}" for n in FORMATS)
            print(f"step {t:5d}/{steps}  {el:6.1f} s  per-step update cosine: {line}", flush=True)
    return {"series": series, "exact_max": exact_max, "G": G,
            "seconds": time.perf_counter() - t0}


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def summarize(series: dict, exact_max: dict, G: Gradients, steps: int) -> dict:
    lo, hi = G.shrink
    phases = {"before_shrink": (1, lo), "shrink": (lo, hi), "after_shrink": (hi, steps + 1)}
    out = {}
    for name, s in series.items():
        f = {"moments": FORMATS[name][0],
             "master": "fp32" if FORMATS[name][1] == torch.float32 else "bf16_sr",
             "state_bytes_per_param": F.state_bytes_per_param(*(
                 (FORMATS[name][0], "fp32") if FORMATS[name][1] == torch.float32
                 else (FORMATS[name][0], "bf16_sr")))}
        for kind in ("same", "fresh", "traj", "window"):
            for part in PARTS:
                c, r = s.get(f"{kind}_cos_{part}", []), s.get(f"{kind}_rel_{part}", [])
                if not c:
                    continue
                f[f"{kind}_{part}"] = {"cos_mean": _mean(c), "cos_min": min(c),
                                       "rel_mean": _mean(r), "rel_max": max(r)}
        f["same_state_exact_max_abs_diff"] = exact_max[name] if f["master"] == "fp32" else None
        for part in PARTS:
            ratio, vr = s[f"traj_ratio_{part}"], s[f"v_ratio_{part}"]
            f[f"phases_{part}"] = {
                ph: {"update_cos_mean": _mean(s[f"traj_cos_{part}"][a - 1:b - 1]),
                     "update_norm_ratio_mean": _mean(ratio[a - 1:b - 1]),
                     "v_ratio_mean": _mean(vr[a - 1:b - 1]),
                     "v_ratio_at_end": vr[b - 2] if b - 2 < len(vr) and b > a else math.nan}
                for ph, (a, b) in phases.items()}
            f[f"m_rel_final_{part}"] = s[f"m_rel_{part}"][-1]
        f["final"] = {"cum_update_cos": s["cum_cos"][-1], "cum_update_rel": s["cum_rel"][-1],
                      "param_rel": s["param_rel"][-1], "cum_update_cos_min": min(s["cum_cos"])}
        f["meets_bar_0.99"] = f["traj_all"]["cos_mean"] >= 0.99
        out[name] = f
    return out


def plot(series: dict, G: Gradients, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, axes = plt.subplots(4, 1, figsize=(9, 13), sharex=True)
    for name, s in series.items():
        x = range(1, len(s["traj_cos_all"]) + 1)
        axes[0].plot(x, s["traj_cos_all"], label=name, lw=0.8)
        axes[1].plot(x, s["traj_ratio_all"], label=name, lw=0.8)
        axes[2].plot(x, s["v_ratio_matrix"], label=name, lw=0.8)
        axes[3].plot(x, s["cum_rel"], label=name, lw=0.8)
    axes[0].set_ylabel("per-step update cosine\n(own run vs fp32 run)")
    axes[1].set_ylabel("|u_f| / |u_32|")
    axes[2].set_ylabel("mean v / fp32's (matrix)")
    axes[3].set_ylabel("|p_f - p_32| / |p_32 - p0|")
    axes[3].set_xlabel("step")
    for ax in axes:
        ax.axvspan(G.shrink[0], G.shrink[1], color="0.9", label="gradients / 10")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Adam state formats vs fp32 Adam, {G.n:,} elements")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def table(summary: dict, window: int) -> str:
    """The Markdown table of docs/optimizer-formats.md: cosines "mean / min" over the steps."""
    def mm(f: dict, key: str, rel: bool = False) -> str:
        d = f.get(key)
        if not d:
            return "-"
        return f"{d['rel_mean']:.4f}" if rel else f"{d['cos_mean']:.5f} / {d['cos_min']:.5f}"

    rows = [("| format | B/param | per-step update cos | update rel err (mean) | same-state cos | "
             f"fresh cos | fresh rel err (mean) | {window}-step update cos | final cumulative "
             "update cos | final cumulative update rel err | final rel param distance |"),
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in summary.items():
        fi = f["final"]
        rows.append(f"| {name} | {f['state_bytes_per_param']:.3f} | {mm(f, 'traj_all')} | "
                    f"{mm(f, 'traj_all', True)} | {mm(f, 'same_all')} | {mm(f, 'fresh_all')} | "
                    f"{mm(f, 'fresh_all', True)} | {mm(f, 'window_all')} | "
                    f"{fi['cum_update_cos']:.5f} | {fi['cum_update_rel']:.4f} | "
                    f"{fi['param_rel']:.2e} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--hidden", type=int, default=1024, help="row width of the parts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    ap.add_argument("--fresh-every", type=int, default=1,
                    help="measure 'fresh' every N steps (0: never)")
    ap.add_argument("--window", type=int, default=100,
                    help="also compare the updates of every WINDOW steps (0: never)")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--out", default=None, help="JSON path (default /var/tmp/infinity-bench/"
                                                "adam-formats-agree-<time>.json)")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be >= 1")

    import infinity
    info = infinity.native_info()
    cpu = {"lscpu_model_name": _cpu_model(), "adam_kernel": info.get("adam_kernel"),
           "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
           os.cpu_count(), "threads": a.threads, "load_avg": os.getloadavg()}
    print(f"CPU: {cpu['lscpu_model_name']}, adam kernel {cpu['adam_kernel']}, {cpu['cpus']} CPUs, "
          f"load {cpu['load_avg'][0]:.1f}; torch {torch.__version__}", flush=True)
    print(f"{a.steps} steps, {a.numel:,} elements (rows of {a.hidden}), seed {a.seed}", flush=True)

    res = run(a.steps, a.numel, a.hidden, a.seed, a.threads, a.fresh_every, a.window,
              a.log_every)
    G = res["G"]
    summary = summarize(res["series"], res["exact_max"], G, a.steps)
    parts = {k: [s.start, s.stop] for k, s in G.slices.items()}
    doc = {"tool": "tools/bench/adam_formats_agreement.py", "argv": sys.argv[1:] if argv is None
           else list(argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu,
           "torch": torch.__version__, "hparams": HP, "steps": a.steps, "numel": a.numel,
           "hidden": a.hidden, "seed": a.seed, "parts": parts,
           "shrink_steps": list(G.shrink), "seconds": res["seconds"],
           "load_avg_end": os.getloadavg(), "window": a.window, "summary": summary,
           "series": res["series"]}
    out = a.out or os.path.join("/var/tmp/infinity-bench",
                                time.strftime("adam-formats-agree-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1, allow_nan=True)

    print()
    print(table(summary, a.window))
    print()
    for name, f in summary.items():
        ph = f["phases_matrix"]
        print(f"{name}: matrix |u_f|/|u_32| before / during / after the shrink "
              f"{ph['before_shrink']['update_norm_ratio_mean']:.4f} / "
              f"{ph['shrink']['update_norm_ratio_mean']:.4f} / "
              f"{ph['after_shrink']['update_norm_ratio_mean']:.4f}; mean v / fp32's at the "
              f"shrink's end {ph['shrink']['v_ratio_at_end']:.4f}; per part per-step cos "
              + ", ".join(f"{p} {f[f'traj_{p}']['cos_mean']:.4f}" for p in PARTS[1:]))
    print(f"\n{res['seconds']:.0f} s; JSON: {out}")
    if a.plot:
        msg = plot(res["series"], G, a.plot)
        print(msg or f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
