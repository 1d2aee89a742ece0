#!/usr/bin/env python3
"""Late landings: train small models of several families at stage 3 while background steps are
seen landed later than they did (each poll hands out a finished step with probability P, the
rest later; tests/integration/late_landing.py; a low P holds steps across the forward into the
backward, where a release can hurt: before its fix the ALBERT race showed at 0.05, rarely at
0.3), beside torch AdamW, over params/optimizer on cpu and nvme, reuse distance 0 and the
default, a device budget of 1.2x the parameters and none, clipping off and acting. A unit
released while a backward op or a step still reads it shows as an error ("storage of size 0")
or a loss unequal to torch's. The short CI version is
tests/integration/test_stage3_features.py::test_random_late_landings_train_like_torch.

Run (from the repository root):
    python tools/landing_fuzz.py --seeds 2
    python tools/landing_fuzz.py --seeds 2 --late-copies     # and every device copy late
    python tools/landing_fuzz.py --seeds 1 --deferred-bf16 --steps 3   # late copies = immediate
    python tools/landing_fuzz.py --seeds 1 --deferred-bf16 --boundary   # the last micro-batch
                                                                        # steps early
Options: --families (default all: llama gpt2 torch llama_tied albert bert t5), --seeds N (seeds
1..N per config), --p P [P ...] (default 0.05 0.3), --steps S (default 4), --late-copies (the
paths a GPU takes: the fetch through host slots, the device memory cache off, and gradients
copied to host buffers, never held; every copy to the device and every gradient's copy to the
host completed late on a helper thread, seeded by the case: storage/transfers.py LateCopies;
a case also fails when a buffer was released under a copy, poisoned or lost).
Prints one line per case and a summary; exit status 1 when any case failed.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import late_landing  # noqa: E402

TOLERANCE = 1e-5   # the parity tests' fp32 bound on the relative loss difference


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(late_landing.FAMILIES),
                    choices=late_landing.FAMILIES)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--p", type=float, nargs="+", default=[0.05, 0.3])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--late-copies", action="store_true")
    ap.add_argument("--deferred-bf16", action="store_true",
                    help="bf16 with an fp32 master, the deferred schedule: late copies against "
                         "the immediate ones, bit for bit (steps started ahead of their use)")
    ap.add_argument("--boundary", action="store_true",
                    help="with --deferred-bf16: early_step auto and no clipping, so the last "
                         "micro-batch's backward steps the units (optim/boundary_steps.py)")
    args = ap.parse_args(argv)
    if args.late_copies or args.deferred_bf16:
        from infinity.engine import sizing as engine_sizing
        from infinity.storage.device_cache import DeviceMemoryCache

        DeviceMemoryCache.supported = staticmethod(lambda device: False)
        engine_sizing.gradients_held = lambda device: False     # copied out, as off a CPU
    if args.deferred_bf16:
        return deferred_bf16(args)
    failed = cases = late = to_host = 0
    for family, tier, reuse, share, clip, p, seed in itertools.product(
            args.families, ("nvme", "cpu"), (0, None), (1.2, None), (0.0, 0.05), args.p,
            range(1, args.seeds + 1)):
        tag = f"{family} {tier} reuse={reuse} share={share} clip={clip} p={p} seed={seed}"
        cases += 1
        if args.late_copies:
            from infinity.storage.transfers import LATE_ENV

            os.environ[LATE_ENV] = str(cases)      # each case its own delays
        engines: list = []
        with tempfile.TemporaryDirectory(prefix="landing-fuzz-") as disk:
            try:
                worst, handed_late = late_landing.run_case(
                    family, tier, disk, seed, reuse, share, clip, p, args.steps, engines)
            except Exception as exc:  # noqa: BLE001 - a case's failure is the finding
                failed += 1
                print(f"FAIL {tag}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
        late += handed_late
        ok = worst <= TOLERANCE
        copies = engines[0].manager.copies
        counts = ""
        if args.late_copies:
            ok = ok and copies.poisoned == 0 and copies.lost == 0
            to_host += copies.to_host_copies
            counts = (f", {copies.copies} late copies ({copies.to_host_copies} to the host, "
                      f"{copies.poisoned} poisoned, {copies.lost} lost)")
        failed += not ok
        print(f"{'ok  ' if ok else 'DIFF'} {tag}: worst relative loss difference {worst:.1e}, "
              f"{handed_late} landings handed out late{counts}", flush=True)
    print(f"{cases} cases, {failed} failed, {late} landings handed out late in all" +
          (f", {to_host} late copies to the host" if args.late_copies else ""))
    return 1 if failed else 0


def deferred_bf16(args: argparse.Namespace) -> int:
    """``--deferred-bf16``: each case trained with the immediate copies and with late ones
    (seeded by the case); the losses must be equal, bit for bit, no buffer poisoned or lost, and
    no step's write of a device copy landed before the copy that filled it.
    Under late copies a unit's deferred step starts once its copy to the device is issued
    (zero/steps_ahead.py), with the immediate ones at its use: the same bits either way."""
    failed = cases = ahead = 0
    early = "auto" if args.boundary else "off"
    clips = (0.0,) if args.boundary else (0.0, 1.0)    # clipping turns the boundary steps off
    for family, tier, reuse, share, clip, seed in itertools.product(
            args.families, ("nvme", "cpu"), (0, None), (1.2, None), clips,
            range(1, args.seeds + 1)):
        tag = f"{family} {tier} reuse={reuse} share={share} clip={clip} seed={seed}"
        cases += 1
        try:
            with tempfile.TemporaryDirectory(prefix="landing-fuzz-") as disk:
                at_use, *_ = late_landing.run_deferred_bf16(
                    family, tier, disk, None, reuse, share, clip, args.steps, early)
            with tempfile.TemporaryDirectory(prefix="landing-fuzz-") as disk:
                late, started, poisoned, lost, overtaking = late_landing.run_deferred_bf16(
                    family, tier, disk, 1000 * seed + cases, reuse, share, clip, args.steps,
                    early)
        except Exception as exc:  # noqa: BLE001 - a case's failure is the finding
            failed += 1
            print(f"FAIL {tag}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        ok = late == at_use and poisoned == 0 and lost == 0 and overtaking == 0
        failed += not ok
        ahead += started
        print(f"{'ok  ' if ok else 'DIFF'} {tag}: {started} steps ahead, {poisoned} poisoned, "
              f"{lost} lost, {overtaking} writes before their fill"
              + ("" if late == at_use else f"; losses {late} vs {at_use}"),
              flush=True)
    print(f"{cases} cases, {failed} failed, {ahead} steps started ahead in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
