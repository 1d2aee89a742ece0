"""The dry run's gradient adds into resident host homes (simulate/stepper.py; [Note: host adds
off the training thread] in storage/transfers.py): one rank on a GPU, the deferred schedule,
gradients accumulated in host memory. Each unit's add runs on the "host adds" lane after its
copy to the host, beside the backward and the next micro-batch, and the step waits for the
last copy and add; on a CPU device the training thread makes it at the copy."""
from __future__ import annotations

import pytest
from fakes import GPU_BOX

from infinity.commands.dry_run import DryRunRates, DryRunSetup, dry_run, meta_llama
from infinity.config import InfinityConfig
from infinity.optim.gradients import FOLDING_UNITS
from infinity.planner.inputs import llama_stats
from infinity.planner.run_plan import plan_run
from infinity.simulate.clock import WAIT
from infinity.simulate.copies import D2H

pytest.importorskip("transformers")

MODEL = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 160, "vocab_size": 384,
         "max_position_embeddings": 64, "tie_word_embeddings": False, "use_cache": False,
         "attention_dropout": 0.0}
ADDS = "host adds"


def _run(host_memory_GBps: float, early_step: str = "off", accumulate: int = 2):
    cfg = InfinityConfig.from_dict({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulate,
        "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
        "infinity": {"compute_dtype": "bf16", "early_step": early_step}}, world_size=1)
    plan = plan_run(cfg, GPU_BOX, stats=llama_stats(MODEL), device_is_cpu=False)
    rates = DryRunRates(compute_flops_per_s=1e10, nvme_read_GBps=3.0, nvme_write_GBps=2.0,
                        adam_params_per_s=1e9, pcie_GBps=10.0, host_memory_GBps=host_memory_GBps)
    return dry_run(meta_llama(MODEL), DryRunSetup(plan=plan), rates, seq_len=16, micro_batch=2,
                   steps=2, accumulate=accumulate)


def _unit_of(what: str) -> str:
    return what.split()[1] if what.startswith("gradient ") else what.split()[1].split("'")[0]


def test_each_add_follows_its_copy_and_the_step_waits_for_the_last() -> None:
    report = _run(host_memory_GBps=0.01)     # slow enough that the adds outlast the backward
    copies = [(start, end, _unit_of(what)) for lane, start, end, what in report.spans
              if lane == D2H and what.startswith("gradient ")]
    adds = [(start, end, _unit_of(what)) for lane, start, end, what in report.spans
            if lane == ADDS]
    assert len(adds) == len(copies) == 6 * 2 * 2      # 6 units, 2 micro-batches, 2 steps
    for (c_start, c_end, c_unit), (a_start, a_end, a_unit) in zip(copies, adds):
        assert a_unit == c_unit and a_start >= c_end and a_end > a_start
    waits = [(start, end) for lane, start, end, what in report.spans
             if lane == WAIT and "copies and adds" in what]
    assert len(waits) == 2                           # one a step, none at a backward's end
    for _, end in waits:
        assert any(abs(end - a_end) < 1e-12 for _, a_end, _ in adds)


def test_slow_adds_lengthen_the_step_by_at_most_their_own_time() -> None:
    free, slow = _run(0.0), _run(0.01)
    added = sum(end - start for lane, start, end, _ in slow.spans if lane == ADDS)
    assert sum(end - start for lane, start, end, _ in free.spans if lane == ADDS) == 0.0
    longer = sum(s.seconds for s in slow.steps) - sum(s.seconds for s in free.steps)
    assert 0 < longer <= added + 1e-12


def test_the_early_step_adds_nothing_on_the_host() -> None:
    """An early step hands each unit's gradient to its Adam: nothing is accumulated at home."""
    report = _run(0.01, early_step="on", accumulate=1)
    assert not [s for s in report.spans if s[0] == ADDS]


def test_the_last_micro_batch_steps_each_unit_after_its_add() -> None:
    """early_step "auto" with accumulation: the last micro-batch's backward steps each unit once
    its gradient's add is through ([Note: the last micro-batch steps early] in
    optim/boundary_steps.py), instead of the deferred steps at the next forward; the step
    predicted no longer than the deferred schedule's (here the Adam is slow against compute,
    so it is shorter: the Adam runs beside the backward)."""
    report = _run(host_memory_GBps=1.0, early_step="auto")
    adds = {}
    for lane, start, end, what in report.spans:
        if lane == ADDS:
            adds.setdefault(what.split()[1].split("'")[0], []).append(end)
    steps = [(start, what.split()[1]) for lane, start, _, what in report.spans
             if lane == "CPU Adam" and what.startswith("step ")]
    assert len(steps) == 6 * 2                      # every unit, each of the 2 steps
    for trace in report.steps:      # each step's units stepped within it, not in the next
        assert sum(trace.start <= start < trace.start + trace.seconds
                   for start, _ in steps) == 6
    for start, unit in steps:
        assert any(end <= start for end in adds[unit])
    deferred = _run(host_memory_GBps=1.0, early_step="off")
    assert sum(s.seconds for s in report.steps) < sum(s.seconds for s in deferred.steps)


def test_at_most_folding_units_units_hold_adds_for_their_steps() -> None:
    """The last micro-batch's adds wait for their steps' kernels ([Note: the last adds fold into
    the step] in optim/boundary_steps.py) in at most ``FOLDING_UNITS`` units at once: with an
    Adam so slow that no step ends within the backward, the first units' adds fold and the rest
    are made on the adds lane in full; with a fast Adam every unit's folds."""
    def folded(adam_params_per_s: float) -> list[bool]:
        cfg = InfinityConfig.from_dict({
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"}},
            "infinity": {"compute_dtype": "bf16", "early_step": "auto"}}, world_size=1)
        plan = plan_run(cfg, GPU_BOX, stats=llama_stats(MODEL), device_is_cpu=False)
        rates = DryRunRates(compute_flops_per_s=1e10, nvme_read_GBps=3.0, nvme_write_GBps=2.0,
                            adam_params_per_s=adam_params_per_s, pcie_GBps=10.0,
                            host_memory_GBps=100.0)
        report = dry_run(meta_llama(MODEL), DryRunSetup(plan=plan), rates, seq_len=16,
                         micro_batch=2, steps=1, accumulate=2)
        adds = [what for lane, _, _, what in report.spans if lane == ADDS]
        assert len(adds) == 6 * 2                     # 6 units, 2 micro-batches
        assert not any(what.endswith("in its step") for what in adds[:6])
        return [what.endswith("in its step") for what in adds[6:]]

    assert folded(1e3) == [True] * FOLDING_UNITS + [False] * (6 - FOLDING_UNITS)
    assert folded(1e12) == [True] * 6
