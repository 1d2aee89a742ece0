"""checkpoint/pretrained.py at unit level: a Hugging Face directory found
(index, single file, one file given, and every refusal with its text), opened and checked whole
(missing shards, tensors an index promises), matched to a model (tied names, base-model prefix
both ways, missing / unexpected / mismatched parameters and buffers, ignore patterns, the error
and the warnings) and read into units through each path (O_DIRECT, straight, through the ring),
with real safetensors files. test_pretrained_files.py covers the read-ahead; the engine's
integration tests reached the rest."""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import torch
from messages import raises_naming
from safetensors.torch import save_file
from torch import nn

from infinity.checkpoint import pretrained as pt
from infinity.checkpoint import pretrained_files as pfiles
from infinity.checkpoint.pretrained import (
    MatchReport,
    PretrainedMismatchError,
    PretrainedWeights,
)
from infinity.checkpoint.pretrained_files import weight_map
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileWriter
from infinity.engine.hf_conversions import Fusion

F32, BF16 = torch.float32, torch.bfloat16


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _sharded(directory: Path, files: dict[str, dict[str, torch.Tensor]]) -> Path:
    for name, tensors in files.items():
        _save(directory / name, tensors)
    index = {k: name for name, tensors in files.items() for k in tensors}
    (directory / pfiles.INDEX_NAME).write_text(json.dumps({"weight_map": index}))
    return directory


# -- finding the files ---------------------------------------------------------------------
def test_a_directory_an_index_and_a_single_file_are_found(tmp_path: Path) -> None:
    d = _sharded(tmp_path / "s", {"a.safetensors": {"x": torch.zeros(2)},
                                  "b.safetensors": {"y": torch.zeros(1), "z": torch.ones(1)}})
    expect = (d, {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"})
    assert weight_map(d) == expect
    assert weight_map(d / pfiles.INDEX_NAME) == expect
    one = _save(tmp_path / "one" / "model.safetensors", {"p": torch.zeros(1), "q": torch.ones(2)})
    assert weight_map(one.parent) == (one.parent, {"p": "model.safetensors",
                                                   "q": "model.safetensors"})
    other = _save(tmp_path / "w" / "weights.safetensors", {"p": torch.zeros(1)})
    assert weight_map(other) == (other.parent, {"p": "weights.safetensors"})


def test_what_is_not_a_pretrained_directory_is_refused_with_its_text(tmp_path: Path) -> None:
    pickle = tmp_path / "pytorch_model.bin"
    pickle.write_bytes(b"x")
    with pytest.raises(CheckpointError) as info:
        weight_map(pickle)
    assert str(info.value) == (f"{pickle}: not a safetensors file; infinity reads safetensors "
                               "only (no pickle): pass the model's directory or its "
                               "*.safetensors file")
    with pytest.raises(FileNotFoundError) as info:
        weight_map(tmp_path / "nowhere")
    assert str(info.value) == (f"{tmp_path / 'nowhere'} does not exist: pass a local directory "
                               "saved with save_pretrained (download a Hub model first, e.g. "
                               "`hf download <repo> --local-dir DIR`)")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError) as info:
        weight_map(empty)
    assert str(info.value) == f"{empty} has no model.safetensors and no {pfiles.INDEX_NAME}."
    for n in ("f.safetensors", "e.safetensors", "d.safetensors", "c.safetensors",
              "b.safetensors", "a.safetensors"):
        (empty / n).write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        weight_map(empty)
    assert str(info.value) == (f"{empty} has no model.safetensors and no {pfiles.INDEX_NAME}. It "
                               "holds a.safetensors, b.safetensors, c.safetensors, "
                               "d.safetensors, e.safetensors: pass one of them as the path.")
    (empty / "model.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        weight_map(empty)
    assert str(info.value) == (
        f"{empty} has no model.safetensors and no {pfiles.INDEX_NAME}. It holds pickle files "
        "(pytorch_model.bin): infinity reads safetensors only; convert them once with "
        "transformers (from_pretrained, then save_pretrained)")


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[]", b'{"weight_map": []}',
                                  b'{"weight_map": {"x": 3}}', b'{"weight_map": {"x": "a"},'
                                                               b' "other": 1, "y": 2}'])
def test_a_damaged_index_is_refused_naming_it(tmp_path: Path, body: bytes) -> None:
    index = tmp_path / pfiles.INDEX_NAME
    index.write_bytes(body)
    if body.startswith(b'{"weight_map": {"x": "a"}'):
        assert weight_map(tmp_path) == (tmp_path, {"x": "a"})
        return
    with pytest.raises(CheckpointError) as info:
        weight_map(tmp_path)
    if body in (b"{not json", b"\xff\xfe"):
        assert str(info.value).startswith(f"{index}: not valid JSON (")
    else:
        assert str(info.value) == f"{index}: no \"weight_map\" of tensor names to file names"


def test_an_index_naming_a_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / pfiles.INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "a.safetensors",
                                                                     "y": "sub/b.safetensors"}}))
    with pytest.raises(CheckpointError) as info:
        weight_map(tmp_path)
    assert str(info.value) == (f"{tmp_path / pfiles.INDEX_NAME}: file 'sub/b.safetensors' is not a "
                               f"file name in {tmp_path}")


def test_what_is_no_regular_file_is_named_by_kind(tmp_path: Path, monkeypatch) -> None:
    """not_a_file: a FIFO, a directory, a socket, a character device and a block device by
    their kind; a symbolic link by where it leads (a missing target, a loop, a path that cannot
    be read, or the kind of what it ends at); a regular file, a link to one, or nothing, None."""
    monkeypatch.chdir(tmp_path)         # a socket's path must be short: bound by a relative name
    os.mkfifo("fifo")
    os.mkdir("dir")
    (tmp_path / "regular").write_bytes(b"x")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("sock")
        assert pfiles.not_a_file(tmp_path / "sock") == "a socket"
    assert pfiles.not_a_file(tmp_path / "fifo") == "a FIFO (named pipe)"
    assert pfiles.not_a_file(tmp_path / "dir") == "a directory"
    assert pfiles.not_a_file(Path(os.devnull)) == "a character device"
    assert pfiles.not_a_file(tmp_path / "regular") is None
    assert pfiles.not_a_file(tmp_path / "nothing") is None
    links = {"dangling": "nothing", "loop1": "loop2", "loop2": "loop1", "under": "regular/x",
             "to_fifo": "fifo", "to_link": "to_fifo", "to_regular": "regular"}
    for name, target in links.items():
        os.symlink(target, name)
    assert pfiles.not_a_file(tmp_path / "dangling") == ("a symbolic link to nothing, which does "
                                                    "not exist")
    assert pfiles.not_a_file(tmp_path / "loop1") == "a symbolic link that loops (to loop2)"
    assert pfiles.not_a_file(tmp_path / "under") == (
        f"a symbolic link to regular/x, which cannot be read ({os.strerror(errno.ENOTDIR)})")
    assert pfiles.not_a_file(tmp_path / "to_fifo") == "a symbolic link to a FIFO (named pipe)"
    assert pfiles.not_a_file(tmp_path / "to_link") == "a symbolic link to a FIFO (named pipe)"
    assert pfiles.not_a_file(tmp_path / "to_regular") is None
    # a block device cannot be made without privileges: its mode, as lstat gives it
    block = os.stat_result((stat.S_IFBLK | 0o600, 0, 0, 1, 0, 0, 0, 0, 0, 0))
    monkeypatch.setattr(pfiles.os, "lstat", lambda path: block)
    assert pfiles.not_a_file(tmp_path / "disk") == "a block device"


