"""Checkpoints under faults and bad input: an interrupted save leaves the earlier checkpoint and
``latest`` whole; a damaged, incomplete or mismatched checkpoint is refused, with what is wrong
and what to do, before any state is touched; nothing the engine did not write is removed."""
from __future__ import annotations

import errno
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

import infinity
from infinity.checkpoint.directory import resummed
from infinity.checkpoint import CheckpointError
from infinity.checkpoint import save as save_module
from infinity.checkpoint.directory import VERSION
from infinity.checkpoint.tensor_file import TensorFileReader, TensorFileWriter
from parity import VOCAB, checkpoint_engine, loss_of, make_model, train_random, zero_config


@pytest.fixture
def engine(disk_dir):
    eng = checkpoint_engine(disk_dir, "nvme", steps=2)
    yield eng
    eng.close()


_train = train_random


def _weights(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "rank0_model.safetensors"))


def _assert_unchanged(engine, disk_dir, before: str) -> None:
    """The engine's states equal those saved in ``before``."""
    after = engine.save_checkpoint(disk_dir / "probe", tag="after", save_latest=False)
    saved = _weights(disk_dir / "probe" / before)
    now = _weights(after)
    assert all(torch.equal(saved[k], now[k]) for k in saved)


def test_an_interrupted_save_leaves_the_last_checkpoint_whole(engine, disk_dir, monkeypatch):
    first = engine.save_checkpoint(disk_dir / "ckpt")
    _train(engine, 1)
    calls = {"n": 0}
    original = TensorFileWriter.append

    def failing_append(self, name, values):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError(errno.EIO, "injected write error")
        return original(self, name, values)

    monkeypatch.setattr(TensorFileWriter, "append", failing_append)
    with pytest.raises(OSError, match="injected"):
        engine.save_checkpoint(disk_dir / "ckpt")
    with pytest.raises(OSError, match="injected"):       # the same tag again: replaced whole
        calls["n"] = 0
        engine.save_checkpoint(disk_dir / "ckpt", tag="global_step2")
    monkeypatch.setattr(TensorFileWriter, "append", original)
    assert sorted(p.name for p in (disk_dir / "ckpt").iterdir()) == ["global_step2", "latest"]
    assert (disk_dir / "ckpt" / "latest").read_text().strip() == first.name
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    other, *_ = infinity.initialize(model=make_model("llama", seed=3, layers=2), config=ds)
    try:
        assert other.load_checkpoint(disk_dir / "ckpt")[0] == str(first)
    finally:
        other.close()
    _train(engine, 1)                                    # the engine goes on
    assert engine.save_checkpoint(disk_dir / "ckpt").name == "global_step4"


def test_no_room_is_an_error_before_writing(engine, disk_dir, monkeypatch):
    monkeypatch.setattr(save_module, "free_bytes", lambda path: 1000)
    with pytest.raises(OSError, match="needs .* which has 1000 B free") as info:
        engine.save_checkpoint(disk_dir / "ckpt")
    assert info.value.errno == errno.ENOSPC
    assert list((disk_dir / "ckpt").iterdir()) == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "missing_file"])
def test_a_damaged_checkpoint_is_refused_before_anything_is_loaded(engine, disk_dir, damage):
    directory = engine.save_checkpoint(disk_dir / "ckpt", tag="good")
    engine.save_checkpoint(disk_dir / "probe", tag="before", save_latest=False)
    target = directory / "rank0_optim.safetensors"
    expected = {"truncate": "truncated", "flip": "sha256", "no_manifest": "good has no manifest.json.*deleted or never written",
                "missing_file": "is missing"}[damage]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (directory / "manifest.json").unlink()
    else:
        target.unlink()
    _train(engine, 1)      # the engine has moved on: a refused load must leave it there
    engine.save_checkpoint(disk_dir / "probe", tag="moved", save_latest=False)
    with pytest.raises(CheckpointError, match=expected):
        engine.load_checkpoint(disk_dir / "ckpt")
    _assert_unchanged(engine, disk_dir, "moved")


