#!/usr/bin/env python3
"""The engine's host time per unit: a stage-3 engine against plain torch on a model whose
compute is negligible, so what is left is the engine's hooks (fetch, release, gradient hand-off,
the step's bookkeeping) on the host.

Why: on the first H200 the 0.49B forward was launch-bound (each kernel started within ~20 µs of
its launch; ~3 ms of host time a layer, docs/benchmark-history.md "The first H200 pass"). Whether that host time is
the engine's or the model's own Python decides where to cut. This runs on any machine (a CPU
device: the hooks' Python and the copies' bookkeeping, not CUDA's launch costs).

Run (from the repository root):
    python3 tools/bench/hook_overhead.py --rounds 5
Per round, interleaved, each timed as the median of ``--calls`` calls after ``--warmup``: a no-grad
forward and a training step (forward, backward, AdamW step), engine and plain torch. Reports the
difference per unit (the engine's units: each decoder layer, the embedding, the head) and the
ratio, median over rounds. A third engine with ``infinity.detached_reads`` "off" (no saved-tensor
hooks: zero/detached_reads.py) is timed beside them: the hooks' share of the step.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _median_s(fn: Callable[[], Any], calls: int, warmup: int) -> float:
    times = []
    for i in range(warmup + calls):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=7, help="decoder layers (0.49B's 7)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None, help="append the results as a JSON line here")
    args = ap.parse_args()
    if min(args.layers, args.rounds, args.calls) < 1 or args.warmup < 0:
        raise SystemExit("--layers, --rounds and --calls must be >= 1, --warmup >= 0")
    import torch
    import transformers

    import infinity

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_hidden_layers=args.layers, vocab_size=256,
                                   max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    plain = copy.deepcopy(model)
    unwatched = copy.deepcopy(model)
    ds = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"},
                                "stage3_param_persistence_threshold": 0},
          "infinity": {"compute_dtype": "fp32"}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    off = copy.deepcopy(ds)
    off["infinity"]["detached_reads"] = "off"
    engine_off, *_ = infinity.initialize(model=unwatched, config=off)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))

    def step_of(eng: Any) -> Callable[[], None]:
        def step() -> None:
            out = eng(input_ids=ids, labels=ids)
            eng.backward(out.loss)
            eng.step()
        return step

    def plain_step() -> None:
        out = plain(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> None:
            with torch.no_grad():
                fn()
        return call

    units = len(engine.units)
    rounds: list[dict[str, float]] = []
    try:
        for r in range(args.rounds):
            got = {}
            for name, fn in (("forward engine", no_grad(lambda: engine(input_ids=ids))),
                             ("forward plain", no_grad(lambda: plain(input_ids=ids))),
                             ("step engine", step_of(engine)), ("step plain", plain_step),
                             ("step engine unwatched", step_of(engine_off))):
                got[name] = _median_s(fn, args.calls, args.warmup)
            rounds.append(got)
            print(f"round {r}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in got.items()),
                  flush=True)
    finally:
        engine.close()
        engine_off.close()
    res: dict[str, Any] = {"units": units, "layers": args.layers, "rounds": rounds,
                           "machine": C.machine_info(), "git": C.git_state()}
    for what in ("forward", "step"):
        per_unit = [(x[f"{what} engine"] - x[f"{what} plain"]) / units for x in rounds]
        ratio = [x[f"{what} engine"] / x[f"{what} plain"] for x in rounds]
        res[f"{what}_ms_per_unit"] = statistics.median(per_unit) * 1e3
        res[f"{what}_ratio"] = statistics.median(ratio)
        print(f"{what}: the engine adds {res[f'{what}_ms_per_unit']:.3f} ms a unit "
              f"({units} units), engine / plain {res[f'{what}_ratio']:.2f}, median of "
              f"{len(rounds)} rounds")
    res["detached_reads_ratio"] = statistics.median(
        x["step engine"] / x["step engine unwatched"] for x in rounds)
    print(f"step: with the saved-tensor hooks / without (detached_reads \"off\") "
          f"{res['detached_reads_ratio']:.3f}, median of {len(rounds)} rounds")
    if args.json:
        C.append_jsonl(Path(args.json), res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