def test_a_weights_file_that_is_no_regular_file_is_refused_naming_its_kind(
        tmp_path: Path) -> None:
    os.mkfifo(tmp_path / pfiles.SINGLE_NAME)
    with raises_naming(CheckpointError, f"{tmp_path / pfiles.SINGLE_NAME} is a FIFO (named pipe), "
                       "not a file: infinity reads the weights from regular files. Replace it "
                       "with the file itself (copy the model directory again)", ends=True):
        weight_map(tmp_path)


# -- opening -------------------------------------------------------------------------------
def test_missing_shards_are_listed_sorted_with_what_they_hold(tmp_path: Path) -> None:
    index = {"x": "b.safetensors", "w": "b.safetensors", "v": "a.safetensors",
             "u": "c.safetensors"}
    _save(tmp_path / "c.safetensors", {"u": torch.zeros(1)})
    (tmp_path / pfiles.INDEX_NAME).write_text(json.dumps({"weight_map": index}))
    with pytest.raises(CheckpointError) as info:
        PretrainedWeights(tmp_path)
    assert str(info.value) == (
        f"{tmp_path}: the shard file(s) that {pfiles.INDEX_NAME} names are missing: a.safetensors "
        "(holds 1 tensors, e.g. v); b.safetensors (holds 2 tensors, e.g. w). Copy the whole "
        "directory again (an interrupted download?)")


def test_a_shard_lacking_tensors_is_refused_listing_them(tmp_path: Path) -> None:
    _save(tmp_path / "a.safetensors", {"x": torch.zeros(1)})
    names = [f"t{i:02d}" for i in range(25)]
    (tmp_path / pfiles.INDEX_NAME).write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", **{n: "a.safetensors" for n in names}}}))
    with pytest.raises(CheckpointError) as info:
        PretrainedWeights(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'a.safetensors'} lacks 25 tensor(s) that {pfiles.INDEX_NAME} says it holds: "
        f"{', '.join(names[:20])}. The directory is damaged or its shards come from different "
        "saves")


def test_files_are_opened_with_o_direct_unless_told_or_refused(tmp_path: Path,
                                                               monkeypatch) -> None:
    """direct_io: a second descriptor per file, closed with the reader; off, or refused by the
    filesystem, none; the names and each one's file."""
    d = _sharded(tmp_path / "m", {"a.safetensors": {"x": torch.zeros(2)},
                                  "b.safetensors": {"y": torch.zeros(1)}})
    w = PretrainedWeights(d)
    assert sorted(w._direct_fds) == [str(d / "a.safetensors"), str(d / "b.safetensors")]
    assert w._tensors["x"].direct_fd == w._direct_fds[str(d / "a.safetensors")]
    assert sorted(w.names) == ["x", "y"] and w.file_of("y") == d / "b.safetensors"
    fds = list(w._direct_fds.values())
    w.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert w._direct_fds == {} and w._readers == {}
    w.close()
    with PretrainedWeights(d, direct_io=False) as w:
        assert w._direct_fds == {} and w._tensors["x"].direct_fd is None
    real_open = os.open

    def refusing(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(pt.os, "open", refusing)
    with PretrainedWeights(d) as w:
        assert w._direct_fds == {} and w._tensors["x"].direct_fd is None


def test_the_commit_point_is_the_file_a_reader_sees(tmp_path: Path) -> None:
    """A directory's model.safetensors, else its index; a file given, that file itself: as
    (name, device, inode, size, mtime), which a save over it changes; None when neither is a
    regular file."""
    def point(path: Path) -> tuple:
        st = path.stat()
        return path.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    one = _save(tmp_path / "one" / "weights.safetensors", {"p": torch.zeros(1)})
    assert pfiles.commit_point(one) == point(one)
    sharded = _sharded(tmp_path / "s", {"a.safetensors": {"x": torch.zeros(2)}})
    assert pfiles.commit_point(sharded) == point(sharded / pfiles.INDEX_NAME)
    single = _save(sharded / pfiles.SINGLE_NAME, {"x": torch.zeros(2)})
    assert pfiles.commit_point(sharded) == point(single)
    assert pfiles.commit_point(tmp_path / "one") is None
    assert pfiles.commit_point(tmp_path / "nothing") is None


def test_a_directory_saved_over_at_every_open_is_refused(tmp_path: Path, monkeypatch,
                                                         infinity_log) -> None:
    """Another process commits a save while each of the OPEN_ATTEMPTS opens runs: each retry is
    logged, then the load gives up saying why and what to do."""
    d = _sharded(tmp_path / "m", {"a.safetensors": {"x": torch.zeros(2)}})
    saves = iter(range(1000))
    monkeypatch.setattr(pt, "commit_point", lambda source: next(saves))
    with infinity_log.at_level(logging.INFO, logger="infinity"), raises_naming(
            CheckpointError, f"{d} was saved over {pfiles.OPEN_ATTEMPTS} times", "another process "
            "keeps saving into it; load it when that save is done, or from a copy", ends=True):
        PretrainedWeights(d)
    assert [r.getMessage() for r in infinity_log.records] == (
        [f"{d} was saved over while it was being opened; opening it again"] * pfiles.OPEN_ATTEMPTS)


# -- the match -----------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.head = nn.Linear(2, 4, bias=False)
        self.head.weight = self.embed.weight           # tied
        self.proj = nn.Linear(2, 3)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)


