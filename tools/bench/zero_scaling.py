#!/usr/bin/env python3
"""ZeRO across ranks (issue 25): the same model at 1 and 2 ranks (gloo, localhost), stage 3 with
parameters and optimizer on NVMe and stage 2 with the optimizer in host memory.

Run (from the repository root):
    python3 tools/bench/zero_scaling.py                        # 0.54B, both cases, 2 rounds
    python3 tools/bench/zero_scaling.py --size tiny --steps 1 --rounds 1     # a smoke test
Writes JSON lines to --out (default /var/tmp/infinity-bench/zero_scaling-<time>.jsonl) and a
Markdown table beside it (.md), as well as the screen.

Model: Llama width 2048 / 5504 / vocab 32000, 8 layers (0.54B; tools/bench/_common.py's shapes,
``--size`` takes any of them), fp32, seq 128, micro-batch ``--mbs`` per rank, so the global batch
is mbs x ranks (weak scaling, as ZeRO is used: each rank adds its own micro-batch). Each rank
trains on its own token batches: rank r of N takes batches r, r + N, ... of the seeded sequence
of _common.token_batches.

Cases (``--cases``):
  s3-nvme   ZeRO-3, offload_param and offload_optimizer nvme, host_memory_budget --host-budget
            per rank (out_of_core.py's settings), no clipping (the early step)
  s2-cpu    ZeRO-2, offload_optimizer cpu, host_memory_budget --s2-host-budget (unset: the
            engine's default), no clipping
  gloo-floor  no engine: the transport alone, torch.distributed all_gather_into_tensor and
            reduce_scatter_tensor of a --floor-mib fp32 buffer (about a unit of the 0.54B model)
            at the same threads per rank, median of 5 after 1; what a collective of the
            engine's costs at least on this machine (appended to the same results file:
            ``--cases gloo-floor --worlds 2 --rounds 1 --out <the same .jsonl>``)
Each run is a fresh set of processes: 1 rank (--threads torch threads) or 2 ranks started as
torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR 127.0.0.1, a free MASTER_PORT; torch
threads --threads / 2 each), never two runs at once. Rounds interleave the world sizes, the
order alternating by round (1, 2 / 2, 1), so the 2/1 ratios are taken between runs minutes apart.
Per rank and timed step (after --warmup): step time (first forward to the end of step()),
engine.step_stats() (comm_s, comm_sent_bytes / comm_received_bytes counted by the collectives
wrapper, io_read_bytes / io_write_bytes of its own swap files), and peak RSS (VmHWM, a 50 ms
sampler thread, wait4's ru_maxrss).
On a machine with fewer cores than ranks x threads, the ranks share the CPUs: the table says how
many cores there were.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import out_of_core as O  # noqa: E402

CASES = ("s3-nvme", "s2-cpu")
FLOOR = "gloo-floor"
DEFAULT_SIZE = "2048x8x16x5504x32000"     # 0.54B: out_of_core.py's 0.49B shape with 8 layers
NVME = "@NVME@"
# DeepSpeed beside (shared/peers/RESULTS.md, 2026-12-01, this machine kind; not run here)
DEEPSPEED = ("DeepSpeed 0.19.8 ZeRO-3 nvme/nvme, 0.66B Qwen2 (hidden 1536, 12 layers), fp32, "
             "2 x 256 tokens: 1 rank 31.3 s/step, peak RSS 17.1 GiB, 69 s to initialise; 2 gloo "
             "ranks (1 x 256 tokens each): both ranks OOM-killed during initialisation on this "
             "24 GiB machine (shared/peers/RESULTS.md)")


def ds_config(case: str, args: argparse.Namespace) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "weight_decay": args.weight_decay}},
        "aio": {"block_size": args.aio_block_size, "queue_depth": args.aio_queue_depth,
                "thread_count": 1, "single_submit": False, "overlap_events": True},
        "infinity": {"collective_timeout": args.collective_timeout},
    }
    if case == FLOOR:
        cfg["floor_mib"] = args.floor_mib
    elif case == "s3-nvme":
        cfg["zero_optimization"] = {"stage": 3,
                                    "offload_param": {"device": "nvme", "nvme_path": NVME},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": NVME}}
        cfg["infinity"]["host_memory_budget"] = args.host_budget
    elif case == "s2-cpu":
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        if args.s2_host_budget:
            cfg["infinity"]["host_memory_budget"] = args.s2_host_budget
    else:
        raise ValueError(f"unknown case {case!r}: expected one of {', '.join(CASES)}, "
                         f"{FLOOR}")
    return cfg


def comm_formula_bytes(case: str, n_params: int, world: int) -> int:
    """Bytes one rank receives (and sends) a step by the stage's rule, fp32: stage 3 gathers the
    model twice (forward, backward) and reduce-scatters its gradient once; stage 2 reduce-scatters
    the gradient and gathers the updated parameters; each moves (N-1)/N of the model per rank."""
    moves = 3 if case == "s3-nvme" else 2
    return int(moves * 4 * n_params * (world - 1) / world)


# =========================================================================== worker (one rank)
def worker(spec: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    res: dict = {"bench": "zero_scaling", "case": spec["case"], "size": spec["size"],
                 "world": world, "rank": rank, "threads": spec["threads"]}
    C.measured_worker(res, lambda sampler: (_floor if spec["case"] == FLOOR else _rank_run)(
        spec, res, rank, world, sampler))


def _rank_run(spec: dict, res: dict, rank: int, world: int, sampler: C.RssSampler) -> None:
    import torch
    import transformers

    import infinity

    torch.set_num_threads(spec["threads"])
    shape = C.size_shape(spec["size"])
    cfg = C.llama_config(shape, spec["seq"])
    runs = spec["warmup"] + spec["steps"]
    data = C.token_batches(spec["seed"], runs * world, cfg.vocab_size, spec["seq"],
                           spec["mbs"])[rank::world]
    # one directory for the run: every rank must read the same config (initialize checks it),
    # and each makes its own private swap directory in it
    nvme = spec["nvme_dir"]
    dsc = json.loads(json.dumps(spec["ds_config"]).replace(NVME, nvme))
    res["ds_config"] = dsc
    t0 = time.perf_counter()
    torch.manual_seed(spec["seed"])     # the same on every rank: the shards form one model
    with infinity.zero.Init(config=dsc):
        model = transformers.LlamaForCausalLM(cfg)
    res["n_params"] = sum(p.numel() for p in model.parameters())   # meta tensors count too
    engine, *_ = infinity.initialize(model=model, config=dsc)
    try:
        res["init_s"] = time.perf_counter() - t0
        res["ranks"] = [engine.ranks.rank, engine.ranks.world_size]
        res["rss_after_init_bytes"] = C.proc_status()["VmRSS"]
        res["vm_hwm_after_init_bytes"] = C.proc_status()["VmHWM"]
        res["swap_bytes_after_init"] = C.dir_bytes(nvme)
        res["early_step_in_use"] = bool(engine.optimizer.early_step)
        losses, steps, stats = [], [], []
        for ids in data:
            sampler.take_peak()
            ta = time.perf_counter()
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            steps.append(time.perf_counter() - ta)
            losses.append(float(out.loss))
            stats.append(engine.step_stats())
            stats[-1]["rss_peak_bytes"] = sampler.take_peak()
            print(f"[{spec['case']} r{rank}/{world}] step {len(steps) - 1} loss {losses[-1]:.6f} "
                  f"{steps[-1]:.2f}s {json.dumps({k: round(v, 3) for k, v in stats[-1].items()})}",
                  file=sys.stderr, flush=True)
        res["native_info"] = infinity.native_info()
    finally:
        engine.close()      # removes this rank's swap directory
    res["losses"] = losses
    res["step_s"] = steps
    res["stats"] = stats
    timed = slice(spec["warmup"], None)
    res["median_step_s"] = C.median(steps[timed])
    res["median_stats"] = {k: C.median([s[k] for s in stats[timed]]) for k in stats[0]}
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _floor(spec: dict, res: dict, rank: int, world: int, sampler: C.RssSampler) -> None:
    """The collectives alone on a buffer of ``floor_mib`` MiB (see the module docstring)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    numel = (spec["ds_config"]["floor_mib"] << 20) // 4 // world * world
    full, shard = torch.zeros(numel), torch.ones(numel // world)
    ops = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full)}
    res["floor"] = {}
    for name, op in ops.items():
        op()
        dist.barrier()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        received = numel * 4 * (world - 1) // world
        med = C.median(times)
        res["floor"][name] = {"buffer_bytes": numel * 4, "received_bytes": received,
                              "median_s": med, "gib_per_s": received / med / C.GiB}
    dist.destroy_process_group()


