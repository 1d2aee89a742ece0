#!/usr/bin/env python3
"""The dry run against a real step at the out-of-core bench's sizes (issue 27's bar, 0.49B): the
engine's recorded fetch / prefetch / keep / release order equals ``infinity plan --dry-run``'s,
and its tier manager's peak bytes per tier are within 5% of the dry run's.

Run (from the repository root):
    python3 tools/bench/dry_run_check.py                    # 0.49B, early step on and off
    python3 tools/bench/dry_run_check.py --size 1.04B --schedules on
Writes JSON lines to --out (default /var/tmp/infinity-bench/dry_run_check-<time>.jsonl) and a
Markdown table beside it (.md), as well as the screen.

Each (size, schedule) runs twice, each time in a fresh process: "ordered", where every reap of
the optimizer waits for its background steps (so the order follows the coordinator's decisions
alone, as in tests/integration/test_dry_run.py), against the dry run with steps that cost
nothing; and "timed", the engine as it is, whose peaks are compared with the dry run's on the
rates of this machine given by --compute-gflops / --read-GBps / --write-GBps. The model and
config are the out-of-core bench's (tools/bench/out_of_core.py: ZeRO-3, parameters and
optimizer on NVMe, 3 GiB host budget, fp32, micro-batch 1, seq 128).
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
from plan_calibration import ds_config, model_kwargs  # noqa: E402

PEAK_BAR = 0.05


def worker(spec: dict) -> None:
    """One real run: events per step (with ``ordered``, reaps wait for every step), the tier
    manager's peaks and the bytes each step moved."""
    import torch
    import transformers

    import infinity
    from infinity.zero.protocols import Wait

    with C.worker_stdout() as emit:
        res: dict = {"ok": False}
        torch.set_num_threads(spec["threads"])
        nvme = tempfile.mkdtemp(prefix="dry-run-check-", dir=spec["scratch"])
        try:
            dsc = json.loads(json.dumps(spec["ds_config"]).replace("@NVME@", nvme))
            cfg = transformers.LlamaConfig(**spec["model_kwargs"])
            cfg._attn_implementation = "sdpa"
            torch.manual_seed(spec["seed"])
            with infinity.zero.Init(config=dsc):
                model = transformers.LlamaForCausalLM(cfg)
            engine, *_ = infinity.initialize(model=model, config=dsc)
            try:
                if spec["ordered"]:
                    reap = engine.optimizer.reap
                    engine.optimizer.reap = lambda wait=Wait.NONE: reap(Wait.ALL)
                g = torch.Generator().manual_seed(spec["seed"] + 12345)
                events, io, step_s = [], [], []
                for _ in range(spec["steps"]):
                    ids = torch.randint(0, cfg.vocab_size, (spec["mbs"], spec["seq"]), generator=g)
                    engine.coordinator.events = log = []
                    start = time.perf_counter()
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                    engine.step()
                    step_s.append(time.perf_counter() - start)
                    events.append(log)
                    st = engine.step_stats()
                    io.append([st["io_read_bytes"], st["io_write_bytes"]])
                engine.coordinator.events = None
                m = engine.manager
                res.update(events=events, io=io, step_s=step_s, peaks={
                    "host": m.host_budget.peak, "device": m.device_budget.peak,
                    "nvme": m.tier_bytes()["nvme"]}, ok=True)
            finally:
                engine.close()
        finally:
            os.rmdir(nvme)
        res["vm_hwm_bytes"] = C.proc_status()["VmHWM"]
        emit(res)


def simulate(size: str, schedule: str, args: argparse.Namespace, instant: bool):
    from infinity.commands.dry_run import DryRunRates, DryRunSetup, dry_run, meta_llama
    from infinity.config import InfinityConfig
    from infinity.planner.run_plan import plan_run
    from infinity.planner.inputs import detect_hardware, llama_stats
    from infinity.planner.shape import shape_from_llama_kwargs

    mk = model_kwargs(size, args.seq)
    cfg = InfinityConfig.from_dict(ds_config(args, schedule, args.scratch))
    plan = plan_run(cfg, detect_hardware(args.scratch), stats=llama_stats(mk))
    events: list = []
    started = time.perf_counter()
    report = dry_run(meta_llama(mk), DryRunSetup(plan=plan),
                     DryRunRates(compute_flops_per_s=args.compute_gflops * 1e9,
                                 nvme_read_GBps=args.read_GBps, nvme_write_GBps=args.write_GBps,
                                 adam_params_per_s=args.adam_gparams * 1e9),
                     seq_len=args.seq, micro_batch=args.mbs, steps=args.steps,
                     shape=shape_from_llama_kwargs(mk), instant=instant, events=events)
    return events, report, time.perf_counter() - started