def _net_tensors(prefix: str = "") -> dict[str, torch.Tensor]:
    return {f"{prefix}embed.weight": torch.arange(8.0).reshape(4, 2),
            f"{prefix}proj.weight": torch.full((3, 2), 2.0), f"{prefix}proj.bias": torch.ones(3),
            f"{prefix}scale": torch.tensor([5.0, 6.0, 7.0])}


def test_a_parameter_a_shard_holds_but_the_index_omits_is_named_as_such(tmp_path: Path) -> None:
    """The index lists the tensors it maps; one a shard holds that it leaves out is missing for
    the load, and the error says where it is and why it is not read."""
    t = _net_tensors()
    d = _sharded(tmp_path / "s", {"a.safetensors": {k: v for k, v in t.items() if k != "proj.bias"},
                                  "b.safetensors": {"proj.bias": t["proj.bias"]}})
    index = json.loads((d / pfiles.INDEX_NAME).read_text())
    del index["weight_map"]["proj.bias"]
    (d / pfiles.INDEX_NAME).write_text(json.dumps(index))
    _save(d / "a.safetensors", t)                      # the shard holds proj.bias after all
    with PretrainedWeights(d) as w, pytest.raises(PretrainedMismatchError) as info:
        w.match(_Net())
    assert ("1 parameter(s) of the model are not in it: proj.bias (the shard files hold 1 "
            f"tensor(s) that {pfiles.INDEX_NAME} does not list, e.g. proj.bias (a.safetensors): "
            "an index that names only part of the weights)") in str(info.value)


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Net()
        self.extra = nn.Linear(1, 1, bias=False)


def test_a_tied_parameter_matches_under_any_of_its_names(tmp_path: Path) -> None:
    """The checkpoint holds the head's name only: both names are served; a non-persistent
    buffer's saved copy is not unexpected; a persistent buffer is matched."""
    t = _net_tensors()
    t["head.weight"] = t.pop("embed.weight")
    t["inv_freq"] = torch.zeros(2)
    _save(tmp_path / "model.safetensors", t)
    with PretrainedWeights(tmp_path) as w:
        report = w.match(_Net())
        assert report == MatchReport()
        assert w.provides("embed.weight") and w.provides("head.weight")
        assert w.provides("proj.bias") and not w.provides("scale")
        assert sorted(w._buffers) == ["scale"]


def test_the_base_model_prefix_is_removed_or_added(tmp_path: Path) -> None:
    """A base model's checkpoint into a model with a head (prefix added to the checkpoint's
    names, the model's own ``extra`` missing), and a model-with-head checkpoint into the base
    model (prefix removed); without a prefix, names are taken as they are."""
    base = _save(tmp_path / "base" / "model.safetensors", _net_tensors()).parent
    with PretrainedWeights(base) as w:
        report = w.match(_Wrapped(), prefix="model", strict=False)
        assert report.missing == ["extra.weight"] and report.unexpected == []
        assert w.provides("model.proj.weight")
    full = _save(tmp_path / "full" / "model.safetensors", _net_tensors("model.")).parent
    with PretrainedWeights(full) as w:
        assert w.match(_Net(), prefix="model") == MatchReport()
        assert w.provides("proj.weight")
    with PretrainedWeights(full) as w:
        report = w.match(_Net(), strict=False)
        assert report.missing == ["embed.weight", "proj.weight", "proj.bias"]
        assert report.missing_buffers == ["scale"]
    # both with the prefix: the names as they are
    with PretrainedWeights(full) as w:
        assert w.match(_Wrapped(), prefix="model", strict=False).missing == ["extra.weight"]
    # a name merely starting with the prefix's letters is not prefixed
    odd = _save(tmp_path / "odd" / "model.safetensors", {"modelx.w": torch.zeros(1)}).parent
    with PretrainedWeights(odd) as w:
        m = nn.Module()
        m.modelx = nn.Module()
        m.modelx.w = nn.Parameter(torch.ones(1))
        assert w.match(m, prefix="model") == MatchReport()


def test_a_mismatch_lists_every_problem_in_one_error(tmp_path: Path) -> None:
    t = _net_tensors()
    t["proj.weight"] = torch.zeros(2, 2)
    t["scale"] = torch.zeros(4)
    del t["proj.bias"]
    t["stray"] = torch.zeros(1)
    _save(tmp_path / "model.safetensors", t)
    with PretrainedWeights(tmp_path) as w, pytest.raises(PretrainedMismatchError) as info:
        w.match(_Net())
    assert str(info.value) == (
        f"the checkpoint in {tmp_path} does not match the model: 2 shape(s) differ: "
        "proj.weight: checkpoint [2, 2] in model.safetensors, model [3, 2]; scale (buffer): "
        "checkpoint [4] in model.safetensors, model [3] | 1 parameter(s) of the model are not in "
        "it: proj.bias | 1 tensor(s) of it are not in the model: stray (model.safetensors) "
        "(nothing was loaded; ignore_mismatched_sizes=True initialises the mismatched ones; "
        "strict=False loads what matches and leaves the rest at a random init)")
    with PretrainedWeights(tmp_path) as w, pytest.raises(PretrainedMismatchError) as info:
        w.match(_Net(), ignore_mismatched_sizes=True)
    assert str(info.value) == (
        f"the checkpoint in {tmp_path} does not match the model: 1 parameter(s) of the model "
        "are not in it: proj.bias | 1 tensor(s) of it are not in the model: stray "
        "(model.safetensors) (nothing was loaded; strict=False loads what matches and "
        "leaves the rest at a random init)")
    with PretrainedWeights(tmp_path) as w, pytest.raises(PretrainedMismatchError) as info:
        w.match(_Net(), strict=False)
    assert str(info.value) == (
        f"the checkpoint in {tmp_path} does not match the model: 2 shape(s) differ: "
        "proj.weight: checkpoint [2, 2] in model.safetensors, model [3, 2]; scale (buffer): "
        "checkpoint [4] in model.safetensors, model [3] (nothing was loaded; "
        "ignore_mismatched_sizes=True initialises the mismatched ones)")


