"""The overlap seen in a profile (skipped visibly without CUDA; tools/gpu_check.sh runs it where a
GPU is lent): a stage-3 engine with parameters homed in host memory copies each unit to the
device ahead of its use, so torch.profiler's trace shows host-to-device copies on a stream other
than the compute stream, and part of their time concurrent with compute kernels. The gradients'
copies to the host likewise leave on a stream of their own. The trace is read by
tools/bench/gpu_profile.py's functions (the figures gpu_check.sh reports)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import infinity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
from parity import VOCAB, make_model, zero_config  # noqa: E402
import gpu_profile  # noqa: E402

pytestmark = pytest.mark.gpu


def test_copies_run_on_their_own_streams_beside_compute(disk_dir, tmp_path) -> None:
    # units of ~8 MiB in bf16 and enough tokens that a unit's kernels take about as long as
    # the next unit's copy: an ahead copy has compute to run beside
    model = make_model("llama", layers=6, width=1024).cuda()
    ds = zero_config(3, "cpu", "cpu", str(disk_dir), compute_dtype="bf16", early_step="on")
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (32, 128), generator=gen).cuda() for _ in range(3)]

    def step(x: torch.Tensor) -> None:
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()

    try:
        for x in batches[:2]:          # warm-up: the allocator, the prefetch's first fetches
            step(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(batches[2])
            torch.cuda.synchronize()
    finally:
        engine.close()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    figures = gpu_profile.overlap_figures(json.loads(path.read_text()))
    streams = figures["streams"]
    assert figures["events"]["compute"] > 0 and figures["events"]["h2d"] > 0, figures
    # the prefetch's copies to the device and the gradients' copies to the host run on streams
    # of their own (the step thread's copies of stepped values may still use the compute
    # stream: gpu_profile reports their share)
    assert set(streams["h2d"]) - set(streams["compute"]), streams
    assert set(streams["d2h"]) - set(streams["compute"]), streams
    # ahead copies beside compute: some of their time runs while a compute kernel does (with
    # every copy on the compute stream this share would be exactly 0)
    assert figures["h2d_hidden_share"] > 0, figures
