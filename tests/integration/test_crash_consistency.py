"""Crash consistency (issue 23), the short version: a training process under stage 3 with
parameters and optimizer on NVMe is killed at fixed-seed points covering every mode -- SIGKILL
inside a save's writes, fsyncs and renames, a step and a load; SIGKILL and SIGINT at random
delays; SIGINT inside a commit's renames; a full disk; EIO from the I/O engine in a step, a save
and a load -- and after each the save directory, the swap path and their neighbours are checked
(see crash_harness.py). The long version is tools/crash_test.py.

The last two tests are engine bugs the crash test found, each reproduced on its own (a bare
ENOSPC from the write of `latest`; a hang at exit after a Ctrl-C as a load starts hashing)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import crash_harness
import infinity
from parity import VOCAB, make_model, train_steps, zero_config


@pytest.mark.slow
def test_checkpoints_and_swap_space_survive_kills_at_random_points(capsys):
    lines: list[str] = []
    with crash_harness.workspace() as ws:
        run = crash_harness.CrashRun(ws, seed=23, say=lines.append)
        summary = run.run(len(crash_harness.CI_SCHEDULE), crash_harness.CI_SCHEDULE)
    per_mode = ", ".join(f"{m} {c['fired']}/{c['tried']}" for m, c in summary["per_mode"].items())
    with capsys.disabled():
        print(f"\ncrash consistency: {summary['points']} kill points tried, {summary['fired']} "
              f"fired, {summary['survived']} survived ({per_mode}); ENOSPC {ws.enospc}")
    assert not summary["failures"], "\n".join(lines)
    assert summary["final_ok"]
    unfired = [m for m in crash_harness.MODES if summary["per_mode"][m]["fired"] == 0]
    assert not unfired, f"modes whose fault never landed: {unfired}\n" + "\n".join(lines)


def test_a_full_disk_at_latest_names_the_save_dir(disk_dir, monkeypatch):
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=make_model("torch", layers=2), config=ds)
    save_dir = disk_dir / "ckpt"
    try:
        batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(i))
                   for i in range(2)]
        train_steps(engine, batches[:1])
        first = engine.save_checkpoint(save_dir)
        train_steps(engine, batches[1:])
        fsync = os.fsync

        def full_at_latest(fd: int) -> None:     # as ext4 reports a delayed allocation
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            if name.startswith(".latest.") and name.endswith(".pending"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            fsync(fd)

        monkeypatch.setattr(os, "fsync", full_at_latest)
        with pytest.raises(OSError) as info:
            engine.save_checkpoint(save_dir)
        monkeypatch.setattr(os, "fsync", fsync)
        assert info.value.errno == errno.ENOSPC
        assert (save_dir / "latest").read_text().strip() == first.name   # holds today
        assert str(save_dir) in str(info.value) and "latest" in str(info.value), str(info.value)
        assert f"latest still names {first.name}" in str(info.value), str(info.value)
    finally:
        engine.close()


_LOAD_WITH_CTRL_C_AT_THE_HASH_THREAD = """
import os, signal, sys, threading
import infinity
from parity import make_model, zero_config
ds = zero_config(3, "nvme", "nvme", sys.argv[2])
ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
engine, *_ = infinity.initialize(model=make_model("torch", layers=2), config=ds)
start = threading.Thread.start
def ctrl_c_as_it_starts(self):     # the Ctrl-C lands just as the load starts its hash thread
    start(self)
    if self.name.startswith("checkpoint-hash"):
        os.kill(os.getpid(), signal.SIGINT)
threading.Thread.start = ctrl_c_as_it_starts
try:
    engine.load_checkpoint(sys.argv[1])
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_as_a_load_starts_hashing_lets_the_process_exit(disk_dir):
    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = infinity.initialize(model=make_model("torch", layers=2), config=ds)
    try:
        train_steps(engine, [torch.randint(0, VOCAB, (2, 16))])
        engine.save_checkpoint(disk_dir / "ckpt")
    finally:
        engine.close()
    child = subprocess.Popen(
        [sys.executable, "-c", _LOAD_WITH_CTRL_C_AT_THE_HASH_THREAD, str(disk_dir / "ckpt"),
         str(disk_dir)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        cwd=Path(__file__).parent)
    try:
        assert child.stdout.readline().strip() == "interrupted"
        child.wait(timeout=15)        # it has nothing left to do but exit
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit after a Ctrl-C in load_checkpoint")
    finally:
        child.kill()
        child.wait()