def test_a_lenient_match_warns_and_serves_only_what_matched(tmp_path: Path,
                                                            infinity_log) -> None:
    t = _net_tensors()
    t["proj.weight"] = torch.zeros(2, 2)
    del t["proj.bias"]
    del t["scale"]
    t["stray"] = torch.zeros(1)
    _save(tmp_path / "model.safetensors", t)
    with infinity_log.at_level(logging.INFO, logger="infinity"):
        with PretrainedWeights(tmp_path) as w:
            report = w.match(_Net(), strict=False, ignore_mismatched_sizes=True)
            assert report == MatchReport(
                missing=["proj.bias"], unexpected=["stray"],
                mismatched=["proj.weight: checkpoint [2, 2] in model.safetensors, model [3, 2]"],
                missing_buffers=["scale"])
            assert w.provides("embed.weight") and not w.provides("proj.weight")
            assert not w.provides("proj.bias")
    messages = [(r.levelname, r.getMessage()) for r in infinity_log.records]
    assert messages == [
        ("WARNING", f"{tmp_path}: 1 parameter(s) of another shape keep the model's init: "
                    "proj.weight: checkpoint [2, 2] in model.safetensors, model [3, 2]"),
        ("WARNING", f"{tmp_path}: 1 parameter(s) not in the checkpoint were not loaded and are "
                    "random (the model's init): proj.bias"),
        ("WARNING", f"{tmp_path}: 1 tensor(s) not in the model were not loaded: stray"),
        ("INFO", f"{tmp_path}: buffer(s) not in the checkpoint keep the model's values: scale")]


def test_lists_are_cut_and_ignore_patterns_searched(tmp_path: Path, infinity_log) -> None:
    """An error lists 20 names of each kind, a warning 5, with the full counts; patterns are
    regular expressions searched anywhere in the name."""
    model = nn.Module()
    for i in range(25):
        setattr(model, f"p{i:02d}", nn.Parameter(torch.zeros(1)))
    stray = {f"s{i:02d}": torch.zeros(1) for i in range(25)}
    _save(tmp_path / "model.safetensors", stray)
    with PretrainedWeights(tmp_path) as w, pytest.raises(PretrainedMismatchError) as info:
        w.match(model)
    params = ", ".join(f"p{i:02d}" for i in range(20))
    tensors = ", ".join(f"s{i:02d} (model.safetensors)" for i in range(20))
    assert str(info.value) == (
        f"the checkpoint in {tmp_path} does not match the model: 25 parameter(s) of the model "
        f"are not in it: {params} | 25 tensor(s) of it are not in the model: {tensors} "
        "(nothing was loaded; strict=False loads what matches and leaves the rest at a random "
        "init)")
    with infinity_log.at_level(logging.WARNING, logger="infinity"):
        with PretrainedWeights(tmp_path) as w:
            report = w.match(model, strict=False, ignore_unexpected=[r"0\d$"],
                             ignore_missing=["p1"])
    assert report.unexpected == [f"s{i:02d}" for i in range(10, 25)]
    assert report.missing == [f"p{i:02d}" for i in (*range(10), *range(20, 25))]
    assert [r.getMessage() for r in infinity_log.records] == [
        f"{tmp_path}: 15 parameter(s) not in the checkpoint were not loaded and are random "
        "(the model's init): p00, p01, p02, p03, p04",
        f"{tmp_path}: 15 tensor(s) not in the model were not loaded: s10, s11, s12, s13, s14"]


def test_an_integer_tensor_for_a_floating_parameter_is_refused(tmp_path: Path) -> None:
    _save(tmp_path / "model.safetensors", {"w": torch.arange(3)})
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(3))
    with PretrainedWeights(tmp_path) as w, pytest.raises(PretrainedMismatchError) as info:
        w.match(model)
    assert str(info.value) == (f"w in {tmp_path / 'model.safetensors'} is torch.int64, but the "
                               "model's w is a floating point parameter")


# -- transformers' load-time renamings and fusions -----------------------------------------
def _moe_build(get) -> torch.Tensor:
    """transformers' fusion of two experts' w1 / w3 into one ``gate_up`` (experts, 2 x 2, 3)."""
    return torch.stack([torch.cat([get(f"e{i}.w1"), get(f"e{i}.w3")]) for i in range(2)])


_MOE_PARTS = ("e0.w1", "e0.w3", "e1.w1", "e1.w3")


def _moe_checkpoint(directory: Path, dtype: torch.dtype = F32) -> dict[str, torch.Tensor]:
    """Keys as the Hub saves them (under ``blk.``), the first part alone in b.safetensors (so
    the fused tensor's file is told apart from its second part's); the values by renamed key."""
    values = {k: (torch.arange(6) + 10 * i).reshape(2, 3).to(dtype)
              for i, k in enumerate(_MOE_PARTS)}
    values["norm"] = torch.tensor([1.0, 2.0, 3.0])
    _sharded(directory, {"b.safetensors": {"blk.e0.w1": values["e0.w1"]},
                         "a.safetensors": {f"blk.{k}": v for k, v in values.items()
                                           if k != "e0.w1"}})
    return values


def _unprefixed(key: str) -> str:
    return key.removeprefix("blk.")


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.zeros(2, 4, 3))
        self.norm = nn.Parameter(torch.zeros(3))


def test_renamed_keys_match_the_model_and_two_of_one_name_are_refused(tmp_path: Path) -> None:
    """Keys are matched under the model's names for them, the files keep theirs; two keys
    renamed to one name mean the directory mixes two layouts."""
    t = {"blk.w": torch.ones(2), "blk.b": torch.zeros(2)}
    _save(tmp_path / "model.safetensors", t)
    model = nn.Module()
    model.w, model.b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    with PretrainedWeights(tmp_path) as w:
        assert w.match(model, renamed=_unprefixed) == MatchReport()
        assert sorted(w.names) == ["b", "w"] and w.file_of("w") == tmp_path / "model.safetensors"
        out = torch.empty(2)
        w.fill([("w", 0, out)])
        assert torch.equal(out, torch.ones(2))
    _save(tmp_path / "two" / "model.safetensors", {"a.gamma": torch.ones(2),
                                                   "a.weight": torch.ones(2)})
    with PretrainedWeights(tmp_path / "two") as w, raises_naming(
            PretrainedMismatchError, "two tensors of the checkpoint are the model's a.weight",
            "in model.safetensors", "the directory mixes two layouts; save it again"):
        w.match(model, renamed=lambda k: k.replace("gamma", "weight"))


