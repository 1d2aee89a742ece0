#!/usr/bin/env python3
"""Plan calibration (issue 27): the planner's predicted step time and peak host memory for the
out-of-core bench against the measured ones, with the model's inputs measured in the same run,
its constants fitted on one size and checked on another held out.

Run (from the repository root; the machine as quiet as you can get it):
    python3 tools/bench/plan_calibration.py                          # 0.49B fit, 1.04B held out, 2 rounds
    python3 tools/bench/plan_calibration.py --fit tiny --check tiny --rounds 1 --steps 1   # smoke
    python3 tools/bench/plan_calibration.py --report RESULTS.jsonl   # the tables again
Writes JSON lines to --out (default /var/tmp/infinity-bench/plan_calibration-<time>.jsonl) and
the Markdown tables beside it (.md), as well as the screen.

Setup: the out-of-core bench's (tools/bench/out_of_core.py): Llama width 2048 / 5504 / vocab
32000, 7 layers (0.49B) or 18 (1.04B), micro-batch 1, seq 128, ZeRO-3 with parameters and
optimizer on NVMe (--scratch), host budget 3 GiB, early step on and off, compute dtype fp32
(written in the config, so the run does not depend on what "auto" picks on this CPU; pass
--compute-dtype auto to calibrate that). Every run is a fresh process, one after another; each
round runs, in this order:

  inputs       ``infinity.train.calibrate``: the block's matrix products' FLOP/s in the compute
               dtype (``measure_compute``), the swap path's cold read and write GB/s at the
               engine's aio settings (``measure_disk``, nvme-tune's measurement of one point),
               the CPU Adam's parameters/s (``measure_adam``), the resident bytes a block adds
               to a plain forward + backward (``measure_layer_memory``, 1 and 3 blocks); the
               runtime RSS is measured in each engine run before the model is built.
  ours         the engine on the fit size, early step on; compute alone (plain torch forward +
               backward of the same model in RAM) of the fit size; the engine on the fit size,
               early step off; then the check size, on and off.

Fit (``infinity.planner.calibration.fit_constants``) per round on the fit size's runs: compute
efficiency (FLOPs at the measured matmul rate / compute alone), overlap (step / the slower
lane), RSS residual (peak RSS - the named parts); the fitted constants are the medians over the
rounds whose fit runs all began at a 1-minute load average <= --max-load (a shared machine:
another job's burst during compute alone moved the efficiency 0.48-1.02 in one run). Check:
every run predicted with the inputs measured next to it (same round, same slot; the compute
rate timed before each of its steps) and the fitted constants; the error is the median over
rounds. The emulated device pool's
peak in the RSS is the dry run's of the same config (``infinity plan --dry-run``, equal to the
tier manager's: tests/integration/test_dry_run.py). Bars: step within 25%, peak RSS within max(10%, 64 MiB).
The table also shows the planner's stored constants' predictions, and the predicted NVMe bytes
per step against the engine's counters.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TIME_BAR = 0.25
RSS_BAR, RSS_FLOOR = 0.10, 64 * C.MiB
SCHEDULES = ("on", "off")


def model_kwargs(size: str, seq: int) -> dict[str, Any]:
    h, layers, heads, inter, vocab = C.size_shape(size)
    return dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                max_position_embeddings=max(2048, seq), tie_word_embeddings=False,
                use_cache=False, attention_dropout=0.0)


def ds_config(args: argparse.Namespace, schedule: str, nvme_path: str = "@NVME@") -> dict:
    """The out-of-core bench's config (out_of_core.ds_config), compute dtype written in."""
    return {
        "train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": nvme_path},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
        "aio": {"block_size": args.aio_block_size, "queue_depth": args.aio_queue_depth,
                "thread_count": 1, "single_submit": False, "overlap_events": True},
        "infinity": {"host_memory_budget": args.host_budget, "early_step": schedule,
                     "compute_dtype": args.compute_dtype},
    }


