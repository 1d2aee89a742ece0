"""Activation offload on a CUDA device (zero/activation_swap.py, [Note: activation copies];
skipped visibly without CUDA, run by tools/gpu_check.sh where a GPU is lent): saved tensors leave
the GPU on the copies' device-to-host stream and come back on its host-to-device stream, and
training gives the losses it gives without offload (and plain PyTorch's), fp32 with TF32 off.

Which stream a copy ran on is read from a torch.profiler trace (kineto's Chrome trace: a GPU
memcpy event's ``args.stream``): every copy the copies' owner made in the profiled step (the
swap's, the units' and the gradients') must be a memcpy on a stream where no kernel of the step
ran, i.e. not on the compute stream."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.storage.transfers import CudaCopies

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from parity import VOCAB, loss_of, make_model, reference_step, zero_config

# fp32 matmuls without TF32 (tests/gpu/conftest.py): parity with torch at fp32 bounds
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]


def _config(disk_dir, offload: bool) -> dict:
    section = {"offload_activations": "nvme", "activation_min_bytes": 1,
               "activation_window": "64KiB"} if offload else {}
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), **section)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    return ds


def _batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 64), generator=gen).cuda() for _ in range(count)]


def _counted(inner, calls: dict[str, int], name: str):
    def counted(*args, **kwargs):
        calls[name] += 1
        return inner(*args, **kwargs)
    return counted


def _losses(disk_dir, offload: bool, batches, profile_step: int | None = None):
    """Losses of a 3-layer Llama trained on ``batches``, the swapper's stats, and for step
    ``profile_step`` its Chrome trace (a path) and the copies the owner made in it."""
    model = make_model("llama", layers=3, width=64).cuda()
    engine, *_ = infinity.initialize(model=model, config=_config(disk_dir, offload))
    losses, trace = [], None
    calls = {"to_host": 0, "to_device": 0}
    try:
        copies = engine.manager.copies
        assert isinstance(copies, CudaCopies)
        for i, x in enumerate(batches):
            if i == profile_step:
                for name in calls:       # count every copy the owner makes in this step
                    setattr(copies, name, _counted(getattr(copies, name), calls, name))
                activities = [torch.profiler.ProfilerActivity.CPU,
                              torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities) as prof:
                    loss = loss_of(engine(input_ids=x, labels=x))
                    engine.backward(loss)
                    engine.step()
                    torch.cuda.synchronize()
                for name in calls:
                    delattr(copies, name)
                trace = disk_dir / "trace.json"
                prof.export_chrome_trace(str(trace))
            else:
                loss = loss_of(engine(input_ids=x, labels=x))
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        stats = engine.activation_swapper.stats if offload else None
    finally:
        engine.close()
    return losses, stats, trace, calls


def test_activation_offload_on_cuda_gives_the_losses_without_it(disk_dir) -> None:
    batches = _batches(5)
    with_offload, stats, _, _ = _losses(disk_dir, True, batches)
    without, _, _, _ = _losses(disk_dir, False, batches)
    reference = make_model("llama", layers=3, width=64).cuda()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01,
                                foreach=False)
    torch_losses = [reference_step(reference, ref_opt, x, 0.0).item() for x in batches]
    # written, read back and copied to the device through the copies' owner
    assert stats.written > 0 and stats.to_host_copies > 0 and stats.to_device_copies > 0, stats
    torch.testing.assert_close(torch.tensor(with_offload), torch.tensor(without),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(with_offload), torch.tensor(torch_losses),
                               rtol=1e-5, atol=0)


def test_the_swap_copies_run_on_the_side_streams(disk_dir) -> None:
    batches = _batches(3)
    _, stats, trace, calls = _losses(disk_dir, True, batches, profile_step=2)
    events = json.loads(Path(trace).read_text())["traceEvents"]
    kernel_streams = {e["args"]["stream"] for e in events
                      if e.get("cat") == "kernel" and "stream" in e.get("args", {})}
    memcpy = [e for e in events if e.get("cat") == "gpu_memcpy" and "stream" in e.get("args", {})]
    assert kernel_streams and memcpy, "no kernel or memcpy events in the profile"
    side = {"DtoH": 0, "HtoD": 0}
    for e in memcpy:
        if e["args"]["stream"] in kernel_streams:
            continue
        for way in side:
            if way in e["name"]:
                side[way] += 1
    assert stats.to_host_copies > 0 and stats.to_device_copies > 0, stats
    assert calls["to_host"] > 0 and calls["to_device"] > 0, calls
    # each copy of the owner is one memcpy off the compute stream (a copy made on the compute
    # stream would leave fewer there)
    assert side["DtoH"] >= calls["to_host"] and side["HtoD"] >= calls["to_device"], \
        (side, calls, kernel_streams)