def test_missing_latest_and_unknown_tags(engine, disk_dir, infinity_log):
    with infinity_log.at_level(logging.WARNING):
        assert engine.load_checkpoint(disk_dir / "nothing-here") == (None, None)
    assert "no checkpoint loaded" in infinity_log.text
    returned = engine.save_checkpoint(disk_dir / "ckpt", tag="a")
    with pytest.raises(CheckpointError, match="no checkpoint 'b'.*checkpoints there: a"):
        engine.load_checkpoint(disk_dir / "ckpt", tag="b")
    # the directory save_checkpoint returns loads as it is (it loaded nothing, with a warning)
    _train(engine, 1)
    assert engine.load_checkpoint(returned)[0] == str(returned)
    assert engine.global_steps == 2
    with pytest.raises(ValueError, match="cannot name a directory"):
        engine.save_checkpoint(disk_dir / "ckpt", tag="../escape")


def test_files_the_engine_did_not_write_are_kept(engine, disk_dir):
    directory = engine.save_checkpoint(disk_dir / "ckpt", tag="t")
    (directory / "notes.txt").write_text("mine")
    for _ in range(2):      # replacing the tag: the user's file moves along with it
        engine.save_checkpoint(disk_dir / "ckpt", tag="t")
        assert (directory / "notes.txt").read_text() == "mine"
        assert sorted(p.name for p in (disk_dir / "ckpt").iterdir()) == ["latest", "t"]
    (disk_dir / "plain").mkdir()
    (disk_dir / "plain" / "t").mkdir()
    (disk_dir / "plain" / "t" / "data.bin").write_text("x")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        engine.save_checkpoint(disk_dir / "plain", tag="t")
    assert (disk_dir / "plain" / "t" / "data.bin").read_text() == "x"
    (disk_dir / "afile").write_text("x")
    with pytest.raises(OSError, match="cannot create the checkpoint directory"):
        engine.save_checkpoint(disk_dir / "afile" / "sub")


def test_saving_at_the_wrong_moment_or_bad_client_state(engine, disk_dir):
    with pytest.raises(TypeError, match="client_state must hold numbers"):
        engine.save_checkpoint(disk_dir / "ckpt", client_state={"t": torch.zeros(2)})
    # a set: JSON holds none
    with pytest.raises(TypeError, match="client_state must hold numbers.*Object of type set"):
        engine.save_checkpoint(disk_dir / "ckpt", client_state={"epochs": {1, 2}})
    assert not (disk_dir / "ckpt").exists()
    x = torch.randint(0, VOCAB, (2, 16))
    engine.backward(loss_of(engine(input_ids=x, labels=x)))
    with pytest.raises(RuntimeError, match="between backward\\(\\) and step\\(\\)"):
        engine.save_checkpoint(disk_dir / "ckpt")
    engine.step()
    weight = engine.module.model.layers[0].mlp.up_proj.weight
    with infinity.zero.GatheredParameters([weight]):
        with pytest.raises(RuntimeError, match="inside GatheredParameters"):
            engine.save_checkpoint(disk_dir / "ckpt")
    assert engine.save_checkpoint(disk_dir / "ckpt").name == "global_step3"


