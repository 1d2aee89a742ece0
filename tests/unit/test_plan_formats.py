"""The planner's bytes per Adam state format (issue 38): the states of each unit by the
optimizer's rule, the NVMe bytes a step moves, the refusals, and the formats table of
``infinity plan`` (for a target and for this machine). Against a built engine: the format
configs of tests/integration/test_plan_is_the_engine.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from infinity import cli
from infinity.config import InfinityConfig
from infinity.planner.engine_sizes import INT8_SUB_GROUP, optimizer_store_bytes
from infinity.planner.formats import local_formats, render_formats
from infinity.planner.inputs import LLAMA_PRESETS, ModelStats, llama_stats
from infinity.planner.placement import place, state_bytes
from infinity.planner.run_plan import check_state_format, plan_run, state_format_refusal
from infinity.planner.shape import shape_from_llama_kwargs
from infinity.planner.state_format import QBLOCK, StateFormat
from infinity.planner.step_time import nvme_traffic
from infinity.planner.target import GPU_PRESETS, Target, Workload
from infinity.planner.target_plan import plan_target
from infinity.planner.tiers import Tier

from fakes import CPU_BOX, GPU_BOX

GiB, TiB, TB = 2**30, 2**40, 10**12
MODEL = ModelStats.from_counts(40_000_000, 4_000_000, 10, 4_000_000)
LLAMA_1T = dict(hidden_size=25600, intermediate_size=68352, num_hidden_layers=128,
                num_attention_heads=200, num_key_value_heads=200, vocab_size=32000,
                tie_word_embeddings=False)


def config(stage: int, param: str, opt: str, world_size: int = 1, **infinity: object
           ) -> InfinityConfig:
    zero = {"stage": stage, "offload_param": {"device": param, "nvme_path": "/swap"},
            "offload_optimizer": {"device": opt, "nvme_path": "/swap"}}
    return InfinityConfig.from_dict({"zero_optimization": zero, "infinity": infinity},
                                    world_size=world_size)


def h100_node(nvme: int = 28 * TB) -> Target:
    return Target(gpu=GPU_PRESETS["H100"], gpus_per_node=8, host_memory_bytes=2 * TiB,
                  cpu_cores=112, nvme_bytes=nvme, nvme_drives=4, nvme_read_GBps=12.0,
                  nvme_write_GBps=8.0)


# ---- the bytes ---------------------------------------------------------------------------------

def test_each_unit_takes_its_format_by_the_optimizers_rule() -> None:
    """int8 asked: a range of 4096 or more elements stores 1 + 1 B and 2 x 4 B per 2048-element
    block in host memory; a smaller one keeps fp32 moments and, under a bf16 master, an fp32
    master of its own (state_format.unit_format)."""
    fmt = StateFormat("int8", "bf16")
    states = state_bytes(fmt, [(8192, 8192), (1000, 1024), (5000, 5120)], ranks=1,
                         sharded=False, master_separate=False, compute_itemsize=2)
    assert states.optimizer == 2 * (8192 + 5000) + 12 * 1000
    assert states.scales == 8 * (8192 // QBLOCK) + 8 * 3
    assert states.kept_fp32 == 1
    # an fp32 master beside bf16 compute: 4 more bytes for every element
    separate = state_bytes(StateFormat("int8"), [(8192, 8192)], ranks=1, sharded=False,
                           master_separate=True, compute_itemsize=2)
    assert separate.optimizer == 6 * 8192
    # sharded over 4 ranks: the elements of each kind shared as the plan's counts are
    shared = state_bytes(StateFormat("bf16"), [(8_000_000, 2_000_896)], ranks=4, sharded=True,
                         master_separate=True, compute_itemsize=2)
    assert shared.optimizer == 8 * 2_000_000


@pytest.mark.parametrize("moments, master, compute, per_element", [
    ("fp32", "fp32", "bf16", 12), ("bf16", "fp32", "bf16", 8), ("int8", "fp32", "bf16", 6),
    ("int8", "bf16", "bf16", 2), ("int8", "fp32", "fp32", 2)])
def test_nvme_bytes_per_step_are_the_formats(moments, master, compute, per_element) -> None:
    """Adam states on NVMe are read and written once a step in their bytes: m + v (8, 4, 2)
    and a separate fp32 master (4; none when the parameter is its own master: fp32 compute on
    a CPU, or a bf16 master); the int8 scales stay in host memory."""
    unit = 4 << 20
    model = ModelStats.from_counts(10 * unit, unit, 10)
    cfg = config(3, "nvme", "nvme", compute_dtype=compute, optimizer_moments=moments,
                 optimizer_master=master)
    plan = plan_run(cfg, CPU_BOX, stats=model)
    lay = plan.placement
    assert lay.states.optimizer == per_element * model.trainable_params
    read, write = nvme_traffic(lay, plan.grad_tier)
    params = lay.c * lay.param_elems
    assert write == params + per_element * model.trainable_params
    assert read == 2 * params + per_element * model.trainable_params
    assert lay.states.scales == (8 * 10 * unit // QBLOCK if moments == "int8" else 0)
    # the engine's sizes: its NVMe reserve and host homes hold the same stores
    tier, host, int8 = optimizer_store_bytes([unit] * 10, lay.state_format,
                                             plan.master_separate, lay.c)
    assert tier == per_element * model.trainable_params and host == lay.states.scales
    assert plan.sizes.nvme_bytes == lay.c * model.total_params + tier
    assert plan.sizes.host_home_bytes == host and int8 == (moments == "int8")


def test_an_int8_run_never_gets_a_sub_group_under_two_blocks() -> None:
    """The optimizer refuses int8 sub-groups under 4096 elements: a tight host budget gives
    the others 2048-element ones, an int8 run 4096."""
    tight = {"host_memory_budget": 8 << 20, "compute_dtype": "bf16"}
    plain = plan_run(config(3, "nvme", "nvme", **tight), CPU_BOX, stats=MODEL)
    int8 = plan_run(config(3, "nvme", "nvme", optimizer_moments="int8", **tight), CPU_BOX,
                    stats=MODEL)
    assert plain.sizes.sub_group_numel == 2048
    assert int8.sizes.sub_group_numel == INT8_SUB_GROUP == 4096


def test_a_config_sub_group_under_one_int8_chunk_is_refused_by_the_plan_as_by_the_engine() -> None:
    """``sub_group_size`` 1000 (stepped as 2048) with int8 moments: the engine refuses it at its
    first unit, so the plan does too, with the engine's message (it said "fits"); a table
    comparing formats under that size shows int8 refused and plans the others."""
    def at(sub_group_size: int, moments: str) -> InfinityConfig:
        cfg = config(3, "cpu", "cpu", optimizer_moments=moments, compute_dtype="fp32")
        return dataclasses.replace(cfg, zero=dataclasses.replace(
            cfg.zero, sub_group_size=sub_group_size))
    int8 = at(1000, "int8")
    with pytest.raises(ValueError, match="chunks of at least 4096 elements.*sub-group at 2048"):
        plan_run(int8, CPU_BOX, stats=MODEL)
    rows = {r.format.label: r for r in local_formats(at(1000, "fp32"), MODEL, CPU_BOX,
                                                         recommend=False)}
    assert rows["int8 moments"].refused == "the sub-group is under one int8 chunk (4096 elements)"
    assert rows["fp32"].refused is None and rows["bf16 moments"].fits
    assert plan_run(at(4096, "int8"), CPU_BOX, stats=MODEL).sizes.sub_group_numel == 4096
    # units all under MIN_INT8_NUMEL keep fp32 moments: nothing is stepped in int8, nothing
    # refused (the engine trains it)
    tiny = ModelStats.from_counts(30_000, 3_000, 10)
    assert plan_run(at(1000, "int8"), CPU_BOX, stats=tiny).optimizer.sub_group_numel <= 4096


# ---- the refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg, hw, short, message", [
    (config(3, "cpu", "cpu", compute_dtype="bf16", optimizer_master="bf16"), CPU_BOX,
     "a bf16 master needs bf16 or int8 moments",
     'optimizer_master = "bf16" with optimizer_moments "fp32": the stochastically rounded'),
    (config(3, "cpu", "cpu", compute_dtype="fp32", optimizer_moments="int8",
            optimizer_master="bf16"), CPU_BOX, "a bf16 master needs bf16 compute (here fp32)",
     'but the compute dtype is fp32: set infinity.compute_dtype to "bf16"'),
    (config(3, "cpu", "cpu", compute_dtype="bf16", optimizer_moments="int8",
            optimizer_master="bf16"), GPU_BOX, "not available on GPUs yet",
     'optimizer_master = "bf16" runs on a CPU device only for now'),
    (config(2, "none", "none", compute_dtype="bf16", optimizer_moments="bf16"), GPU_BOX,
     "the optimizer is on the GPU (formats need it offloaded)",
     'with the optimizer on the GPU (zero_optimization.offload_optimizer.device "none")'),
])
def test_the_refusals_say_why_and_what_to_set(cfg, hw, short, message) -> None:
    lay = place(cfg, MODEL, hw)
    assert state_format_refusal(cfg, lay, not hw.has_gpu)[0] == short
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_state_format(cfg, lay, not hw.has_gpu)
    with pytest.raises(ValueError, match="infinity.optimizer_m"):
        plan_run(cfg, hw, stats=MODEL)


def test_a_bf16_master_on_a_gpu_is_only_projected() -> None:
    """The planner may project a bf16 master on a GPU (single copy: no fp32 master at all);
    the engine's plan refuses it, and formats with the optimizer on the GPU stay refused."""
    cfg = config(3, "nvme", "nvme", compute_dtype="bf16", optimizer_moments="int8",
                 optimizer_master="bf16")
    plan = plan_run(cfg, GPU_BOX, stats=MODEL, project_gpu_master=True)
    assert not plan.master_separate and plan.placement.states.optimizer == 2 * 4_000_000
    on_gpu = config(3, "nvme", "none", compute_dtype="bf16", optimizer_moments="int8",
                    optimizer_master="bf16")
    with pytest.raises(ValueError, match="with the optimizer on the GPU"):
        plan_run(on_gpu, GPU_BOX, stats=MODEL, project_gpu_master=True)


