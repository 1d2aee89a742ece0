"""One rank of the gathers-issued-ahead cases (started by tests/integration/ranks.py ``launch``,
tests/distributed/test_gather_ahead_ranks.py): for each case, stage 3 with ``overlap_comm`` on
trains TinyLM (seed 0) on this rank's rows of each global micro-batch, and writes its losses,
its sequence of collectives (``Collectives.sequence_log``), the gathers issued ahead and the
late gathers' counters. A case's ``plant`` breaks the rule on purpose (the test expects it to
fail): "no_wait" -- compute does not wait on the gather's handle; "early_release" -- the unit
is let go right after its gather was issued ahead, before its use. A case that raises is
recorded with its error, on every rank alike, and the next case runs. A case's "freeze"
freezes each block's norm (``freeze``).

argv: out_dir nvme_dir cases_json steps
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from parity import make_model
from parity_ranks_worker import MICRO, case_config, global_batches

import infinity


MANAGER: list = [None]    # the engine's tier manager, for the "early_release" plant


def _plant(name: str | None):
    """Apply the planted fault ``name``; returns the undo."""
    from infinity.zero.unit import Unit

    if name is None:
        return lambda: None
    if name == "no_wait":
        original = Unit.wait_gather

        def no_wait(self) -> None:
            self.gather_event = None        # forgotten: compute reads the buffer at once
        Unit.wait_gather = no_wait
        return lambda: setattr(Unit, "wait_gather", original)
    if name == "early_release":
        original = Unit.gather_ahead

        def release_early(self) -> None:
            original(self)
            self.release(MANAGER[0])        # not held from its gather to its use
        Unit.gather_ahead = release_early
        return lambda: setattr(Unit, "gather_ahead", original)
    raise ValueError(f"unknown plant {name!r}")


def freeze(model, case: dict):
    """With the case's "freeze": each block's norm is frozen (a fine-tune that trains part of a
    unit): such a unit's backward is done only at its inputs' gradient, after the next unit's
    pre-backward hook. Returns ``model``."""
    if case.get("freeze"):
        for block in model.blocks:
            block.norm.requires_grad_(False)
    return model


def run_case(case: dict, nvme_dir: str, steps: int, rank: int, world: int) -> dict:
    from infinity.storage.device_cache import DeviceMemoryCache

    # "slots": the path of devices without the memory cache (CUDA): NVMe reads of the own
    # shard into host fetch slots, then a copy into the device buffer, then the gather
    supported = DeviceMemoryCache.supported
    DeviceMemoryCache.supported = staticmethod(
        (lambda device: False) if case.get("slots") else supported)
    undo = _plant(case.get("plant"))
    try:
        return _run_case(case, nvme_dir, steps, rank, world)
    finally:
        undo()
        DeviceMemoryCache.supported = supported


def _run_case(case: dict, nvme_dir: str, steps: int, rank: int, world: int) -> dict:
    model = freeze(make_model("torch", seed=0, layers=3, width=32), case)
    config = case_config(case, nvme_dir, world)
    engine, *_ = infinity.initialize(model=model, config=config)
    MANAGER[0] = engine.manager
    batches = global_batches(case.get("seed", 1), steps, engine.gradient_accumulation_steps(),
                             world)
    engine.comm.sequence_log = log = []
    losses: list[float] = []
    result: dict = {}
    try:
        for micros in batches:
            total = 0.0
            for x in micros:
                mine = x[rank * MICRO:(rank + 1) * MICRO]
                loss = engine(input_ids=mine, labels=mine)
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / len(micros))
        result = {"losses": losses}
    except Exception:  # noqa: BLE001 - a planted fault: reported, the next case runs
        result = {"losses": losses, "error": traceback.format_exc()}
    finally:
        late = engine.comm.late
        result.update({
            "sequence": [list(entry) for entry in log],
            "ahead_issued": engine.coordinator.ahead.issued,
            # of those, NVMe-homed units' (issued once the unit before had its kernels queued)
            "ahead_after": engine.coordinator.ahead.issued_after,
            "ahead_dropped": engine.coordinator.ahead.dropped,
            "overlap_enabled": engine.coordinator.ahead.enabled,
            # each unit's param home and whether its parameters are sharded (which point its
            # gathers are issued ahead at: a host home's at the use of the unit before it, an
            # NVMe home's after that unit's kernels)
            "homes": [u.param_home.name for u in engine.units],
            "sharded": [bool(u.params_sharded) for u in engine.units],
            # units copied to the device ahead of use (slot or host home), used by a fetch
            "prefetch_hits": sum(u.prefetch_hits for u in engine.units),
            "late": None if late is None else {"issued": late.issued, "landed": late.landed,
                                               "lost": late.lost}})
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - after a planted fault the close may complain too
            result.setdefault("close_error", traceback.format_exc())
    return result


def main() -> None:
    out, nvme_dir, cases, steps = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), \
        int(sys.argv[4])
    import torch.distributed as dist

    infinity.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    results = {case["name"]: run_case(case, nvme_dir, steps, rank, world) for case in cases}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