def test_a_checkpoint_of_another_model_is_refused(engine, disk_dir):
    engine.save_checkpoint(disk_dir / "ckpt")
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    wider, *_ = infinity.initialize(model=make_model("llama", layers=2, width=64), config=ds)
    try:
        with pytest.raises(CheckpointError, match="shapes differ"):
            wider.load_checkpoint(disk_dir / "ckpt")
    finally:
        wider.close()
    deeper_model = make_model("llama", layers=3)
    # a parameter the checkpoint lacks inside a unit it has: the rest of the unit is loaded
    # around it (on NVMe: read, filled, written back)
    deeper_model.model.layers[0].extra = torch.nn.Parameter(torch.full((300,), 0.5))
    before = {n: p.detach().clone() for n, p in deeper_model.named_parameters()
              if n.startswith(("model.layers.2", "model.layers.0.extra"))}
    nvme = zero_config(3, "nvme", "nvme", str(disk_dir))
    nvme["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    deeper, *_ = infinity.initialize(model=deeper_model, config=nvme)
    try:
        with pytest.raises(CheckpointError, match="10 of the model's parameters are not in it"):
            deeper.load_checkpoint(disk_dir / "ckpt")
        deeper.load_checkpoint(disk_dir / "ckpt", load_module_strict=False)
        deeper.save_checkpoint(disk_dir / "deeper", tag="t")
    finally:
        deeper.close()
    saved = _weights(disk_dir / "ckpt" / "global_step2")
    loaded = _weights(disk_dir / "deeper" / "t")
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert len(before) == 10 and all(torch.equal(before[k], loaded[k]) for k in before)
    manifest = json.loads((disk_dir / "deeper" / "t" / "manifest.json").read_text())
    assert manifest["params"]["model.layers.2.mlp.up_proj.weight"]["steps"] == 0


def test_a_save_stopped_between_renames_is_recovered(engine, disk_dir, monkeypatch):
    """Without an atomic exchange of directories (some filesystems), replacing a tag takes two
    renames; a crash between them leaves the tag missing and its last save renamed aside: a load
    uses that, and the next save of the tag cleans it up (keeping the user's files)."""
    from infinity.checkpoint import directory as directory_module

    first = engine.save_checkpoint(disk_dir / "ckpt", tag="t")
    (first / "notes.txt").write_text("mine")
    _train(engine, 1)
    monkeypatch.setattr(directory_module, "_exchange", lambda a, b: False)
    real_rename = directory_module.os.rename

    def crash_before_the_new_one_is_in_place(src, dst):
        if ".t.partial" in str(src):
            raise KeyboardInterrupt("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(directory_module.os, "rename", crash_before_the_new_one_is_in_place)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(disk_dir / "ckpt", tag="t")
    monkeypatch.setattr(directory_module.os, "rename", real_rename)
    assert not (disk_dir / "ckpt" / "t").exists()
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    other, *_ = infinity.initialize(model=make_model("llama", seed=3, layers=2), config=ds)
    try:
        path, _ = other.load_checkpoint(disk_dir / "ckpt")
        assert path.endswith(".t.replaced") and other.global_steps == 2
    finally:
        other.close()
    engine.save_checkpoint(disk_dir / "ckpt", tag="t")
    assert sorted(p.name for p in (disk_dir / "ckpt").iterdir()) == ["latest", "t"]
    assert (disk_dir / "ckpt" / "t" / "notes.txt").read_text() == "mine"
    assert json.loads((disk_dir / "ckpt" / "t" / "manifest.json").read_text())[
        "engine"]["global_steps"] == 3


def test_a_users_file_in_a_left_staging_directory_goes_into_the_tag(engine, disk_dir):
    staging = disk_dir / "ckpt" / ".t.partial.0a1b2c3d"
    staging.mkdir(parents=True)
    (staging / "rank0_model.safetensors").write_bytes(b"half a file")
    (staging / "notes.txt").write_text("mine")
    engine.save_checkpoint(disk_dir / "ckpt", tag="t")
    assert sorted(p.name for p in (disk_dir / "ckpt").iterdir()) == ["latest", "t"]
    assert (disk_dir / "ckpt" / "t" / "notes.txt").read_text() == "mine"
    assert engine.load_checkpoint(disk_dir / "ckpt")[0].endswith("/t")


def test_a_tag_that_is_a_symbolic_link_is_refused_and_its_target_kept(engine, disk_dir):
    """Saving to tag "best" -> global_step2 used to replace and then clean the link's target
    through it: the checkpoint `latest` named lost its files."""
    ckpt = disk_dir / "ckpt"
    target = engine.save_checkpoint(ckpt)
    (ckpt / "best").symlink_to(target.name)
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(CheckpointError, match="is a symbolic link.*target is left alone"):
        engine.save_checkpoint(ckpt, tag="best")
    assert sorted(p.name for p in target.iterdir()) == before
    assert (ckpt / "best").is_symlink() and not (ckpt / ".best.partial").exists()
    path, _ = engine.load_checkpoint(ckpt)
    assert str(path) == str(target)


def test_a_failed_resave_keeps_the_users_files_in_the_tag(engine, disk_dir, monkeypatch):
    """The user's files (an adapter in .safetensors among them) are carried into the new save
    before the atomic exchange; when that fails, they go back, and nothing of theirs is deleted
    (the staging clean-up used to remove every *.safetensors)."""
    from infinity.checkpoint import directory

    ckpt = disk_dir / "ckpt"
    tag = engine.save_checkpoint(ckpt, tag="best")
    (tag / "notes.txt").write_text("mine")
    (tag / "adapter.safetensors").write_bytes(b"not ours")
    _train(engine, 1)

    def failing_exchange(a, b):
        raise OSError(errno.EIO, "injected exchange error")

    monkeypatch.setattr(directory, "_exchange", failing_exchange)
    with pytest.raises(OSError, match="injected"):
        engine.save_checkpoint(ckpt, tag="best")
    assert (tag / "notes.txt").read_text() == "mine"
    assert (tag / "adapter.safetensors").read_bytes() == b"not ours"
    monkeypatch.undo()
    engine.save_checkpoint(ckpt, tag="best")
    assert (tag / "adapter.safetensors").read_bytes() == b"not ours"


def test_a_users_safetensors_in_a_left_staging_directory_survives(engine, disk_dir):
    """A save killed after carrying the user's files into .<tag>.partial: the next save reuses
    that directory, removes only the names a save writes, and takes the user's file along."""
    ckpt = disk_dir / "ckpt"
    engine.save_checkpoint(ckpt, tag="best")
    staging = ckpt / ".best.partial.0a1b2c3d"
    staging.mkdir()
    (staging / "adapter.safetensors").write_bytes(b"not ours")
    (staging / "rank0_model.safetensors").write_bytes(b"a half-written file of ours")
    engine.save_checkpoint(ckpt, tag="best")
    assert (ckpt / "best" / "adapter.safetensors").read_bytes() == b"not ours"
    assert not staging.exists()


@pytest.mark.parametrize("damage", ["params_entry", "newer_version", "counter", "betas",
                                    "groups", "scaler"])
def test_a_manifest_that_does_not_match_its_files_is_refused_before_loading(engine, disk_dir,
                                                                            damage):
    """A params entry missing from manifest.json (its tensors whole) used to raise a bare
    KeyError after every parameter had been overwritten; a newer format says to upgrade; a
    damaged counter or group setting raised (or was taken) after the weights were loaded."""
    ckpt = disk_dir / "ckpt"
    tag = engine.save_checkpoint(ckpt)
    manifest_path = tag / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "params_entry":
        manifest["params"].pop("lm_head.weight")
        expected = r"no step count for 1 parameter\(s\) \(lm_head\.weight\)"
    elif damage == "newer_version":
        manifest["version"] = VERSION + 1
        expected = "newer infinity: upgrade infinity"
    elif damage == "counter":
        manifest["engine"]["global_steps"] = "2"
        expected = "global_steps = '2', not an integer"
    elif damage == "betas":
        manifest["param_groups"][0]["betas"] = [0.9]
        expected = r"param_groups\[0\]\.betas = \[0\.9\], not two numbers"
    elif damage == "groups":
        manifest["param_groups"] = {"0": manifest["param_groups"][0]}
        expected = "has 0 optimizer param group|not a list of settings"
    else:
        manifest["loss_scaler"] = [1.0]
        expected = "loss_scaler is not a dict"
    manifest_path.write_text(json.dumps(resummed(manifest)))
    _train(engine, 1)
    probe = engine.save_checkpoint(disk_dir / "probe", tag="before", save_latest=False)
    steps, betas = engine.global_steps, engine.optimizer.param_groups[0]["betas"]
    with pytest.raises(CheckpointError, match=expected):
        engine.load_checkpoint(ckpt, verify_checksums=False)
    _assert_unchanged(engine, disk_dir, probe.name)
    assert (engine.global_steps, engine.optimizer.param_groups[0]["betas"]) == (steps, betas)


@pytest.mark.parametrize("kind", ["model", "optim"])
def test_a_file_copied_in_from_another_save_is_refused_without_checksums(engine, disk_dir,
                                                                         kind):
    """A rank file of the save one step earlier (the same size and tensors) put in place of
    the later save's: the weights of one save with the moments of the other. With
    ``verify_checksums=False`` only the save's id tells them apart (see [Note: which save a
    file belongs to]); refused before anything is loaded."""
    ckpt = disk_dir / "ckpt"
    earlier = engine.save_checkpoint(ckpt, tag="earlier")
    _train(engine, 1)
    later = engine.save_checkpoint(ckpt, tag="later")
    name = f"rank0_{kind}.safetensors"
    assert (earlier / name).stat().st_size == (later / name).stat().st_size
    shutil.copyfile(earlier / name, later / name)
    _train(engine, 1)
    probe = engine.save_checkpoint(disk_dir / "probe", tag="before", save_latest=False)
    steps = engine.global_steps
    with pytest.raises(CheckpointError, match=f"{name} carries save [0-9a-f]{{32}}'s id, not "
                                              "this checkpoint's"):
        engine.load_checkpoint(ckpt, tag="later", verify_checksums=False)
    _assert_unchanged(engine, disk_dir, probe.name)
    assert engine.global_steps == steps


def _two_group_engine(disk_dir, model, decay_first: bool, **ds_extra):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1},
              {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds.update(ds_extra)
    engine, *_ = infinity.initialize(model=model, config=ds,
                                     model_parameters=groups if decay_first else groups[::-1])
    return engine


def test_param_groups_built_in_another_order_are_refused(disk_dir):
    """The groups' settings are restored by position: groups built in another order would
    give each parameter the other group's lr and weight decay, silently. Refused, naming a
    parameter; load_optimizer_states=False still loads the weights."""
    first = _two_group_engine(disk_dir, make_model("llama", layers=2), decay_first=True)
    _train(first, 1)
    tag = first.save_checkpoint(disk_dir / "ckpt")
    first.close()
    second = _two_group_engine(disk_dir, make_model("llama", layers=2, seed=1), decay_first=False)
    try:
        groups = [dict(g) for g in second.optimizer.param_groups]
        with pytest.raises(CheckpointError, match=r"in another optimizer param group.*group 1 "
                                                  r"then, 0 now.*load_optimizer_states=False"):
            second.load_checkpoint(disk_dir / "ckpt")
        assert [dict(g) for g in second.optimizer.param_groups] == groups
        assert second.global_steps == 0
        assert second.load_checkpoint(disk_dir / "ckpt", load_optimizer_states=False)[0] == str(tag)
        assert second.global_steps == 1
    finally:
        second.close()


def test_the_configs_update_rule_is_kept_over_the_checkpoints(disk_dir, infinity_log):
    """adam_w_mode is the config's (as it is DeepSpeed's optimizer's attribute): a checkpoint
    saved with L2 Adam does not turn an AdamW engine into one."""
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False,
                                                  "weight_decay": 0.1}}
    first, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    _train(first, 1)
    first.save_checkpoint(disk_dir / "ckpt")
    first.close()
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}
    second, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    try:
        with infinity_log.at_level(logging.WARNING):
            second.load_checkpoint(disk_dir / "ckpt")
        assert all(g["adamw_mode"] is True for g in second.optimizer.param_groups)
        assert "adamw_mode = False" in infinity_log.text
    finally:
        second.close()