# ---- the formats table -------------------------------------------------------------------------

def test_the_1t_plan_lists_each_format_and_its_step_drops_by_the_byte_ratio() -> None:
    """README's 1T on one node of 8 x H100 (both on NVMe, NVMe-bound): each format at that
    rung; the NVMe bytes of a step fall with the states' bytes (fp32: 2 + 2 + 12 read, 2 + 12
    written per parameter; int8 + bf16 master: 2 + 2 + 2 and 2 + 2), and the NVMe-bound step
    with them; the bf16 master is a projection on GPUs."""
    stats, shape = llama_stats(LLAMA_1T), shape_from_llama_kwargs(LLAMA_1T)
    plan = plan_target(stats, shape, h100_node(), Workload())
    rows = {row.format.label: row for row in plan.formats}
    assert list(rows) == ["fp32", "bf16 moments", "int8 moments", "int8 + bf16 master"]
    assert rows["fp32"].current and not any(r.current for r in list(rows.values())[1:])
    assert all(r.fits and r.refused is None for r in rows.values())
    assert [r.projected for r in rows.values()] == [False, False, False, True]
    fp32, packed = rows["fp32"], rows["int8 + bf16 master"]
    assert fp32.step_s == pytest.approx(plan.step.predicted_s)
    ratio = (fp32.nvme_read + fp32.nvme_write) / (packed.nvme_read + packed.nvme_write)
    assert ratio == pytest.approx(30 / 10, rel=0.03)
    assert fp32.step_s / packed.step_s == pytest.approx(ratio, rel=0.05)
    nvme = [r.per_rank["nvme"] for r in rows.values()]
    assert nvme == sorted(nvme, reverse=True)
    assert nvme[0] / nvme[3] == pytest.approx(14 / 4, rel=0.02)
    # the int8 scales live in host memory: int8 moments hold a little more of it than fp32
    assert 0 < rows["int8 moments"].per_rank["host"] - fp32.per_rank["host"] < 1 * GiB
    text = "\n".join(render_formats(plan.formats, target=True))
    assert "int8 + bf16 master" in text and "projected: not available on GPUs yet" in text
    assert "fp32 *" in text