# =========================================================================== driver
def run_ranks(world: int, spec: dict, *, log_dir: Path, tag: str, timeout_s: float) -> list[dict]:
    """One run: ``world`` worker processes on localhost as torchrun starts them; each rank's
    JSON result (plus process_wall_s, wait4_maxrss_bytes, log), by rank. A rank that fails or
    hangs past ``timeout_s`` makes every rank of the run be killed and reported."""
    port = _free_port()
    spec = dict(spec, nvme_dir=tempfile.mkdtemp(prefix=f"zero-scaling-{tag}-",
                                                dir=spec["scratch"]))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--spec", json.dumps(spec)]
    procs, logs = [], []
    started = time.perf_counter()
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        else:
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key, None)
        log_path = log_dir / f"{tag}-r{rank}.log"
        log = open(log_path, "w")
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        logs.append((log, log_path))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env))
    out_bufs: list[bytes] = [b""] * world

    def read(i: int) -> None:
        out_bufs[i] = procs[i].stdout.read() if procs[i].stdout else b""

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(world)]
    for t in readers:
        t.start()

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    timers = [threading.Timer(timeout_s, kill_all)]
    timers[0].start()
    results = []
    try:
        statuses = []
        for p in procs:
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            statuses.append((p.returncode, usage.ru_maxrss * 1024, time.perf_counter() - started))
            if p.returncode != 0 and len(timers) == 1:
                # one rank failed: the others must stop within the collective timeout (issue
                # 25's bar); past it plus a margin they are killed, and the log says so
                timers.append(threading.Timer(
                    spec["ds_config"]["infinity"]["collective_timeout"] + 30, kill_all))
                timers[-1].start()
    finally:
        for timer in timers:
            timer.cancel()
    for t in readers:
        t.join()
    try:
        os.rmdir(spec["nvme_dir"])     # empty when every rank removed its swap directory
    except OSError as exc:
        print(f"  {spec['nvme_dir']} left behind: {exc}", flush=True)
    for rank, ((log, log_path), (code, maxrss, wall)) in enumerate(zip(logs, statuses)):
        log.close()
        result = None
        for line in out_bufs[rank].decode(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    result = json.loads(line)
                except json.JSONDecodeError:
                    pass
        if result is None:
            result = {"ok": False, "rank": rank, "world": world,
                      "error": (f"timed out after {timeout_s:.0f} s" if wall >= timeout_s else
                                f"rank {rank} exited {code} without a result")}
        result.update(returncode=code, process_wall_s=round(wall, 1), wait4_maxrss_bytes=maxrss,
                      log=str(log_path))
        if not result.get("ok"):
            result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-25:]
        results.append(result)
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=DEFAULT_SIZE,
                    help="HxLxAxIxV or a _common.py name (default: 0.54B, 8 layers of 2048)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma list of " + ", ".join(CASES) + f" (and {FLOOR})")
    ap.add_argument("--worlds", default="1,2", help="comma list of world sizes")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; world order alternates")
    O.add_run_arguments(ap)     # --host-budget (3GiB, stage 3), --seq, --mbs, --threads, ...
    ap.add_argument("--s2-host-budget", default=None,
                    help="host_memory_budget of the stage 2 case (default: the engine's)")
    ap.add_argument("--collective-timeout", type=float, default=300)
    ap.add_argument("--floor-mib", type=int, default=256, help="buffer of the gloo-floor case")
    ap.add_argument("--scratch", default="/var/tmp/infinity-bench",
                    help="directory on the NVMe/disk under test (swap files go in fresh subdirs)")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per run")
    ap.add_argument("--out", default=None, help="results .jsonl (the table goes beside it as .md)")
    ap.add_argument("--report", metavar="JSONL", default=None,
                    help="only print the table of an earlier run's results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.spec))
        return 0
    if args.report:
        records = [json.loads(line) for line in Path(args.report).read_text().splitlines()]
        print(report(records))
        return 0

    C.size_shape(args.size)  # fail early on a bad size
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    for case in cases:
        ds_config(case, args)  # fail early on a bad case
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or scratch / f"zero_scaling-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.with_suffix(".logs")
    logs.mkdir(exist_ok=True)
    machine = C.machine_info()
    try:
        import infinity

        machine["native_info"] = infinity.native_info()
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        machine["native_info"] = f"unavailable: {exc}"
    C.append_jsonl(out, {"bench": "zero_scaling", "kind": "header", "machine": machine,
                         "argv": sys.argv, "size": args.size,
                         "n_params": C.llama_params(C.size_shape(args.size)),
                         "ds_configs": {c: ds_config(c, args) for c in cases}})
    ok = True
    for r in range(args.rounds):
        order = worlds if r % 2 == 0 else worlds[::-1]
        for case in cases:
            for world in order:
                spec = {"case": case, "size": args.size, "steps": args.steps,
                        "warmup": args.warmup, "seq": args.seq, "mbs": args.mbs,
                        "seed": args.seed, "threads": max(1, args.threads // world),
                        "scratch": str(scratch), "ds_config": ds_config(case, args)}
                tag = f"r{r}-{case}-w{world}"
                print(f"round {r} {case} world {world}: running", flush=True)
                results = run_ranks(world, spec, log_dir=logs, tag=tag, timeout_s=args.timeout)
                record = {"bench": "zero_scaling", "kind": "run", "round": r, "case": case,
                          "world": world, "loadavg": os.getloadavg(), "ranks": results}
                C.append_jsonl(out, record)
                for res in results:
                    ok = ok and bool(res.get("ok"))
                    if res.get("ok") and "floor" in res:
                        print(f"  rank {res['rank']}: {json.dumps(res['floor'])}", flush=True)
                        continue
                    print(f"  rank {res.get('rank')}: " + (
                        f"median step {res['median_step_s']:.2f} s, init {res['init_s']:.0f} s, "
                        f"peak RSS {C.gib(res['vm_hwm_bytes'])} GiB, comm recv "
                        f"{res['median_stats']['comm_received_bytes'] / C.GiB:.2f} GiB/step, "
                        f"NVMe read {res['median_stats']['io_read_bytes'] / C.GiB:.2f} GiB/step"
                        if res.get("ok") else f"FAILED: {res.get('error')} (log {res['log']})"),
                          flush=True)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    table = report(records)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0 if ok else 1


def report(records: list[dict]) -> str:
    header = next(r for r in records if r.get("kind") == "header")
    runs = [r for r in records if r.get("kind") == "run" and r["case"] != FLOOR]
    floors = [r for r in records if r.get("kind") == "run" and r["case"] == FLOOR]
    m = header["machine"]
    n_params = header["n_params"]
    lines = [f"ZeRO scaling bench ({header['size']} = {n_params / 1e9:.2f}B params, fp32); "
             f"{m['cpu']}, {m['cpus']} CPUs, {m['mem_total_gib']} GiB, load avg at start "
             f"{[round(x, 2) for x in m['loadavg']]}; native {m.get('native_info')}", ""]
    rows = []
    for run in runs:
        case, world = run["case"], run["world"]
        for res in run["ranks"]:
            if not res.get("ok"):
                rows.append([run["round"], case, world, res.get("rank"),
                             "FAILED: " + str(res.get("error"))[:80]] + [None] * 9)
                continue
            st = res["median_stats"]
            samples = world * res["ds_config"]["train_micro_batch_size_per_gpu"]
            rows.append([
                run["round"], case, world, res["rank"], round(res["median_step_s"], 2),
                ", ".join(f"{x:.2f}" for x in res["step_s"]),
                f"{st['comm_s']:.2f}", f"{st['io_wait_s']:.2f}",
                f"{st['comm_sent_bytes'] / C.GiB:.3f} / {st['comm_received_bytes'] / C.GiB:.3f}",
                f"{st['io_read_bytes'] / C.GiB:.3f} / {st['io_write_bytes'] / C.GiB:.3f}",
                C.gib(res["vm_hwm_bytes"]), C.gib(res["wait4_maxrss_bytes"]),
                round(res["init_s"], 1), samples])
    lines.append(C.markdown_table(
        ["round", "case", "ranks", "rank", "median step s", "steps s", "comm s", "io wait s",
         "comm sent / recv GiB/step", "NVMe read / write GiB/step", "peak RSS GiB (VmHWM)",
         "wait4 maxrss GiB", "init s", "samples/step (all ranks)"], rows))
    lines.append("")
    lines += _ratios(runs, n_params)
    for run in floors:
        for res in run["ranks"]:
            if res.get("ok"):
                lines.append(f"* transport floor, {run['world']} ranks, rank {res['rank']}, "
                             f"{res['threads']} thread(s): " + "; ".join(
                                 f"{op} of {f['buffer_bytes'] / C.MiB:.0f} MiB: "
                                 f"{f['median_s']:.3f} s, {f['gib_per_s']:.2f} GiB/s received"
                                 for op, f in res["floor"].items()))
    return "\n".join(lines)


def _ratios(runs: list[dict], n_params: int) -> list[str]:
    """Per round and case: 2-rank / 1-rank step time, throughput, NVMe bytes per rank, peak RSS
    per rank; comm bytes against the stage's formula."""
    out = []
    by = {(r["round"], r["case"], r["world"]): r for r in runs}
    cases = sorted({r["case"] for r in runs})
    worlds = sorted({r["world"] for r in runs})
    if len(worlds) < 2:
        return out
    lo, hi = worlds[0], worlds[-1]
    for case in cases:
        step, thr, nvme_r, nvme_w, rss, comm = [], [], [], [], [], []
        for rnd in sorted({r["round"] for r in runs}):
            a, b = by.get((rnd, case, lo)), by.get((rnd, case, hi))
            if not a or not b or not all(x.get("ok") for x in a["ranks"] + b["ranks"]):
                continue
            sa = max(x["median_step_s"] for x in a["ranks"])
            sb = max(x["median_step_s"] for x in b["ranks"])
            step.append(sb / sa)
            thr.append((hi / sb) / (lo / sa))
            ra = max(x["median_stats"]["io_read_bytes"] for x in a["ranks"])
            rb = max(x["median_stats"]["io_read_bytes"] for x in b["ranks"])
            wa = max(x["median_stats"]["io_write_bytes"] for x in a["ranks"])
            wb = max(x["median_stats"]["io_write_bytes"] for x in b["ranks"])
            if ra:
                nvme_r.append(rb / ra)
            if wa:
                nvme_w.append(wb / wa)
            rss.append(max(x["vm_hwm_bytes"] for x in b["ranks"]) /
                       max(x["vm_hwm_bytes"] for x in a["ranks"]))
            formula = comm_formula_bytes(case, n_params, hi)
            comm.append(max(x["median_stats"]["comm_received_bytes"] for x in b["ranks"])
                        / formula if formula else 0.0)
        if not step:
            continue

        def fmt(xs: list[float]) -> str:
            return ", ".join(f"{x:.2f}" for x in xs) + f" (median {C.median(xs):.2f})"

        out.append(f"* {case}, {hi} ranks / {lo} rank, per round: step time {fmt(step)}; "
                   f"throughput (samples/s, all ranks) {fmt(thr)}; peak RSS per rank {fmt(rss)}"
                   + (f"; NVMe read per rank {fmt(nvme_r)}" if nvme_r else "")
                   + (f"; NVMe written per rank {fmt(nvme_w)}" if nvme_w else "")
                   + f"; received bytes / the stage's formula "
                   f"({comm_formula_bytes(case, n_params, hi) / C.GiB:.3f} GiB) {fmt(comm)}")
    out.append(f"* beside: {DEEPSPEED}")
    return out


if __name__ == "__main__":
    sys.exit(main())