def test_a_scheduler_state_of_another_kind_is_refused_before_loading(disk_dir):
    """Saved under a ds_config schedule, resumed with a torch LambdaLR factory (the Hugging
    Face habit): the scheduler's load_state_dict raised a bare KeyError after every weight and
    counter had been replaced. Now refused first; load_lr_scheduler_states=False loads."""
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}
    first, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    _train(first, 2)
    first.save_checkpoint(disk_dir / "ckpt")
    first.close()
    del ds["scheduler"]
    second, *_ = infinity.initialize(
        model=make_model("llama", layers=2, seed=1), config=ds,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5))
    try:
        second.save_checkpoint(disk_dir / "probe", tag="before", save_latest=False)
        with pytest.raises(CheckpointError, match="another kind of scheduler.*"
                                                  "load_lr_scheduler_states=False"):
            second.load_checkpoint(disk_dir / "ckpt")
        _assert_unchanged(second, disk_dir, "before")
        assert second.global_steps == 0
        second.load_checkpoint(disk_dir / "ckpt", load_lr_scheduler_states=False)
        assert second.global_steps == 2
    finally:
        second.close()


def test_a_load_that_fails_part_way_stops_the_engine_until_a_load_completes(engine, disk_dir,
                                                                            monkeypatch):
    """An I/O error in the middle of a load leaves some units loaded and others not: training
    or saving that mix is refused until a load completes."""
    engine.save_checkpoint(disk_dir / "ckpt")
    _train(engine, 1)
    calls = {"n": 0}
    original = TensorFileReader.read_into

    def failing_read(self, name, out, start=0):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(errno.EIO, "injected read error")
        return original(self, name, out, start)

    monkeypatch.setattr(TensorFileReader, "read_into", failing_read)
    with pytest.raises(OSError, match="injected read error"):
        engine.load_checkpoint(disk_dir / "ckpt")
    x = torch.randint(0, VOCAB, (2, 16))
    with pytest.raises(RuntimeError, match="load_checkpoint failed part-way"):
        engine(input_ids=x, labels=x)
    with pytest.raises(RuntimeError, match="load_checkpoint failed part-way"):
        engine.save_checkpoint(disk_dir / "ckpt")
    monkeypatch.setattr(TensorFileReader, "read_into", original)
    engine.load_checkpoint(disk_dir / "ckpt")
    assert engine.global_steps == 2
    _train(engine, 1)


