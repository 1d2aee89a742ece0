"""Two ranks with ``overlap_comm``: a unit's all-gather issued ahead, at the use of the unit
before it or, homed on NVMe, once that unit's kernels are queued (see [Note: gathers issued
ahead] in zero/gather_ahead.py), under late collectives
(comm/ahead.py ``LateGathers``: the gathered bytes land on a helper thread only after the
handle's wait, NaN until then) and late copies (storage/transfers.py ``LateCopies``). Gloo, 2
processes on localhost, one launch for every case (tests/distributed/gather_ahead_ranks_worker.py).

- Stage 3, parameters on NVMe (through host fetch slots, the device memory cache off as on
  CUDA) and on the host, early step and deferred step (clipping + accumulation): the mean loss
  of the ranks equals plain torch AdamW's on the whole batch within the parity tests' 1e-5, and
  the two ranks' sequences of collectives are identical, entry for entry; the own shards were
  copied to the device ahead of use too (a host home's copy issued as soon as prefetch picks
  the unit, zero/unit.py ``_copy_home``); every gather issued ahead landed. Where each unit's
  gather was issued ahead, by its home: host-homed units' at the use of the unit before them;
  NVMe-homed units' once the unit before them had its kernels queued (its forward post-hook,
  its backward done after its reduce-scatter), their reads waited for there, not before that
  unit's compute (``AheadGathers.home_keeps_up``): counted, and every sharded unit but the
  first of a pass is gathered ahead somewhere; in the backward an NVMe-homed unit's gather
  ahead comes after the reduce-scatter of the unit before it. With each block's norm frozen (a
  unit done only at its inputs' gradient, after the next unit's pre-backward hook) none is
  issued at that point: the unit after the next is not gathered ahead there.
- Planted faults, for each home (each must fail): compute that does not wait on the gather's
  handle (NaN or wrong losses), a unit let go between its gather ahead and its use (refused,
  named).
"""
from __future__ import annotations

import json
import math
import re

import pytest
from parity import make_model
from gather_ahead_ranks_worker import freeze
from parity_ranks_worker import LR, WEIGHT_DECAY, global_batches
from ranks import check_ranks, launch, read_results, reference_run

from infinity.comm.ahead import LATE_COLLECTIVES_ENV
from infinity.storage.transfers import LATE_ENV

pytestmark = pytest.mark.distributed

STEPS = 3
OVERLAP = {"overlap_comm": True}
PARITY = [{"name": f"ahead-s3-{param}-{schedule}", "stage": 3, "param": param,
           "opt": "nvme" if param == "nvme" else "cpu", "schedule": schedule,
           "slots": param == "nvme", "zero_extra": OVERLAP}
          for param in ("nvme", "cpu") for schedule in ("early", "deferred")] + [
    {"name": "ahead-s3-nvme-early-frozen", "stage": 3, "param": "nvme", "opt": "nvme",
     "schedule": "early", "slots": True, "zero_extra": OVERLAP, "freeze": True}]
PLANTED = [{"name": f"planted-{param}-{plant}", "stage": 3, "param": param,
            "opt": "nvme" if param == "nvme" else "cpu", "slots": param == "nvme",
            "schedule": "early", "zero_extra": OVERLAP, "plant": plant}
           for param in ("cpu", "nvme") for plant in ("no_wait", "early_release")]


@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory) -> list[dict]:
    out, nvme = tmp_path_factory.mktemp("ahead2"), tmp_path_factory.mktemp("ahead2-nvme")
    results = launch(2, "gather_ahead_ranks_worker.py",
                     [str(out), str(nvme), json.dumps(PARITY + PLANTED), str(STEPS)],
                     timeout=600, env_extra={LATE_ENV: "7", LATE_COLLECTIVES_ENV: "7"})
    check_ranks(results)
    return read_results(out, 2)


def _reference(case: dict) -> list[float]:
    deferred = case["schedule"] == "deferred"
    batches = global_batches(1, STEPS, 2 if deferred else 1, 2)
    losses, _ = reference_run(freeze(make_model("torch", seed=0, layers=3, width=32), case),
                              batches, lr=LR,
                              weight_decay=WEIGHT_DECAY, clip=0.05 if deferred else 0.0)
    return losses


def _mean_losses(ranks: list[dict]) -> list[float]:
    return [sum(r["losses"][s] for r in ranks) / len(ranks) for s in range(STEPS)]


