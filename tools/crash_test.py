#!/usr/bin/env python3
"""Crash consistency of checkpoints and swap space: kill a training process at random points
(SIGKILL, SIGINT, a full disk, EIO from the I/O engine; in saves, steps and loads) and check
after each that ``latest`` is the last committed checkpoint, bit for bit, and loads; that every
committed checkpoint equals the uninterrupted run's; that nothing outside the engine's
directories changed; and that a dead run's swap directory does not survive the next start.
The harness and the checks are tests/integration/crash_harness.py (its docstring lists them);
the short CI version is tests/integration/test_crash_consistency.py.

Run (from the repository root; as root a 64 MiB ext4 image is loop-mounted for real ENOSPC,
else ENOSPC is injected at the checkpoint writer, and the first line says which):
    python tools/crash_test.py --points 200 --seed 23 --out /var/tmp/infinity-crash/crash-200.jsonl
Weights directories (issue 34): ``--exports N`` kills N children saving a transformers
directory over an earlier save instead (save_pretrained, export, save_16bit_model; fewer, as
many and more shards; SIGKILL at a random file operation or a random delay) and checks each
leaves the earlier save or the new one, never a mix (tests/integration/weights_crash.py):
    python tools/crash_test.py --exports 200 --seed 23
Options: --points N (kill points, default 200), --seed S, --out F (JSON lines: one per point,
then a summary; default /var/tmp/infinity-crash/crash-<time>.jsonl), --no-mount (inject
ENOSPC), --ci (the CI schedule, cycled), --base DIR (a real disk, default $INFINITY_TEST_DISK or
/var/tmp). Exit status 1 when any point failed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import crash_harness  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=200)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-mount", action="store_true")
    ap.add_argument("--ci", action="store_true")
    ap.add_argument("--base", default=None)
    ap.add_argument("--exports", type=int, default=0,
                    help="kill N saves of a weights directory instead (see above)")
    args = ap.parse_args(argv)
    if args.exports:
        return _exports(args)
    # stop cleanly (the loop mount is undone) on SIGTERM and on Ctrl-C, also when started with &
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = _results_path(args.out, "crash")
    started = time.monotonic()
    with open(out, "w") as f, crash_harness.workspace(args.base, mount=not args.no_mount) as ws:
        record, say = _reporters(f)
        run = crash_harness.CrashRun(ws, args.seed, say=say)
        summary = run.run(args.points, crash_harness.CI_SCHEDULE if args.ci else None, record)
        minutes = (time.monotonic() - started) / 60
        say(f"\n{'mode':<14} {'tried':>6} {'fired':>6} {'survived':>9}  where it landed")
        for mode, c in summary["per_mode"].items():
            where = ", ".join(f"{w} {n}" for w, n in sorted(c["windows"].items()))
            say(f"{mode:<14} {c['tried']:>6} {c['fired']:>6} {c['survived']:>9}  {where}")
        say(f"{summary['points']} kill points ({summary['fired']} fired), {summary['survived']} "
            f"survived; final load {'ok' if summary['final_ok'] else 'FAILED'}; unloadable "
            f"{summary['unloadable']}, changed checkpoints {summary['changed_checkpoints']}, "
            f"changed outside {summary['changed_outside']}; {minutes:.1f} min; ENOSPC "
            f"{ws.enospc}; results in {out}")
        for failure in summary["failures"]:
            say(f"FAILURE: {failure}")
    return 1 if summary["failures"] else 0


def _results_path(given: Path | None, kind: str) -> Path:
    """``--out``, or a time-stamped file of ``kind`` under /var/tmp/infinity-crash."""
    out = given or (Path("/var/tmp/infinity-crash")
                    / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _reporters(f: IO[str]) -> tuple[Callable[[dict], None], Callable[[str], None]]:
    """``record(rec)``: one JSON line into ``f``; ``say(line)``: printed and recorded."""
    def record(rec: dict) -> None:
        f.write(json.dumps(rec) + "\n")
        f.flush()

    def say(line: str) -> None:
        print(line, flush=True)
        record({"say": line})
    return record, say


def _exports(args: argparse.Namespace) -> int:
    import tempfile

    import weights_crash

    out = _results_path(args.out, "exports")
    started = time.monotonic()
    base = args.base or os.environ.get("INFINITY_TEST_DISK", "/var/tmp")
    with open(out, "w") as f, tempfile.TemporaryDirectory(prefix="infinity-exports-",
                                                          dir=base) as work:
        record, say = _reporters(f)
        summary = weights_crash.run_kills(Path(work), args.exports, args.seed, say, record)
        say(f"\n{'kind and mode':<24} {'tried':>6} {'killed':>7} {'old':>5} {'new':>5} "
            f"{'failed':>7}")
        for key, c in sorted(summary["per_kind"].items()):
            say(f"{key:<24} {c['tried']:>6} {c['killed']:>7} {c['old']:>5} {c['new']:>5} "
                f"{c['failed']:>7}")
        say(f"{summary['points']} points, {len(summary['failures'])} failures; "
            f"{(time.monotonic() - started) / 60:.1f} min; results in {out}")
        for failure in summary["failures"]:
            say(f"FAILURE: {failure}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