def test_a_disk_that_fills_during_the_write_says_what_and_what_to_do(engine, disk_dir,
                                                                     monkeypatch):
    """Another writer fills the disk after the room check: the bare "[Errno 28] No space left on
    device" now names the checkpoint, the directory and what to do; latest is unchanged."""
    ckpt = disk_dir / "ckpt"
    engine.save_checkpoint(ckpt)
    calls = {"n": 0}
    original = TensorFileWriter.append

    def filling_append(self, name, values):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, name, values)

    monkeypatch.setattr(TensorFileWriter, "append", filling_append)
    _train(engine, 1)
    with pytest.raises(OSError, match=r"checkpoint global_step3: the disk of .* filled up.*"
                                      r"previous checkpoint and latest are unchanged") as info:
        engine.save_checkpoint(ckpt)
    assert info.value.errno == errno.ENOSPC
    assert (ckpt / "latest").read_text().strip() == "global_step2"


def test_a_failed_latest_update_leaves_the_old_one_and_no_partial_file(engine, disk_dir,
                                                                       monkeypatch):
    """The rename that points ``latest`` at a new tag fails: ``latest`` still names the last
    tag and the engine's own temporary file is gone (before, ``.latest.partial`` stayed)."""
    from infinity.checkpoint import directory

    first = engine.save_checkpoint(disk_dir / "ckpt")
    _train(engine, 1)
    replace = directory.os.replace

    def failing_replace(src, dst, *args, **kwargs):
        if str(dst).endswith("latest"):
            raise OSError(errno.EIO, "injected rename error")
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(directory.os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected rename error"):
        engine.save_checkpoint(disk_dir / "ckpt")
    monkeypatch.setattr(directory.os, "replace", replace)
    names = sorted(p.name for p in (disk_dir / "ckpt").iterdir())
    assert not [n for n in names if n.startswith(".latest.")], names
    assert (disk_dir / "ckpt" / "latest").read_text().strip() == first.name


def test_a_load_whose_writes_fail_gives_every_slot_back(disk_dir, monkeypatch):
    """Two chunk writes of one unit fail at their wait: the clean-up stopped at the first, so
    the other chunk's slot (an optimizer step slot) stayed taken, one more per failed load."""
    from infinity.storage.manager import FlatStore

    ds = zero_config(3, "nvme", "nvme", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["zero_optimization"]["sub_group_size"] = 2048        # 8 KiB slots: many chunks a unit
    engine, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    try:
        _train(engine, 1)
        engine.save_checkpoint(disk_dir / "ckpt")
        engine.flush()
        pool = engine.optimizer.step_pool
        original = FlatStore.store_async
        calls = {"n": 0}

        class FailingWrite:
            def __init__(self, request):
                self.request = request

            def wait(self, timeout=None):
                self.request.wait()
                raise OSError(5, "injected EIO at completion")

        def failing(self, buf, start=0, count=None, shadow=False):
            request = original(self, buf, start, count, shadow)
            if self.name.endswith("embed_tokens.params"):
                calls["n"] += 1
                if calls["n"] in calls.get("fail", ()):
                    return FailingWrite(request)
            return request

        monkeypatch.setattr(FlatStore, "store_async", failing)
        engine.load_checkpoint(disk_dir / "ckpt")      # counts the unit's chunk writes
        chunks = calls["n"]
        assert chunks >= 3, chunks
        calls["fail"] = (chunks - 1, chunks)            # the last two: both still in flight
        for _ in range(2):
            calls["n"] = 0
            monkeypatch.setattr(FlatStore, "store_async", failing)
            with pytest.raises(OSError, match="injected EIO at completion"):
                engine.load_checkpoint(disk_dir / "ckpt")
            monkeypatch.setattr(FlatStore, "store_async", original)
            assert pool.available == pool.count, (pool.available, pool.count)
        engine.load_checkpoint(disk_dir / "ckpt")
        _train(engine, 1)
    finally:
        engine.close()


def test_a_checkpoint_with_the_older_scheduler_state_still_loads(disk_dir):
    """Older infinity checkpoints hold a ds_config schedule's state in torch LambdaLR's form
    (last_epoch = steps taken); the schedule still takes it, and the checks before a load must
    not refuse what it takes (they did, as "another kind of scheduler")."""
    ds = zero_config(3, "cpu", "cpu", str(disk_dir))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                      "warmup_type": "linear"}}
    first, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    _train(first, 3)
    tag = first.save_checkpoint(disk_dir / "ckpt")
    expected = first.get_lr()
    first.close()
    manifest_path = tag / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    position = manifest["lr_scheduler"]["last_batch_iteration"]
    manifest["lr_scheduler"] = {"last_epoch": position + 1, "base_lrs": [1e-3], "_step_count": 4,
                                "verbose": False, "_get_lr_called_within_step": False,
                                "_last_lr": expected, "lr_lambdas": [None]}
    manifest_path.write_text(json.dumps(resummed(manifest)))
    second, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    try:
        second.load_checkpoint(disk_dir / "ckpt")
        assert second.get_lr() == pytest.approx(expected)
        assert second.lr_scheduler.last_batch_iteration == position
    finally:
        second.close()