def test_a_format_plan_refuses_the_rungs_with_the_optimizer_on_the_gpu() -> None:
    """int8 moments asked: stages 0-3 with the optimizer on the GPU are refused (the engine
    would), an offloaded rung is chosen, and its ds_config carries the format; the bytes per
    parameter are 2 + 6.0039 (fp32 master, int8 m, v and their scales)."""
    kwargs = LLAMA_PRESETS["7B"]
    base = dataclasses.replace(InfinityConfig(), infinity=dataclasses.replace(
        InfinityConfig().infinity, optimizer_moments="int8"))
    plan = plan_target(llama_stats(kwargs), shape_from_llama_kwargs(kwargs),
                       Target(gpu=GPU_PRESETS["H100"], gpus_per_node=1,
                              host_memory_bytes=256 * GiB, cpu_cores=32),
                       Workload(), base)
    rungs = plan.decision.rungs
    assert all("refuses the Adam state format" in r.why() for r in rungs[:4])
    assert plan.chosen.placement.opt_tier is not Tier.DEVICE
    assert plan.ds_config()["infinity"]["optimizer_moments"] == "int8"
    assert plan.chosen.bytes_per_param()["optimizer_states"] == pytest.approx(6 + 8 / 2048,
                                                                             abs=1e-4)
    rows = {row.format.label: row for row in plan.formats}
    assert rows["int8 moments"].current and rows["fp32"].refused is None