def test_a_fused_tensor_is_matched_and_filled_from_its_parts(tmp_path: Path) -> None:
    """The fusions are asked with the renamed keys; the fused tensor replaces its parts, in the
    first part's file, with the shape and dtype built on the meta device (nothing allocated);
    its pieces are transformers' fused values, cast, and built once for several pieces."""
    values = _moe_checkpoint(tmp_path)
    fused = _moe_build(values.__getitem__)
    asked: list[list[str]] = []
    devices: list[str] = []

    def build(get) -> torch.Tensor:
        def part(key: str) -> torch.Tensor:
            value = get(key)
            devices.append(value.device.type)
            return value
        return _moe_build(part)

    def fusions(keys):
        asked.append(sorted(keys))
        return {"gate_up": Fusion("gate_up", _MOE_PARTS, build)}

    with PretrainedWeights(tmp_path) as w:
        assert w.match(_Moe(), renamed=_unprefixed, fusions=fusions) == MatchReport()
        assert asked == [sorted([*_MOE_PARTS, "norm"])]
        assert devices == ["meta"] * 4
        assert sorted(w.names) == ["gate_up", "norm"]
        assert w.file_of("gate_up") == tmp_path / "b.safetensors"
        first, second, norm = torch.empty(10, dtype=BF16), torch.empty(9), torch.empty(3)
        w.fill([("gate_up", 5, first), ("norm", 0, norm)])
        assert torch.equal(first, fused.reshape(-1)[5:15].to(BF16))
        assert torch.equal(norm, values["norm"])
        once = w.bytes_read
        assert once == (4 * 6 + 3) * 4            # each part read whole, once
        w.fill([("gate_up", 15, second)])
        assert torch.equal(second, fused.reshape(-1)[15:])
        assert w.bytes_read == once               # kept for the unit's next piece


def test_a_fused_tensor_of_integer_parts_for_a_floating_parameter_is_refused(
        tmp_path: Path) -> None:
    _moe_checkpoint(tmp_path, dtype=torch.int64)
    fusions = {"gate_up": Fusion("gate_up", _MOE_PARTS, _moe_build)}
    with PretrainedWeights(tmp_path) as w, raises_naming(
            PretrainedMismatchError, "gate_up in", "is torch.int64, but the model's gate_up is "
            "a floating point parameter"):
        w.match(_Moe(), renamed=_unprefixed, fusions=lambda keys: fusions)


def test_the_last_two_fused_tensors_are_kept(tmp_path: Path) -> None:
    """FUSED_KEPT = 2: a unit's next piece of either of the last two fused tensors built is
    served without reading their parts again; a third evicts the first built."""
    parts = {f"{t}.{p}": torch.full((4,), float(i)) for i, (t, p) in
             enumerate((t, p) for t in "abc" for p in ("lo", "hi"))}
    _save(tmp_path / "model.safetensors", parts)
    model = nn.Module()
    fusions = {}
    for t in "abc":
        model.register_parameter(t, nn.Parameter(torch.zeros(2, 4)))
        fusions[t] = Fusion(t, (f"{t}.lo", f"{t}.hi"),
                            lambda get, t=t: torch.stack([get(f"{t}.lo"), get(f"{t}.hi")]))
    read = []
    with PretrainedWeights(tmp_path) as w:
        w.match(model, fusions=lambda keys: fusions)
        for t in "abacba":
            before = w.bytes_read
            out = torch.empty(8)
            w.fill([(t, 0, out)])
            assert torch.equal(out, torch.cat([parts[f"{t}.lo"], parts[f"{t}.hi"]]))
            read.append(w.bytes_read - before)
    assert read == [32, 32, 0, 32, 0, 32]


def test_a_fused_buffer_is_loaded_from_its_parts(tmp_path: Path) -> None:
    lo, hi = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    _save(tmp_path / "model.safetensors", {"table.lo": lo, "table.hi": hi})
    model = nn.Module()
    model.register_buffer("table", torch.zeros(2, 2))
    fusion = Fusion("table", ("table.lo", "table.hi"),
                    lambda get: torch.stack([get("table.lo"), get("table.hi")]))
    with PretrainedWeights(tmp_path) as w:
        assert w.match(model, fusions=lambda keys: {"table": fusion}) == MatchReport()
        w.load_buffers(model)
    assert torch.equal(model.table, torch.stack([lo, hi]))


