"""An I/O error inside an optimizer step reaches the caller at engine.step(), without a hang, and
engine.close() still removes the swap files (both schedules)."""
from __future__ import annotations

import os

import pytest
import torch

import infinity
from infinity.storage.manager import FlatStore
from parity import VOCAB, loss_of, make_model, zero_config


@pytest.mark.parametrize("schedule", ["on", "off"])
def test_write_error_in_a_step_is_raised_at_step_and_close_cleans_up(disk_dir, monkeypatch,
                                                                      schedule) -> None:
    torch.manual_seed(0)
    model = make_model("llama", layers=3, width=64)
    ds = zero_config(3, "nvme", "nvme", str(disk_dir), early_step=schedule)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    x = torch.randint(0, VOCAB, (1, 8))
    engine.backward(loss_of(engine(input_ids=x, labels=x)))
    engine.step()                                   # a clean first step

    original = FlatStore.store_async

    def failing(self, buf, start=0, count=None):
        if self.name.endswith(".exp_avg_sq"):
            raise OSError(5, "injected EIO", self.name)
        return original(self, buf, start, count)

    monkeypatch.setattr(FlatStore, "store_async", failing)
    try:
        with pytest.raises(OSError, match="injected EIO"):
            engine.backward(loss_of(engine(input_ids=x, labels=x)))
            engine.step()
    finally:
        monkeypatch.setattr(FlatStore, "store_async", original)
        engine.close()
    swap_dirs = [d for d in os.listdir(disk_dir) if d.startswith("infinity-swap")]
    assert swap_dirs == [], f"close() left {swap_dirs} in {disk_dir}"
