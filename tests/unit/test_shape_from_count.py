"""A shape from a parameter count alone (``infinity plan --params N``, issue 36): depth and width
follow published models (planner/shape.py, [Note: shapes from a parameter count]), the shape's
Llama counts N, ``--layers`` wins, and the estimated model is planned parameter by parameter so
that a block too large to fetch is split as for a config."""
from __future__ import annotations

import json

import pytest

from infinity import cli
from infinity.planner.inputs import llama_stats, shape_stats
from infinity.planner.shape import PUBLISHED_SHAPES, estimated_shape
from infinity.planner.target import GPU_PRESETS, Target, Workload
from infinity.planner.target_plan import plan_target

TB = 10**12
COUNT_TOLERANCE = 0.01
"""The MLP width takes up what depth and width leave of the count, in steps of 256 (64 for
small MLPs): half a step is at most 0.7% of N from 1e8 up (7B: 3 x 4096 x 128 x 32 / 7e9)."""
SHAPE_TOLERANCE = 0.10
"""Depth and width against the real family's: between two table rows they are interpolated, so
a count a little off a row moves them a few % (70B: 81 x 8448 against Llama 2's 80 x 8192, since
the row counts 64.95B as a Llama with a full-width attention), well inside the spread of real
models of one size (GPT-3 13B is 40 x 5140, Llama 13B 40 x 5120; MT-NLG 530B has 105 layers,
ZeRO-Infinity's 0.5T 124)."""
ONE_T_NODE = ["--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "2TiB", "--nvme", "28TB"]


@pytest.mark.parametrize("count, layers, hidden", [
    (7 * 10**9, 32, 4096),           # Llama 7B
    (70 * 10**9, 80, 8192),          # Llama 2 70B
    (175 * 10**9, 96, 12288),        # GPT-3 175B
    (10**12, 128, 25600),            # ZeRO-Infinity 1T
])
def test_a_count_takes_the_shape_of_its_published_family(count, layers, hidden) -> None:
    shape = estimated_shape(count)
    assert shape.estimated and shape.source
    assert abs(shape.llama_params() / count - 1) < COUNT_TOLERANCE, shape
    assert abs(shape.layers / layers - 1) < SHAPE_TOLERANCE, shape
    assert abs(shape.hidden / hidden - 1) < SHAPE_TOLERANCE, shape
    assert shape.hidden % 128 == 0 and shape.intermediate % 256 == 0
    assert 2.4 < shape.intermediate / shape.hidden < 3.0        # Llama's 8h/3, the count's rest


def test_the_table_rows_are_reproduced_and_the_count_holds_between_them() -> None:
    """At a row's own count the row's depth and width come back; from 1e8 to 1e14 the count is
    met and the width never shrinks as the count grows (it was sqrt(N / 384) at 32 layers)."""
    for row in PUBLISHED_SHAPES:
        shape = estimated_shape(row.count)
        assert (shape.layers, shape.hidden) == (row.layers, row.hidden), row
    width = 0
    for step in range(61):
        count = int(10 ** (8 + step / 10))
        shape = estimated_shape(count)
        assert abs(shape.llama_params() / count - 1) < COUNT_TOLERANCE, (count, shape)
        assert shape.hidden >= width, (count, shape)
        width = shape.hidden


def test_the_estimated_stats_are_the_shape_parameter_by_parameter() -> None:
    """q, k, v, o, gate, up, down and two norms a block, the embedding, final norm and head:
    the same counts as a config's (llama_stats), so a split has every parameter's size."""
    shape = estimated_shape(10**12)
    stats = shape_stats(shape)
    h, i, n = shape.hidden, shape.intermediate, shape.layers
    assert stats.total_params == shape.llama_params()
    assert stats.param_numels is not None and len(stats.param_numels) == 9 * n + 3
    assert stats.param_numels[1:10] == (h * h,) * 4 + (h * i,) * 3 + (h, h)
    assert stats.n_units == n + 3 and stats.largest_unit_params == 4 * h * h + 3 * h * i + 2 * h
    split = stats.split_into_parameters()
    assert split.n_units == 9 * n + 3 and split.largest_unit_params == h * i
    assert stats == llama_stats(dict(hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                                     num_attention_heads=h // 128, vocab_size=shape.vocab))


def test_layers_wins_and_the_width_follows_the_count(capsys) -> None:
    shape = estimated_shape(70 * 10**9, 80)
    assert shape.layers == 80 and "given" in shape.source
    assert abs(shape.llama_params() / (70 * 10**9) - 1) < COUNT_TOLERANCE
    assert cli.main(["plan", "--params", "1T", "--layers", "64", *ONE_T_NODE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["shape"]["layers"] == 64 and data["model"]["n_units"] == 64 + 3


def test_1t_by_count_on_8x80gb_recommends_nvme_with_a_step(capsys) -> None:
    """It estimated 32 layers of width 51031 (a 29.4B-element block, 110 GiB fetched with its
    gradient) and answered INFEASIBLE; with ZeRO-Infinity's depth it fits at the deepest rung."""
    assert cli.main(["plan", "--params", "1T", *ONE_T_NODE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["feasible"], data["decision"]
    assert data["recommended"] == "ZeRO-Infinity: parameters and optimizer states on NVMe"
    assert data["predicted_step_s"] > 0 and data["bottleneck"]
    shape = data["model"]["shape"]
    assert (shape["layers"], shape["hidden"]) == (128, 25472) and shape["estimated"]
    note = next(n for n in data["notes"] if n.startswith("model shape estimated"))
    assert "128 layers of width 25472" in note and "ZeRO-Infinity 1T (128 x 25600)" in note


def test_a_block_too_large_to_fetch_is_split_for_an_estimated_shape() -> None:
    """1T on 16 x V100-32G (the paper's DGX-2): a 7.8B-element block is 15.6 GB in fp16, and
    twice that with its gradient, over a 30 GiB GPU: each parameter is its own unit, as for the
    --hf-config of docs/planner.md. From counts alone (no sizes) it was INFEASIBLE."""
    shape = estimated_shape(10**12)
    target = Target(gpu=GPU_PRESETS["V100-32G"], gpus_per_node=16, host_memory_bytes=3 * TB // 2,
                    cpu_cores=48, nvme_bytes=8 * 3_840_000_000_000, nvme_drives=8,
                    nvme_read_GBps=24.0, nvme_write_GBps=16.0)
    plan = plan_target(shape_stats(shape), shape, target, Workload())
    assert plan.chosen is not None, [r.why() for r in plan.decision.rungs]
    assert plan.chosen.units_split and plan.step is not None and plan.step.predicted_s > 0
    assert any("its own unit" in n for n in plan.notes)


@pytest.mark.parametrize("argv, said", [
    (["--params", "1e6", "--layers", "1000"], "90,868,096 parameters, more than 10% off"),
    (["--params", "1000"], "give a larger count"),
    (["--params", "1e30"], "over the 1e+15 this planner plans for"),
    (["--params", "1e6", "--dry-run"], "--dry-run runs the model's own modules"),
])
def test_a_count_the_planner_cannot_shape_is_refused_not_replaced(capsys, argv, said) -> None:
    """A count whose shape would be another size (a deep narrow block at 1000 layers planned
    90.9M for 1M, silently), or past any machine (1e30 ran for minutes without an answer), is
    refused in one line, before any planning."""
    if "1e30" in argv:          # argparse's own refusal of the value
        with pytest.raises(SystemExit) as info:
            cli.main(["plan", *argv])
        assert info.value.code == 2
    else:
        assert cli.main(["plan", *argv]) == 2
    assert said in capsys.readouterr().err
