"""The dry run's predicted step is its schedule's critical path (issue 36), on README's two GPU
plans: 70B on one H100 (parameters on the CPU, Adam states on NVMe) and the 1T Llama on 8 x
H100 (both on NVMe), with docs/planner.md's configs and flags.

The step is the training thread's time -- its compute and its waits on the other resources,
now the host <-> device copies too (simulate/copies.py) -- so it is at least the
busiest resource's time and at most all of theirs together; the copies keep [Note: copy
events]: no compute of a unit starts before the copy that brought it ended, and no unit's CPU
Adam before its gradient's copy to the host ended. Host-homed units (70B's) are copied ahead
too, as soon as prefetch picks them, so their copies overlap compute where the drives keep up.
With ``overlap_comm`` (on at stage 3, passed as the engine passes it) all-gathers of
host-homed units (70B on 8 x H100 with parameters on the CPU) are issued ahead and overlap
compute, no unit's compute starting before its gather's end; the 1T plan's NVMe-homed units'
gathers are issued ahead once the unit before them has computed (issued at its use, their reads
ran before its compute: 156.6 s instead of 95.9 s with fast drives), its step no longer than
with every gather at use.
Planted faults (compute not waiting for its copy; the Adam not waiting for its gradient;
compute not waiting for its gather) break that order, so these checks can fail.

Fast: each plan is made for the whole model (``infinity plan``'s own path: the rung, pools and
budgets of 80 or 128 layers), and the dry run then runs the first ``DEPTH`` blocks of the same
widths under that plan (a block's schedule does not depend on how many follow it), a few
seconds instead of the whole model's ~15 s (the full runs' figures are in docs/planner.md).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from infinity import cli
from infinity.commands import dry_run as dry_run_module
from infinity.commands import plan as plan_command
from infinity.simulate.collectives import SimCollectives
from infinity.simulate.copies import SimCopies
from infinity.simulate.stepper import SimStepper

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                 tie_word_embeddings=False)
LLAMA_1T = dict(hidden_size=25600, intermediate_size=68352, num_hidden_layers=128,
                num_attention_heads=200, num_key_value_heads=200, vocab_size=32000,
                tie_word_embeddings=False)
PLANS = {
    "70B on one H100": (LLAMA_70B, ["--gpus", "1", "--gpu", "H100", "--host-memory", "512GiB",
                                    "--cpu-cores", "32", "--nvme", "2x3.84TB"]),
    "1T on 8 x H100": (LLAMA_1T, ["--gpus", "8", "--gpu", "H100", "--host-memory", "2TiB",
                                  "--cpu-cores", "112", "--nvme", "4x7TB"]),
}
HOST_HOMED = "70B on 8 x H100, parameters on the CPU"
"""Several ranks with parameters homed in host memory (a config's ``offload_param`` cpu): where
gathers are issued ahead at the use of the unit before them ([Note: gathers issued ahead]: NVMe
homes, 1T's, only after that unit's compute)."""
HOST_HOMED_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                     "bf16": {"enabled": True},
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                     "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                           "offload_optimizer": {"device": "cpu"}}}
PLANS[HOST_HOMED] = (LLAMA_70B, ["--gpus", "8", "--gpu", "H100", "--host-memory", "2TiB",
                                 "--cpu-cores", "112", "--nvme", "4x7TB"])
FAST_DRIVES = ["--nvme-read-GBps", "1000", "--nvme-write-GBps", "1000"]
"""Drives that keep up: compute, not the NVMe, bounds the step, so copies can hide behind it
(on the plans as given both are NVMe-bound: a unit's copy can start only when its read is over,
after the compute before it)."""
DEPTH = 3
"""Blocks the dry run runs (the plan is the whole model's)."""

Span = tuple[str, float, float, str]


def dry_run(tmp_path: Path, monkeypatch, capsys, plan: str,
            extra: tuple[str, ...] = ()) -> tuple[dict, list[Span]]:
    """``infinity plan --hf-config ... --dry-run --json --trace`` of ``plan`` (the model's first
    ``DEPTH`` blocks dry-run under the whole model's plan): the report and the last step's
    spans (resource, start, end, what), in seconds."""
    model, flags = PLANS[plan]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                  **model}))
    if plan == HOST_HOMED:
        ds = tmp_path / "ds_config.json"
        ds.write_text(json.dumps(HOST_HOMED_CONFIG))
        flags = [*flags, "--config", str(ds)]

    def first_blocks(args):
        cfg = transformers.LlamaConfig(**{**model, "num_hidden_layers": DEPTH})
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg)

    monkeypatch.setattr(plan_command, "_meta_model", first_blocks)
    trace = tmp_path / "step.json"
    assert cli.main(["plan", "--hf-config", str(config), *flags, *extra, "--dry-run", "--json",
                     "--trace", str(trace)]) == 0
    report = json.loads(capsys.readouterr().out)["dry_run"]
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    last = max(e["ts"] for e in events if e["ph"] == "i") / 1e6
    spans = [(rows[e["tid"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["name"])
             for e in events if e["ph"] == "X"]
    return report, [s for s in spans if s[2] > last]


def _unit(what: str, *kinds: str) -> str | None:
    match = re.match(rf"(?:{'|'.join(kinds)}) (\S+)", what)
    return match.group(1) if match else None


def out_of_order(spans: list[Span]) -> list[str]:
    """Where [Note: copy events] is broken: a unit's compute that starts before the end of the
    copy (H2D) that brought it, a unit's CPU Adam that starts before its gradient's copy to
    the host (D2H) ended."""
    eps = 1e-9
    compute = sorted((lo, _unit(what, "forward", "backward"))
                     for row, lo, _, what in spans if row == "compute")
    broken = []
    for row, lo, hi, what in spans:
        if row == "H2D":
            unit = _unit(what, "copy")
            first = next((start for start, u in compute if u == unit and start >= lo), None)
            if first is not None and first < hi - eps:
                broken.append(f"{unit}: compute at {first:.6f} s, its copy ends {hi:.6f} s")
    # a unit's Adam reads the gradient its backward of the same step sent down: paired from
    # the step's end (the spans also hold the tail of the step before: copies still landing),
    # the last Adam with the last copy, and so on (a copy queued behind others may start after
    # an Adam that did not wait for it, so pairing by start times would miss that)
    for unit in {_unit(what, "step") for row, *_, what in spans if row == "CPU Adam"}:
        steps = sorted(lo for row, lo, _, what in spans
                       if row == "CPU Adam" and _unit(what, "step") == unit)
        lands = sorted(hi for row, _, hi, what in spans
                       if row == "D2H" and _unit(what, "gradient") == unit)
        for lo, hi in zip(reversed(steps), reversed(lands)):
            if lo < hi - eps:
                broken.append(f"{unit}: Adam at {lo:.6f} s, its gradient lands {hi:.6f} s")
    return broken


def gathers_out_of_order(spans: list[Span]) -> list[str]:
    """Where [Note: gathers issued ahead] is broken on the clock: a unit's compute that starts
    before the end of the all-gather issued ahead for it."""
    eps = 1e-9
    compute = sorted((lo, _unit(what, "forward", "backward"))
                     for row, lo, _, what in spans if row == "compute")
    broken = []
    for row, lo, hi, what in spans:
        unit = _unit(what, "all-gather ahead") if row == "collectives" else None
        first = next((start for start, u in compute if u == unit and start >= lo), None)
        if first is not None and first < hi - eps:
            broken.append(f"{unit}: compute at {first:.6f} s, its gather ends {hi:.6f} s")
    return broken


def inside_compute(spans: list[Span], row: str) -> float:
    """Seconds of ``row``'s busy time that lie inside compute spans."""
    compute = [(lo, hi) for r, lo, hi, _ in spans if r == "compute"]
    return sum(max(0.0, min(hi, c1) - max(lo, c0))
               for r, lo, hi, _ in spans if r == row for c0, c1 in compute)


@pytest.mark.parametrize("plan", [p for p in PLANS if p != HOST_HOMED])
def test_the_predicted_step_is_the_schedules_critical_path(tmp_path, monkeypatch, capsys,
                                                           plan: str) -> None:
    report, spans = dry_run(tmp_path, monkeypatch, capsys, plan)
    step, busy = report["simulated_step_s"], report["busy_s"]
    assert report["analytical_step_s"] > 0      # the plan's figure beside the dry run's
    resources = {row: s for row, s in busy.items() if row != "compute waits"}
    # the GPU's copies are rows: parameters up, gradients down
    assert busy["H2D"] > 0 and busy["D2H"] > 0 and busy["NVMe"] > 0
    assert max(resources.values()) <= step * (1 + 1e-9)
    assert step <= sum(resources.values()) * (1 + 1e-9)
    assert busy["compute"] + busy["compute waits"] == pytest.approx(step, rel=1e-9)
    # the copies are on the critical path where they are waited for
    assert any(row == "compute waits" and what.startswith("waits for the copy of ")
               for row, *_, what in spans)
    assert out_of_order(spans) == []


@pytest.mark.parametrize("plan, row", [
    ("1T on 8 x H100", "H2D"), ("1T on 8 x H100", "D2H"), ("70B on one H100", "D2H"),
    # 70B's parameters live in host memory: prefetch copies a unit from its home to the device
    # as soon as it picks it (zero/unit.py ``_copy_home``), behind the compute before it
    ("70B on one H100", "H2D")])
def test_copies_overlap_compute_where_the_drives_keep_up(tmp_path, monkeypatch, capsys,
                                                        plan: str, row: str) -> None:
    report, spans = dry_run(tmp_path, monkeypatch, capsys, plan, tuple(FAST_DRIVES))
    busy = report["busy_s"][row]
    assert busy > 0
    # some of the row's time hidden behind compute (a microsecond at least: not the rounding
    # of two spans that only touch)
    assert inside_compute(spans, row) >= 1e-6
    assert out_of_order(spans) == []


def _compute_does_not_wait(monkeypatch) -> None:
    monkeypatch.setattr(SimCopies, "compute_waits", lambda self, event: None)


def _adam_reads_the_gradient_early(monkeypatch) -> None:
    original = SimStepper._gradient_to_host

    def leaves(self, unit):
        landed = original(self, unit)
        self.grad_landed.pop(unit.index, None)      # the step no longer waits for it
        return landed
    monkeypatch.setattr(SimStepper, "_gradient_to_host", leaves)


@pytest.mark.parametrize("fault", [_compute_does_not_wait, _adam_reads_the_gradient_early],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_planted_fault_breaks_the_copies_order(tmp_path, monkeypatch, capsys, fault) -> None:
    fault(monkeypatch)
    _, spans = dry_run(tmp_path, monkeypatch, capsys, "70B on one H100", tuple(FAST_DRIVES))
    assert out_of_order(spans)


def _gathers_at_use(monkeypatch) -> None:
    """The dry run as it was before it passed ``overlap_comm``: every gather at use."""
    assemble = dry_run_module.assemble
    monkeypatch.setattr(dry_run_module, "assemble",
                        lambda *args, **kwargs: assemble(*args, **{**kwargs, "overlap_comm": False}))


def test_gathers_issued_ahead_overlap_compute_where_parameters_are_host_homed(
        tmp_path, monkeypatch, capsys) -> None:
    """``overlap_comm`` (on at stage 3) passed as the engine passes it, several ranks with
    parameters in host memory: a unit's all-gather runs on the collectives' row during the
    compute of the unit before it, and that unit's compute starts only at the gather's end;
    gathered at use, the collectives never overlap compute."""
    report, spans = dry_run(tmp_path, monkeypatch, capsys, HOST_HOMED)
    step, busy = report["simulated_step_s"], report["busy_s"]
    resources = {row: s for row, s in busy.items() if row != "compute waits"}
    assert max(resources.values()) <= step * (1 + 1e-9)
    assert step <= sum(resources.values()) * (1 + 1e-9)
    assert any(row == "collectives" and what.startswith("all-gather ahead model.layers.")
               for row, *_, what in spans)
    assert inside_compute(spans, "collectives") >= 1e-6
    assert gathers_out_of_order(spans) == []

    _gathers_at_use(monkeypatch)
    _, at_use = dry_run(tmp_path, monkeypatch, capsys, HOST_HOMED)
    assert not any(what.startswith("all-gather ahead") for *_, what in at_use)
    assert inside_compute(at_use, "collectives") < 1e-6


@pytest.mark.parametrize("drives", [(), tuple(FAST_DRIVES)], ids=["as given", "fast drives"])
def test_nvme_homed_units_are_gathered_ahead_after_the_unit_before_them(
        tmp_path, monkeypatch, capsys, drives: tuple[str, ...]) -> None:
    """The 1T plan's parameters live on NVMe: a unit's gather is issued ahead once the unit
    before it has its kernels queued (its forward post-hook, its backward done), its read
    waited for there. Issued at that unit's use instead, the read ran before its compute
    (156.6 s instead of 95.9 s with fast drives) and the gathers lay inside that compute. On the
    dry run's clock compute is the training thread's own, so at the point after it the compute
    is over: no gather lies inside that compute, compute waits for each, and the step is no
    longer than with every gather at use (shorter only where compute outside the units lies
    between that point and the use)."""
    report, spans = dry_run(tmp_path, monkeypatch, capsys, "1T on 8 x H100", drives)
    assert any(row == "collectives" and what.startswith("all-gather ahead model.layers.")
               for row, *_, what in spans)
    assert gathers_out_of_order(spans) == []
    assert inside_compute(spans, "collectives") < 1e-6
    _gathers_at_use(monkeypatch)
    at_use, _ = dry_run(tmp_path, monkeypatch, capsys, "1T on 8 x H100", drives)
    assert report["simulated_step_s"] <= at_use["simulated_step_s"] * (1 + 1e-9)


def test_compute_not_waiting_for_a_gather_issued_ahead_breaks_the_order(tmp_path, monkeypatch,
                                                                        capsys) -> None:
    monkeypatch.setattr(SimCollectives, "compute_waits", lambda self, handle: None)
    _, spans = dry_run(tmp_path, monkeypatch, capsys, HOST_HOMED)
    assert gathers_out_of_order(spans)