def test_a_failure_tidying_the_replaced_save_is_reported_as_a_committed_save(engine, disk_dir,
                                                                             monkeypatch):
    """Replacing a tag: the exchange commits, then removing the old save's files fails (an
    unlink error). The error said nothing of the commit: the cleanup of what the staging path
    held (the old save, after the exchange) failed again and replaced it, and the lock file's
    removal after it. Now the save says it is in place and latest was not moved; it loads."""
    from infinity.checkpoint import directory as directory_module
    from infinity.checkpoint.directory import SavedError

    engine.save_checkpoint(disk_dir / "ckpt", tag="t")
    _train(engine, 1)
    real_exchange, real_unlink = directory_module._exchange, directory_module.os.unlink
    after = {"exchanged": False}

    def exchange(a, b):
        after["exchanged"] = real_exchange(a, b)
        return after["exchanged"]

    def unlink(name, *args, dir_fd=None, **kwargs):
        if after["exchanged"] and dir_fd is not None:
            raise OSError(errno.EIO, "Input/output error")
        return real_unlink(name, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(directory_module, "_exchange", exchange)
    monkeypatch.setattr(directory_module.os, "unlink", unlink)
    with pytest.raises(SavedError, match=r"checkpoint t is saved whole .*\(committed\).*latest "
                                         r"was not pointed at it"):
        engine.save_checkpoint(disk_dir / "ckpt", tag="t")
    monkeypatch.undo()
    if not after["exchanged"]:
        pytest.skip("no atomic exchange of directories on this file system")
    assert json.loads((disk_dir / "ckpt" / "t" / "manifest.json").read_text())[
        "engine"]["global_steps"] == engine.global_steps      # the new save is the tag's


@pytest.mark.parametrize("edit", ["lr", "counter key", "steps"])
def test_a_manifest_changed_after_its_save_is_refused(engine, disk_dir, edit) -> None:
    """The tensor files are checked against the manifest's sums, and nothing checked the
    manifest: a changed byte loaded silently in one case of seven (the "engine" key renamed
    reset the step counters to 0, an lr or a step count changed). Its own checksum now."""
    tag = engine.save_checkpoint(disk_dir / "ckpt")
    path = tag / "manifest.json"
    text = path.read_text()
    changed = {"lr": lambda t: t.replace('"lr": 0.001', '"lr": 0.003', 1),
               "counter key": lambda t: t.replace('"engine"', '"engind"', 1),
               "steps": lambda t: t.replace('"global_steps": 2', '"global_steps": 3', 1)}[edit](text)
    assert changed != text, edit
    path.write_text(changed)
    with pytest.raises(CheckpointError, match="was changed after its save"):
        engine.load_checkpoint(disk_dir / "ckpt")


@pytest.mark.parametrize("named", ["save_dir", "tag_dir"])
def test_a_deepspeed_checkpoint_is_named_as_one_with_the_way_to_its_weights(
        engine, disk_dir, named) -> None:
    """A DeepSpeed save directory was told its manifest "was deleted or never written ...
    restore the manifest"; the directory of one of its tags gave (None, None)."""
    save_dir = disk_dir / "ds_ckpt"
    tag_dir = save_dir / "global_step10"
    tag_dir.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tag_dir / name).write_bytes(b"not read")
    (save_dir / "latest").write_text("global_step10")
    target = save_dir if named == "save_dir" else tag_dir
    with pytest.raises(CheckpointError, match=r"is a DeepSpeed checkpoint .*zero_to_fp32\.py"):
        engine.load_checkpoint(target)
    assert sorted(p.name for p in tag_dir.iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