def test_a_gpu_plan_with_a_bf16_master_is_a_projection_without_a_config() -> None:
    base = dataclasses.replace(InfinityConfig(), infinity=dataclasses.replace(
        InfinityConfig().infinity, optimizer_moments="int8", optimizer_master="bf16"))
    stats, shape = llama_stats(LLAMA_1T), shape_from_llama_kwargs(LLAMA_1T)
    plan = plan_target(stats, shape, h100_node(), Workload(), base)
    assert plan.projection and plan.ds_config() == {}
    data = plan.as_dict()
    assert data["projection"] and data["recommended"] is None and data["ds_config"] == {}
    assert data["state_format"]["label"] == "int8 + bf16 master"
    assert "projected (a bf16 master is not available on GPUs yet)" in plan.render()
    # a rung whose single copy would live deeper than its name says is not taken
    assert "a deeper rung's layout" in plan.decision.rungs[6].why()


def test_this_machines_formats_say_what_cannot_run_here() -> None:
    """A CPU without bf16 compute: the bf16 master is refused with its reason; the others
    are planned with their bytes (less NVMe for fewer bytes per moment)."""
    cfg = config(3, "nvme", "nvme", compute_dtype="fp32")
    rows = {r.format.label: r for r in local_formats(cfg, MODEL, CPU_BOX, recommend=False)}
    assert rows["int8 + bf16 master"].refused == "a bf16 master needs bf16 compute (here fp32)"
    nvme = [rows[k].per_rank["nvme"] for k in ("fp32", "bf16 moments", "int8 moments")]
    assert nvme[0] > nvme[1] > nvme[2]
    bf16 = config(3, "nvme", "nvme", compute_dtype="bf16")
    rows = {r.format.label: r for r in local_formats(bf16, MODEL, CPU_BOX, recommend=True)}
    assert rows["int8 + bf16 master"].refused is None and rows["int8 + bf16 master"].fits
    text = "\n".join(render_formats(tuple(rows.values()), target=False))
    assert "fp32 *" in text and text.splitlines()[1].count("step") == 1   # no step column


