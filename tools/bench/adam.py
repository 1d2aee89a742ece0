#!/usr/bin/env python3
"""CPU Adam step: ours vs torch AdamW(fused=True) vs DeepSpeedCPUAdam, with a bandwidth roofline.

Run (from the repository root; DeepSpeed lives in the peers venv, so run the bench with its python;
this adds the checkout to sys.path, and INFINITY_NATIVE_LIB may point at a fresh native build):
    DS_ACCELERATOR=cpu $HOME/.venvs/peers/bin/python tools/bench/adam.py --n 67108864 --rounds 15
Writes a JSON and a Markdown table to --out (default /var/tmp/infinity-bench/adam-<time>.{json,md})
as well as the screen.

Layouts: "flat" (one tensor of N params) and "mixed" (~100 tensors of log-uniform sizes from 1e3 to
4e6, summing to N). All contenders of a layout are built first, then stepped round by round,
each round in a rotated order, --rounds timed rounds after --warmup; each contender's figure is its
median. Ratios are of medians, and also the median of per-round ratios (robust to drifts in
machine load, since both sides of a ratio are timed seconds apart) and the ratio of the fastest
rounds (closest to a quiet machine when others load it).

Contenders (B/param = bytes moved per parameter per step):
  rmw_bandwidth   28  native a,c,d += b over 4 fp32 arrays, same threads and chunks as ours: the
                      read-modify-write memory roofline of an fp32 Adam step (flat only)
  ours            28  infinity CPUAdam (one native call per step for all tensors)
  ours_bf16copy   30  the same step also writing the updated params as bf16 (adam_step_tensors)
  torch_fused     28  torch.optim.AdamW(fused=True)
  ds_fp32         28  DeepSpeedCPUAdam(adamw_mode=True) fp32
  ds_bf16         22  DeepSpeedCPUAdam with bf16 params+grads, fp32 states
  ds_fp32_copy    34  DeepSpeedCPUAdam fp32, then a torch copy_ of each param into a bf16 buffer
  home_zeroed_by_step  32  ours on a flat fp32 gradient home, the kernel leaving it at zero as it
                      goes (zero_grad; the home refilled untimed before each step) (flat only)
  home_zeroed_after    36  the same step, then the home zeroed by a pass of its own (flat only)
  home_last_add_folded 34  a bf16 gradient folded into the zeroing step of the home (flat only)
  home_last_add_first  42  the same gradient added into the home first (the adder's pass), then
                      the zeroing step (flat only)
Hyperparameters: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01 (AdamW).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from infinity.base.native_info import native_info  # noqa: E402
from infinity.optim import _adam_native  # noqa: E402
from infinity.optim.cpu_adam import CPUAdam, adam_step_flat, adam_step_tensors  # noqa: E402
from infinity.storage.host_adds import add_widened  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
FLAT_HP = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)


def layout_sizes(layout: str, n: int, count: int = 100, seed: int = 0) -> list[int]:
    """One tensor, or ``count`` tensors of log-uniform sizes in [1e3, 4e6] scaled to sum to n."""
    if layout == "flat":
        return [n]
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(np.log(1e3), np.log(4e6), count))
    sizes = np.maximum((raw / raw.sum() * n).astype(np.int64), 1)
    sizes[-1] += n - int(sizes.sum())
    return [int(s) for s in sizes]


def make_params(sizes: list[int], grads: list[torch.Tensor], dtype=torch.float32):
    ps = []
    for s, g in zip(sizes, grads):
        p = torch.nn.Parameter(torch.randn(s).to(dtype))
        p.grad = g if dtype == torch.float32 else g.to(dtype)
        ps.append(p)
    return ps


# Each builder returns (step function, bytes per param, objects to keep alive).
Builder = Callable[[list[int], list[torch.Tensor], int], tuple[Callable[[], None], int, object]]


def build_rmw(sizes, grads, threads):
    n = sum(sizes)
    a, b, c, d = (torch.rand(n) for _ in range(4))

    def step():
        _adam_native.rmw_bandwidth(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), n,
                                   threads)
    return step, 28, (a, b, c, d)


def build_ours(sizes, grads, threads):
    ps = make_params(sizes, grads)
    opt = CPUAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, threads=threads)
    return opt.step, 28, (ps, opt)


def build_ours_bf16(sizes, grads, threads):
    ps = [torch.randn(s) for s in sizes]
    ms = [torch.zeros(s) for s in sizes]
    vs = [torch.zeros(s) for s in sizes]
    hs = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    count = [0]

    def step():
        count[0] += 1
        adam_step_tensors(ps, grads, ms, vs, step=count[0], half_outs=hs, threads=threads,
                          **FLAT_HP)
    return step, 30, (ps, ms, vs, hs)


def build_torch_fused(sizes, grads, threads):
    ps = make_params(sizes, grads)
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    return opt.step, 28, (ps, opt)


def _ds_adam(ps):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True,
                            fp32_optimizer_states=True)


def build_ds_fp32(sizes, grads, threads):
    ps = make_params(sizes, grads)
    opt = _ds_adam(ps)
    return opt.step, 28, (ps, opt)


def build_ds_bf16(sizes, grads, threads):
    ps = make_params(sizes, grads, dtype=torch.bfloat16)
    opt = _ds_adam(ps)
    return opt.step, 22, (ps, opt)


def build_ds_fp32_copy(sizes, grads, threads):
    ps = make_params(sizes, grads)
    opt = _ds_adam(ps)
    copies = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in ps]

    def step():
        opt.step()
        for c, p in zip(copies, ps):
            c.copy_(p.data.view(-1))
    return step, 34, (ps, opt, copies)


def _build_home(zero_in_kernel: bool):
    """A gradient home stepped and left at zero for the next cycle's adds: by the kernel as it
    goes (``zero_grad``, [Note: the step gives the home back at zero] in optim/kernel.py), or
    by a pass of its own after the step (what the engine did before)."""
    def build(sizes, grads, threads):
        n = sum(sizes)
        p, m, v, home = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.empty(n)
        fill = torch.cat(grads)
        count = [0]

        def step():
            count[0] += 1
            adam_step_flat(p, home, m, v, step=count[0], threads=threads,
                           zero_grad=zero_in_kernel, **FLAT_HP)
            if not zero_in_kernel:
                home.zero_()
        # the home holds a gradient before every step (refilled untimed: ``prepare``)
        return step, 32 if zero_in_kernel else 36, (p, m, v, home), lambda: home.copy_(fill)
    return build


def _build_fold(folded: bool):
    """The last micro-batch's bf16 gradient completing a home as the step reads it: folded into
    the kernel chunk by chunk (``addends``, [Note: the last adds fold into the step] in
    optim/boundary_steps.py), or added first by a pass of its own (the adder thread's add),
    then the zeroing step."""
    def build(sizes, grads, threads):
        n = sum(sizes)
        p, m, v, home = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.empty(n)
        fill, staged = torch.cat(grads), torch.cat(grads).to(torch.bfloat16)
        count = [0]

        def step():
            count[0] += 1
            if not folded:
                add_widened(home, staged)
            adam_step_flat(p, home, m, v, step=count[0], threads=threads, zero_grad=True,
                           addends=[(0, staged)] if folded else (), **FLAT_HP)
        return step, 34 if folded else 42, (p, m, v, home, staged), lambda: home.copy_(fill)
    return build


CONTENDERS: dict[str, Builder] = {
    "rmw_bandwidth": build_rmw, "ours": build_ours, "ours_bf16copy": build_ours_bf16,
    "torch_fused": build_torch_fused, "ds_fp32": build_ds_fp32, "ds_bf16": build_ds_bf16,
    "ds_fp32_copy": build_ds_fp32_copy, "home_zeroed_by_step": _build_home(True),
    "home_zeroed_after": _build_home(False), "home_last_add_folded": _build_fold(True),
    "home_last_add_first": _build_fold(False),
}
FLAT_ONLY = ("rmw_bandwidth", "home_zeroed_by_step", "home_zeroed_after", "home_last_add_folded",
             "home_last_add_first")
DS = ("ds_fp32", "ds_bf16", "ds_fp32_copy")


def deepspeed_available() -> str | None:
    """None if DeepSpeedCPUAdam loads, else why not."""
    try:
        import logging

        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
        from deepspeed.utils import logger as ds_logger
        for h in ds_logger.handlers:  # DeepSpeed logs to stdout; keep stdout for our results
            if isinstance(h, logging.StreamHandler):
                h.setStream(sys.stderr)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def run_layout(layout: str, n: int, names: list[str], rounds: int, warmup: int,
               threads: int) -> dict:
    sizes = layout_sizes(layout, n)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) * 1e-2 for s in sizes]
    built = {}
    for name in names:
        if name in FLAT_ONLY and layout != "flat":
            continue
        built[name] = CONTENDERS[name](sizes, grads, threads)
    times: dict[str, list[float]] = {k: [] for k in built}
    order = list(built)
    for r in range(warmup + rounds):
        rot = order[r % len(order):] + order[:r % len(order)]
        for name in rot:
            step = built[name][0]
            if len(built[name]) > 3:
                built[name][3]()          # untimed preparation (a home's gradient refilled)
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    out = {"ntensors": len(sizes), "contenders": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        bpp = built[name][1]
        out["contenders"][name] = {
            "median_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
            "gparams_per_s": round(n / med / 1e9, 3), "bytes_per_param": bpp,
            "eff_gbps": round(n * bpp / med / 1e9, 2), "times_ms": [round(t * 1e3, 2) for t in ts]}
    out["ratios"] = ratios(times, layout)
    del built
    gc.collect()
    return out


def _ratio(times: dict[str, list[float]], num: str, den: str) -> dict | None:
    """Speed of `num` relative to `den` (>1: num faster): ratio of medians and median of per-round
    ratios."""
    if num not in times or den not in times:
        return None
    a, b = times[num], times[den]
    return {"of_medians": round(statistics.median(b) / statistics.median(a), 3),
            "median_per_round": round(statistics.median(y / x for x, y in zip(a, b)), 3),
            "of_minima": round(min(b) / min(a), 3)}


def ratios(times: dict[str, list[float]], layout: str) -> dict:
    r = {}
    for peer in ("torch_fused", "ds_fp32"):
        r[f"ours_vs_{peer}"] = _ratio(times, "ours", peer)
    # the faster peer: the one with the lower median in this run
    peers = [k for k in ("torch_fused", "ds_fp32") if k in times]
    if peers:
        fastest = min(peers, key=lambda k: statistics.median(times[k]))
        r["ours_vs_faster_peer"] = dict(_ratio(times, "ours", fastest), peer=fastest)
    if "rmw_bandwidth" in times:
        r["ours_fraction_of_rmw"] = _ratio(times, "ours", "rmw_bandwidth")
    r["bf16copy_vs_ours_fp32"] = _ratio(times, "ours_bf16copy", "ours")
    r["bf16copy_vs_ds_bf16"] = _ratio(times, "ours_bf16copy", "ds_bf16")
    r["bf16copy_vs_ds_fp32_copy"] = _ratio(times, "ours_bf16copy", "ds_fp32_copy")
    r["home_zeroed_by_step_vs_after"] = _ratio(times, "home_zeroed_by_step", "home_zeroed_after")
    r["home_last_add_folded_vs_first"] = _ratio(times, "home_last_add_folded",
                                                "home_last_add_first")
    return {k: v for k, v in r.items() if v is not None}


def markdown(res: dict) -> str:
    load = [round(x, 1) for x in res["load_average_before"] + res["load_average_after"]]
    lines = [f"N = {res['n']:,} params, {res['threads']} threads, {res['rounds']} rounds "
             f"(+{res['warmup']} warm-up), kernel {res['adam_kernel']}, load average "
             f"(1/5/15 min) before {load[:3]}, after {load[3:]}", "",
             "| layout | contender | B/param | median ms | G params/s | eff. GB/s |",
             "|---|---|---|---|---|---|"]
    for layout, lr in res["layouts"].items():
        for name, c in lr["contenders"].items():
            lines.append(f"| {layout} ({lr['ntensors']}) | {name} | {c['bytes_per_param']} | "
                         f"{c['median_ms']} | {c['gparams_per_s']} | {c['eff_gbps']} |")
    lines += ["", "| layout | ratio (>1: first is faster) | of medians | median per round | "
                  "of minima |", "|---|---|---|---|---|"]
    for layout, lr in res["layouts"].items():
        for k, v in lr["ratios"].items():
            name = f"{k} ({v['peer']})" if "peer" in v else k
            lines.append(f"| {layout} | {name} | {v['of_medians']} | {v['median_per_round']} | "
                         f"{v['of_minima']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--layouts", default="flat,mixed")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma list of contenders (default: all)")
    ap.add_argument("--out", default=None, help="output path prefix (.json and .md are added)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    names = [s for s in (a.only.split(",") if a.only else CONTENDERS) if s]
    why_no_ds = deepspeed_available() if any(s in DS for s in names) else None
    if why_no_ds:
        print(f"DeepSpeed contenders skipped ({why_no_ds}); run with the peers venv python",
              file=sys.stderr)
        names = [s for s in names if s not in DS]
    info = native_info()
    res = {"bench": "adam", "n": a.n, "threads": a.threads, "rounds": a.rounds,
           "warmup": a.warmup, "adam_kernel": _adam_native.best_kernel(),
           "native_library": info["library"], "deepspeed_skipped": why_no_ds,
           "versions": {"python": platform.python_version(), "torch": torch.__version__},
           "command": " ".join(sys.argv), "load_average_before": os.getloadavg(),
           "layouts": {}}
    try:
        import deepspeed
        res["versions"]["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001
        pass
    for layout in a.layouts.split(","):
        res["layouts"][layout] = run_layout(layout, a.n, names, a.rounds, a.warmup, a.threads)
        print(f"[{layout}] done", file=sys.stderr)
    res["load_average_after"] = os.getloadavg()
    md = markdown(res)
    prefix = Path(a.out) if a.out else Path("/var/tmp/infinity-bench") / time.strftime(
        "adam-%Y%m%d-%H%M%S")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1))
    prefix.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {prefix.with_suffix('.json')} and {prefix.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
