"""`infinity plan` for a target machine (issue 27): the decision path against hand-computed
cases, the step time per link, the target flags, and the 1T plan from a Hugging Face config."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from infinity import cli
from infinity.planner.inputs import LLAMA_PRESETS, llama_stats
from infinity.planner.shape import activation_bytes, shape_from_llama_kwargs
from infinity.planner.step_time import (
    CPU_ADAM_BYTES_PER_PARAM,
    CPU_ADAM_PARAMS_PER_CORE,
    LINK_EFFICIENCY,
    OVERLAP_FACTOR,
)
from infinity.planner.target import DEVICE_RESERVE_BYTES, GPU_PRESETS, Target, Workload
from infinity.planner.target_plan import plan_target

GiB, TiB, TB = 2**30, 2**40, 10**12
LLAMA_1T = dict(hidden_size=25600, intermediate_size=68352, num_hidden_layers=128,
                num_attention_heads=200, num_key_value_heads=200, vocab_size=32000,
                tie_word_embeddings=False)
# per block 4 h^2 + 3 h i + 2 h = 7,870,924,800; x 128 + 2 x 32000 x 25600 + 25600
P_1T = 128 * (4 * 25600**2 + 3 * 25600 * 68352 + 2 * 25600) + 2 * 32000 * 25600 + 25600
LABELS = ("stage 0", "ZeRO-1", "ZeRO-2", "ZeRO-3: parameters", "ZeRO-3, optimizer states offloaded",
          "ZeRO-3, parameters and optimizer", "ZeRO-Infinity: optimizer states on NVMe",
          "ZeRO-Infinity: parameters and optimizer states on NVMe")


def node(gpu: str, gpus: int, host: int, nvme: int = 0, cores: int = 112, drives: int = 1,
         read: float = 12.0, write: float = 8.0) -> Target:
    return Target(gpu=GPU_PRESETS[gpu], gpus_per_node=gpus, host_memory_bytes=host, cpu_cores=cores,
                  nvme_bytes=nvme, nvme_drives=drives, nvme_read_GBps=read, nvme_write_GBps=write)


def plan_for(kwargs: dict, target: Target, **workload: object):
    return plan_target(llama_stats(kwargs), shape_from_llama_kwargs(kwargs), target, Workload(**workload))


def chosen_index(plan) -> int:
    assert plan.decision.feasible, [r.why() for r in plan.decision.rungs]
    label = plan.decision.rungs[-1].label
    return next(i for i, prefix in enumerate(LABELS) if label.startswith(prefix))


def test_7b_on_one_24gb_gpu_offloads_the_optimizer_with_checkpointing() -> None:
    """6,738,415,616 params on a 4090 (24564 MiB - 2 GiB reserved = 21.99 GiB):
    stages 0-3 keep bf16 params (2 B) + fp32 master, m, v (12 B) on the one GPU: 94.3 GB;
    offloading the optimizer leaves 2 B/param (13.5 GB) + one 202M-element block fetched twice
    over (working set) + activations. Without checkpointing the activations are
    32 x 2048 x 2 (8 x 4096 + 4 x 11008) + 6 x 32000 x 2048 = 10.46 GB: over; with it
    32 x 2 x 4096 x 2048 + one block 2048 x 2 (8 x 4096 + 4 x 11008) + the logits = 1.24 GB."""
    kwargs = LLAMA_PRESETS["7B"]
    p = 6_738_415_616
    plan = plan_for(kwargs, node("4090", 1, 128 * GiB, 2 * TB, cores=16))
    assert GPU_PRESETS["4090"].memory_bytes - DEVICE_RESERVE_BYTES == plan.decision.target.device_budget_bytes
    rungs = plan.decision.rungs
    for rung in rungs[:4]:
        assert not rung.fits and rung.memory.device["states"] >= 14 * p
        assert "GPU memory" in rung.why()
    assert chosen_index(plan) == 4
    m = plan.chosen
    assert m.checkpointing and not m.units_split
    assert m.device["states"] == 2 * p
    assert m.device["activations"] == 32 * 2 * 4096 * 2048 + 2048 * 2 * (8 * 4096 + 4 * 11008) \
        + 6 * 32000 * 2048 == 1_244_659_712
    assert activation_bytes(shape_from_llama_kwargs(kwargs), 2048, 1, False) == \
        32 * 2048 * 2 * (8 * 4096 + 4 * 11008) + 6 * 32000 * 2048
    assert m.host["states"] == 12 * p                        # fp32 master, m, v on the host
    assert m.bytes_per_param() == {"params": 2, "optimizer_states": 12, "grads": 0}  # early step
    assert m.model_states_bytes == 14 * p
    assert m.device_total <= plan.decision.target.device_budget_bytes
    assert plan.ds_config()["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert plan.ds_config()["bf16"] == {"enabled": True} and "fp16" not in plan.ds_config()


def test_7b_step_time_per_link_by_hand() -> None:
    """Compute: 2048 tokens x (8 N + 16 L h s) (checkpointing recomputes the forward; N: the
    parameters less the input embedding's 32000 x 4096, a lookup) at 40% of 165.2 TFLOPS; PCIe: the fp32 gradient shard down (4 P) against the updated bf16 params up
    (2 P); CPU Adam: P at min(16 cores x 0.9 G/s, 200 GB/s / 30 B)."""
    p, layers, h, s = 6_738_415_616, 32, 4096, 2048
    plan = plan_for(LLAMA_PRESETS["7B"], node("4090", 1, 128 * GiB, 2 * TB, cores=16))
    links = {link.name: link for link in plan.step.links}
    assert set(links) == {"GPU compute", "PCIe host<->GPU", "CPU Adam"}   # 1 GPU: no collectives
    mult = p - 32000 * h
    compute = s * (8 * mult + 16 * layers * h * s) / (165.2e12 * 0.4)
    assert links["GPU compute"].seconds == pytest.approx(compute)
    assert links["PCIe host<->GPU"].seconds == pytest.approx(4 * p / (32e9 * LINK_EFFICIENCY))
    adam_rate = min(CPU_ADAM_PARAMS_PER_CORE * 16, 200e9 / CPU_ADAM_BYTES_PER_PARAM)
    assert links["CPU Adam"].seconds == pytest.approx(p / adam_rate)
    bound = max(compute, 4 * p / (32e9 * LINK_EFFICIENCY), p / adam_rate)
    assert plan.step.bottleneck == "GPU compute" and plan.step.bound_s == pytest.approx(bound)
    assert plan.step.predicted_s == pytest.approx(OVERLAP_FACTOR * bound)
    assert plan.step.tokens_per_s == pytest.approx(s / plan.step.predicted_s)
    model_flops = s * (6 * mult + 12 * layers * h * s)
    assert plan.step.tflops_per_gpu == pytest.approx(model_flops / plan.step.predicted_s / 1e12)


def test_70b_on_8x80gb_shards_and_offloads_the_optimizer() -> None:
    """68,976,648,192 params on 8 x H100 (77.65 GiB usable each), 2 TiB host:
    ZeRO-3 on the GPUs alone needs 14 P / 8 = 120.7 GB a GPU; with the optimizer on the CPU a
    GPU keeps 2 P / 8 = 17.2 GB plus 80 x 2048 x 2 (8 x 8192 + 4 x 28672) + 6 x 32000 x 2048 =
    59.4 GB of activations without checkpointing, and a rank's host share
    0.8 x 2 TiB / 8 = 219.9 GB holds its 12 P / 8 = 103.5 GB of Adam states. Each block's
    gradient is reduced on the GPU ([Note: gradients reduced on the device]) in bf16 (the
    compute dtype: ``communication_data_type`` unset): two buffers of its 855,654,400 elements
    and its shard, 2 x 9 x 106,956,800 x 2 = 3.85 GB, would leave no room for a block fetched
    ahead beside those activations, one (1.93 GB) does: it fits without checkpointing (with
    fp32 buffers, 3.85 GB even for one, it did not)."""
    p = 68_976_648_192
    plan = plan_for(LLAMA_PRESETS["70B"], node("H100", 8, 2 * TiB, 28 * TB))
    zero3 = plan.decision.rungs[3].memory
    assert not zero3.fits and zero3.device["states"] >= 14 * p // 8
    assert chosen_index(plan) == 4
    m = plan.chosen
    assert not m.checkpointing
    assert m.device["activations"] == 80 * 2048 * 2 * (8 * 8192 + 4 * 28672) + 6 * 32000 * 2048
    assert m.derived.device_grad_buffers == 1 and m.derived.device_grad_dtype == "bf16"
    assert m.device["gradients"] == m.engine.device_gradient_bytes == 9 * 106_956_800 * 2
    # each unit's shard is rounded up to 2048 elements (83 units)
    assert 2 * p / 8 <= m.device["states"] <= 2 * (p / 8 + 2048 * 83)
    assert 12 * p / 8 <= m.host["states"] <= 12 * (p / 8 + 2048 * 83)
    assert m.node_host <= 2 * TiB and m.engine.host_home_bytes + m.engine.host_buffer_bytes <= 0.8 * 2 * TiB / 8
    names = {link.name for link in plan.step.links}
    assert "collectives (NVLink)" in names and "CPU Adam" in names


def test_1t_on_one_node_of_8x80gb_goes_to_nvme() -> None:
    """1.009T params, 8 x H100, 2 TiB, 28 TB NVMe: parameters on the CPU need 2 P / 8 = 252 GB a
    rank, over its 219.9 GB share; so both on NVMe: 14 P = 14.1 TB for the node's swap files
    (early step: no gradient home), under 28 TB. Every rank's host bytes together fit 2 TiB."""
    assert llama_stats(LLAMA_1T).total_params == P_1T
    plan = plan_for(LLAMA_1T, node("H100", 8, 2 * TiB, 28 * TB, drives=4))
    params_on_cpu = plan.decision.rungs[6]
    assert not params_on_cpu.fits and "host memory" in params_on_cpu.why()
    # (small parameters stay on the GPU: the 257 norms of 25,600 elements)
    assert params_on_cpu.memory.host["states"] >= 2 * (P_1T - 257 * 25600) // 8 > 0.8 * 2 * TiB / 8
    assert chosen_index(plan) == 7
    m = plan.chosen
    assert m.config.zero.stage == 3
    assert m.config.zero.offload_param.device == m.config.zero.offload_optimizer.device == "nvme"
    assert 14 * P_1T <= m.node_nvme <= 1.01 * 14 * P_1T <= 28 * TB
    assert m.node_host == 8 * m.host_total <= 2 * TiB
    assert m.checkpointing                  # 128 blocks of activations do not fit 80 GB
    # the sub-group is a rank's shard of a block, not a whole 7.7B-element block (issue 27)
    assert m.engine.sub_group_numel <= -(-7_870_924_800 // 8) + (1 << 20)   # rounded to 1 Mi
    assert plan.step.bottleneck.startswith("NVMe")


def test_1t_on_16x32gb_v100_uses_fp16_and_splits_the_blocks() -> None:
    """The paper's DGX-2 (16 x V100 32 GB, 1.5 TB, 8 x 3.84 TB NVMe): no bf16, so fp16 with
    loss scaling and the deferred step (fp32 gradients kept: 2 + 12 + 4 = 18 B/param); a whole
    block (7.87B elements, 15.7 GB in fp16, again for its gradient) is over a 30 GiB GPU, so
    every parameter is its own unit (largest 25600 x 68352 = 1.75B)."""
    plan = plan_for(LLAMA_1T, node("V100-32G", 16, 1_500_000_000_000, 8 * 3_840_000_000_000,
                                   cores=48, drives=8))
    assert chosen_index(plan) == 7
    m = plan.chosen
    assert m.placement.compute_dtype == "fp16" and not m.placement.early_step
    assert plan.ds_config()["fp16"]["enabled"] is True and "bf16" not in plan.ds_config()
    assert m.units_split and m.stats.largest_unit_params == 25600 * 68352
    assert tuple(m.config.infinity.unit_modules) == ("Linear",)
    assert plan.ds_config()["infinity"]["unit_modules"] == ["Linear"]
    assert m.bytes_per_param() == {"params": 2, "optimizer_states": 12, "grads": 4}
    assert m.node_host <= 1_500_000_000_000 and m.node_nvme <= 8 * 3_840_000_000_000
    assert any("too large to stream" in n for n in plan.notes)
    assert any("no bf16" in n for n in plan.notes)


def test_a_plan_that_fits_nowhere_says_what_to_add() -> None:
    """1T on 8 x 80 GB with 512 GiB and no NVMe: every rung is over; NVMe of about 14 P would
    make the deepest rung fit, so would more host memory (parameters and Adam states on the CPU),
    or more nodes."""
    plan = plan_for(LLAMA_1T, node("H100", 8, 512 * GiB))
    assert not plan.decision.feasible and plan.chosen is None and plan.step is None
    assert len(plan.decision.rungs) == 8 and not any(r.fits for r in plan.decision.rungs)
    assert plan.ds_config() == {}
    adds = plan.decision.additions
    nvme = [a for a in adds if a.startswith("NVMe")]
    assert len(nvme) == 1 and "-> ZeRO-Infinity: parameters and optimizer states on NVMe" in nvme[0]
    assert any(a.startswith("host memory") for a in adds)
    assert any(a.startswith("more GPUs") for a in adds)
    text = plan.render()
    assert "INFEASIBLE" in text and "ds_config" not in text
    data = plan.as_dict()
    assert data["feasible"] is False and data["predicted_step_s"] is None and data["additions"]


def test_target_flags_errors(capsys) -> None:
    assert cli.main(["plan", "--model-size", "7B", "--gpus", "8", "--gpu", "H100", "--world-size", "4"]) == 2
    assert "--world-size 4 is not --gpus x --nodes = 8 x 1 = 8" in capsys.readouterr().err
    assert cli.main(["plan", "--model-size", "7B", "--seq-len", "4096"]) == 2
    assert "describes the workload of a target machine" in capsys.readouterr().err
    assert cli.main(["plan", "--model-size", "7B", "--gpus", "2"]) == 2
    assert "needs its GPU" in capsys.readouterr().err
    assert cli.main(["plan", "--model-size", "7B", "--gpu", "H100", "--host-budget", "8GiB"]) == 2
    assert "--host-memory" in capsys.readouterr().err
    # a size without its unit is bytes: refused, not planned as an 80-byte GPU (whose only
    # advice was that splitting a weight is not built)
    for flag, example in (("--gpu-memory", "80GiB"), ("--host-memory", "2TiB"),
                          ("--nvme", "28TB")):
        extra = [] if flag == "--gpu-memory" else ["--gpu", "H100"]
        assert cli.main(["plan", "--params", "7B", "--gpus", "1", *extra, flag, "80"]) == 2
        err = capsys.readouterr().err
        assert f"{flag} 80: 80 bytes is no machine's" in err and f"e.g. {flag} {example}" in err
    # --dry-run on this machine is one rank
    assert cli.main(["plan", "--model-size", "tiny", "--world-size", "2", "--dry-run"]) == 2
    assert "--dry-run on this machine runs one rank" in capsys.readouterr().err


def test_model_configs_in_the_wrong_place_are_named(tmp_path, capsys) -> None:
    """A transformers config.json given as --config (it suggested 'data_types' for
    'model_type'), and a config with no causal-LM class (transformers listed ~400 classes)."""
    import json

    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                 "hidden_size": 64}))
    assert cli.main(["plan", "--model-size", "tiny", "--config", str(llama)]) == 2
    assert "this is a transformers model config (model_type 'llama'), not a ds_config" in \
        capsys.readouterr().err
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps({"model_type": "t5", "d_model": 64, "d_ff": 128, "d_kv": 16,
                              "num_layers": 1, "num_heads": 4, "vocab_size": 100}))
    assert cli.main(["plan", "--hf-config", str(t5)]) == 2
    err = capsys.readouterr().err
    assert "model_type 't5') has no causal language model class" in err and len(err) < 600