def run_worker(kind: str, spec: dict, log: Path, timeout: float) -> dict:
    """``python -m infinity.train.calibrate KIND`` with ``spec`` on stdin; its JSON line."""
    started, load = time.perf_counter(), os.getloadavg()
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "infinity.train.calibrate", kind],
                              input=json.dumps(spec).encode(), stdout=subprocess.PIPE,
                              stderr=err, timeout=timeout, cwd=REPO)
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"ok": False, "error": f"exit {proc.returncode}"}
    res.update({"kind": kind, "wall_s": round(time.perf_counter() - started, 1),
                "loadavg_before": load, "loadavg_after": os.getloadavg(), "log": str(log)})
    if not res.get("ok"):
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-20:]
    return res


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scratch = Path(args.scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.out = Path(args.out or self.scratch /
                        f"plan_calibration-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        self.logs = self.out.with_suffix(".logs")
        self.logs.mkdir(parents=True, exist_ok=True)

    def run(self, kind: str, tag: str, spec: dict, rnd: int, **extra) -> dict:
        res = run_worker(kind, spec, self.logs / f"{tag}-r{rnd}{extra.get('slot', '')}.log",
                         self.args.timeout)
        res.update({"tag": tag, "round": rnd, **extra})
        C.append_jsonl(self.out, res)
        state = "ok" if res.get("ok") else f"FAILED: {res.get('error')}"
        extra = f" {res['median_step_s']:.2f} s" if res.get("median_step_s") else ""
        print(f"[round {rnd}] {tag}: {state}{extra} (load {res['loadavg_before'][0]:.1f})",
              flush=True)
        return res

    def inputs(self, rnd: int, slot: str, layer_memory: bool = False) -> None:
        """The rates, measured next to the runs they are used for (``slot``: "fit" before the
        fit size's runs, "check" before the held-out size's), so a change of load on this
        shared machine hits a run and its inputs alike."""
        a = self.args
        h, _, _, inter, _ = C.size_shape(a.fit)
        specs = [("compute", dict(hidden=h, intermediate=inter, tokens=a.seq * a.mbs,
                                  dtype=self.dtype(), threads=a.threads)),
                 ("disk", dict(path=str(self.scratch), size=a.disk_bytes,
                               block_size=a.aio_block_size, queue_depth=a.aio_queue_depth)),
                 ("adam", dict(numel=a.adam_numel, sub_group=a.adam_sub_group,
                               threads=a.threads))]
        if layer_memory:
            specs.append(("layer_memory", dict(model_kwargs=model_kwargs(a.fit, a.seq),
                                               seq=a.seq, micro_batch=a.mbs, threads=a.threads)))
        for kind, spec in specs:
            self.run(kind, f"input-{kind.replace('_', '-')}", spec, rnd, slot=slot)

    def dtype(self) -> str:
        if self.args.compute_dtype != "auto":
            return self.args.compute_dtype
        from infinity.config import InfinityConfig
        from infinity.planner.inputs import detect_hardware
        from infinity.planner.placement import choose_compute_dtype

        return choose_compute_dtype(InfinityConfig.from_dict(ds_config(self.args, "on", "/tmp")),
                                    detect_hardware())

    def probe(self) -> dict:
        """The compute input, timed again just before each step of a run (see
        ``engine_steps``): on a shared machine load changes within minutes."""
        a = self.args
        h, _, _, inter, _ = C.size_shape(a.fit)
        return dict(hidden=h, intermediate=inter, tokens=a.seq * a.mbs, dtype=self.dtype(),
                    threads=a.threads, min_s=0.1)

    def engine(self, size: str, schedule: str, rnd: int) -> None:
        a = self.args
        self.run("engine", f"{size}-{schedule}", dict(
            model_kwargs=model_kwargs(size, a.seq), ds_config=ds_config(a, schedule), seq=a.seq,
            micro_batch=a.mbs, steps=a.steps, warmup=a.warmup, threads=a.threads,
            scratch=str(self.scratch), probe=self.probe()), rnd)

    def compute_alone(self, size: str, rnd: int) -> None:
        a = self.args
        self.run("compute_alone", f"{size}-compute", dict(
            model_kwargs=model_kwargs(size, a.seq), seq=a.seq, micro_batch=a.mbs,
            steps=a.steps, warmup=a.warmup, threads=a.threads, probe=self.probe(),
            dtype=self.dtype()), rnd)

    def all(self) -> None:
        a = self.args
        for rnd in range(a.rounds):
            self.inputs(rnd, "fit", layer_memory=True)
            self.engine(a.fit, "on", rnd)
            self.compute_alone(a.fit, rnd)
            self.engine(a.fit, "off", rnd)
            if a.check != a.fit:
                self.inputs(rnd, "check")
                self.engine(a.check, "on", rnd)
                if a.check_compute:
                    self.compute_alone(a.check, rnd)
                self.engine(a.check, "off", rnd)


# =========================================================================== analysis
def _median(records: list[dict], key) -> float | None:
    values = [key(r) for r in records if r.get("ok")]
    return statistics.median(values) if values else None


def _slots(records: list[dict]) -> list[dict]:
    """The runs' records; an input without its slot (older files) takes "fit" the first time
    in its round and "check" after."""
    seen: dict[tuple[str, int], int] = {}
    out = []
    for r in records:
        if r.get("kind") in ("header", "analysis"):
            continue
        if str(r.get("tag", "")).startswith("input-") and "slot" not in r:
            key = (r["tag"], r["round"])
            seen[key] = seen.get(key, 0) + 1
            r = dict(r, slot="fit" if seen[key] == 1 else "check")
        out.append(r)
    return out


def analyse(records: list[dict], args: argparse.Namespace) -> dict:
    """Per round: each run predicted with the inputs measured next to it; the constants fitted
    on the fit size's runs of that round. Medians over rounds of the measurements, the fitted
    constants and the errors; the table's rows."""
    from infinity.config import InfinityConfig
    from infinity.planner.calibration import Constants, MachineRates, fit_constants, predict_run
    from infinity.planner.inputs import detect_hardware, llama_stats
    from infinity.planner.shape import shape_from_llama_kwargs

    records = _slots(records)
    hw = detect_hardware(args.scratch)
    sizes = [args.fit] + ([args.check] if args.check != args.fit else [])
    rounds = sorted({r["round"] for r in records if "round" in r})
    stored = Constants()

    def inputs_of(rnd: int, slot: str) -> dict | None:
        mine = [r for r in records if r.get("round") == rnd and r.get("ok")
                and str(r.get("tag", "")).startswith("input-")]
        def pick(tag: str, key: str, want: str = slot):
            hits = [r[key] for r in mine if r["tag"] == tag and r["slot"] == want] or \
                [r[key] for r in mine if r["tag"] == tag]
            return hits[0] if hits else None
        got = {"compute": pick("input-compute", "flops_per_s"),
               "read": pick("input-disk", "read_GBps"), "write": pick("input-disk", "write_GBps"),
               "adam": pick("input-adam", "params_per_s"),
               "layer": pick("input-layer-memory", "layer_rss_bytes", "fit")}
        return None if None in (got["compute"], got["read"], got["write"], got["adam"]) else got

    pools: dict[tuple[str, str], int] = {}

    def device_pool(size: str, schedule: str, cfg, stats) -> int:
        """The emulated device pool's peak, from the dry run of the same config."""
        if (size, schedule) not in pools:
            from infinity.commands.dry_run import DryRunRates, DryRunSetup, dry_run, meta_llama
            from infinity.planner.run_plan import plan_run

            setup = DryRunSetup(plan=plan_run(cfg, hw, stats=stats))
            report = dry_run(meta_llama(model_kwargs(size, args.seq)), setup,
                             DryRunRates(compute_flops_per_s=1e11, nvme_read_GBps=3.0,
                                         nvme_write_GBps=3.0, adam_params_per_s=1e9),
                             seq_len=args.seq, micro_batch=args.mbs, steps=3)
            pools[(size, schedule)] = report.peak["device"]
        return pools[(size, schedule)]

    def with_probe(i: dict, run: dict) -> dict:
        """The run's own compute rate, timed before each of its steps, when it has one."""
        rate = run.get("median_probe_flops_per_s")
        return dict(i, compute=rate) if rate else i

    def predictor(size: str, schedule: str, constants: Constants, runtime: int, i: dict):
        mk = model_kwargs(size, args.seq)
        cfg = InfinityConfig.from_dict(ds_config(args, schedule, args.scratch))
        stats = llama_stats(mk)
        rates = MachineRates(compute_flops_per_s=i["compute"], nvme_read_GBps=i["read"],
                             nvme_write_GBps=i["write"], adam_params_per_s=i["adam"],
                             runtime_rss_bytes=runtime,
                             layer_rss_bytes=None if i["layer"] is None else int(i["layer"]))
        return predict_run(cfg, stats, shape_from_llama_kwargs(mk), hw,
                           seq_len=args.seq, micro_batch=args.mbs, rates=rates,
                           constants=constants,
                           device_pool_bytes=device_pool(size, schedule, cfg, stats))

    def run_of(tag: str, rnd: int) -> dict | None:
        return next((r for r in records if r.get("tag") == tag and r.get("round") == rnd
                     and r.get("ok")), None)

    fits, quiet = {}, {}
    for rnd in rounds:
        i_fit = inputs_of(rnd, "fit")
        alone = run_of(f"{args.fit}-compute", rnd)
        fit_runs, loads = [], []
        for schedule in SCHEDULES:
            run = run_of(f"{args.fit}-{schedule}", rnd)
            if run and i_fit:
                p = predictor(args.fit, schedule, stored, run["runtime_rss_bytes"],
                              with_probe(i_fit, run))
                fit_runs.append((p, run["median_step_s"], run["vm_hwm_bytes"]))
                loads.append(run.get("loadavg_before", [0])[0])
        if not fit_runs or alone is None:
            continue
        loads.append(alone.get("loadavg_before", [0])[0])
        p_alone = predictor(args.fit, "on", stored, 0, with_probe(i_fit, alone))
        fits[rnd] = fit_constants(fit_runs, [(p_alone, alone["median_step_s"])])
        quiet[rnd] = max(loads) <= args.max_load
    if not fits:
        raise SystemExit(f"nothing to fit: no round with {args.fit}'s engine runs, its compute "
                         "alone and the inputs all measured")
    med = statistics.median
    # fitted on the rounds whose fit runs all began on a quiet machine (all rounds if none did)
    chosen = [f for rnd, f in fits.items() if quiet[rnd]] or list(fits.values())
    fitted = Constants(compute_efficiency=med(f.compute_efficiency for f in chosen),
                       overlap=med(f.overlap for f in chosen),
                       rss_residual_bytes=int(med(f.rss_residual_bytes for f in chosen)))
    per_round = []
    for rnd in rounds:
        i_fit, i_check = inputs_of(rnd, "fit"), inputs_of(rnd, "check")
        for size in sizes:
            for schedule in SCHEDULES:
                run = run_of(f"{size}-{schedule}", rnd)
                i = i_fit if size == args.fit else (i_check or i_fit)
                if run is None or i is None:
                    continue
                i = with_probe(i, run)
                p = predictor(size, schedule, fitted, run["runtime_rss_bytes"], i)
                q = predictor(size, schedule, stored, run["runtime_rss_bytes"], i)
                per_round.append({"size": size, "schedule": schedule, "round": rnd, "run": run,
                                  "p": p, "q": q, "inputs": i,
                                  "loadavg": run.get("loadavg_before", [0])[0]})
    rows = []
    for size in sizes:
        for schedule in SCHEDULES:
            mine = [x for x in per_round if x["size"] == size and x["schedule"] == schedule]
            if not mine:
                continue
            step = med(x["run"]["median_step_s"] for x in mine)
            rss = int(med(x["run"]["vm_hwm_bytes"] for x in mine))
            t_errs = [x["p"].predicted_s / x["run"]["median_step_s"] - 1 for x in mine]
            r_errs = [x["p"].peak_rss_bytes - x["run"]["vm_hwm_bytes"] for x in mine]
            t_err, r_err = med(t_errs), int(med(r_errs))
            r_tol = max(RSS_BAR * rss, RSS_FLOOR)
            last = mine[-1]
            st = last["run"]["median_stats"]
            rows.append({
                "size": size, "schedule": schedule,
                "role": "fit" if size == args.fit else "held out",
                "measured_step_s": step, "per_round_s": [round(x["run"]["median_step_s"], 2)
                                                         for x in mine],
                "predicted_step_s": med(x["p"].predicted_s for x in mine),
                "per_round_time_error": [round(e, 3) for e in t_errs], "time_error": t_err,
                "time_ok": abs(t_err) <= TIME_BAR,
                "stored_predicted_step_s": med(x["q"].predicted_s for x in mine),
                "measured_rss": rss, "per_round_rss": [x["run"]["vm_hwm_bytes"] for x in mine],
                "predicted_rss": int(med(x["p"].peak_rss_bytes for x in mine)),
                "rss_error_bytes": r_err, "per_round_rss_error": r_errs,
                "rss_tolerance_bytes": r_tol, "rss_ok": abs(r_err) <= r_tol,
                "stored_predicted_rss": int(med(x["q"].peak_rss_bytes for x in mine)),
                "measured_read": st["io_read_bytes"], "measured_write": st["io_write_bytes"],
                "predicted_read": last["p"].nvme_read_bytes,
                "predicted_write": last["p"].nvme_write_bytes,
                "lanes": last["p"].lanes, "bottleneck": last["p"].bottleneck,
                "rss_parts": last["p"].rss_parts, "loadavg": [x["loadavg"] for x in mine],
                "speculation": last["run"].get("speculation"),
                "compute_dtype": last["run"].get("compute_dtype"),
                "sizes_agree": _sizes_agree(last["p"], last["run"].get("engine_sizes")),
                "tier_peak": last["run"].get("tier_peak_bytes")})
    ins = [x["inputs"] for x in per_round]
    alone = [r["median_step_s"] for r in records if r.get("tag") == f"{args.fit}-compute"
             and r.get("ok")]
    return {"inputs": {"compute_flops_per_s": med(i["compute"] for i in ins),
                       "nvme_read_GBps": med(i["read"] for i in ins),
                       "nvme_write_GBps": med(i["write"] for i in ins),
                       "adam_params_per_s": med(i["adam"] for i in ins),
                       "layer_rss_bytes": med([i["layer"] for i in ins if i["layer"]] or [0]),
                       "compute_alone_s": med(alone)},
            "fitted": vars(fitted),
            "fitted_per_round": {rnd: dict(vars(f), quiet=quiet[rnd]) for rnd, f in fits.items()},
            "stored": vars(stored), "rows": rows}


def _sizes_agree(p, engine: dict | None) -> bool | None:
    """The planner's engine sizes equal the engine's own (the same function, the same inputs)."""
    if not engine:
        return None
    keys = ("host_budget", "device_budget", "sub_group_numel", "nvme_bytes", "host_buffer_bytes")
    mine = {k: getattr(p.sizes, k) for k in keys}
    return all(engine.get(k) == v for k, v in mine.items())


def render(result: dict, machine: dict, args: argparse.Namespace) -> str:
    gb = 1e9
    i, f, s = result["inputs"], result["fitted"], result["stored"]
    head = [f"Plan calibration ({args.compute_dtype} compute, mbs {args.mbs}, seq {args.seq}, "
            f"host budget {args.host_budget}, {args.warmup} warm-up + {args.steps} timed steps, "
            f"{args.rounds} round(s); fit {args.fit}, held out {args.check}); {machine['cpu']}, "
            f"{machine['cpus']} CPUs, {machine['mem_total_gib']} GiB, load avg at start "
            f"{tuple(round(x, 1) for x in machine['loadavg'])}", "",
            f"Inputs (medians over rounds): block matmuls {i['compute_flops_per_s'] / 1e9:.1f} "
            f"GFLOP/s; NVMe read {i['nvme_read_GBps']:.2f} GB/s, write "
            f"{i['nvme_write_GBps']:.2f} GB/s; CPU Adam {i['adam_params_per_s'] / 1e9:.2f} "
            f"G params/s; a block's RSS in a forward + backward "
            + (f"{i['layer_rss_bytes'] / C.MiB:.1f} MiB" if i.get("layer_rss_bytes") else "-")
            + f"; compute alone ({args.fit}) {i['compute_alone_s']:.2f} s", "",
            f"Constants fitted on {args.fit}: compute efficiency {f['compute_efficiency']:.3f}, "
            f"overlap {f['overlap']:.3f}, RSS residual {f['rss_residual_bytes'] / C.MiB:+.0f} MiB "
            f"(stored in the planner: {s['compute_efficiency']:.3f}, {s['overlap']:.3f}, "
            f"{s['rss_residual_bytes'] / C.MiB:+.0f} MiB); per round (quiet = fitted on): "
            + "; ".join(f"{rnd}: {r['compute_efficiency']:.3f} / {r['overlap']:.3f} / "
                        f"{r['rss_residual_bytes'] / C.MiB:+.0f} MiB"
                        + (" (quiet)" if r["quiet"] else f" (load over {args.max_load:g})")
                        for rnd, r in result["fitted_per_round"].items()), ""]
    rows = []
    for r in result["rows"]:
        rows.append([
            r["size"], r["schedule"], r["role"],
            f"{r['measured_step_s']:.2f} ({', '.join(map(str, r['per_round_s']))})",
            f"{r['predicted_step_s']:.2f} ({r['time_error']:+.0%}; rounds "
            f"{', '.join(f'{e:+.0%}' for e in r['per_round_time_error'])}) "
            f"{'ok' if r['time_ok'] else 'MISS'}",
            f"{r['stored_predicted_step_s']:.2f}",
            f"{r['measured_rss'] / C.GiB:.3f}",
            f"{r['predicted_rss'] / C.GiB:.3f} ({r['rss_error_bytes'] / C.MiB:+.0f} MiB, "
            f"tol {r['rss_tolerance_bytes'] / C.MiB:.0f}) {'ok' if r['rss_ok'] else 'MISS'}",
            f"{r['measured_read'] / gb:.2f} / {r['measured_write'] / gb:.2f}",
            f"{r['predicted_read'] / gb:.2f} / {r['predicted_write'] / gb:.2f}",
            f"CPU {r['lanes']['CPU']:.2f} / NVMe {r['lanes']['NVMe']:.2f}",
            r["sizes_agree"]])
    table = C.markdown_table(
        ["size", "early step", "role", "measured step s (rounds)", "predicted s (median error)",
         "stored constants s", "measured peak RSS GiB", "predicted GiB (error)",
         "NVMe read / write GB measured", "predicted", "lanes s (fitted)", "sizes = engine's"],
        rows)
    held = [r for r in result["rows"] if r["role"] == "held out"]
    verdict = ("held out: " + "; ".join(
        f"{r['schedule']}: time {r['time_error']:+.0%} ({'met' if r['time_ok'] else 'NOT met'} "
        f"<= 25%), RSS {r['rss_error_bytes'] / C.MiB:+.0f} MiB "
        f"({'met' if r['rss_ok'] else 'NOT met'} <= {r['rss_tolerance_bytes'] / C.MiB:.0f})"
        for r in held)) if held else "no held-out size"
    parts = "\n".join(f"- {r['size']} {r['schedule']}: " + ", ".join(
        f"{k} {v / C.MiB:.0f}" for k, v in r["rss_parts"].items()) + " MiB; tier manager peaks "
        + (", ".join(f"{k} {v / C.MiB:.0f}" for k, v in r["tier_peak"].items()) + " MiB"
           if r["tier_peak"] else "-") for r in result["rows"])
    return "\n".join(head + [table, "", verdict, "", "Predicted RSS parts:", parts])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", default="0.49B", help="size the constants are fitted on")
    ap.add_argument("--check", default="1.04B", help="size held out")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--host-budget", default="3GiB")
    ap.add_argument("--compute-dtype", default="fp32", choices=("fp32", "bf16", "auto"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--aio-block-size", type=int, default=1 << 20)
    ap.add_argument("--aio-queue-depth", type=int, default=32)
    ap.add_argument("--disk-bytes", type=int, default=1 << 30, help="file size of the disk input")
    ap.add_argument("--adam-numel", type=int, default=1 << 27)
    ap.add_argument("--adam-sub-group", type=int, default=18 << 20)
    ap.add_argument("--max-load", type=float, default=3.0,
                    help="fit the constants on the rounds whose fit-size runs all began at a "
                         "1-minute load average of at most this (all rounds when none did)")
    ap.add_argument("--check-compute", action="store_true",
                    help="also run compute alone on the held-out size (diagnostic, not fitted)")
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench",
                    help="directory on the disk under test (swap files, the disk input)")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per worker")
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", metavar="JSONL", nargs="+", help="tables of earlier results")
    return ap


def main() -> int:
    args = parser().parse_args()
    for size in (args.fit, args.check):
        C.size_shape(size)
    if args.report:
        records, machine = [], None
        for path in args.report:
            for line in Path(path).read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    if r.get("kind") == "analysis":
                        continue
                    if r.get("kind") == "header":
                        machine = machine or r["machine"]
                        args = parser().parse_args(r["argv"][1:] + ["--report", *args.report])
                    else:
                        records.append(r)
        print(render(analyse(records, args), machine or C.machine_info(), args))
        return 0
    drv = Driver(args)
    machine = C.machine_info()
    C.append_jsonl(drv.out, {"kind": "header", "machine": machine, "argv": sys.argv})
    drv.all()
    records = [json.loads(ln) for ln in drv.out.read_text().splitlines() if ln.strip()]
    result = analyse([r for r in records if r.get("kind") != "header"], args)
    C.append_jsonl(drv.out, {"kind": "analysis", **result})
    text = render(result, machine, args)
    print(text)
    drv.out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {drv.out} and {drv.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