@pytest.mark.parametrize("case", PARITY, ids=[c["name"] for c in PARITY])
def test_gathers_issued_ahead_train_as_one_process(ranks_results, case) -> None:
    ranks = [r[case["name"]] for r in ranks_results]
    home = "NVME" if case["param"] == "nvme" else "HOST"
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["overlap_enabled"], r
        sharded = [u for u, on in enumerate(r["sharded"]) if on]
        assert sharded and all(r["homes"][u] == home for u in sharded), (r["homes"], sharded)
        assert r["ahead_issued"] > 0, r
        # NVMe-homed units' gathers ahead are issued after the unit before them computed,
        # host-homed units' at its use
        assert r["ahead_after"] == (r["ahead_issued"] if home == "NVME" else 0), r
        # the own shards were copied to the device ahead too (from a host home as soon as
        # prefetch picked the unit, from a slot an NVMe read filled): local, so the sequences
        # below stay equal
        assert r["prefetch_hits"] > 0, r
        late = r["late"]
        assert late is not None and late["issued"] == r["ahead_issued"], (late, r["ahead_issued"])
        assert late["landed"] == late["issued"] and late["lost"] == 0, late
    # every rank issued the same collectives in the same order, gathers ahead included
    assert ranks[0]["sequence"] == ranks[1]["sequence"]
    sequence = ranks[0]["sequence"]
    ahead = {tag for kind, _, tag in sequence if kind == "all-gather ahead"}
    at_use = {tag for kind, _, tag in sequence if kind == "all-gather"}
    assert sum(kind == "all-gather ahead" for kind, *_ in sequence) == ranks[0]["ahead_issued"]
    assert at_use      # the first unit of a pass is gathered at use
    # every unit but the first of a pass is gathered ahead somewhere
    assert len(ahead) >= len(sharded) - 1, (ahead, sharded)
    if home == "NVME":
        paired = _gathers_after_reduce(sequence)
        # with frozen norms a block's backward is done at its inputs' gradient, which is now
        # marked before the next block's pre-backward hook gathers that block (it came after,
        # and those gathers were issued at use): paired too
        assert paired > 0, sequence
    ref = _reference(case)
    losses = _mean_losses(ranks)
    for s, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= 1e-5 * abs(b), (case["name"], s, losses, ref)


def _gathers_after_reduce(sequence: list) -> int:
    """Gathers issued ahead at a unit's backward done: its reduce-scatter first, then the next
    unit's gather, so the reduce-scatter just before such a gather (among gathers and
    reduce-scatters: the arrived mask's all-reduce may come between) is of the unit gathered
    last before it. Raises where one is not (the gather issued before the unit's reduce-scatter
    follows the reduce-scatter of the unit before). Returns how many there were."""
    paired, last_gathered, previous = 0, None, None
    for kind, _, tag in sequence:
        if kind == "all-gather ahead" and previous is not None and previous[0] == "reduce-scatter":
            assert previous[1] == previous[2], \
                (f"the gather ahead of unit {tag} follows the reduce-scatter of unit "
                 f"{previous[1]}, not of unit {previous[2]}, the last gathered")
            paired += 1
        if kind.startswith("all-gather"):
            previous, last_gathered = (kind, tag), tag
        elif kind == "reduce-scatter":
            previous = (kind, tag, last_gathered)
    return paired


def _nan_failure(error: str) -> bool:
    """The traceback ``error`` ends in an exception raised because values were NaN or not
    finite (the gathered bytes read before they landed), not in any other failure."""
    lines = error.strip().splitlines()
    return bool(lines) and re.search(r"\bnan\b|not finite|non-finite", lines[-1], re.I) is not None


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_planted_faults_fail(ranks_results, param: str) -> None:
    no_wait = [r[f"planted-{param}-no_wait"] for r in ranks_results]
    ref = _reference(PLANTED[0])
    for r in no_wait:      # the fault was reached: gathers were issued ahead
        assert r["ahead_issued"] > 0, r
    losses = _mean_losses(no_wait) if all(len(r["losses"]) == STEPS for r in no_wait) else None
    if losses is None:
        # it stopped early: only a failure of the NaN or loss kind counts (any other error
        # would pass without the fault being what broke it)
        errors = [r.get("error", "") for r in no_wait]
        assert any(_nan_failure(e) for e in errors), errors
    else:
        assert any(not math.isfinite(a) or abs(a - b) > 1e-5 * abs(b)
                   for a, b in zip(losses, ref)), (losses, ref)
    for r in (r[f"planted-{param}-early_release"] for r in ranks_results):
        assert "released while its all-gather issued ahead" in r.get("error", ""), r