# -- reading -------------------------------------------------------------------------------
def _odd_file(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """bf16 ``h`` of 3 elements then fp32 ``f``: ``f`` starts 6 bytes into the data, not
    aligned to its element size."""
    gen = torch.Generator().manual_seed(0)
    t = {"h": torch.randn(3, generator=gen).to(BF16), "f": torch.randn(2000, generator=gen)}
    return _save(directory / "model.safetensors", t).parent, t


@pytest.mark.parametrize("direct_io", [True, False])
def test_every_read_path_gives_the_files_values(tmp_path: Path, monkeypatch, direct_io) -> None:
    """Reads of a misaligned tensor in pieces, at offsets, cast or not, into a non-contiguous
    target; renamed parameters served under their new names; bytes_read counts each piece."""
    monkeypatch.setattr(pt, "CONVERT_BYTES", 64)
    monkeypatch.setattr(pt, "READ_PIECE_BYTES", 128)
    d, t = _odd_file(tmp_path)
    model = nn.Module()
    model.h = nn.Parameter(torch.zeros(3))
    model.f = nn.Parameter(torch.zeros(2000))
    with PretrainedWeights(d, direct_io=direct_io) as w:
        w.match(model)
        w.rename({"new.f": "f", "new.h": "h", "new.gone": "gone"})
        assert sorted(w._params) == ["new.f", "new.h"]
        out_f = torch.empty(1990)
        out_h = torch.empty(2)
        out_b = torch.empty(100, dtype=BF16)
        strided = torch.empty(100)[::2]
        w.fill([("new.f", 10, out_f), ("new.h", 1, out_h), ("new.f", 7, out_b),
                ("new.f", 0, strided)])
        assert torch.equal(out_f, t["f"][10:])
        assert torch.equal(out_h, t["h"][1:].float())
        assert torch.equal(out_b, t["f"][7:107].to(BF16))
        assert torch.equal(strided, t["f"][:50])
        assert w.bytes_read == 1990 * 4 + 2 * 2 + 100 * 4 + 50 * 4
        w.fill([])
        assert w.bytes_read == 1990 * 4 + 2 * 2 + 100 * 4 + 50 * 4


def test_a_piece_is_cut_by_the_size_of_its_path(tmp_path: Path, monkeypatch) -> None:
    """Direct and ring reads are cut at CONVERT_BYTES, straight ones at READ_PIECE_BYTES."""
    monkeypatch.setattr(pt, "CONVERT_BYTES", 64)
    monkeypatch.setattr(pt, "READ_PIECE_BYTES", 128)
    d, _ = _odd_file(tmp_path)
    with PretrainedWeights(d) as w:
        jobs = w._jobs(w._tensors["f"], 5, torch.empty(40))
        assert [(j[1], j[2], j[4]) for j in jobs] == [(5, 16, "direct"), (21, 16, "direct"),
                                                      (37, 8, "direct")]
    with PretrainedWeights(d, direct_io=False) as w:
        jobs = w._jobs(w._tensors["f"], 0, torch.empty(40))
        assert [(j[1], j[2], j[4]) for j in jobs] == [(0, 32, "straight"), (32, 8, "straight")]
        jobs = w._jobs(w._tensors["f"], 0, torch.empty(40, dtype=BF16))
        assert [(j[1], j[2], j[4]) for j in jobs] == [(0, 16, "ring"), (16, 16, "ring"),
                                                      (32, 8, "ring")]
        jobs = w._jobs(w._tensors["f"], 0, torch.empty(80)[::2])
        assert [(j[2], j[4]) for j in jobs] == [(16, "ring"), (16, "ring"), (8, "ring")]
        assert w._jobs(w._tensors["f"], 0, torch.empty(0)) == []


def test_buffered_reads_drop_their_pages_unless_told(tmp_path: Path, monkeypatch) -> None:
    d, t = _odd_file(tmp_path)
    for drop in (True, False):
        with PretrainedWeights(d, direct_io=False, drop_cache=drop) as w:
            dropped = []
            reader = w._tensors["f"].reader
            monkeypatch.setattr(reader, "drop_cached",
                                lambda name, first, count: dropped.append((name, first, count)))
            w._params = dict(w._tensors)
            out = torch.empty(10)
            w.fill([("f", 3, out)])
            assert torch.equal(out, t["f"][3:13])
            assert dropped == ([("f", 3, 10)] if drop else [])


def test_buffers_are_loaded_into_the_model(tmp_path: Path) -> None:
    _save(tmp_path / "model.safetensors", _net_tensors())
    net = _Net()
    with PretrainedWeights(tmp_path) as w:
        w.match(net)
        w.load_buffers(net)
    assert torch.equal(net.scale, torch.tensor([5.0, 6.0, 7.0]))
    assert torch.equal(net.inv_freq, torch.ones(2))


def test_a_file_that_shrinks_or_fails_while_read_is_reported(tmp_path: Path,
                                                             monkeypatch) -> None:
    """O_DIRECT reads: a file cut short after it was opened is a CheckpointError naming the
    tensor and the byte; an I/O error keeps its errno and says what was read where."""
    d, t = _odd_file(tmp_path)
    path = d / "model.safetensors"
    with PretrainedWeights(d) as w:
        w._params = dict(w._tensors)
        os.truncate(path, 100)
        with pytest.raises(CheckpointError) as info:
            w.fill([("f", 0, torch.empty(2000))])
        assert str(info.value) == (f"{path}: short read of tensor f at byte 100: the file "
                                   "shrank while being read")
    _odd_file(tmp_path)

    def failing(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    with PretrainedWeights(d) as w:
        w._params = dict(w._tensors)
        monkeypatch.setattr(pt.os, "preadv", failing)
        with pytest.raises(OSError) as info:
            w.fill([("f", 0, torch.empty(4))])
        assert info.value.errno == 5
        start = w._tensors["f"].reader.data_start + w._tensors["f"].info.begin
        assert str(info.value) == (f"[Errno 5] reading 4096 bytes at {start - start % 4096} "
                                   f"from {path}: Input/output error")


# -- conversion hints, buffered and direct reads, the match's edges ------------------------------
@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "model.pt", "model.pth"])
def test_each_pickle_suffix_gets_the_conversion_hint(tmp_path: Path, pickle_name: str) -> None:
    (tmp_path / pickle_name).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"It holds pickle files \(pytorch_model\.bin\)"):
        weight_map(tmp_path)


def test_buffered_reads_drop_their_pages_by_default(tmp_path: Path, monkeypatch) -> None:
    d, _ = _odd_file(tmp_path)
    with PretrainedWeights(d, direct_io=False) as w:
        dropped = []
        monkeypatch.setattr(w._tensors["f"].reader, "drop_cached",
                            lambda name, first, count: dropped.append((name, first, count)))
        w._params = dict(w._tensors)
        w.fill([("f", 0, torch.empty(4))])
    assert dropped == [("f", 0, 4)]


