"""Checkpoints through their public behaviour: ``save_latest=False`` leaves ``latest`` where it
was, and a save fsyncs every file and directory of the checkpoint before it becomes visible
(recorded by inode, whatever path or descriptor the fsync went through)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import infinity
from parity import VOCAB, make_model, train_steps, zero_config


def _engine(disk_dir, seed: int = 0):
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    engine, *_ = infinity.initialize(model=make_model("torch", seed=seed, layers=2), config=ds)
    return engine


def _train(engine, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    train_steps(engine, [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(steps)])


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "rank0_model.safetensors"))


@pytest.fixture
def engine(disk_dir):
    eng = _engine(disk_dir)
    _train(eng, 1)
    yield eng
    eng.close()


def test_save_latest_false_leaves_latest_on_the_previous_checkpoint(engine, disk_dir) -> None:
    """Tag A saved with latest, the engine trains on, tag B saved with save_latest=False:
    ``latest`` still names A, and a load of the directory loads A (its weights and step)."""
    save_dir = disk_dir / "ckpt"
    a = engine.save_checkpoint(save_dir, tag="A")
    _train(engine, 2, seed=2)
    b = engine.save_checkpoint(save_dir, tag="B", save_latest=False)
    assert (save_dir / "latest").read_text().strip() == "A"
    saved_a, saved_b = _weights(a), _weights(b)
    assert any(not torch.equal(saved_a[k], saved_b[k]) for k in saved_a), "A and B must differ"
    other = _engine(disk_dir, seed=5)
    try:
        path, _ = other.load_checkpoint(save_dir)
        assert path == str(a) and other.global_steps == 1
        probe = other.save_checkpoint(disk_dir / "probe", tag="loaded", save_latest=False)
        loaded = _weights(probe)
        assert all(torch.equal(loaded[k], saved_a[k]) for k in saved_a)
    finally:
        other.close()


class _FsyncRecorder:
    """Wraps os.fsync and os.fdatasync: for each call, the (device, inode) synced, whether it is
    a directory, and the inodes ``save_dir/<tag>`` and ``save_dir/latest`` had at that moment
    (None: not there), so "synced before it was visible" can be told afterwards."""

    def __init__(self, save_dir: Path, tag: str) -> None:
        self.tag_path, self.latest_path = save_dir / tag, save_dir / "latest"
        self.calls: list[dict] = []
        self._fsync, self._fdatasync = os.fsync, os.fdatasync

    @staticmethod
    def _ino(path: Path) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _record(self, fd) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        st = os.fstat(fd)
        self.calls.append({"ino": (st.st_dev, st.st_ino), "dir": stat.S_ISDIR(st.st_mode),
                           "tag": self._ino(self.tag_path), "latest": self._ino(self.latest_path)})

    def fsync(self, fd) -> None:
        self._record(fd)
        self._fsync(fd)

    def fdatasync(self, fd) -> None:
        self._record(fd)
        self._fdatasync(fd)

    def synced(self, ino, *, is_dir: bool, when=lambda call: True) -> bool:
        return any(c["ino"] == ino and c["dir"] == is_dir and when(c) for c in self.calls)


@pytest.mark.parametrize("save_latest", [True, False])
def test_every_file_and_directory_is_fsynced_before_the_checkpoint_is_visible(
        engine, disk_dir, monkeypatch, save_latest) -> None:
    """Each file of the committed checkpoint (tensor files, manifest) and its directory are
    fsynced while the tag does not name it yet; the save directory after the tag names it (the
    rename made durable); ``latest`` before it is renamed in place, the save directory after.
    The same on a second save of the same tag (the old checkpoint replaced)."""
    save_dir = disk_dir / "ckpt"
    for attempt in range(2):
        if attempt:
            _train(engine, 1, seed=3)
        recorder = _FsyncRecorder(save_dir, "T")
        monkeypatch.setattr(os, "fsync", recorder.fsync)
        monkeypatch.setattr(os, "fdatasync", recorder.fdatasync)
        final = engine.save_checkpoint(save_dir, tag="T", save_latest=save_latest)
        monkeypatch.undo()
        final_ino = recorder._ino(final)
        assert final == save_dir / "T" and final_ino is not None
        not_yet_visible = lambda call: call["tag"] != final_ino   # noqa: E731
        manifest = json.loads((final / "manifest.json").read_text())
        names = sorted(p.name for p in final.iterdir())
        assert names == sorted([*manifest["files"], "manifest.json"])
        assert {"rank0_model.safetensors", "rank0_optim.safetensors"} <= set(names)
        unsynced = [n for n in names if not recorder.synced(recorder._ino(final / n), is_dir=False,
                                                            when=not_yet_visible)]
        assert not unsynced, f"save {attempt}: not fsynced before the commit: {unsynced}"
        assert recorder.synced(final_ino, is_dir=True, when=not_yet_visible), \
            f"save {attempt}: the checkpoint directory was not fsynced before the commit"
        assert recorder.synced(recorder._ino(save_dir), is_dir=True,
                               when=lambda call: call["tag"] == final_ino), \
            f"save {attempt}: the save directory was not fsynced after the commit"
        if save_latest:
            latest_ino = recorder._ino(save_dir / "latest")
            assert recorder.synced(latest_ino, is_dir=False,
                                   when=lambda call: call["latest"] != latest_ino), \
                f"save {attempt}: latest was not fsynced before its rename"
            assert recorder.synced(recorder._ino(save_dir), is_dir=True,
                                   when=lambda call: call["latest"] == latest_ino), \
                f"save {attempt}: the save directory was not fsynced after latest moved"
