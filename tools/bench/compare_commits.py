#!/usr/bin/env python3
"""Two commits of infinity side by side on the out-of-core step: a change that should not change
speed (a restructuring) is checked against the commit before it, in the same run, interleaved.

Run (from the repository root):
    python3 tools/bench/compare_commits.py --old 7ab77b8 --new HEAD               # 0.49B, on+off, 3 rounds
    python3 tools/bench/compare_commits.py --old HEAD~1 --new HEAD --size tiny --rounds 1 --steps 1
Writes JSON lines to --out (default /var/tmp/infinity-bench/compare-<time>.jsonl) and a Markdown
summary beside it (.md), as well as the screen.

Each commit is checked out as a detached git worktree under --trees, and each run is the
out-of-core bench's own "ours" worker (tools/bench/out_of_core.py of THAT commit: ZeRO-3,
parameters and optimizer on NVMe, 3 GiB host budget) in a fresh process, importing that tree's
infinity: a sitecustomize on PYTHONPATH drops the editable install's finder, and both trees load
the same native library (--native-lib, default the installed one), so only the Python differs.
Per round and schedule the two commits run back to back, the first of them alternating by round.
Reported per schedule: each commit's median step (over rounds of the per-run medians) with its
min..max, new/old of the medians, the per-round ratios, and each commit's peak RSS (VmHWM, max
over rounds). Bar of issue 24: step within 5% (or the old commit's own spread, if larger) and
peak RSS within 32 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_SHIM = ("import sys\n"
         "sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__]\n")


def worktree(rev: str, trees: Path) -> tuple[str, Path]:
    """(full sha, a detached worktree of ``rev`` under ``trees``), made once per sha."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    path = trees / sha[:12]
    if not (path / "infinity" / "__init__.py").is_file():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force",
                        str(path), sha], check=True, capture_output=True)
    return sha, path


def native_library() -> str:
    sys.path.insert(0, str(REPO))
    import importlib.util
    spec = importlib.util.find_spec("infinity.libinfinity_native")
    if spec is None or not spec.origin:
        raise SystemExit("no installed native library: pass --native-lib")
    return spec.origin


def run_once(tree: Path, size: str, schedule: str, args: argparse.Namespace, shim: Path,
             lib: Path, out: Path) -> dict:
    """One out_of_core.py run of ``tree``'s code: its "ours" record."""
    env = dict(os.environ, PYTHONPATH=f"{shim}{os.pathsep}{tree}", INFINITY_NATIVE_LIB=str(lib))
    cmd = [sys.executable, str(tree / "tools" / "bench" / "out_of_core.py"), "--sizes", size,
           "--schedules", schedule, "--only", "ours", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--host-budget", args.host_budget, "--out", str(out)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree,
                          timeout=args.timeout)
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] \
        if out.exists() else []
    ours = [r for r in records if r.get("tag", "").startswith("ours") and r.get("ok")]
    if proc.returncode != 0 or not ours:
        raise SystemExit(f"{tree.name} {size} {schedule} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    r = ours[-1]
    return {"median_step_s": r["median_step_s"], "vm_hwm_bytes": r.get("vm_hwm_bytes"),
            "wall_s": time.perf_counter() - started}


def summarize(results: list[dict], schedules: list[str], labels: tuple[str, str]) -> str:
    old_label, new_label = labels
    lines = ["| schedule | old median s (min..max) | new median s (min..max) | new/old | "
             "per-round new/old | old peak RSS GiB | new peak RSS GiB | RSS delta MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for sched in schedules:
        mine = [r for r in results if r["schedule"] == sched]
        old = [r for r in mine if r["which"] == "old"]
        new = [r for r in mine if r["which"] == "new"]
        if not old or not new:
            continue
        o = [r["median_step_s"] for r in old]
        n = [r["median_step_s"] for r in new]
        per_round = [nr["median_step_s"] / orr["median_step_s"]
                     for orr, nr in zip(sorted(old, key=lambda r: r["round"]),
                                        sorted(new, key=lambda r: r["round"]))]
        o_rss = max(r["vm_hwm_bytes"] or 0 for r in old)
        n_rss = max(r["vm_hwm_bytes"] or 0 for r in new)
        lines.append(f"| {sched} | {C.median(o):.2f} ({min(o):.2f}..{max(o):.2f}) | "
                     f"{C.median(n):.2f} ({min(n):.2f}..{max(n):.2f}) | "
                     f"{C.median(n) / C.median(o):.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in per_round)} | {C.gib(o_rss)} | "
                     f"{C.gib(n_rss)} | {(n_rss - o_rss) / 2**20:+.0f} |")
    return f"old = {old_label}, new = {new_label}\n\n" + "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the commit before the change")
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--size", default="0.49B")
    ap.add_argument("--schedules", default="on,off")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--host-budget", default="3GiB")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds per run")
    ap.add_argument("--trees", type=Path, default=Path("/var/tmp/infinity-bench/trees"))
    ap.add_argument("--native-lib", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    schedules = args.schedules.split(",")
    args.trees.mkdir(parents=True, exist_ok=True)
    out = args.out or Path(f"/var/tmp/infinity-bench/compare-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    shim = args.trees / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_SHIM)
    lib = args.trees / "libinfinity_native.so"      # one copy: a rebuild meanwhile changes nothing
    shutil.copyfile(args.native_lib or native_library(), lib)
    (old_sha, old_tree), (new_sha, new_tree) = worktree(args.old, args.trees), worktree(args.new, args.trees)
    machine = C.machine_info()
    C.append_jsonl(out, {"bench": "compare_commits", "kind": "header", "machine": machine,
                         "argv": sys.argv, "old": old_sha, "new": new_sha})
    print(f"old {old_sha[:12]} ({old_tree}), new {new_sha[:12]} ({new_tree}); machine: "
          f"{machine.get('cpu', '?')} x {machine.get('cpus', '?')}", flush=True)
    results = []
    runs_dir = out.with_suffix("")
    runs_dir.mkdir(exist_ok=True)
    for rnd in range(args.rounds):
        for sched in schedules:
            order = [("old", old_tree), ("new", new_tree)]
            if rnd % 2:
                order.reverse()
            for which, tree in order:
                res = run_once(tree, args.size, sched, args, shim, lib,
                               runs_dir / f"r{rnd}-{sched}-{which}.jsonl")
                res.update({"bench": "compare_commits", "round": rnd, "schedule": sched,
                            "which": which, "sha": old_sha if which == "old" else new_sha,
                            "size": args.size, "loadavg": os.getloadavg()})
                C.append_jsonl(out, res)
                results.append(res)
                print(f"round {rnd} {sched} {which}: {res['median_step_s']:.2f} s, peak RSS "
                      f"{C.gib(res['vm_hwm_bytes'] or 0)} GiB ({res['wall_s']:.0f} s wall)",
                      flush=True)
    text = summarize(results, schedules, (old_sha[:12], new_sha[:12]))
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    print(f"results: {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