class _Two(nn.Module):
    """Parameters a, b, c and persistent buffers x, y, in that order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2))
        self.b = nn.Parameter(torch.zeros(2))
        self.c = nn.Parameter(torch.zeros(2))
        self.register_buffer("x", torch.zeros(2))
        self.register_buffer("y", torch.zeros(2))


def test_the_match_goes_on_past_a_missing_or_mismatched_parameter_or_buffer(
        tmp_path: Path) -> None:
    """a missing, b of another shape, c matched; buffer x missing, y matched: c and y are still
    served (a ``break`` at the first problem left them out)."""
    _save(tmp_path / "model.safetensors", {"b": torch.zeros(3), "c": torch.ones(2),
                                           "y": torch.ones(2)})
    with PretrainedWeights(tmp_path) as w:
        report = w.match(_Two(), strict=False, ignore_mismatched_sizes=True)
        assert report.missing == ["a"] and report.missing_buffers == ["x"]
        assert w.provides("c") and sorted(w._buffers) == ["y"]
    _save(tmp_path / "m2" / "model.safetensors", {"a": torch.zeros(2), "b": torch.zeros(2),
                                                  "c": torch.ones(2), "x": torch.zeros(3),
                                                  "y": torch.ones(2)})
    with PretrainedWeights(tmp_path / "m2") as w:
        report = w.match(_Two(), ignore_mismatched_sizes=True)
        assert report.mismatched == ["x (buffer): checkpoint [3] in model.safetensors, model [2]"]
        assert sorted(w._buffers) == ["y"]


def test_a_strict_error_with_only_missing_parameters_names_the_fix(tmp_path: Path) -> None:
    _save(tmp_path / "model.safetensors", {"b": torch.zeros(2), "c": torch.zeros(2),
                                           "x": torch.zeros(2), "y": torch.zeros(2)})
    with PretrainedWeights(tmp_path) as w, pytest.raises(PretrainedMismatchError) as info:
        w.match(_Two())
    assert str(info.value).endswith("(nothing was loaded; strict=False loads what matches and "
                                    "leaves the rest at a random init)")


def test_warnings_list_five_of_each(tmp_path: Path, infinity_log) -> None:
    model = nn.Module()
    tensors = {}
    for i in range(7):
        setattr(model, f"p{i}", nn.Parameter(torch.zeros(2)))
        tensors[f"p{i}"] = torch.zeros(3)
        model.register_buffer(f"b{i}", torch.zeros(1))
    _save(tmp_path / "model.safetensors", tensors)
    with infinity_log.at_level(logging.INFO, logger="infinity"):
        with PretrainedWeights(tmp_path) as w:
            w.match(model, strict=False, ignore_mismatched_sizes=True)
    shapes = "; ".join(f"p{i}: checkpoint [3] in model.safetensors, model [2]" for i in range(5))
    assert [r.getMessage() for r in infinity_log.records] == [
        f"{tmp_path}: 7 parameter(s) of another shape keep the model's init: {shapes}",
        f"{tmp_path}: buffer(s) not in the checkpoint keep the model's values: b0, b1, b2, b3, "
        "b4"]


def test_an_integer_buffer_is_loaded_exactly(tmp_path: Path) -> None:
    """Read in its own dtype (not through float32, which holds 2**24 + 1 no more)."""
    big = torch.tensor([2**40 + 1, -3])
    _save(tmp_path / "model.safetensors", {"steps": big})
    model = nn.Module()
    model.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    with PretrainedWeights(tmp_path) as w:
        w.match(model)
        w.load_buffers(model)
    assert torch.equal(model.steps, big)


def test_a_shared_non_persistent_buffer_saved_under_both_names_is_not_unexpected(
        tmp_path: Path) -> None:
    model = nn.Module()
    model.one, model.two = nn.Module(), nn.Module()
    shared = torch.ones(2)
    model.one.register_buffer("inv_freq", shared, persistent=False)
    model.two.register_buffer("inv_freq", shared, persistent=False)
    _save(tmp_path / "model.safetensors", {"one.inv_freq": torch.ones(2),
                                           "two.inv_freq": torch.ones(2)})
    with PretrainedWeights(tmp_path) as w:
        assert w.match(model) == MatchReport()


def test_the_ring_buffers_are_not_pinned(tmp_path: Path, monkeypatch) -> None:
    """They are host staging for host units: page-locking 3 x 16 MiB would buy nothing."""
    calls = []
    real = pt.aligned_empty

    def spy(nbytes, *args, **kwargs):
        calls.append(kwargs)
        return real(nbytes, *args, **kwargs)

    monkeypatch.setattr(pt, "aligned_empty", spy)
    d, _ = _odd_file(tmp_path)
    with PretrainedWeights(d, direct_io=False) as w:
        w._params = dict(w._tensors)
        w.fill([("f", 0, torch.empty(4, dtype=BF16))])
    assert calls == [{"pin": False}] * pt.RING


def _misaligned(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Written in the order given (infinity's writer): bf16 ``h`` of 3 elements then fp32
    ``f``, which starts 6 bytes after ``h``: not aligned to its element size."""
    gen = torch.Generator().manual_seed(1)
    t = {"h": torch.randn(3, generator=gen).to(BF16), "f": torch.randn(3000, generator=gen)}
    directory.mkdir(parents=True, exist_ok=True)
    writer = TensorFileWriter(directory / "model.safetensors",
                              [(n, v.dtype, tuple(v.shape)) for n, v in t.items()])
    for n, v in t.items():
        writer.append(n, v)
    writer.close()
    return directory, t


def test_direct_reads_of_a_misaligned_tensor_in_partial_reads(tmp_path: Path,
                                                              monkeypatch) -> None:
    """O_DIRECT reads that come back 4 KiB at a time (the loop adds them up), of a tensor not
    aligned to its element size (copied out of the buffer before the view), at an offset past
    the first block; an error there names the bytes asked and where."""
    d, t = _misaligned(tmp_path)
    real = os.preadv

    def partial(fd, buffers, offset):
        return real(fd, [buffers[0][:4096]], offset)

    monkeypatch.setattr(pt.os, "preadv", partial)
    with PretrainedWeights(d) as w:
        w._params = dict(w._tensors)
        out = torch.empty(2000)
        w.fill([("f", 1000, out)])
        assert torch.equal(out, t["f"][1000:])
        info = w._tensors["f"].info
        assert (w._tensors["f"].reader.data_start + info.begin) % 4 != 0
        w.close()
        w.close()
    with PretrainedWeights(d) as w:
        w._params = dict(w._tensors)
        monkeypatch.setattr(pt.os, "preadv", lambda fd, b, off: (_ for _ in ()).throw(
            OSError(5, "Input/output error")))
        with pytest.raises(OSError) as info:
            w.fill([("f", 2000, torch.empty(4))])
        start = w._tensors["f"].reader.data_start + w._tensors["f"].info.begin + 2000 * 4
        a0 = start - start % 4096
        a1 = -(-(start + 16) // 4096) * 4096
        assert str(info.value) == (f"[Errno 5] reading {a1 - a0} bytes at {a0} from "
                                   f"{d / 'model.safetensors'}: Input/output error")
        assert a0 > 0


def test_a_model_name_outside_the_prefix_is_kept(tmp_path: Path) -> None:
    """A base model's checkpoint that also holds the head's own ``extra.weight``: the model's
    names under the prefix lose it, the head's keep theirs."""
    t = _net_tensors()
    t["extra.weight"] = torch.full((1, 1), 3.0)
    _save(tmp_path / "model.safetensors", t)
    with PretrainedWeights(tmp_path) as w:
        assert w.match(_Wrapped(), prefix="model") == MatchReport()
        assert w.provides("extra.weight") and w.provides("model.proj.bias")


def test_the_reader_runs_ring_minus_one_pieces_ahead(tmp_path: Path, monkeypatch) -> None:
    """With RING = 3 buffers, two reads are submitted before the first copy waits, then one
    more after each: the order of submits and waits, through an executor that runs each read
    at once (no timing)."""
    monkeypatch.setattr(pt, "CONVERT_BYTES", 64)
    d, t = _odd_file(tmp_path)
    events: list[str] = []

    class _Done:
        def __init__(self, value):
            self.value = value

        def result(self):
            events.append("wait")
            return self.value

        def exception(self):
            return None

    class _Executor:
        def submit(self, fn, *args):
            events.append("read")
            return _Done(fn(*args))

        def shutdown(self, wait=True):
            pass

    with PretrainedWeights(d, direct_io=False) as w:
        w._params = dict(w._tensors)
        w.fill([("f", 0, torch.empty(1, dtype=BF16))])       # makes the ring
        w._reader = _Executor()
        out = torch.empty(64, dtype=BF16)                     # 4 pieces of 16
        w.fill([("f", 0, out)])
    assert torch.equal(out, t["f"][:64].to(BF16))
    assert events == ["read", "read", "wait", "read", "wait", "read", "wait", "wait"]


def test_a_direct_read_whose_last_piece_is_one_byte_is_whole(tmp_path: Path,
                                                              monkeypatch) -> None:
    """A file ending 1 byte past a block boundary, read 4 KiB at a time: the last preadv
    returns that 1 byte, which is data, not a short read."""
    def write(nbytes: int) -> Path:
        return _save(tmp_path / "model.safetensors",
                     {"u": torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)})

    path = write(5000)
    with PretrainedWeights(tmp_path) as w:
        data_start = w._tensors["u"].reader.data_start + w._tensors["u"].info.begin
    nbytes = 2 * 4096 + 1 - data_start
    path = write(nbytes)
    assert path.stat().st_size == 2 * 4096 + 1
    real = os.preadv
    sizes = []

    def partial(fd, buffers, offset):
        n = real(fd, [buffers[0][:4096]], offset)
        sizes.append(n)
        return n

    monkeypatch.setattr(pt.os, "preadv", partial)
    with PretrainedWeights(tmp_path) as w:
        w._params = dict(w._tensors)
        out = torch.empty(nbytes, dtype=torch.uint8)
        w.fill([("u", 0, out)])
    assert sizes[-1] == 1
    assert torch.equal(out, torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))


