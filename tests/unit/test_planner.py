"""The planner against hand math, its warnings, model stats, hardware detection and `infinity plan`."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch import nn

from infinity import cli
from infinity.config import InfinityConfig
from infinity.planner.inputs import (
    LLAMA_PRESETS,
    Hardware,
    ModelStats,
    detect_hardware,
    llama_stats,
)
from infinity.planner.plan import RUNTIME_OVERHEAD_BYTES, plan_memory, recommend_config
from infinity.planner.shape import estimated_shape
from infinity.planner.sizes import derive_sizes
from infinity.planner.tiers import Tier

from fakes import CPU_BOX, GPU_BOX

GiB, MiB = 2**30, 2**20
SMALL = ModelStats.from_counts(10_000_000, 1_000_000, 10, 10_000_000)


def config(stage: int, param: str, opt: str, **extra: object) -> InfinityConfig:
    zero = {"stage": stage, "offload_param": {"device": param, "nvme_path": "/swap"},
            "offload_optimizer": {"device": opt, "nvme_path": "/swap"}}
    return InfinityConfig.from_dict({"zero_optimization": zero, **extra})


def test_small_model_zero3_nvme_matches_hand_math() -> None:
    """10M params, largest unit 1M, CPU-only, fp32, host budget 1 GiB, device budget 256 MiB."""
    cfg = config(3, "nvme", "nvme", infinity={"host_memory_budget": "1GiB", "device_memory_budget": "256MiB"})
    plan = plan_memory(cfg, SMALL, CPU_BOX)
    s = plan.sizes
    assert s.compute_dtype == "fp32" and s.early_step  # CPU-only default; no clipping, no accumulation
    # sub-group: half of 1 GiB over 4 slots x 16 B fits 8,388,608; capped by the unit rounded up to 1 Mi
    assert (s.sub_group_size, s.buffer_count, s.buffer_size) == (1 << 20, 4, 1 << 20)
    # prefetch: 2 units as the coordinator counts them (their flat numel, 1M padded to 4 KiB:
    # 1,000,448), since 256 MiB - (current unit + its grads = 8 MB) leaves room; the live
    # limit holds the fetched unit beside them
    assert (s.prefetch_bucket_size, s.max_live_parameters) == (2_000_896, 3_001_344)
    # parameter slots: one unit's shard rounded up to 1024 elements; current + 2 prefetched + 1
    assert (s.param_buffer_size, s.param_buffer_count) == (1_000_448, 4)
    assert s.reduce_bucket_size == 1_000_448 and s.persistence_threshold == 100_000

    table = plan.table()
    # fp32 on CPU: the master is the parameter (4 B), Adam m and v 8 B, no gradient home: 12 B/param on NVMe
    assert table["params"] == {"device": 0, "host": 0, "nvme": 40_000_000}
    assert table["optimizer_states"] == {"device": 0, "host": 0, "nvme": 80_000_000}
    assert table["grads"] == {"device": 0, "host": 0, "nvme": 0}
    # the host buffers are the run plan's pools as the engine allocates them: the step stream's
    # 8 slots (3 sub-groups of m, v in flight + 2 for the parameters written home; the fp32
    # master is the parameter) of one unit's range rounded to 2048 elements; no fetch slots
    # (NVMe reads land in the device pool); the early step's held gradients (a room of one
    # unit's fp32 gradient and the unit waiting for it); the activation staging (8 x 4 MiB)
    opt_slots = 8 * 1_001_472 * 4
    held = 2 * 1_000_448 * 4
    staging = 8 * 4 * MiB
    assert table["buffers"]["host"] == opt_slots + held + staging
    assert {i.pool: i.nbytes for i in plan.items if i.pool} == {"optimizer": opt_slots}
    # the device pool keeps every unit it can (the parameter buffers' units): the model's
    # 10M fp32 parameters and a unit's gradients, under its 256 MiB budget
    working = 4 * (10_000_000 + 1_000_000)
    assert table["buffers"]["device"] == working
    assert plan.peak_host_rss_bytes == opt_slots + held + staging + working + RUNTIME_OVERHEAD_BYTES
    assert plan.nvme_read_bytes_per_step == 80_000_000 + 2 * 40_000_000  # states + fwd/bwd fetches
    assert plan.nvme_write_bytes_per_step == 80_000_000 + 40_000_000
    assert plan.fits and not plan.warnings
    assert "fits" in plan.render() and "nvme" in plan.render()


@pytest.mark.parametrize("hw, extra, per_param", [
    # CPU-only fp32: params stored once (4) + m, v (8) + grads (4) = 16 B, not DeepSpeed's 20
    (CPU_BOX, {}, 16),
    # GPU mixed precision, one micro-step: bf16 params (2) + master, m, v (12) + grads in
    # bf16 (2: the home never sums, see [Note: the gradient home in the compute dtype]) = 16 B
    (GPU_BOX, {"bf16": {"enabled": True}}, 16),
    # accumulating over micro-steps: the gradient home is fp32 (4), 18 B
    (GPU_BOX, {"bf16": {"enabled": True}, "gradient_accumulation_steps": 2}, 18),
])
def test_bytes_per_param_on_host(hw: Hardware, extra: dict, per_param: int) -> None:
    cfg = config(3, "cpu", "cpu", gradient_clipping=1.0, **extra)  # clipping: gradients kept
    plan = plan_memory(cfg, SMALL, hw)
    assert not plan.sizes.early_step
    states = sum(plan.bytes(c, "host") for c in ("params", "grads", "optimizer_states"))
    assert states == per_param * SMALL.total_params
    # no pools; on a CPU device (activations in host memory) the swapper's staging (8 x 4 MiB:
    # the config names a swap directory, "auto" may offload to it), which the engine allocates
    staging = 8 * 4 * MiB if not hw.has_gpu else 0
    assert plan.bytes("buffers", "host") == staging and plan.bytes(tier="nvme") == 0


def test_world_size_shards_by_stage() -> None:
    stats = ModelStats.from_counts(8_000_000, 1_000_000, 8)
    # fp32 without offload on a GPU: the engine keeps a master of its own beside the compute
    # copy (state_homes: one copy on a CPU device only), so the optimizer shard is master, m
    # and v (12 B); the deferred schedule's gradients live in host memory, as the engine keeps
    # them: from stage 1 each rank keeps the gradient of the shard it steps (the optimizer's
    # gradient stores are its shard's; test_plan_is_the_engine checks it on two ranks)
    for stage, expected in ((1, (4 * 8_000_000, 4 * 2_000_000, 12 * 2_000_000)),
                            (2, (4 * 8_000_000, 4 * 2_000_000, 12 * 2_000_000))):
        cfg = InfinityConfig.from_dict({"zero_optimization": {"stage": stage},
                                        "infinity": {"early_step": "off"}}, world_size=4)
        plan = plan_memory(cfg, stats, GPU_BOX)
        assert (plan.bytes("params", "device"), plan.bytes("grads", "host"),
                plan.bytes("optimizer_states", "device")) == expected
        assert plan.bytes("grads", "device") == 0


def test_the_device_gradient_buffers_are_a_row_of_the_device_tier() -> None:
    """Several ranks on a GPU reduce each unit's gradient in device buffers (see [Note:
    gradients reduced on the device] in optim/device_gradients.py): ``infinity plan`` shows
    the bytes the engine reserves for them on the device, and a device budget they overflow
    does not fit."""
    stats = ModelStats.from_counts(8_000_000, 1_000_000, 8)

    def cfg(**budget: object) -> InfinityConfig:
        zero = {"stage": 3, "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"}}
        return InfinityConfig.from_dict(
            {"zero_optimization": zero, "communication_data_type": "fp32",
             "infinity": {"early_step": "off", "compute_dtype": "bf16", **budget}},
            world_size=4)
    plan = plan_memory(cfg(), stats, GPU_BOX)
    # 1M elements (4 KiB-padded in bf16: 1,001,472) in 4 shards of 251,904, and the own one
    nbytes = 2 * (4 * 251_904 + 251_904) * 4
    assert plan.sizes.device_grad_bytes == nbytes
    (row,) = [i for i in plan.items if i.tier == "device" and "device buffer" in i.note]
    assert row.nbytes == nbytes and row.note.startswith("2 fp32 device buffer(s)")
    # a byte short of one buffer beside a fetched unit (and no prefetch): no plan fits there
    # (the prefetch's bytes as counted: its elements and the shard padding of its units)
    fetched = plan.bytes(tier="device") - nbytes - plan.sizes.prefetch_device_bytes
    tight = cfg(device_memory_budget=fetched + nbytes // 2 - 1)
    assert not plan_memory(tight, stats, GPU_BOX).fits


def test_optimizer_on_host_over_budget_warns_with_the_fix() -> None:
    stats = llama_stats(LLAMA_PRESETS["1B"])
    cfg = config(2, "none", "cpu", infinity={"host_memory_budget": "3GiB"}, bf16={"enabled": True})
    plan = plan_memory(cfg, stats, GPU_BOX)
    assert not plan.fits
    (warning,) = [w for w in plan.warnings if "on host" in w]
    assert warning.startswith("optimizer states need 10.51 GiB on host")
    assert "host budget is 3.00 GiB: set offload_optimizer.device nvme" in warning


def test_small_host_budget_shrinks_sub_groups_and_says_it_is_slow() -> None:
    """Small sub-groups are slow, not a failure (initialize trains them): a note, and the plan
    still fits (it said "does not fit" on this warning alone)."""
    cfg = config(3, "nvme", "nvme", infinity={"host_memory_budget": "40MiB", "device_memory_budget": "1GiB"})
    plan = plan_memory(cfg, SMALL, CPU_BOX)
    # half of 40 MiB over 4 slots x 16 B = 327,680 elements (a multiple of 1024)
    assert plan.sizes.sub_group_size == 327_680
    # the device budget is the user's: parameter buffers would free no host memory (nothing
    # for the run plan to give up, see planner/optimizer_room.py)
    assert any("slow: " in n and "leaves the optimizer 327,680-element sub-groups" in n
               for n in plan.notes), plan.notes
    assert not plan.room.changed
    assert plan.fits and plan.warnings == (), plan.warnings


def test_values_written_in_the_config_win_and_apply_round_trips() -> None:
    cfg = config(3, "cpu", "nvme", infinity={"host_memory_budget": "8GiB"})
    cfg = InfinityConfig.from_dict({**cfg.to_dict(), "zero_optimization": {
        **cfg.to_dict()["zero_optimization"], "sub_group_size": 5e6, "stage3_prefetch_bucket_size": 123}})
    sizes = derive_sizes(cfg, SMALL, CPU_BOX)
    assert sizes.sub_group_size == 5_000_000 and sizes.prefetch_bucket_size == 123
    resolved = sizes.apply(cfg)
    assert "auto" not in json.dumps(resolved.to_dict()["zero_optimization"])
    assert InfinityConfig.from_dict(resolved.to_dict()) == resolved
    assert derive_sizes(resolved, SMALL, CPU_BOX) == sizes  # resolving twice changes nothing


def test_cpu_only_device_budget_is_taken_from_host_memory() -> None:
    cfg = config(3, "cpu", "cpu")
    sizes = derive_sizes(cfg, SMALL, CPU_BOX)
    working = 4 * (1_000_000 + 2_000_000) + 4 * 1_000_000
    # plus the flat layout's padding: 4 KiB per unit and 64 B per parameter, in 5 states
    working += 5 * (SMALL.n_units * 4096 + 16 * SMALL.n_units * 64)
    assert sizes.device_budget_bytes == working
    assert sizes.host_budget_bytes == int(0.8 * 16 * GiB) - working
    gpu = derive_sizes(cfg, SMALL, GPU_BOX)
    assert gpu.device_budget_bytes == 78 * GiB and gpu.host_budget_bytes == int(0.8 * 200 * GiB)


def test_cpu_only_device_pool_counts_against_an_explicit_host_budget() -> None:
    stats = ModelStats.from_counts(200_000_000, 10_000_000, 22)  # 3.2 GB of states at 16 B/param
    plan = plan_memory(InfinityConfig.from_dict({"infinity": {"host_memory_budget": "1GiB"}}), stats, CPU_BOX)
    (warning,) = [w for w in plan.warnings if w.startswith("optimizer states")]
    assert warning.startswith("optimizer states need 1.49 GiB in the device pool")
    assert "host memory budget is 1.00 GiB: set offload_optimizer.device cpu" in warning
    assert plan.sizes.host_budget_bytes == 0  # the pool took all of it
    cfg = recommend_config(stats, CPU_BOX, InfinityConfig.from_dict({"infinity": {"host_memory_budget": "1GiB"}}))
    assert (cfg.zero.stage, cfg.zero.offload_optimizer.device) == (3, "nvme")


def test_recommend_picks_the_shallowest_tiers_that_fit() -> None:
    assert recommend_config(SMALL, CPU_BOX).zero.stage == 0
    big = ModelStats.from_counts(2_000_000_000, 50_000_000, 42)  # 32 GB of states at 16 B/param
    cfg = recommend_config(big, CPU_BOX)
    assert (cfg.zero.stage, cfg.zero.offload_param.device, cfg.zero.offload_optimizer.device) == (3, "nvme", "nvme")
    assert plan_memory(cfg, big, CPU_BOX).fits


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)   # 272
        self.norm = nn.LayerNorm(16)    # 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)                              # 1600
        self.blocks = nn.ModuleList(Block() for _ in range(3))          # 3 x 304
        self.norm = nn.LayerNorm(16)                                    # 32
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight                            # tied: counted once
        self.embed.weight.requires_grad_(False)


def test_model_stats_from_module_units_and_tied_weights() -> None:
    stats = ModelStats.from_module(TinyLM())
    assert stats.total_params == 1600 + 3 * 304 + 32
    assert stats.trainable_params == 3 * 304 + 32
    assert stats.n_units == 5 and stats.largest_unit_params == 1600 and stats.largest_param == 1600
    named = ModelStats.from_module(TinyLM(), unit_modules=["Linear"])  # each Linear is a unit
    assert named.n_units == 1 + 3 + 3 + 1  # embed, 3 Linear units, 3 block norms, final norm


def test_llama_presets_match_transformers_on_meta() -> None:
    transformers = pytest.importorskip("transformers")
    kwargs = LLAMA_PRESETS["85M"]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    built, closed = ModelStats.from_module(model), llama_stats(kwargs)
    assert (built.total_params, built.n_units, built.largest_unit_params, built.largest_param) == \
        (closed.total_params, closed.n_units, closed.largest_unit_params, closed.largest_param)
    assert sorted(built.param_numels) == sorted(closed.param_numels)
    assert llama_stats(LLAMA_PRESETS["1B"]).total_params == 940_640_256  # DS_E2E.md's 940.6M


def test_detect_hardware(disk_dir) -> None:
    hw = detect_hardware(disk_dir / "not-yet" / "swap")
    assert hw.cpu_cores >= 1 and 0 < hw.host_available_bytes <= hw.host_total_bytes
    assert hw.disk_free_bytes is not None and hw.disk_free_bytes > 0
    assert hw.has_gpu == torch.cuda.is_available()
    assert not (disk_dir / "not-yet").exists()  # probing creates nothing


def test_cli_plan_preset_text(capsys) -> None:
    assert cli.main(["plan", "--model-size", "125M", "--host-budget", "4GiB"]) == 0
    out = capsys.readouterr().out
    # the byte vocabulary of infinity train: the 125M shape has 85.4M parameters there
    assert "85.4M params" in out and "optimizer states" in out and "ds_config" in out


@pytest.mark.parametrize("size", ["85M", "1B"])
def test_cli_plan_model_size_is_the_model_train_builds(size, capsys) -> None:
    """plan's 85M was a 576-wide 32000-vocabulary model, train's the 768-wide byte one: the
    plan of the demo said it did not fit at the demo's budget."""
    import torch
    from transformers import LlamaForCausalLM

    from infinity.train.models import preset_config

    with torch.device("meta"):
        model = LlamaForCausalLM(preset_config(size, 64))
    assert cli.main(["plan", "--model-size", size, "--host-budget", "4GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["total_params"] == sum(p.numel() for p in model.parameters())


def test_cli_plan_json_with_config(tmp_path, capsys) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "x"},
                                                    "offload_optimizer": {"device": "nvme", "nvme_path": "x"}},
                              "infinity": {"compute_dtype": "fp32"}}))   # the hand math below is fp32's
    code = cli.main(["plan", "--params", "2e8", "--layers", "8", "--config", str(ds), "--nvme-path",
                     str(tmp_path), "--host-budget", "2GiB", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    # --params is planned as the Llama of its estimated shape (8 layers of width 1152): that
    # shape's own count, within 1% of 2e8 (tests/unit/test_shape_from_count.py)
    total = estimated_shape(200_000_000, 8).llama_params()
    assert abs(total / 200_000_000 - 1) < 0.01
    assert data["recommended"] is False and data["model"]["total_params"] == total
    assert data["table_bytes"]["optimizer_states"]["nvme"] == 8 * total
    budgets = data["budget_bytes"]
    if torch.cuda.is_available():
        assert budgets["host"] == 2 * GiB
    else:  # the emulated device pool is paid from the host budget
        assert budgets["host"] + budgets["device"] == 2 * GiB
    assert data["ds_config"]["zero_optimization"]["offload_param"]["nvme_path"] == str(tmp_path)
    assert data["hardware"]["nvme_path"] == str(tmp_path)


def test_cli_plan_bad_input_exits_2(capsys) -> None:
    assert cli.main(["plan", "--model-size", "7B", "--host-budget", "lots"]) == 2
    assert "--host-budget" in capsys.readouterr().err
    # --layers shapes --params only: with a preset it was ignored silently
    assert cli.main(["plan", "--model-size", "7B", "--layers", "4"]) == 2
    assert "--layers goes with --params" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("INFINITY_SKIP_HF") == "1", reason="INFINITY_SKIP_HF=1")
def test_cli_plan_hf_config(tmp_path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    transformers.LlamaConfig(**LLAMA_PRESETS["85M"]).to_json_file(path)
    assert cli.main(["plan", "--hf-config", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["total_params"] == llama_stats(LLAMA_PRESETS["85M"]).total_params


def test_cli_plan_config_that_is_a_directory(tmp_path, capsys) -> None:
    """It was an IsADirectoryError traceback."""
    assert cli.main(["plan", "--model-size", "125M", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--config {tmp_path} is a directory" in err


@pytest.mark.skipif(os.environ.get("INFINITY_SKIP_HF") == "1", reason="INFINITY_SKIP_HF=1")
def test_cli_plan_bad_hf_config_is_one_line_and_never_asks_the_hub(tmp_path, capsys,
                                                                    monkeypatch) -> None:
    """A missing local path fell through to the hub (a repo-id error, or minutes of retries
    offline); a file that is not JSON was a traceback."""
    transformers = pytest.importorskip("transformers")

    def no_hub(*args, **kwargs):
        raise AssertionError(f"asked the Hugging Face hub for {args}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-json.json").write_text("vocab_size: 100\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty-dir").mkdir()
    cases = {
        "./missing.json": "missing.json does not exist",
        "configs/llama.json": "configs/llama.json does not exist",
        str(tmp_path / "no" / "such" / "dir"): "does not exist",
        "not-json.json": "not-json.json: not valid JSON at line 1 column 1",
        "list.json": "list.json: expected a transformers config with a \"model_type\" key",
        "empty-dir": "empty-dir: no config.json there",
    }
    for arg, expected in cases.items():
        assert cli.main(["plan", "--hf-config", arg]) == 2, arg
        err = capsys.readouterr().err
        assert err.startswith("infinity plan: error: --hf-config ") and err.count("\n") == 1, err
        assert expected in err, (arg, err)


def test_a_speculative_plan_counts_the_second_copies_on_nvme() -> None:
    """Clipping makes the step deferred and, with parameters and Adam states on NVMe,
    speculative: the engine keeps second copies of them (its reserve counts them), which the
    plan left out (it showed, and checked the free space against, half the disk)."""
    cfg = config(3, "nvme", "nvme", gradient_clipping=1.0,
                 infinity={"host_memory_budget": "1GiB", "compute_dtype": "fp32"})
    plan = plan_memory(cfg, SMALL, CPU_BOX)
    once = sum(i.nbytes for i in plan.items if i.tier == Tier.NVME
               and i.component in ("params", "optimizer_states"))
    copies = [i for i in plan.items if i.component == "speculative_copies"]
    # the engine's reserve counts the units padded (4 KiB-aligned): within 0.2% of the raw count
    assert len(copies) == 1 and abs(copies[0].nbytes - once) <= 2e-3 * once, (copies, once)
    plain = plan_memory(dataclasses.replace(cfg, infinity=dataclasses.replace(
        cfg.infinity, speculative_step="off")), SMALL, CPU_BOX)
    assert not [i for i in plain.items if i.component == "speculative_copies"]


def test_cli_plan_measures_the_path_the_swap_space_takes(tmp_path, capsys) -> None:
    """A path left on a "cpu" section is not where the engine swaps (``ZeroConfig.swap_path``):
    the plan measures the "nvme" section's path, as the engine uses it."""
    swap, unused = tmp_path / "swap", tmp_path / "unused"
    swap.mkdir()
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(swap)},
        "offload_optimizer": {"device": "cpu", "nvme_path": str(unused)}}}))
    status = cli.main(["plan", "--params", "2e8", "--config", str(ds), "--host-budget", "2GiB",
                       "--json"])
    data = json.loads(capsys.readouterr().out)
    assert status == (0 if data["fits"] else 1), status     # 1: nothing fits (this disk)
    assert data["hardware"]["nvme_path"] == str(swap)
    assert not [n for n in data["notes"] if str(unused) in n]


def test_cli_plan_nvme_path_that_does_not_exist_yet(tmp_path, capsys) -> None:
    """Plan only sizes: a missing swap path is measured on its nearest existing parent, created
    by nobody, and named in a note (a run would fail on it)."""
    missing = tmp_path / "not-yet" / "swap"
    code = cli.main(["plan", "--params", "2e9", "--host-budget", "2GiB", "--nvme-path",
                     str(missing), "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["disk_free_bytes"] > 0 and not (tmp_path / "not-yet").exists()
    assert data["ds_config"]["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(missing)
    notes = [n for n in data["notes"] if "does not exist yet" in n]
    assert len(notes) == 1 and f"of {tmp_path}" in notes[0] and f"mkdir -p {missing}" in notes[0]


def test_cli_plan_on_a_swap_path_train_refuses_does_not_fit(tmp_path, capsys) -> None:
    """A regular file (or tmpfs) as nvme_path: train refuses it at the preflight, so the plan
    must not say "fits" (it did)."""
    not_a_dir = tmp_path / "swapfile"
    not_a_dir.write_bytes(b"")
    code = cli.main(["plan", "--params", "2e9", "--host-budget", "2GiB", "--nvme-path",
                     str(not_a_dir), "--json"])
    assert code == 1        # nothing fits: a script's `infinity plan ... && infinity train` stops
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False
    assert any("is not a directory" in w for w in data["warnings"]), data["warnings"]


def test_cli_plan_default_swap_path_is_the_one_train_uses(capsys) -> None:
    """It was /var/tmp/infinity-swap, which does not exist: the printed ds_config failed to train."""
    from infinity.planner.plan import DEFAULT_SWAP_DIR
    from infinity.train.defaults import DEFAULT_NVME_PATH

    assert DEFAULT_SWAP_DIR == DEFAULT_NVME_PATH
    status = cli.main(["plan", "--model-size", "70B", "--host-budget", "4GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert status == (0 if data["fits"] else 1), status     # fits where the disk holds it
    assert data["ds_config"]["zero_optimization"]["offload_param"]["nvme_path"] == DEFAULT_SWAP_DIR
    assert data["hardware"]["nvme_path"] == DEFAULT_SWAP_DIR
    assert any("does not exist yet" in n for n in data["notes"]) == (not os.path.isdir(DEFAULT_SWAP_DIR))


@pytest.mark.parametrize("hw", [CPU_BOX, GPU_BOX])
def test_minimum_host_budget_is_the_edge_of_host_budget_fits(hw: Hardware) -> None:
    """What `infinity train` checks a given host budget against, before the engine starts."""
    from infinity.planner.plan import host_budget_fits, minimum_host_budget

    cfg = config(3, "nvme", "nvme", gradient_clipping=1.0)

    def with_budget(budget: int) -> InfinityConfig:
        return InfinityConfig.from_dict({**cfg.to_dict(), "infinity": {"host_memory_budget": budget}})

    least = minimum_host_budget(cfg, SMALL, hw)
    assert least is not None and 0 < least < 1 * GiB
    assert host_budget_fits(with_budget(least), SMALL, hw)
    assert not host_budget_fits(with_budget(int(least * 0.99)), SMALL, hw)
    assert not host_budget_fits(with_budget(1), SMALL, hw)
    hosted = config(3, "cpu", "cpu")   # states on the host: the budget must hold them (16 B/param)
    assert minimum_host_budget(hosted, SMALL, hw) >= 12 * SMALL.total_params


def test_a_prefetch_bucket_larger_than_the_model_is_the_model() -> None:
    """DeepSpeed configs carry stage3_prefetch_bucket_size 1e9 or more; sized as written it
    gave a fetch slot per unit of it, which starved every other host pool (a tiny model failed
    at initialize with "0 B of the 40 KiB host budget")."""
    from infinity.planner.sizes import derive_sizes

    cfg = config(3, "nvme", "nvme", zero_optimization={
        "stage": 3, "stage3_prefetch_bucket_size": 1e12,
        "offload_param": {"device": "nvme", "nvme_path": "/swap"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}})
    sizes = derive_sizes(cfg, SMALL, CPU_BOX)
    assert sizes.prefetch_bucket_size == SMALL.total_params
    assert sizes.param_buffer_count <= 2 + -(-SMALL.total_params // SMALL.largest_unit_params)


@pytest.mark.parametrize("count", ["0", "0.0000001"])
def test_cli_plan_refuses_a_model_without_parameters(count, capsys) -> None:
    """It printed a plan for 0 parameters in 34 units."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--params", count])
    assert exit_info.value.code == 2
    assert "a model has at least one" in capsys.readouterr().err


def test_the_planner_is_pure_and_the_one_home_of_tiers_and_sizes() -> None:
    """The planner imports no torch, storage or I/O (DESIGN.md: the one place sizes are computed,
    importable from anywhere); storage's Tier is the planner's, and the optimizer's slot and
    chunk counts are the planner's functions."""
    import subprocess
    import sys

    code = ("import sys, infinity.planner.plan, infinity.planner.engine_sizes, "
            "infinity.planner.run_plan\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
            "m.startswith(('infinity.storage', 'infinity.io', 'infinity.zero', 'infinity.optim'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]

    from infinity.optim import gradients, pools
    from infinity.planner import engine_sizes, run_plan
    from infinity.planner.tiers import Tier
    from infinity.storage import tiers

    assert tiers.Tier is Tier and Tier.HOST == "host" and Tier.from_offload_device("cpu") is Tier.HOST
    assert pools.optimizer_pools is run_plan.optimizer_pools
    assert gradients.accumulate_chunk_numel is engine_sizes.accumulate_chunk_numel


@pytest.mark.parametrize("opt, param, grad, separate, early, slots", [
    ("nvme", "nvme", "host", False, True, 3 * 2 + 2),     # m, v; a fetched unit's two staging slots
    ("nvme", "nvme", "nvme", True, False, 3 * 4 + 2),     # + master and gradient (deferred)
    ("nvme", "nvme", "nvme", True, True, 3 * 3 + 2),      # the early step keeps no gradient
    ("host", "host", "host", False, False, 1),            # nothing streamed: at least one
    ("host", "nvme", "host", False, False, 2),
])
def test_step_slot_count(opt, param, grad, separate, early, slots) -> None:
    from infinity.planner.engine_sizes import step_slot_count
    from infinity.planner.tiers import Tier

    assert step_slot_count(Tier(opt), Tier(param), Tier(grad), separate, early) == slots


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_rank_plans_the_same_sub_group(world: int) -> None:
    """Each rank checks a unit's state format against the sub-group (int8 moments need a
    4096-element chunk), so it must be one figure on every rank. At 3 ranks an 8192-element
    unit's shards are 4096, 4096 and nothing: the last rank, sized by its own ranges (160
    elements of the small units), planned 2048, refused int8 alone, and the others waited at
    their first collective until they timed out."""
    from infinity.planner.alignment import shard_numel
    from infinity.planner.run_plan import optimizer_pools
    from infinity.planner.tiers import Tier

    units = [(8192, 8192), (4256, 4256), (4256, 4256)]
    planned = {optimizer_pools(units, world_size=world, rank=rank, shard_states=True,
                               sub_group_numel=10 ** 9, optimizer_tier=Tier.HOST,
                               param_tier=Tier.HOST, streamed=[False] * 3, grad_tier=Tier.HOST,
                               master_separate=True, early_step=False, speculative=False,
                               keeps_gradients=True).sub_group_numel for rank in range(world)}
    largest_shard = max(min(shard_numel(n, world), t) for n, t in units)
    assert planned == {largest_shard}, (world, planned)


def test_accumulate_chunk_is_8_mib_or_the_aligned_largest_gradient() -> None:
    from infinity.planner.engine_sizes import (
        ACCUMULATE_CHUNK_NUMEL,
        accumulate_chunk_numel,
    )

    assert ACCUMULATE_CHUNK_NUMEL * 4 == 8 * MiB
    assert accumulate_chunk_numel(10 ** 9) == ACCUMULATE_CHUNK_NUMEL
    assert accumulate_chunk_numel(0) == accumulate_chunk_numel(1) == 1024   # 4 KiB of fp32
    assert accumulate_chunk_numel(1025) == 2048


@pytest.mark.parametrize("itemsize, accumulation, world, expected", [
    (2, 1, 1, 2),     # 16-bit compute, one micro-step, one rank: the home never sums
    (2, 2, 1, 4),     # accumulation sums in the home: float32
    (2, 1, 2, 4),     # the average over ranks is float32
    (4, 1, 1, 4),     # fp32 compute
])
def test_gradient_home_itemsize(itemsize: int, accumulation: int, world: int,
                                expected: int) -> None:
    from infinity.planner.placement import gradient_home_itemsize
    assert gradient_home_itemsize(itemsize, accumulation, world) == expected


@pytest.mark.parametrize("hw, tier", [(CPU_BOX, "host"), (GPU_BOX, "device")])
def test_optimizer_none_with_a_separate_master_is_counted_where_the_engine_puts_it(
        hw: Hardware, tier: str) -> None:
    """bf16 compute, stage 0, nothing offloaded: on a CPU device the engine keeps the fp32
    master, m and v in host memory (planner/placement.py ``state_homes``), so the plan must count
    them there -- counted in the emulated device pool, `infinity plan` recommended configs that
    failed at initialize (a 4.5M Llama at 90 MiB: "master needs 2.25 MiB of host memory but only
    1.30 MiB ... is free")."""
    cfg = config(0, "none", "none", infinity={"compute_dtype": "bf16"})
    plan = plan_memory(cfg, SMALL, hw)
    assert plan.bytes("optimizer_states", tier) == 12 * SMALL.total_params


@pytest.mark.parametrize("budget, tier, boundary", [("96MiB", "host", True),
                                                  ("64MiB", "nvme", False)])
def test_the_last_micro_batch_steps_early_only_from_gradient_homes_in_host_memory(
        budget: str, tier: str, boundary: bool) -> None:
    """Where the host budget cannot hold the gradients' home it is on NVMe, and the run plan
    says the last micro-batch does not step its units (the backward would write a home the step
    reads back): what the engine's ready line and the dry run then show, as the optimizer does
    (optim/boundary_steps.py ``takes``), though the placement alone would allow it."""
    from infinity.planner.run_plan import plan_run
    cfg = config(3, "nvme", "nvme", gradient_accumulation_steps=4,
                 infinity={"host_memory_budget": budget, "speculative_step": "off"})
    plan = plan_run(cfg, CPU_BOX, stats=SMALL)
    assert plan.placement.boundary_steps and not plan.speculative
    assert (plan.grad_tier.value, plan.boundary_steps) == (tier, boundary)


@pytest.mark.parametrize("extra, early, boundary", [
    ({}, True, False),                                               # one micro-batch: early
    ({"gradient_accumulation_steps": 4}, False, True),              # the last one steps early
    ({"gradient_accumulation_steps": 4, "infinity": {"early_step": "on"}}, False, True),
    ({"gradient_accumulation_steps": 4, "infinity": {"early_step": "off"}}, False, False),
    ({"gradient_accumulation_steps": 4, "gradient_clipping": 1.0}, False, False),   # the norm
    ({"gradient_accumulation_steps": 4, "fp16": {"enabled": True}}, False, False),  # overflow
])
def test_the_schedule_steps_early_where_no_step_needs_every_gradient_first(extra, early,
                                                                          boundary) -> None:
    """The early step with one micro-batch a step; with several, the last one's backward steps
    the units (optim/boundary_steps.py), both only without clipping or an fp16 overflow check,
    and never with early_step "off"."""
    from infinity.planner.placement import place
    lay = place(config(3, "cpu", "cpu", **extra), SMALL, GPU_BOX)
    assert (lay.early_step, lay.boundary_steps) == (early, boundary)


def test_every_rank_plans_for_the_most_constrained_machine() -> None:
    """[Note: one machine for every rank's plan]: the host memory of the rank with the least
    per rank of its node (its MemAvailable and ranks per node together), the least of each
    other size, bf16 only where every CPU has it (the reason naming the ranks without); each
    rank keeps its own swap path and GPU name, and a CPU-only rank stays CPU-only."""
    import dataclasses

    from infinity.planner.inputs import agreed_hardware

    roomy = dataclasses.replace(GPU_BOX, host_available_bytes=900 * GiB, gpu_free_bytes=70 * GiB,
                                disk_free_bytes=None, cpu_bf16=True, nvme_path="/a")
    busy = dataclasses.replace(GPU_BOX, host_available_bytes=300 * GiB, gpu_free_bytes=50 * GiB,
                               disk_free_bytes=2 * GiB, cpu_bf16=False, ranks_per_node=8,
                               nvme_path="/b")
    for rank, own in enumerate((roomy, busy)):
        got = agreed_hardware([roomy, busy], rank)
        assert (got.host_available_bytes, got.gpu_free_bytes, got.disk_free_bytes) == \
            (300 * GiB, 50 * GiB, 2 * GiB)
        assert got.ranks_per_node == 8 and not got.cpu_bf16 and got.nvme_path == own.nvme_path
    assert agreed_hardware([roomy, busy], 0).cpu_bf16_reason == "rank(s) 1 have no native bf16"
    # a big node of 8 ranks (1.5 TiB: 192 GiB a rank) beside a small one of 2 (200 GiB: 100 GiB
    # a rank): the small node's pair, not its memory over the big node's count of ranks
    big = dataclasses.replace(roomy, host_available_bytes=1536 * GiB, ranks_per_node=8)
    small = dataclasses.replace(roomy, host_available_bytes=200 * GiB, ranks_per_node=2)
    got = agreed_hardware([big, small], 0)
    assert (got.host_available_bytes, got.ranks_per_node) == (200 * GiB, 2)
    cpu = dataclasses.replace(CPU_BOX, cpu_bf16=True)
    both = agreed_hardware([cpu, dataclasses.replace(cpu, host_available_bytes=GiB)], 0)
    assert both.cpu_bf16 and both.host_available_bytes == GiB and not both.has_gpu
    assert agreed_hardware([cpu, cpu], 1) == cpu


@pytest.mark.parametrize("budget", ["80MiB", "120MiB", "300MiB", None])
def test_the_recommended_ds_config_plans_what_the_recommendation_shows(budget) -> None:
    """The ds_config ``infinity plan`` hands out is planned as the plan it was shown with (the
    engine reads it): it pinned every derived size, and sizes a config pins are never
    re-shared, so under a tight budget its run split the budget otherwise (85M under 80 MiB:
    139,264-element sub-groups shown, 432,128 run, the device pool 14 MB smaller)."""
    from infinity.planner.inputs import llama_stats
    from infinity.train.models import preset_kwargs

    stats = llama_stats(preset_kwargs("85M", 128))
    given = InfinityConfig.from_dict(
        {"infinity": {"host_memory_budget": budget}} if budget else {})
    shown = plan_memory(recommend_config(stats, CPU_BOX, given, "/swap"), stats, CPU_BOX)
    again = plan_memory(InfinityConfig.load(shown.ds_config), stats, CPU_BOX)
    assert again.budgets == shown.budgets
    assert again.stepped_sub_group == shown.stepped_sub_group
    assert again.table() == shown.table()
    assert again.ds_config == shown.ds_config


def test_ranks_on_one_machine_count_as_its_ranks_whatever_the_launcher_says(monkeypatch) -> None:
    """Without LOCAL_WORLD_SIZE (DeepSpeed's launcher sets LOCAL_SIZE; srun, mpirun, variables
    set by hand) each rank took 80% of its node's memory: two ranks of one 24 GiB machine had
    17.4 GiB each. The ranks that detected one machine are its ranks; LOCAL_SIZE is read too."""
    import dataclasses

    from infinity.planner.inputs import agreed_hardware, local_world_size

    here = dataclasses.replace(CPU_BOX, host_available_bytes=20 * GiB, machine="a/1")
    there = dataclasses.replace(here, machine="b/2")
    got = agreed_hardware([here, here, there], 2)
    assert (got.host_available_bytes, got.ranks_per_node) == (20 * GiB, 2)
    # a launcher's larger count stands; a described machine ("") is taken as described
    assert agreed_hardware([dataclasses.replace(here, ranks_per_node=4), here], 0).ranks_per_node \
        == 4
    assert agreed_hardware([CPU_BOX, CPU_BOX], 0).ranks_per_node == CPU_BOX.ranks_per_node
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert local_world_size() == 1          # "" crashed infinity train's swap check
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert local_world_size() == 1          # one process (no WORLD_SIZE): its own machine
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert local_world_size() == 3          # the deepspeed launcher's count
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")    # an allocation's, not the processes'
    assert local_world_size() == 3


def test_cli_plan_nvme_path_flag_serves_a_config_that_offloads_activations(tmp_path,
                                                                            capsys) -> None:
    """A config with offload_activations "nvme" and no path of its own was refused at the
    config though --nvme-path gave one (the flag was applied after the config was read)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}},
        "infinity": {"offload_activations": "nvme"}}))
    status = cli.main(["plan", "--model-size", "tiny", "--config", str(ds), "--nvme-path",
                       str(tmp_path), "--host-budget", "2GiB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert status == 0 and data["hardware"]["nvme_path"] == str(tmp_path), (status, data)