def first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {i}: engine {x}, dry run {y}"
    return "" if len(a) == len(b) else f"lengths {len(a)} (engine), {len(b)} (dry run)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.49B")
    ap.add_argument("--schedules", default="on,off")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--host-budget", default="3GiB")
    ap.add_argument("--compute-dtype", default="fp32")
    ap.add_argument("--aio-block-size", type=int, default=1 << 20)
    ap.add_argument("--aio-queue-depth", type=int, default=32)
    ap.add_argument("--compute-gflops", type=float, default=60.0)
    ap.add_argument("--read-GBps", type=float, default=3.0, dest="read_GBps")
    ap.add_argument("--write-GBps", type=float, default=5.0, dest="write_GBps")
    ap.add_argument("--adam-gparams", type=float, default=1.2)
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    out = Path(args.out or Path(args.scratch) / f"dry_run_check-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_suffix(".logs")
    logs.mkdir(exist_ok=True)
    machine = C.machine_info()
    C.append_jsonl(out, {"kind": "header", "machine": machine, "argv": sys.argv})
    rows, ok = [], True
    for schedule in args.schedules.split(","):
        for mode in ("ordered", "timed"):
            spec = {"model_kwargs": model_kwargs(args.size, args.seq),
                    "ds_config": ds_config(args, schedule), "ordered": mode == "ordered",
                    "steps": args.steps, "seq": args.seq, "mbs": args.mbs, "seed": args.seed,
                    "threads": args.threads, "scratch": args.scratch}
            real = C.run_worker([sys.executable, __file__, "--worker", json.dumps(spec)],
                                log_path=logs / f"{schedule}-{mode}.log", timeout_s=3600)
            try:
                events, report, dry_s = simulate(args.size, schedule, args,
                                                  instant=mode == "ordered")
            except Exception as exc:  # noqa: BLE001 - e.g. the budget refused, as the engine's
                rows.append([args.size, schedule, mode, f"dry run: {type(exc).__name__}: "
                             f"{str(exc)[:80]}; engine: {real.get('error') or 'ok'}"[:160],
                             "", "", "", ""])
                ok = False
                continue
            rec = {"schedule": schedule, "mode": mode, "ok": real.get("ok"),
                   "error": real.get("error"), "real_peaks": real.get("peaks"),
                   "dry_peaks": report.peak, "real_io": real.get("io"),
                   "dry_io": [[s.nvme_read_bytes, s.nvme_write_bytes] for s in report.steps],
                   "real_step_s": real.get("step_s"),
                   "dry_step_s": [s.seconds for s in report.steps], "dry_wall_s": dry_s,
                   "events": [len(e) for e in events]}
            if real.get("ok"):
                real["events"] = [[tuple(e) for e in step] for step in real["events"]]
                rec["order_equal"] = [a == b for a, b in zip(real["events"], events)]
                rec["first_difference"] = [first_difference(a, b)
                                           for a, b in zip(real["events"], events)]
                rec["peak_ratio"] = {t: report.peak[t] / real["peaks"][t]
                                     for t in ("host", "device", "nvme") if real["peaks"][t]}
            C.append_jsonl(out, rec)
            if not real.get("ok"):
                ok = False
                rows.append([args.size, schedule, mode, "FAILED: " + str(real.get("error"))[:80],
                             "", "", "", ""])
                continue
            order = "equal" if all(rec["order_equal"]) else \
                "; ".join(d for d in rec["first_difference"] if d)
            peaks_ok = all(abs(r - 1) <= PEAK_BAR for r in rec["peak_ratio"].values())
            ok = ok and peaks_ok and (mode == "timed" or all(rec["order_equal"]))
            rows.append([
                args.size, schedule, mode,
                f"{order} ({', '.join(map(str, rec['events']))} events)" if mode == "ordered"
                else "(timing decides; not compared)",
                " / ".join(f"{real['peaks'][t] / C.MiB:.1f}" for t in ("host", "device", "nvme")),
                " / ".join(f"{report.peak[t] / C.MiB:.1f}" for t in ("host", "device", "nvme")),
                ", ".join(f"{t} {r:.4f}" for t, r in rec["peak_ratio"].items()),
                f"{dry_s:.1f}"])
            print(rows[-1], flush=True)
    text = "\n".join([
        f"Dry run vs the engine ({args.size}, fp32, host budget {args.host_budget}, "
        f"{args.steps} steps); {machine['cpu']}, {machine['cpus']} CPUs, load avg at start "
        f"{tuple(round(x, 1) for x in machine['loadavg'])}", "",
        C.markdown_table(["size", "early step", "run", "fetch/release order vs dry run",
                          "engine peaks MiB host / device / NVMe", "dry run peaks",
                          "dry / engine", "dry run wall s"], rows)])
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