def test_target_flags_build_the_target(tmp_path, capsys) -> None:
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"recommendation": {"read_GBps": 2.5, "write_GBps": 1.5}}))
    assert cli.main(["plan", "--params", "7e9", "--gpus", "4", "--nodes", "2", "--gpu", "A100-80G",
                     "--gpu-tflops", "300", "--host-memory", "1TiB", "--cpu-cores", "64", "--nvme",
                     "4x3.84TB", "--nvme-tune", str(tune), "--net-GBps", "25", "--world-size", "8",
                     "--seq-len", "4096", "--micro-batch", "2", "--activation-checkpointing",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    t = data["target"]
    assert (t["gpus_per_node"], t["nodes"], t["world_size"]) == (4, 2, 8)
    assert t["gpu"]["name"] == "A100-80G" and t["gpu"]["peak_tflops"] == 300
    assert t["nvme_bytes"] == 4 * 3_840_000_000_000 and t["nvme_drives"] == 4
    assert (t["nvme_read_GBps"], t["nvme_write_GBps"]) == (10.0, 6.0)    # per drive x 4
    assert data["workload"]["seq_len"] == 4096 and data["activation_checkpointing"] is True
    assert data["feasible"] and "collectives (network)" in data["links"]
    assert set(data["per_rank"]) == {"device", "host", "nvme"}
    assert data["predicted_step_s"] > 0 and data["model_states_bytes"] > 0


def test_no_target_flags_plans_this_machine_and_never_recommends_an_infeasible_config(capsys) -> None:
    """70B on this machine said "offload deeper (stage 3, nvme)" of a stage-3 NVMe config."""
    status = cli.main(["plan", "--model-size", "70B", "--host-budget", "4GiB", "--nvme-path",
                       "/no/such/dir"])
    out = capsys.readouterr().out
    assert "offload deeper" not in out
    assert status == (1 if "INFEASIBLE" in out else 0), (status, out[:300])
    if "INFEASIBLE" in out:
        assert "copy into your ds_config.json" not in out


def test_cli_1t_hf_config_on_8x80gb_plans_nvme_in_well_under_a_minute(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    transformers.LlamaConfig(**LLAMA_1T, max_position_embeddings=4096).to_json_file(path)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "infinity.cli", "plan", "--hf-config", str(path),
                           "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "2TiB",
                           "--nvme", "28TB", "--json"], capture_output=True, text=True, timeout=120,
                          check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert elapsed < 30, elapsed
    data = json.loads(proc.stdout)
    assert data["model"]["total_params"] == P_1T
    zero = data["ds_config"]["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    ranks = data["target"]["gpus_per_node"]
    assert ranks * data["per_rank"]["host"] == data["per_node"]["host"] <= 2 * TiB
    assert data["per_node"]["nvme"] <= 28 * TB
    assert data["predicted_step_s"] > 0 and data["bottleneck"]


def test_a_config_is_planned_as_written_on_the_target(tmp_path, capsys) -> None:
    """--config with target flags: the one rung of its own stage and offload devices, with its
    clipping (so the deferred step: fp32 gradients kept, 18 B/param)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}))
    assert cli.main(["plan", "--model-size", "7B", "--config", str(ds), "--gpus", "2", "--gpu",
                     "A100-40G", "--host-memory", "256GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["decision"]) == 1 and data["decision"][0]["rung"].startswith("the config as written")
    assert (data["decision"][0]["stage"], data["decision"][0]["offload_param"]) == (3, "cpu")
    assert data["feasible"] and data["bytes_per_param"]["this_engine"]["grads"] == 4
    assert data["ds_config"]["bf16"] == {"enabled": True}       # 16-bit compute on the GPUs



def test_the_gradients_cross_pcie_and_the_collectives_in_the_communication_dtype() -> None:
    """70B on 8 x H100 with bf16 compute: ``communication_data_type`` unset reduces in bf16, so
    a rank's shard goes down PCIe in 2 B a parameter (P / 8 x 2 = 17.2 GB) and the
    reduce-scatter moves 2 B a parameter (120.7 GB), half of "fp32" asked (34.5 and 241.4 GB);
    the all-gathers and the parameters going up stay bf16 in both. The device buffers follow
    the dtype: one bf16 buffer of a block (1.93 GB) without checkpointing, where "fp32" keeps
    two (7.7 GB) and needs it."""
    from infinity.config import InfinityConfig

    p = 68_976_648_192
    links, memory = {}, {}
    for comm in (None, "fp32"):
        given = {"bf16": {"enabled": True}}
        if comm is not None:
            given["communication_data_type"] = comm
        plan = plan_target(llama_stats(LLAMA_PRESETS["70B"]),
                           shape_from_llama_kwargs(LLAMA_PRESETS["70B"]),
                           node("H100", 8, 2 * TiB, 28 * TB), Workload(),
                           base=InfinityConfig.from_dict(given))
        links[comm] = {link.name: link for link in plan.step.links}
        memory[comm] = plan.chosen
    pcie, wide_pcie = links[None]["PCIe host<->GPU"], links["fp32"]["PCIe host<->GPU"]
    assert pcie.note == "up 17.2 GB, down 17.2 GB" and wide_pcie.note == "up 17.2 GB, down 34.5 GB"
    coll, wide_coll = links[None]["collectives (NVLink)"], links["fp32"]["collectives (NVLink)"]
    ring = 7 / 8
    assert coll.amount == pytest.approx((2 * 2 + 2) * p * ring)
    assert wide_coll.amount == pytest.approx((2 * 2 + 4) * p * ring)
    bf16, fp32 = memory[None], memory["fp32"]
    assert (bf16.derived.device_grad_dtype, fp32.derived.device_grad_dtype) == ("bf16", "fp32")
    assert not bf16.checkpointing and fp32.checkpointing
    assert fp32.device["gradients"] == 2 * 9 * 106_956_800 * 4


def test_a_tuned_nvme_plan_carries_the_aio_section_its_rates_were_measured_with(tmp_path,
                                                                                capsys) -> None:
    """--nvme-tune's rates were used and its settings dropped: the ds_config printed ran with
    the default aio section, not the one those rates belong to."""
    aio = {"backend": "io_uring", "block_size": 4194304, "queue_depth": 16,
           "intra_op_parallelism": 2, "single_submit": False, "overlap_events": True}
    tune = tmp_path / "tune.json"
    tune.write_text(json.dumps({"recommendation": {"read_GBps": 3.0, "write_GBps": 2.0,
                                                   "aio": aio}}))
    assert cli.main(["plan", "--params", "70e9", "--gpu", "4090", "--nvme", "4TB",
                     "--host-memory", "64GiB", "--nvme-tune", str(tune), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    zero = data["ds_config"]["zero_optimization"]
    assert "nvme" in (zero["offload_param"]["device"], zero["offload_optimizer"]["device"])
    assert data["ds_config"]["aio"] == aio