def test_the_reads_run_on_one_named_helper_thread_that_close_ends(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The first read waits until the second is submitted: one reader runs them in turn (a
    second worker would take the second at once), on a thread named pretrained-read that
    close() shuts down and waits for."""
    monkeypatch.setattr(pt, "CONVERT_BYTES", 64)
    d, t = _odd_file(tmp_path)
    threads: list[threading.Thread] = []
    second_submitted = threading.Event()
    shutdowns: list[bool] = []

    class _Recording(pt.ThreadPoolExecutor):
        submitted = 0

        def submit(self, fn, *args):
            self.submitted += 1
            n = self.submitted

            def read():
                threads.append(threading.current_thread())
                if n == 1:
                    assert second_submitted.wait(30)      # set at once by the caller
                return fn(*args)
            future = super().submit(read)
            if n == 2:
                second_submitted.set()
            return future

        def shutdown(self, wait=True, **kwargs):
            shutdowns.append(wait)
            super().shutdown(wait, **kwargs)

    monkeypatch.setattr(pt, "ThreadPoolExecutor", _Recording)
    w = PretrainedWeights(d)
    w._params = dict(w._tensors)
    out = torch.empty(64)                             # 4 pieces of 16
    w.fill([("f", 0, out)])
    assert torch.equal(out, t["f"][:64])
    assert len(threads) == 4 and len(set(threads)) == 1
    assert threads[0].name.startswith("pretrained-read")
    w.close()
    assert shutdowns == [True] and not threads[0].is_alive()       # joined, not left to exit


def test_direct_reads_ask_for_the_aligned_blocks_around_a_piece_only(tmp_path: Path,
                                                                     monkeypatch) -> None:
    d, t = _misaligned(tmp_path)
    real = os.preadv
    asked = []

    def recording(fd, buffers, offset):
        asked.append((offset, len(buffers[0])))
        return real(fd, buffers, offset)

    monkeypatch.setattr(pt.os, "preadv", recording)
    with PretrainedWeights(d) as w:
        w._params = dict(w._tensors)
        out = torch.empty(10)
        w.fill([("f", 2000, out)])
        start = w._tensors["f"].reader.data_start + w._tensors["f"].info.begin + 2000 * 4
    assert torch.equal(out, t["f"][2000:2010])
    a0 = start - start % 4096
    assert a0 > 0 and asked == [(a0, -(-(start + 40) // 4096) * 4096 - a0)]


def test_an_element_larger_than_a_read_buffer_is_read_one_at_a_time(tmp_path: Path,
                                                                    monkeypatch) -> None:
    """CONVERT_BYTES below an element's size: each piece is one element, not none."""
    monkeypatch.setattr(pt, "CONVERT_BYTES", 2)
    d, t = _odd_file(tmp_path)
    with PretrainedWeights(d) as w:
        w._params = dict(w._tensors)
        assert [(j[1], j[2]) for j in w._jobs(w._tensors["f"], 4, torch.empty(3))] == [
            (4, 1), (5, 1), (6, 1)]
        out = torch.empty(3, dtype=BF16)
        w.fill([("f", 4, out)])
    assert torch.equal(out, t["f"][4:7].to(BF16))


def test_a_contiguous_target_of_any_shape_is_filled_in_element_order(tmp_path: Path,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(pt, "CONVERT_BYTES", 64)
    d, t = _odd_file(tmp_path)
    with PretrainedWeights(d) as w:
        w._params = dict(w._tensors)
        out = torch.empty(4, 10)
        w.fill([("f", 3, out)])
    assert torch.equal(out, t["f"][3:43].reshape(4, 10))


def test_modules_transformers_keeps_in_fp32_are_named_when_a_16_bit_engine_rounds_them(
        infinity_log) -> None:
    """``_keep_in_fp32_modules_strict`` (a MoE router's gate) in bf16 and fp16,
    ``_keep_in_fp32_modules`` in fp16 only; fp32 compute says nothing."""
    import torch
    from torch import nn

    from infinity.engine.pretrained import _warn_fp32_modules_rounded

    class Router(nn.Module):
        _keep_in_fp32_modules_strict = ["gate.weight"]
        _keep_in_fp32_modules = ["norm"]

        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(4, 2, bias=False)
            self.gates = nn.Linear(4, 2, bias=False)     # not "gate": kept out
            self.norm = nn.LayerNorm(4)

    _warn_fp32_modules_rounded(Router(), torch.float32)
    assert "fp32 when transformers" not in infinity_log.text
    _warn_fp32_modules_rounded(Router(), torch.bfloat16)
    assert "keeps ['gate.weight'] in fp32 when transformers loads it in bf16" in infinity_log.text
    assert "1 parameter(s) (e.g. gate.weight)" in infinity_log.text
    infinity_log.clear()
    _warn_fp32_modules_rounded(Router(), torch.float16)
    assert "3 parameter(s)" in infinity_log.text      # gate.weight, norm.weight, norm.bias
