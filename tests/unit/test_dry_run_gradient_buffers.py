"""The dry run's device gradient buffers as a schedule (simulate/stepper.py; [Note: gradients
reduced on the device] in optim/device_gradients.py): with several ranks on a GPU a unit's
gradient is collected and reduced in one of the plan's kept buffers, written again only after
its shard's copy out to the host. With one buffer a unit's reduce waits for the copy out of
the unit before it; with two, for the one two units back."""
from __future__ import annotations

import pytest
from fakes import GPU_BOX, least_budget_with_two_gradient_buffers

from infinity.commands.dry_run import DryRunRates, DryRunSetup, dry_run, meta_llama
from infinity.config import InfinityConfig
from infinity.planner.inputs import llama_stats
from infinity.planner.run_plan import RunPlan, plan_run
from infinity.simulate.clock import WAIT
from infinity.simulate.collectives import COLLECTIVES
from infinity.simulate.copies import D2H

pytest.importorskip("transformers")

MODEL = {"hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 160, "vocab_size": 384,
         "max_position_embeddings": 64, "tie_word_embeddings": False, "use_cache": False,
         "attention_dropout": 0.0}
STATS = llama_stats(MODEL)


def _plan(budget: int) -> RunPlan:
    """Two ranks on GPUs, stage 3 with parameters and optimizer on the CPU, bf16, the prefetch
    set (so a budget decides the buffers alone)."""
    cfg = InfinityConfig.from_dict({
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 60_000,
                              "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
        "infinity": {"compute_dtype": "bf16", "device_memory_budget": budget,
                     "early_step": "off"}}, world_size=2)
    return plan_run(cfg, GPU_BOX, stats=STATS, device_is_cpu=False)


@pytest.fixture(scope="module")
def plans() -> dict[int, RunPlan]:
    """{buffers: plan} at the least device budget that keeps two buffers and a byte under it
    (one): every other size the same."""
    low = least_budget_with_two_gradient_buffers(_plan)
    two, one = _plan(low), _plan(low - 1)
    assert (one.derived.device_grad_buffers, two.derived.device_grad_buffers) == (1, 2)
    assert one.derived.prefetch_bucket_size == two.derived.prefetch_bucket_size
    return {1: one, 2: two}


def _run(plan: RunPlan, pcie_GBps: float):
    rates = DryRunRates(compute_flops_per_s=1e10, nvme_read_GBps=3.0, nvme_write_GBps=2.0,
                        adam_params_per_s=1e9, net_GBps=10.0, pcie_GBps=pcie_GBps)
    return dry_run(meta_llama(MODEL), DryRunSetup(plan=plan), rates, seq_len=16, micro_batch=2,
                   steps=3)


def _buffer_waits(report) -> float:
    return sum(end - start for lane, start, end, what in report.spans
               if lane == WAIT and "copy out of" in what)


SLOW, FAST = 0.01, 1000.0     # GB/s of the host <-> device link: copies out longer than a
                              # unit's backward, or over at once


def test_with_one_buffer_a_units_reduce_waits_for_the_copy_out_before_it(plans) -> None:
    """One buffer, a slow link: no unit's reduce starts while a copy out issued before it is
    still running (every D2H span begun before a reduce-scatter ended before it), and the
    training thread waits for them; over a fast link only for the copies' nanoseconds."""
    report = _run(plans[1], SLOW)
    copies = [(start, end) for lane, start, end, _ in report.spans if lane == D2H]
    reduces = [start for lane, start, _, what in report.spans
               if lane == COLLECTIVES and what.startswith("reduce-scatter")]
    assert copies and reduces
    for begun in reduces:
        assert all(end <= begun for start, end in copies if start < begun)
    assert _buffer_waits(report) > 0
    # over a fast link a wait is at most the copy's own nanoseconds
    fast = _run(plans[1], FAST)
    copying = sum(end - start for lane, start, end, _ in fast.spans if lane == D2H)
    assert _buffer_waits(fast) <= copying < _buffer_waits(report) / 1000


def test_two_buffers_wait_less_and_predict_no_longer_a_step(plans) -> None:
    """The plan with room for two buffers waits less for copies out than the one with one,
    and predicts each step no longer; over a fast link they differ by the copies'
    nanoseconds the one buffer waits."""
    one, two = _run(plans[1], SLOW), _run(plans[2], SLOW)
    assert _buffer_waits(two) < _buffer_waits(one)
    for kept_two, kept_one in zip(two.steps, one.steps):
        assert kept_two.seconds <= kept_one.seconds
    assert sum(s.seconds for s in two.steps) < sum(s.seconds for s in one.steps)
    fast_one, fast_two = _run(plans[1], FAST), _run(plans[2], FAST)
    longer = sum(s.seconds for s in fast_one.steps) - sum(s.seconds for s in fast_two.steps)
    assert 0 <= longer <= _buffer_waits(fast_one) + 1e-12
