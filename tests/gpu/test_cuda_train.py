"""README's main job on a GPU (skipped visibly without CUDA; tools/gpu_check.sh runs it where a
GPU is lent): ``infinity train`` builds its model under ``zero.Init`` (so the engine computes on
the GPU), feeds the sampler's host batches to the device, and learns, with the parameters and
optimizer states in swap files and nothing left behind."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.train.metrics import read_metrics

pytestmark = pytest.mark.gpu


def test_the_main_job_trains_out_of_core_on_the_gpu(disk_dir: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli", "train", "--model-size", "tiny", "--steps", "20",
         "--seq-len", "64", "--lr", "3e-3", "--nvme-path", str(disk_dir), "--host-budget",
         "256MiB", "--metrics", str(metrics)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "INFINITY_LOG_LEVEL": "INFO"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine ready on cuda" in proc.stderr, proc.stderr[-3000:]
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["nvme_bytes"] > 0 for r in rows), rows[-1]
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first, (first, last)
    assert list(disk_dir.iterdir()) == []
