"""The config's monitor sections, written by the engine itself with DeepSpeed's tag names
(Train/Samples/train_loss, lr, loss_scale at x = samples trained): a csv_monitor and a
tensorboard run, read back; steps_per_print and wall_clock_breakdown lines from the engine;
a section enabled without its library is a clear error before anything is built."""
from __future__ import annotations

import csv
import importlib.util

import pytest
import torch

import infinity
from parity import VOCAB, loss_of, make_model, zero_config

STEPS, ACCUMULATION, MICRO = 4, 2, 2


def _config(disk_dir, tmp_path) -> dict:
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    ds.update({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                             "warmup_max_lr": 1e-3,
                                                             "warmup_num_steps": 3,
                                                             "warmup_type": "linear"}},
               "train_micro_batch_size_per_gpu": MICRO,
               "gradient_accumulation_steps": ACCUMULATION,
               "fp16": {"enabled": True, "initial_scale_power": 8},
               "steps_per_print": 2, "wall_clock_breakdown": True,
               "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"),
                               "job_name": "run"},
               "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"),
                               "job_name": "run"}})
    return ds


def _read_csv(path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(x), float(v)) for x, v in rows[1:]]


def test_csv_and_tensorboard_get_deepspeeds_tags_and_the_engine_prints(disk_dir, tmp_path,
                                                                        infinity_log) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, *_ = infinity.initialize(model=make_model("llama", layers=2, width=32),
                                     config=_config(disk_dir, tmp_path))
    gen = torch.Generator().manual_seed(0)
    losses, lrs, scales = [], [], []
    try:
        for _ in range(STEPS):
            lrs.append(engine.get_lr()[0])
            total = 0.0
            for _ in range(ACCUMULATION):
                x = torch.randint(0, VOCAB, (MICRO, 16), generator=gen)
                loss = loss_of(engine(input_ids=x, labels=x))
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / ACCUMULATION)
            scales.append(engine.loss_scale)
    finally:
        engine.close()
    samples = [MICRO * ACCUMULATION * (i + 1) for i in range(STEPS)]
    expected = {"train_loss": losses, "lr": lrs, "loss_scale": scales}
    run = tmp_path / "csv" / "run"
    for tag, values in expected.items():
        header, rows = _read_csv(run / f"Train_Samples_{tag}.csv")
        assert header == ["step", tag]
        assert [x for x, _ in rows] == samples
        assert [v for _, v in rows] == pytest.approx(values, rel=1e-6), tag
    assert lrs[0] == 0.0 < lrs[-1] and scales[0] == 256.0     # the warm-up; fp16's 2**8
    for phase in ("forward", "backward", "step"):
        _, rows = _read_csv(run / f"Train_Samples_elapsed_time_ms_{phase}.csv")
        assert len(rows) == STEPS and all(v >= 0 for _, v in rows)

    events = EventAccumulator(str(tmp_path / "tb" / "run")).Reload()
    for tag, values in expected.items():
        scalars = events.Scalars(f"Train/Samples/{tag}")
        assert [s.step for s in scalars] == samples
        assert [s.value for s in scalars] == pytest.approx(values, rel=1e-6), tag

    printed = [r.getMessage() for r in infinity_log.records]
    progress = [m for m in printed if m.startswith("step=")]
    assert [m.split(",")[0] for m in progress] == ["step=2", "step=4"]
    assert "skipped=0" in progress[0] and f"loss={losses[1]:.4f}" in progress[0]
    assert sum(m.startswith("time (ms) per step, mean of steps") for m in printed) == 2


def test_a_monitor_enabled_without_its_library_is_named(disk_dir, tmp_path, monkeypatch) -> None:
    model = make_model("torch", layers=1)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ImportError, match=r"\"wandb\" section is enabled but the wandb "
                                              r"package is not installed: pip install wandb"):
            infinity.initialize(model=model, config={**ds, "wandb": {"enabled": True}})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ImportError, match=r"\"tensorboard\" section is enabled but the "
                                          r"tensorboard package is not installed"):
        infinity.initialize(model=model, config={**ds, "tensorboard": {"enabled": True}})
    assert list(disk_dir.iterdir()) == []       # nothing was built
