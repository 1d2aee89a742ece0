"""``infinity train`` under ``torchrun --nproc_per_node 2`` (gloo, localhost): the command a user
types (README), judged by what each rank prints and by rank 0's --metrics.

Each rank trains on its own micro-batches ([Note: batches over ranks] in infinity/train/data.py):
with train_batch_size 8 and micro-batches of 2, two ranks accumulate 2 micro-batches each and one
rank accumulates 4, over the same 4 micro-batches a step, so the logged losses (the mean over
all ranks' micro-batches) agree within 1e-5 relative. Only rank 0 prints progress and summary
and writes --metrics, whose comm columns are filled from step_stats at 2 ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.cli import main
from infinity.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

STEPS = 3
# stage 3 with parameters and optimizer states on NVMe, clipping (the deferred step) and
# accumulation: 2 micro-steps at 2 ranks, 4 at 1 rank, the same global batch of 8
CONFIG = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                          "offload_optimizer": {"device": "nvme"}},
    "infinity": {"host_memory_budget": "256MiB", "collective_timeout": 60},
}


def _train_args(config: Path, disk_dir: Path, metrics: Path) -> list[str]:
    return ["-m", "infinity.cli", "train", "--model-size", "tiny", "--config", str(config),
            "--steps", str(STEPS), "--seq-len", "32", "--nvme-path", str(disk_dir),
            "--metrics", str(metrics), "--plot", "off", "--progress-every", "1"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "INFINITY_LOG_LEVEL")}   # the default: INFO on rank 0, warnings elsewhere
    return env


def test_two_ranks_train_as_one_with_the_same_global_batch(disk_dir: Path,
                                                            tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
    # --tee 3 prefixes each line with the rank that wrote it: [default0]:, [default1]:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--tee", "3", *_train_args(config, disk_dir, two)],
        capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    rank0 = [line.split(":", 1)[1] for line in lines if line.startswith("[default0]:")]
    rank1 = [line.split(":", 1)[1] for line in lines if line.startswith("[default1]:")]
    progress = [line for line in rank0 if line.startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in progress] == ["1/3", "2/3", "3/3"], rank0
    assert all("| comm " in line for line in progress), progress   # bytes of the collectives
    assert any("2 ranks" in line for line in rank0)                 # the summary's title
    assert any("collectives (rank 0)" in line for line in rank0)
    assert rank1 == [], rank1           # quiet: no progress, no summary, no INFO logs

    proc = subprocess.run([sys.executable, *_train_args(config, disk_dir, one)],
                          capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows2, rows1 = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in rows2] == [1, 2, 3]     # rank 0 alone wrote the file
    assert [r["loss"] for r in rows2] == pytest.approx([r["loss"] for r in rows1], rel=1e-5)
    assert [r["tokens"] for r in rows2] == [r["tokens"] for r in rows1] == [8 * 32] * STEPS
    for row in rows2:
        assert row["comm_sent_bytes"] > 0 and row["comm_received_bytes"] > 0, row
        assert row["comm_s"] > 0, row
    assert all(r["comm_sent_bytes"] == r["comm_received_bytes"] == 0 for r in rows1), rows1
    assert list(disk_dir.iterdir()) == []      # every rank removed its swap directory


def test_torch_baseline_is_refused_under_several_ranks(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The baseline is one process: under a launcher of 2 ranks it says so (exit 2) before
    reading anything or joining a process group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code = main(["train", "--engine", "torch", "--model-size", "tiny", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--engine torch is the single-process baseline" in err and "2 ranks" in err, err


def test_the_seed_deepspeed_config_runs_unchanged_on_four_ranks(disk_dir: Path,
                                                                 tmp_path: Path) -> None:
    """The ds_config the project's seed brought (stage 3, params and optimizer on CPU, fp16
    with a dynamic loss scale, clipping, train_batch_size 32 = 4 x 2 x 4 ranks), unchanged but
    for its comments, trains on 4 ranks (the small preset model; the 85M main job is recorded in
    BENCHMARKS.md) and its losses are those of one rank with the same global batch."""
    config = Path(__file__).resolve().parents[1] / "integration" / "configs" / "seed_ds_config.json"
    four, one = tmp_path / "four.jsonl", tmp_path / "one.jsonl"

    def args(config: Path, metrics: Path) -> list[str]:
        return ["-m", "infinity.cli", "train", "--model-size", "tiny", "--config", str(config),
                "--steps", "2", "--seq-len", "16", "--plot", "off", "--metrics", str(metrics)]

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         *args(config, four)], capture_output=True, text=True, timeout=300,
        env=dict(_env(), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # one rank with the same global batch: 32 = 4 x 8 (the config's micro and accumulation
    # at 4 ranks are not valid at 1: the rule gives accumulation 8)
    single = json.loads(config.read_text())
    single["gradient_accumulation_steps"] = 8
    config1 = tmp_path / "one.json"
    config1.write_text(json.dumps(single))
    proc = subprocess.run([sys.executable, *args(config1, one)], capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows4, rows1 = read_metrics(four), read_metrics(one)
    assert len(rows4) == 2 and [r["tokens"] for r in rows4] == [32 * 16] * 2
    assert [r["loss"] for r in rows4] == pytest.approx([r["loss"] for r in rows1], rel=1e-5)


def test_ranks_started_with_other_data_or_seed_are_refused(disk_dir: Path) -> None:
    """A rank given another --seed (or its node's own copy of the data that differs) trained on
    other samples without a word, the log and the checkpoint holding rank 0's alone."""
    from ranks import launch

    results = launch(2, "train_seed_ranks_worker.py", [str(disk_dir)], timeout=180)
    for rank, r in enumerate(results):
        assert r.returncode != 0, (rank, r.stdout[-1000:])
        assert "rank 1 was started with another run than rank 0" in r.stderr, r.stderr[-2000:]
        assert "'seed': (0, 1)" in r.stderr, r.stderr[-2000:]
