"""``infinity plan --dry-run`` is the engine's schedule, not a guess: a real engine's training
steps on a small Llama and the dry run of the same model (on the meta device, byte-free) record
the same fetch / prefetch / keep / release order, and the same peak bytes per tier.

Timing would make the two differ where the engine's background steps race its fetches (a unit a
step holds is released when its writes land), so the real engine here reaps its steps at every
reap as if they were over (``_wait_all_reaps``), and the dry run's steps cost nothing
(``instant``): both then follow the coordinator's decisions alone."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

import infinity
from infinity.commands.dry_run import DryRunRates, DryRunSetup, dry_run, meta_llama
from infinity.config import InfinityConfig
from infinity.planner.run_plan import plan_run
from infinity.planner.inputs import detect_hardware, llama_stats
from infinity.planner.shape import shape_from_llama_kwargs
from infinity.zero.protocols import Wait

transformers = pytest.importorskip("transformers")

MODEL = dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=160, vocab_size=384, max_position_embeddings=64,
             tie_word_embeddings=False, use_cache=False, attention_dropout=0.0)
SEQ, MBS, STEPS = 16, 2, 3
RATES = DryRunRates(compute_flops_per_s=1e11, nvme_read_GBps=3.0, nvme_write_GBps=2.0,
                    adam_params_per_s=1e9)


def ds_config(path: str, schedule: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": path},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": path}},
            # a device pool of about three blocks: prefetch, keeping and releasing all decide
            "infinity": {"host_memory_budget": "6MiB", "device_memory_budget": "640KiB",
                         "early_step": schedule,
                         "speculative_step": "off", "compute_dtype": "fp32"}}


def _wait_all_reaps(engine) -> None:
    """Every reap of the real optimizer waits for all background steps (instance attribute,
    this engine only): the order no longer depends on how fast they run."""
    reap = engine.optimizer.reap
    engine.optimizer.reap = lambda wait=Wait.NONE: reap(Wait.ALL)


def real_steps(path: str, schedule: str) -> tuple[list[list[tuple[str, int]]], dict, list]:
    cfg = transformers.LlamaConfig(**MODEL)
    cfg._attn_implementation = "sdpa"
    dsc = ds_config(path, schedule)
    torch.manual_seed(0)
    with infinity.zero.Init(config=dsc):
        model = transformers.LlamaForCausalLM(cfg)
    engine, *_ = infinity.initialize(model=model, config=dsc)
    try:
        _wait_all_reaps(engine)
        g = torch.Generator().manual_seed(1)
        steps, io = [], []
        for _ in range(STEPS):
            ids = torch.randint(0, MODEL["vocab_size"], (MBS, SEQ), generator=g)
            engine.coordinator.events = log = []
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            steps.append(log)
            stats = engine.step_stats()
            io.append((stats["io_read_bytes"], stats["io_write_bytes"]))
        engine.coordinator.events = None      # close() releases everything: not a step's
        m = engine.manager
        peaks = {"host": m.host_budget.peak, "device": m.device_budget.peak,
                 "nvme": m.tier_bytes()["nvme"]}
        return steps, peaks, io
    finally:
        engine.close()


def simulated(path: str, schedule: str):
    cfg = InfinityConfig.from_dict(ds_config(path, schedule))
    stats = llama_stats(MODEL)
    setup = DryRunSetup(plan=plan_run(cfg, detect_hardware(path), stats=stats))
    events: list = []
    report = dry_run(meta_llama(MODEL), setup, RATES, seq_len=SEQ, micro_batch=MBS,
                     steps=STEPS, shape=shape_from_llama_kwargs(MODEL), instant=True,
                     events=events)
    return events, report


@pytest.mark.parametrize("schedule", ["on", "off"])
def test_dry_run_order_and_peaks_equal_the_engine(disk_dir, schedule) -> None:
    real, peaks, io = real_steps(str(disk_dir), schedule)
    dry, report = simulated(str(disk_dir), schedule)
    kinds = {kind for step in real for kind, _ in step}
    assert {"fetch", "release"} <= kinds and len(real[-1]) > 10   # a schedule worth comparing
    for step, (want, got) in enumerate(zip(real, dry)):
        assert got == want, f"step {step}: first difference at {_first_difference(want, got)}"
    for tier in ("host", "device", "nvme"):
        assert report.peak[tier] == pytest.approx(peaks[tier], rel=0.05), tier
    if schedule == "off":
        # the deferred step's reads of the Adam states are issued by the stream's thread after
        # step() returned, so which step's counters of the engine see them is a race
        return
    for step, trace in enumerate(report.steps):
        assert trace.nvme_read_bytes == pytest.approx(io[step][0], rel=0.05)
        assert trace.nvme_write_bytes == pytest.approx(io[step][1], rel=0.05)


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {i}: engine {x}, dry run {y} (engine around it: {a[max(0, i - 3):i + 3]})"
    return f"lengths {len(a)} (engine) and {len(b)} (dry run)"


LLAMA_1T = dict(hidden_size=25600, intermediate_size=68352, num_hidden_layers=128,
                num_attention_heads=200, num_key_value_heads=200, vocab_size=32000,
                tie_word_embeddings=False, max_position_embeddings=4096)


def test_1t_dry_run_on_a_node_of_8x80gb_in_a_minute_and_a_gib(tmp_path) -> None:
    """The issue's bar: the 1T, 128-layer Llama's plan with --dry-run --json on one node of 8 x
    80 GB, 2 TiB, 28 TB finishes in under 60 s (of CPU: the wall time on a shared machine is not
    its own) and 1 GiB, recommends stage 3 with NVMe, and the
    node's ranks' host bytes (the dry run's peak) with their runtimes fit its host memory."""
    import sys
    import time

    path = tmp_path / "config.json"
    transformers.LlamaConfig(**LLAMA_1T).to_json_file(path)
    started = time.perf_counter()
    # the command in a process that reports its own peak RSS last on stderr
    # and its CPU seconds: on a loaded machine the wall time is the neighbours' as much as its
    # own, so the 60 s bar is checked on the CPU time the command used (wall time is printed)
    # The peak is VmHWM (this process's memory since its exec), not getrusage's ru_maxrss: Linux
    # carries the forking process's high-water mark across exec into ru_maxrss, so after a long
    # test session the child "peaked" at pytest's size (1054 MiB, failing this test in a full run)
    main = ("import resource, sys; from infinity import cli; rc = cli.main(sys.argv[1:]); "
            "u = resource.getrusage(resource.RUSAGE_SELF); "
            "print('cpu', u.ru_utime + u.ru_stime, file=sys.stderr); "
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]; "
            "print('maxrss', hwm.split()[1], file=sys.stderr); "
            "sys.exit(rc)")
    proc = subprocess.Popen([sys.executable, "-c", main, "plan", "--hf-config",
                             str(path), "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory",
                             "2TiB", "--nvme", "28TB", "--dry-run", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    wall = time.perf_counter() - started
    assert proc.returncode == 0, err.decode()[-2000:]
    data = json.loads(out)
    zero = data["ds_config"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "nvme" \
        and zero["offload_optimizer"]["device"] == "nvme"
    dry = data["dry_run"]
    assert len(dry["units"]) == 131 and dry["simulated_step_s"] > 0
    assert dry["order"]["forward"] and dry["order"]["backward"]
    ranks, host = data["target"]["gpus_per_node"], data["target"]["host_memory_bytes"]
    runtime = data["per_rank_detail"]["host"]["runtime"]
    assert ranks * (dry["peak_bytes"]["host"] + runtime) <= host
    # the dry run's host peak is the plan's pools and homes (the engine's sizes)
    planned = data["per_rank_detail"]["host"]["states"] + data["per_rank_detail"]["host"]["buffers"]
    assert dry["peak_bytes"]["host"] == pytest.approx(planned, rel=0.01)
    # 8 ranks on GPUs reduce each block's gradient on the device in the compute dtype (bf16,
    # communication_data_type unset): one bf16 buffer of its 7.87B elements and its shard (two
    # would leave no room to fetch a block ahead), held by the dry run's device beside a
    # fetched block as by the plan's
    # ([Note: gradients reduced on the device] in optim/device_gradients.py)
    gradients = data["per_rank_detail"]["device"]["gradients"]
    assert 7_870_924_800 * 9 // 8 * 2 <= gradients < 2 * 7_870_924_800 * 2
    assert dry["peak_bytes"]["device"] >= gradients + 7_870_924_800 * 2   # and a bf16 block
    lines = err.decode().strip().splitlines()
    cpu_s = float(lines[-2].split()[-1])
    print(f"1T dry run: {cpu_s:.1f} CPU s, {wall:.1f} s wall")
    assert cpu_s < 60, f"{cpu_s:.1f} CPU s ({wall:.1f} s wall)"
    maxrss = int(lines[-1].split()[-1]) * 1024
    assert maxrss < 1 << 30, f"{maxrss >> 20} MiB"


def test_this_machines_plan_dry_runs_and_params_alone_cannot(disk_dir, capsys) -> None:
    """Without target flags the recommended config of this machine is dry-run (its compute
    rate measured, the disk's assumed, said in a note); a model given only as a parameter count
    has no modules to run."""
    from infinity import cli

    assert cli.main(["plan", "--model-size", "85M", "--host-budget", "400MiB", "--nvme-path",
                     str(disk_dir), "--dry-run", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    dry = data["dry_run"]
    assert dry["peak_bytes"]["host"] > 0 and dry["order"]["forward"]
    assert dry["simulated_step_s"] > 0 and dry["analytical_step_s"] > 0
    assert any("(measured now)" in note and "assumed" in note for note in dry["notes"])
    assert cli.main(["plan", "--params", "7B", "--gpus", "1", "--gpu", "H100", "--dry-run"]) != 0
    assert "--hf-config or --model-size" in capsys.readouterr().err


def test_this_machines_dry_run_computes_at_the_measured_rate(disk_dir, capsys,
                                                             monkeypatch) -> None:
    """The local dry run's compute runs at the rate measured on this CPU in the plan's compute
    dtype (a fixed 1e11 FLOP/s was 2.3-5.8x off here): twice the measured rate, half the
    compute time, in both the simulated and the analytical step."""
    from infinity import cli
    from infinity.train import calibrate

    asked = []

    def dry(rate: float) -> dict:
        def measured(**probe) -> dict:
            asked.append(probe)
            return {"flops_per_s": rate}

        monkeypatch.setattr(calibrate, "measure_compute", measured)
        assert cli.main(["plan", "--model-size", "85M", "--host-budget", "400MiB",
                         "--nvme-path", str(disk_dir), "--dry-run", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["dry_run"]

    slow, fast = dry(2e10), dry(4e10)
    assert slow["busy_s"]["compute"] == pytest.approx(2 * fast["busy_s"]["compute"], rel=1e-6)
    assert asked[0]["dtype"] in ("fp32", "bf16") and asked[0]["hidden"] <= 1024, asked


def test_an_infeasible_plan_is_shown_without_a_dry_run(disk_dir, capsys) -> None:
    """The dry run of a plan that does not fit replaced the plan with an engine error whose
    advice ("offload deeper") the config already followed; the plan is shown, the dry run
    said to be none; the exit status is 1 (it was 0: a script went on to train)."""
    from infinity import cli

    assert cli.main(["plan", "--model-size", "85M", "--host-budget", "40MiB", "--nvme-path",
                     str(disk_dir), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "INFEASIBLE" in out and "dry run: none (the plan is infeasible)" in out


def test_the_dry_run_takes_the_models_longest_sequence_when_shorter(tmp_path, capsys) -> None:
    """GPT-2-style positions (n_positions 64): the dry run ran 2048 tokens (BERT's table
    crashed with a traceback; GPT-2's was simulated silently at a length it cannot run)."""
    from infinity import cli

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                                  "n_head": 4, "n_positions": 64, "vocab_size": 256}))
    assert cli.main(["plan", "--hf-config", str(config), "--host-budget", "400MiB",
                     "--nvme-path", str(tmp_path), "--dry-run", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["dry_run"]["notes"]
    assert any("sequence 64, micro-batch 1" in note for note in notes), notes