def test_the_cli_flags_set_the_formats_and_json_carries_them(capsys) -> None:
    assert cli.main(["plan", "--params", "7e9", "--gpus", "1", "--gpu", "H100",
                     "--host-memory", "256GiB", "--nvme", "4TB", "--optimizer-moments", "bf16",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["state_format"]["optimizer_moments"] == "bf16"
    assert data["ds_config"]["infinity"]["optimizer_moments"] == "bf16"
    assert [r["format"] for r in data["formats"]] == ["fp32", "bf16 moments", "int8 moments",
                                                      "int8 + bf16 master"]
    assert [r["current"] for r in data["formats"]] == [False, True, False, False]
    assert cli.main(["plan", "--model-size", "85M", "--host-budget", "2GiB",
                     "--optimizer-moments", "int8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ds_config"]["infinity"]["optimizer_moments"] == "int8"
    assert data["state_format"]["label"] == "int8 moments"
    assert any(r["current"] and r["format"] == "int8 moments" for r in data["formats"])
    assert cli.main(["plan", "--model-size", "85M", "--host-budget", "2GiB",
                     "--optimizer-moments", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "Adam states bf16 moments" in text and "Adam state formats at this config" in text


def test_the_cpu_adam_runs_at_the_formats_kernel_and_moves_its_bytes() -> None:
    """The engine's fp32 rate per core with the kernel's time per element swapped for the
    format's (int8 the slowest a core, bf16's stochastic rounding a little slower than fp32,
    as measured: KERNEL_ELEMENTS_PER_S); the memory traffic per parameter
    in the format's bytes: 30 with fp32 states beside bf16 compute, 18 with int8 moments, 12
    with int8 moments and a bf16 master (no separate copy to write)."""
    from infinity.planner.state_format import FP32_STATES
    from infinity.planner.step_time import (
        CPU_ADAM_BYTES_PER_PARAM,
        CPU_ADAM_PARAMS_PER_CORE,
        KERNEL_ELEMENTS_PER_S,
        adam_bytes_per_param,
        adam_params_per_core,
    )
    assert adam_params_per_core(FP32_STATES) == pytest.approx(CPU_ADAM_PARAMS_PER_CORE)
    for moments in ("bf16", "int8"):     # seconds per element: the kernel's part swapped
        extra = 1 / adam_params_per_core(StateFormat(moments)) - 1 / CPU_ADAM_PARAMS_PER_CORE
        want = 1 / KERNEL_ELEMENTS_PER_S[moments] - 1 / KERNEL_ELEMENTS_PER_S["fp32"]
        assert extra == pytest.approx(want, rel=1e-9), moments
    assert adam_params_per_core(StateFormat("int8")) < \
        adam_params_per_core(StateFormat("bf16")) < CPU_ADAM_PARAMS_PER_CORE
    per = {}
    for moments, master in (("fp32", "fp32"), ("int8", "fp32"), ("int8", "bf16")):
        cfg = config(3, "nvme", "nvme", compute_dtype="bf16", optimizer_moments=moments,
                     optimizer_master=master)
        per[moments, master] = adam_bytes_per_param(plan_run(cfg, CPU_BOX, stats=MODEL).placement)
    assert per == {("fp32", "fp32"): CPU_ADAM_BYTES_PER_PARAM, ("int8", "fp32"): 18,
                   ("int8", "bf16"): 12}


def test_a_target_plan_refuses_a_format_no_rung_can_run() -> None:
    """A bf16 master with fp32 moments, or on a GPU without bf16 (a V100 computes in fp16),
    is refused at once with the engine's message, not walked rung by rung."""
    kwargs = LLAMA_PRESETS["7B"]
    stats, shape = llama_stats(kwargs), shape_from_llama_kwargs(kwargs)
    for moments, gpu, message in (("fp32", "H100", 'with optimizer_moments "fp32"'),
                                  ("int8", "V100-32G", "but the compute dtype is fp16")):
        base = dataclasses.replace(InfinityConfig(), infinity=dataclasses.replace(
            InfinityConfig().infinity, optimizer_moments=moments, optimizer_master="bf16"))
        target = Target(gpu=GPU_PRESETS[gpu], gpus_per_node=1, host_memory_bytes=256 * GiB,
                        cpu_cores=32)
        with pytest.raises(ValueError, match=message):
            plan_target(stats, shape, target, Workload(), base)
