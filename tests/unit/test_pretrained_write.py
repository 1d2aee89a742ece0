"""checkpoint/pretrained_write.py at unit level: transformers' weight
layout written from an engine (``save_pretrained``, on a TrainingState of real Units) and from a
checkpoint (``export_pretrained``, on real tensor files), and the pieces under them -- sizes,
dtypes, shard plans and names, the sharded writer's index, stale files and aborts, the model's
text files and the files carried over, tied parameters' names. test_pretrained_files.py covers
the round trip; only the engine's integration tests reached the two entry points before."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from fakes import failing_on_call, recording_training_state
from messages import raises_naming
from safetensors import safe_open
from torch import nn

from infinity.base.budget import MemoryBudget
from infinity.checkpoint import pretrained_write as pw
from infinity.checkpoint import sharded_writer as sw
from infinity.checkpoint.directory import FORMAT, MANIFEST, VERSION
from infinity.checkpoint.layout import UnitLayout
from infinity.checkpoint import weights_dir
from infinity.checkpoint.pretrained_write import (
    config_with_dtype,
    export_pretrained,
    hub_table,
    out_dtype,
    save_pretrained,
    saved_names,
    shard_bytes,
)
from infinity.checkpoint.sharded_writer import (
    CARRIED_FILES,
    ShardedWriter,
    plan_shards,
    shard_names,
    write_model_files,
    write_text,
    write_weights,
)
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileWriter
from infinity.checkpoint.training_state import TrainingState
from infinity.checkpoint.unit_io import ChunkPool
from infinity.config.aio import AioConfig
from infinity.io.buffers import aligned_empty
from infinity.optim.records import UnitOptimState
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.tiers import Tier
from infinity.zero.unit import Unit

F32, BF16 = torch.float32, torch.bfloat16


def _load(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _metadata(file: Path) -> dict:
    with safe_open(str(file), "pt") as f:
        return f.metadata()


# -- sizes, dtypes, plans ------------------------------------------------------------------
def test_shard_sizes_units_and_boundaries() -> None:
    """Every unit of the table, fractions, bare numbers and bytes; 1 byte is the smallest size."""
    assert shard_bytes("100") == 100 and shard_bytes("10B") == 10 and shard_bytes(1) == 1
    assert shard_bytes("1.5GB") == 1_500_000_000 and shard_bytes("2kib") == 2048
    assert shard_bytes("3TB") == 3 * 10**12 and shard_bytes("1TiB") == 1 << 40
    assert shard_bytes("7MB") == 7 * 10**6 and shard_bytes("1GiB") == 1 << 30
    assert shard_bytes("5KB") == 5000


def test_shard_size_errors_name_the_value() -> None:
    """The three refusals, whole: a string that is no size (an "I" without its "B" is none), a
    type that is none (a bool is no int here), a size of 0."""
    for bad in ("5IB", "5KI", "5 parsecs"):
        with pytest.raises(ValueError) as info:
            shard_bytes(bad)
        assert str(info.value) == (f"max_shard_size {bad!r}: expected bytes or a size like "
                                   "\"5GB\" or \"500MiB\"")
    for bad in (True, 2.0, None):
        with pytest.raises(TypeError) as info:
            shard_bytes(bad)
        assert str(info.value) == ("max_shard_size must be an int or a string like \"5GB\", "
                                   f"got {type(bad).__name__}")
    for bad in (0, "0GB", -3):
        with pytest.raises(ValueError) as info:
            shard_bytes(bad)
        assert str(info.value) == f"max_shard_size {bad!r} must be positive"


def test_out_dtypes_by_every_name_and_the_refusal() -> None:
    for name, dtype in (("FP32", F32), ("float32", F32), ("BF16", BF16), ("bfloat16", BF16),
                        ("fp16", torch.float16), ("Torch.Float16", torch.float16)):
        assert out_dtype(name, F32 if dtype is not F32 else BF16) is dtype, name
    assert out_dtype(torch.float16, F32) is torch.float16
    assert out_dtype(torch.float32, BF16) is torch.float32
    for bad in (torch.float64, torch.int8, 16, "int8"):
        with pytest.raises(ValueError) as info:
            out_dtype(bad, F32)
        assert str(info.value) == (f"dtype {bad!r}: expected one of fp32, bf16, fp16 (or the "
                                   "torch dtypes)")


def test_plans_count_every_dimension_and_keep_a_large_first_tensor_alone() -> None:
    """A tensor's bytes are its itemsize times every dimension; a tensor larger than the size
    opens the first shard (no empty shard before it); a shard filled exactly stays one."""
    table = [("m", F32, (4, 5)), ("n", BF16, (10,))]
    assert plan_shards(table, 100) == [table]                  # 80 + 20 = 100: exactly full
    assert plan_shards(table, 99) == [[table[0]], [table[1]]]
    assert plan_shards([("big", F32, (100,))], 8) == [[("big", F32, (100,))]]
    assert plan_shards([("s", F32, ())], 4) == [[("s", F32, ())]]
    assert plan_shards([("s", F32, ()), ("t", F32, ())], 4) == [[("s", F32, ())],
                                                                 [("t", F32, ())]]
    assert plan_shards([], 10) == [[]]
    # a later shard starts empty too: 40 + 60 fill it exactly
    later = [("x", F32, (25,)), ("y", F32, (10,)), ("z", F32, (15,))]
    assert plan_shards(later, 100) == [[later[0]], [later[1], later[2]]]


def test_shard_names_of_one_and_of_several() -> None:
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(2) == ["model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors"]


# -- the sharded writer --------------------------------------------------------------------
def _table(tensors: dict[str, torch.Tensor]):
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def test_the_writer_maps_each_tensor_to_its_file_and_indexes_them(tmp_path: Path) -> None:
    """file_of, total and the index's text (sorted weight_map, total_size, indent 2, newline);
    the directory is made with its parents; each file has {"format": "pt"}."""
    tensors = {"z": torch.ones(10), "a": torch.full((3, 2), 2.0), "m": torch.arange(5)}
    out = tmp_path / "x" / "y"
    writer = ShardedWriter(out, _table(tensors), 64)
    assert writer.file_of == {"z": "model-00001-of-00002.safetensors",
                              "a": "model-00001-of-00002.safetensors",
                              "m": "model-00002-of-00002.safetensors"}
    assert writer.total == 40 + 24 + 40
    for name, value in tensors.items():
        writer.append(name, value.reshape(-1))
    files = writer.close()
    assert files == [out / "model-00001-of-00002.safetensors",
                     out / "model-00002-of-00002.safetensors"]
    body = {"metadata": {"total_size": 104},
            "weight_map": {"a": "model-00001-of-00002.safetensors",
                           "m": "model-00002-of-00002.safetensors",
                           "z": "model-00001-of-00002.safetensors"}}
    assert (out / "model.safetensors.index.json").read_text() == json.dumps(body, indent=2) + "\n"
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors",
                                                      "model.safetensors.index.json"]
    for f in files:
        assert _metadata(f) == {"format": "pt"}
    back = _load(out)
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_tensor_too_many_is_refused_naming_it(tmp_path: Path) -> None:
    writer = ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    writer.append("a", torch.zeros(2))
    with pytest.raises(ValueError) as info:
        writer.append("b", torch.zeros(1))
    assert str(info.value) == f"{tmp_path}: every tensor is written; got more for b"
    writer.close()
    assert list(_load(tmp_path)) == ["a"]


def test_an_unfinished_write_is_refused_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """close() before the last tensor: the error names the directory, every partial file goes
    (the finished first shard's too), nothing is renamed into place."""
    table = [("a", F32, (10,)), ("b", F32, (10,)), ("c", F32, (10,))]
    writer = ShardedWriter(tmp_path, table, 40)
    writer.append("a", torch.zeros(10))
    writer.append("b", torch.zeros(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == [       # the save lock held meanwhile
        ".infinity-save.lock", ".model-00001-of-00003.safetensors.partial",
        ".model-00002-of-00003.safetensors.partial"]
    with pytest.raises(ValueError) as info:
        writer.close()
    assert str(info.value) == f"{tmp_path}: not every tensor was written"
    assert list(tmp_path.iterdir()) == []
    # every tensor appended but the writer of the last shard not closed yet is complete too
    writer = ShardedWriter(tmp_path, [("a", F32, (10,))], 40)
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_close_then_abort_is_harmless(tmp_path: Path) -> None:
    """save_pretrained aborts the writer when anything fails, close() included, which has
    aborted it already: the second abort must not raise over the first error."""
    writer = ShardedWriter(tmp_path, [("a", F32, (10,)), ("b", F32, (10,))], 40)
    writer.append("a", torch.zeros(3))
    with pytest.raises(ValueError, match="not every tensor"):
        writer.close()
    writer.abort()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_stale_file_removed_meanwhile_is_no_error(tmp_path: Path, monkeypatch) -> None:
    """An earlier save's shard that is gone by the time close() removes it (another cleaner)
    is not an error."""
    monkeypatch.setattr(weights_dir, "weight_files",
                        lambda d: {"model-00001-of-00009.safetensors", "model.safetensors"})
    writer = ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    writer.append("a", torch.ones(2))
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_shards_of_empty_tensors_only_are_written_whole(tmp_path: Path) -> None:
    """A shard holding only empty tensors is complete when opened: it is closed and the writer
    goes on to the next shard, whose tensors then arrive."""
    table = [("e", F32, (0,)), ("f", F32, (0, 3)), ("a", F32, (30,)), ("g", F32, (0,))]
    writer = ShardedWriter(tmp_path, table, 0 + 1)      # every tensor its own shard or with empties
    writer.append("a", torch.arange(30.0))
    files = writer.close()
    back = _load(tmp_path)
    assert [f.name for f in files] == shard_names(len(writer.plan))
    assert sorted(back) == ["a", "e", "f", "g"] and back["f"].shape == (0, 3)
    assert torch.equal(back["a"], torch.arange(30.0))
    only_empty = tmp_path / "empty"
    files = ShardedWriter(only_empty, [("e", F32, (0,))], 10).close()
    assert files == [only_empty / "model.safetensors"]
    assert _load(only_empty)["e"].shape == (0,)


def test_a_stale_partial_file_is_replaced(tmp_path: Path) -> None:
    """A partial file left by a killed save, even a symlink, is removed before the new one."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (tmp_path / ".model.safetensors.partial").symlink_to(target)
    writer = ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    writer.append("a", torch.ones(2))
    writer.close()
    assert target.read_bytes() == b"keep"
    assert torch.equal(_load(tmp_path)["a"], torch.ones(2))


def test_a_single_file_save_removes_an_earlier_index_and_its_shards(tmp_path: Path) -> None:
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "model-1-of-2.safetensors", "notes.txt",
                 "model-deadbeef.safetensors", "model-20240101.safetensors"):
        (tmp_path / name).write_text("old")
    writer = ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    writer.append("a", torch.ones(2))
    writer.close()
    # a user's files of names a save never writes stay (a token alone, without a shard
    # suffix, was taken for an earlier save's shard and removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-1-of-2.safetensors", "model-20240101.safetensors", "model-deadbeef.safetensors",
        "model.safetensors", "notes.txt"]


def test_files_and_the_directory_are_fsynced(tmp_path: Path, monkeypatch) -> None:
    """write_text fsyncs the text before its rename, and close() fsyncs the directory (the
    module's ``os`` replaced by a proxy that records what each fsync was given)."""
    synced: list[str] = []
    real_os = weights_dir.os

    class _Os:
        def __getattr__(self, name):
            return getattr(real_os, name)

        @staticmethod
        def fsync(fd):
            synced.append(Path(f"/proc/self/fd/{fd}").resolve().name)
            return real_os.fsync(fd)

    monkeypatch.setattr(weights_dir, "os", _Os())
    write_text(tmp_path / "config.json", "{}\n")
    assert synced == [".config.json.partial"]
    assert (tmp_path / "config.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    synced.clear()
    writer = ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    writer.append("a", torch.ones(2))
    writer.close()
    assert synced and set(synced) == {tmp_path.name}     # after the commit and the removals


def test_a_writer_under_another_single_name_renames_its_file_into_place(tmp_path: Path) -> None:
    """``single_name`` other than model.safetensors: the one file is renamed into place under
    it (returned, fsynced with the directory), no index is written, and an earlier
    model.safetensors beside it is left alone (it is no file of this save)."""
    (tmp_path / "model.safetensors").write_text("base")
    writer = ShardedWriter(tmp_path, [("a", F32, (2,)), ("b", F32, (3,))], 100,
                           single_name="adapter_model.safetensors")
    writer.append("a", torch.ones(2))
    writer.append("b", torch.arange(3.0))
    assert writer.close() == [tmp_path / "adapter_model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_model.safetensors",
                                                          "model.safetensors"]
    assert (tmp_path / "model.safetensors").read_text() == "base"
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("a"), torch.ones(2))
        assert torch.equal(f.get_tensor("b"), torch.arange(3.0))


def test_a_writer_closed_after_its_abort_commits_nothing(tmp_path: Path) -> None:
    """abort() then close(): refused as unfinished, and nothing (not even the finished first
    shard) is renamed into place."""
    writer = ShardedWriter(tmp_path, [("a", F32, (2,)), ("b", F32, (2,))], 8)
    writer.append("a", torch.ones(2))
    writer.abort()
    with raises_naming(ValueError, str(tmp_path), "not every tensor was written"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_writer_removes_stale_partials_of_other_names_first(tmp_path: Path) -> None:
    """The hidden file of an earlier save that did not finish, under a name this save does not
    use, is removed when the writer opens (under its lock), not left behind."""
    stale = tmp_path / ".model-00002-of-00002.safetensors.partial"
    stale.write_bytes(b"old")
    writer = ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    assert not stale.exists()
    writer.append("a", torch.ones(2))
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_failure_while_the_writer_opens_releases_its_lock(tmp_path: Path,
                                                            monkeypatch) -> None:
    """An error before the shard names are known is the one raised (the abort that follows
    does not raise over it), and the save lock is released: the next writer opens."""
    monkeypatch.setattr(sw, "remove_stale_partials",
                        lambda d: (_ for _ in ()).throw(OSError(errno.EIO, "scan failed")))
    with pytest.raises(OSError, match="scan failed"):
        ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    writer = ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    writer.append("a", torch.ones(2))
    writer.close()
    assert torch.equal(_load(tmp_path)["a"], torch.ones(2))


# -- room on the disk and unwritable directories -------------------------------------------
def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(sw, "free_bytes", lambda directory: free)


def test_a_save_needs_room_for_its_weights_and_a_header_reserve(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """The room asked for before anything is written: the weights' bytes plus a header reserve
    of 4 KiB per file and 128 bytes per tensor. Exactly that much free is enough; a byte less
    is refused (ENOSPC) naming the directory, both sizes and the fix, leaving nothing there."""
    table = [("a", F32, (2,)), ("b", F32, (2,)), ("c", F32, (4,))]   # files [a, b] and [c]
    need = 32 + 2 * 4096 + 3 * 128
    _free(monkeypatch, need - 1)
    with raises_naming(OSError, f"[Errno {errno.ENOSPC}] save into {tmp_path} needs "
                       f"{sw.format_bytes(need)}",
                       f"disk has {sw.format_bytes(need - 1)} free",
                       "nothing was written and the earlier save there is unchanged: free "
                       "space or choose another directory", starts=True, ends=True) as info:
        ShardedWriter(tmp_path, table, 16)
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
    _free(monkeypatch, need)
    writer = ShardedWriter(tmp_path, table, 16)
    for name, _, shape in table:
        writer.append(name, torch.ones(shape))
    assert len(writer.close()) == 2


def test_the_room_refusal_names_the_call_that_saves(tmp_path: Path, monkeypatch) -> None:
    """write_weights, save_pretrained and an export each say who wanted the room ("save" by
    default)."""
    _free(monkeypatch, 0)
    with raises_naming(OSError, f"] save into {tmp_path / 'w'} needs"):
        write_weights(tmp_path / "w", [("a", F32, (2,))], 100, lambda writer: None)
    with raises_naming(OSError, f"] save_pretrained into {tmp_path / 's'} needs"):
        save_pretrained(_state(_Model()), tmp_path / "s")
    _checkpoint(tmp_path / "ck")
    with raises_naming(OSError, f"] export into {tmp_path / 'e'} needs"):
        export_pretrained(tmp_path / "ck", tmp_path / "e")


def test_a_disk_that_fills_up_during_a_save_says_so(tmp_path: Path, monkeypatch) -> None:
    """ENOSPC or EDQUOT from the writing: the partial files are removed and the error (errno
    kept) names the call, the directory, the bytes needed and free, and the fix; any other
    error goes through as it was."""
    _free(monkeypatch, 10**9)
    table = [("a", F32, (10,)), ("b", F32, (10,))]

    def filling(exc: BaseException):
        def fill(writer) -> None:
            writer.append("a", torch.ones(10))
            raise exc
        return fill

    for code in (errno.ENOSPC, errno.EDQUOT):
        with raises_naming(OSError, f"[Errno {code}] export into {tmp_path}: the disk filled up "
                           "while writing "
                           f"({os.strerror(code)}; {sw.format_bytes(80)} needed, "
                           f"{sw.format_bytes(10**9)} free now that the partial files are "
                           "removed); the earlier save there is unchanged: free space or "
                           "choose another directory", starts=True, ends=True) as info:
            write_weights(tmp_path, table, 40, filling(OSError(code, os.strerror(code))),
                          what="export")
        assert info.value.errno == code
        assert list(tmp_path.iterdir()) == []
    with raises_naming(OSError, "] save into", "the disk filled up"):
        write_weights(tmp_path, table, 40, filling(OSError(errno.ENOSPC, "full")))
    for other in (OSError(errno.EIO, "bad block"), ValueError("not a disk error")):
        with pytest.raises(type(other)) as info:
            write_weights(tmp_path, table, 40, filling(other))
        assert info.value is other
        assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_be_made_is_refused_naming_it(tmp_path: Path) -> None:
    """A parent that is a file: the errno of mkdir, the call, the directory, the reason, the
    fix."""
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "out"
    with raises_naming(OSError, f"[Errno {errno.ENOTDIR}] export: cannot create {target}: "
                       f"{os.strerror(errno.ENOTDIR)}; choose a writable directory",
                       starts=True, ends=True) as info:
        ShardedWriter(target, [("a", F32, (2,))], 100, what="export")
    assert info.value.errno == errno.ENOTDIR


def test_a_directory_that_is_not_writable_is_refused(tmp_path: Path, monkeypatch) -> None:
    """Writing and entering are both needed (asked of os.access; the test runs as any user,
    root included, so the answer is the proxy's: no write permission)."""
    asked: list[int] = []
    real_os = sw.os

    class _Os:
        def __getattr__(self, name):
            return getattr(real_os, name)

        @staticmethod
        def access(path, mode):
            asked.append(mode)
            return not mode & real_os.W_OK and real_os.access(path, mode)

    monkeypatch.setattr(sw, "os", _Os())
    with raises_naming(PermissionError, f"save: {tmp_path} is not writable; choose another "
                       "directory or fix its permissions", starts=True, ends=True):
        ShardedWriter(tmp_path, [("a", F32, (2,))], 100)
    assert asked == [os.W_OK | os.X_OK]
    assert list(tmp_path.iterdir()) == []


# -- text files and names ------------------------------------------------------------------
def test_model_files_are_written_and_the_source_directorys_carried(tmp_path: Path) -> None:
    """texts are written; from the source directory the CARRIED_FILES it has (files only) that
    texts does not hold; nothing else, and nothing when the source is the directory itself."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("tokenizer.json", "vocab.txt", "generation_config.json", "other.json",
                 "config.json"):
        (src / name).write_text(f"src {name}")
    (src / "merges.txt").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    write_model_files(out, {"config.json": "cfg", "generation_config.json": "gen"}, src)
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "config.json": "cfg", "generation_config.json": "gen",
        "tokenizer.json": "src tokenizer.json", "vocab.txt": "src vocab.txt"}
    assert "tokenizer.json" in CARRIED_FILES and "vocab.txt" in CARRIED_FILES
    plain = tmp_path / "plain"
    plain.mkdir()
    write_model_files(plain, {"config.json": "c"}, None)
    assert [p.name for p in plain.iterdir()] == ["config.json"]
    (src / "config.json").write_text("old")
    write_model_files(src, {"config.json": "new"}, str(src))
    assert (src / "config.json").read_text() == "new"
    assert (src / "tokenizer.json").read_text() == "src tokenizer.json"


def test_a_tied_parameter_is_saved_under_the_name_transformers_keeps() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.head = nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    model.other = nn.Linear(2, 2, bias=False)
    for owner in ("embed.weight", "head.weight"):
        unit = Unit(0, "u", model, [(owner, model.embed.weight, 0),
                                    ("other.weight", model.other.weight, 0)], F32,
                    torch.device("cpu"))
        lay = UnitLayout(unit, None)
        e, o = lay.entries
        assert saved_names(model, [lay], {"head.weight"}) == {e: "embed.weight",
                                                              o: "other.weight"}
        assert saved_names(model, [lay], {"embed.weight"}) == {e: "head.weight",
                                                               o: "other.weight"}
        assert saved_names(model, [lay]) == {e: owner, o: "other.weight"}
        # every name a target: the entry's own
        assert saved_names(model, [lay], {"head.weight", "embed.weight"})[e] == owner


def test_config_dtype_errors_and_text() -> None:
    with pytest.raises(ValueError) as info:
        config_with_dtype("{nope", F32)
    assert str(info.value).startswith("config.json is not valid JSON (Expecting property name")
    with pytest.raises(ValueError) as info:
        config_with_dtype("[1]", F32)
    assert str(info.value) == "config.json is not a JSON object"
    assert config_with_dtype('{"b": 1, "a": 2}', torch.float16) == (
        '{\n  "a": 2,\n  "b": 1,\n  "dtype": "float16"\n}\n')


# -- from an engine ------------------------------------------------------------------------
class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.b = nn.Parameter(torch.arange(4.0) + 100)
        self.frozen = nn.Parameter(torch.full((5,), -1.0), requires_grad=False)
        self.register_buffer("running", torch.tensor([1.5, 2.5]))
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


class _Comm:
    def __init__(self, rank: int, world_size: int = 2, others=None) -> None:
        self.rank, self.world_size = rank, world_size
        self.others = others or {}
        self.gathers: list = []

    def all_gather_objects(self, value):
        return [value if r == self.rank else (None, None) for r in range(self.world_size)]

    def all_gather(self, tensor, tag=None):
        self.gathers.append(tag)
        for (lo, hi), values in self.others.get(tag, []):
            tensor[lo:hi] = values


def _state(model: _Model, dtype=F32, comm=None, log=None, masters=None, units=None,
           **over) -> TrainingState:
    """Two units (u0: a and frozen; u1: b) kept in memory, unless ``units`` are given;
    ``masters`` {unit index: fp32 master} gives a unit an optimizer state with a separate
    master."""
    log = [] if log is None else log
    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    if units is None:
        units = [Unit(0, "u0", model, [("a", model.a, 0), ("frozen", model.frozen, -1)], dtype,
                      torch.device("cpu")),
                 Unit(1, "u1", model, [("b", model.b, 0)], dtype, torch.device("cpu"))]
        for u in units:
            u.adopt(manager, Tier.DEVICE, persistent=True)
    states = []
    for index, master in (masters or {}).items():
        states.append(UnitOptimState(units[index], None, None, master, None,
                                     shard=(0, master.numel())))
    return recording_training_state(model, units, dtype, comm, log,
                                    **{"manager": manager, "unit_states": states, **over})


def test_an_engine_saves_its_weights_in_its_dtype_with_texts_and_carried_files(
        tmp_path: Path) -> None:
    """One rank: every parameter in the compute dtype (dtype None), the persistent buffers in
    their own (an empty one written empty, a non-persistent one not at all), the texts and the
    source's carried files; the engine asked under ``what`` and flushed first."""
    log: list = []
    model = _Model()
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("tok")
    out = tmp_path / "out"
    got = save_pretrained(_state(model, BF16, log=log), str(out), texts={"config.json": "{}"},
                          carry_from=src, what="my_save")
    assert got == out
    assert log == [("open", "my_save"), ("flush",)]
    back = _load(out)
    assert list(back) == ["a", "b", "empty", "frozen", "running"]
    assert back["a"].dtype == BF16 and torch.equal(back["a"], model.a.detach().to(BF16))
    assert torch.equal(back["b"], (torch.arange(4.0) + 100).to(BF16))
    assert torch.equal(back["frozen"], torch.full((5,), -1.0, dtype=BF16))
    assert back["running"].dtype == F32 and torch.equal(back["running"], torch.tensor([1.5, 2.5]))
    assert back["empty"].shape == (0,)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json"]
    assert _metadata(out / "model.safetensors") == {"format": "pt"}


def test_by_default_the_engine_call_is_save_pretrained(tmp_path: Path) -> None:
    log: list = []
    with pytest.raises(RuntimeError) as info:
        save_pretrained(_state(_Model(), log=log, backwards_since_step=1), tmp_path / "o")
    assert str(info.value).startswith("engine.save_pretrained() between backward() and step()")
    assert log == [("open", "save_pretrained")] and not (tmp_path / "o").exists()


def test_a_tied_parameter_is_saved_under_the_name_not_tied_to(tmp_path: Path) -> None:
    """tie_targets reach the names: the unit holds the embedding, the file names it as the
    head when the model ties the embedding to the head (and as itself otherwise)."""
    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.head = nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    manager = TierManager(MemoryBudget("host", None), MemoryBudget("device", None))
    unit = Unit(0, "u0", model, [("embed.weight", model.embed.weight, 0)], F32,
                torch.device("cpu"))
    unit.adopt(manager, Tier.DEVICE, persistent=True)
    state = _state(model, units=[unit])
    save_pretrained(state, tmp_path / "tied", tie_targets={"embed.weight"})
    assert list(_load(tmp_path / "tied")) == ["head.weight"]
    save_pretrained(state, tmp_path / "own")
    assert list(_load(tmp_path / "own")) == ["embed.weight"]


def test_an_fp32_save_takes_trainable_parameters_from_the_master(tmp_path: Path) -> None:
    """A 16-bit engine saved in fp32: u0's trainable ``a`` from its fp32 master (values the
    bf16 parameters cannot hold), ``frozen`` from the parameters; u1 without a master from its
    parameters; a 16-bit save of the same engine reads the parameters."""
    model = _Model()
    master = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    state = _state(model, BF16, masters={0: master})
    save_pretrained(state, tmp_path / "fp32", dtype=F32, max_shard_size="24B")
    back = _load(tmp_path / "fp32")
    assert torch.equal(back["a"], master.reshape(2, 3))
    assert torch.equal(back["frozen"], torch.full((5,), -1.0))
    assert torch.equal(back["b"], torch.arange(4.0) + 100) and back["b"].dtype == F32
    index = json.loads((tmp_path / "fp32" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    save_pretrained(state, tmp_path / "bf16", dtype=BF16)
    assert torch.equal(_load(tmp_path / "bf16")["a"], model.a.detach().to(BF16))
    # a floating-point buffer in the save's dtype too, as infinity export writes it
    assert back["running"].dtype == F32
    assert torch.equal(_load(tmp_path / "bf16")["running"], model.running.to(BF16))


def test_two_tensors_under_one_name_are_refused(tmp_path: Path) -> None:
    """A unit entry named like a persistent buffer: refused before anything is written, the
    message naming the engine call and the name."""
    model = _Model()
    state = _state(model)
    clash = Unit(2, "u2", model, [("running", nn.Parameter(torch.zeros(2)), 0)], F32,
                 torch.device("cpu"))
    clash.adopt(state.manager, Tier.DEVICE, persistent=True)
    state = _state(model, units=[*state.units, clash])
    with pytest.raises(CheckpointError) as info:
        save_pretrained(state, tmp_path / "o", what="save_it")
    assert str(info.value) == "save_it: two tensors would be saved as running"
    assert not (tmp_path / "o").exists()


def test_a_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "o"
    real = pw.save_entries
    failing, calls = failing_on_call(real, 2, OSError(28, "No space left on device"))

    monkeypatch.setattr(pw, "save_entries", failing)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(_state(_Model()), out)
    assert list(out.iterdir()) == []


def test_with_two_ranks_rank0_writes_gathered_units_and_masters(tmp_path: Path) -> None:
    """Each unit is gathered on every rank; an fp32 save of a 16-bit engine puts each unit's
    master together by all_gather (this rank's range copied in, the rest from the others);
    rank 1 writes nothing."""
    model = _Model()
    log: list = []
    own = torch.tensor([0.5, 1.5, 2.5])         # rank 0's shard of u0's master: [0, 3)
    comm = _Comm(0, others={0: [((3, 6), torch.tensor([3.5, 4.5, 5.5]))]})
    state = _state(model, BF16, comm=comm, log=log, masters={0: own})
    state.unit_states[0].shard = (0, 3)
    save_pretrained(state, tmp_path / "r0", dtype=F32)
    assert [e for e in log if e[0] == "gathered"] == [("gathered", "u0"), ("gathered", "u1")]
    assert comm.gathers == [0]
    back = _load(tmp_path / "r0")
    assert torch.equal(back["a"], torch.tensor([[0.5, 1.5, 2.5], [3.5, 4.5, 5.5]]))
    assert torch.equal(back["frozen"], torch.full((5,), -1.0))
    assert torch.equal(back["b"], torch.arange(4.0) + 100)
    save_pretrained(_state(model, BF16, comm=_Comm(0)), tmp_path / "r0b")
    assert torch.equal(_load(tmp_path / "r0b")["a"], model.a.detach().to(BF16))
    save_pretrained(_state(model, BF16, comm=_Comm(1)), tmp_path / "r1")
    assert not (tmp_path / "r1").exists()


def test_with_two_ranks_a_failure_on_either_rank_is_agreed(tmp_path: Path) -> None:
    """Rank 0 told that rank 1 failed raises naming it, after writing (and then removing)
    nothing; a single-rank save with a comm of one rank is a plain call."""

    class _OtherFailed(_Comm):
        def all_gather_objects(self, value):
            return [value, (None, "OSError: disk full")]

    with pytest.raises(CheckpointError) as info:
        save_pretrained(_state(_Model(), comm=_OtherFailed(0)), tmp_path / "o")
    assert str(info.value) == ("rank 1 could not save the weights (OSError: disk full); no file "
                               "was written")

    class _Alone(_Comm):
        def all_gather_objects(self, value):
            raise AssertionError("one rank agrees with nobody")

    save_pretrained(_state(_Model(), comm=_Alone(0, world_size=1)), tmp_path / "one")
    assert sorted(_load(tmp_path / "one")) == ["a", "b", "empty", "frozen", "running"]


def test_rank1_gathers_its_master_range_at_its_offset(tmp_path: Path) -> None:
    """Rank 1's own range of u0's master is [3, 6): copied there, the rest from rank 0, into an
    fp32 buffer whatever torch's default dtype (the all_gather of every rank must agree)."""
    model = _Model()
    own = torch.tensor([3.5, 4.5, 5.5])
    comm = _Comm(1, others={0: [((0, 3), torch.tensor([0.5, 1.5, 2.5]))]})
    dtypes = []
    real = comm.all_gather
    comm.all_gather = lambda tensor, tag=None: (dtypes.append(tensor.dtype), real(tensor, tag))
    state = _state(model, BF16, comm=comm, masters={0: own})
    state.unit_states[0].shard = (3, 6)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        gathered = pw._gathered_master(state, pw.unit_layouts(state)[0], None)
    finally:
        torch.set_default_dtype(previous)
    assert dtypes == [torch.float32] and gathered.dtype == torch.float32
    assert torch.equal(gathered[:6], torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 5.5]))


@pytest.fixture
def nvme(disk_dir: Path):
    m = TierManager(MemoryBudget("host", None), MemoryBudget("device", None),
                    nvme_path=str(disk_dir), aio_config=AioConfig(backend="auto",
                                                                  block_size=1 << 20,
                                                                  queue_depth=4))
    try:
        yield m
    finally:
        m.close()


def _nvme_store(manager: TierManager, name: str, values: torch.Tensor):
    store = manager.create(name, values.numel(), values.dtype, Tier.NVME)
    buf = aligned_empty(values.numel() * values.element_size(), values.dtype, pin=False)
    buf.copy_(values)
    manager.wait(store.store_async(buf))
    return store


class _NvmeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(3000.0))
        self.f = nn.Parameter(torch.full((700,), -2.0), requires_grad=False)


@pytest.mark.parametrize("lend", [False, True])
def test_nvme_homes_are_read_through_the_chunk_pool(tmp_path: Path, nvme, lend) -> None:
    """Parameters and a master on NVMe go through host chunks: the engine's idle pool when it
    lends one (4 KiB slots: a 3000-element master in three chunks), else a pool of its own made
    from the tier manager; the values come back whole."""
    model = _NvmeModel()
    unit = Unit(0, "u0", model, [("w", model.w, 0), ("f", model.f, -1)], F32,
                torch.device("cpu"))
    unit.adopt(nvme, Tier.NVME, persistent=False)
    pools = [BufferPool(nvme, 4096, 2, "lent")] if lend else []
    state = _state(model, units=[unit], manager=nvme, lendable_pools=pools)
    save_pretrained(state, tmp_path / "params")
    back = _load(tmp_path / "params")
    assert torch.equal(back["w"], torch.arange(3000.0))
    assert torch.equal(back["f"], torch.full((700,), -2.0))
    master = torch.arange(unit.numel, dtype=F32) * 0.5
    model = _NvmeModel()
    unit16 = Unit(0, "u0", model, [("w", model.w, 0), ("f", model.f, -1)], BF16,
                  torch.device("cpu"))
    unit16.adopt(nvme, Tier.NVME, persistent=False)
    opt = UnitOptimState(unit16, None, None, _nvme_store(nvme, "u0.master", master), None,
                         shard=(0, unit16.numel))
    state = _state(model, BF16, units=[unit16], manager=nvme, lendable_pools=pools,
                   unit_states=[opt])
    save_pretrained(state, tmp_path / "master", dtype=F32)
    back = _load(tmp_path / "master")
    assert torch.equal(back["w"], master[:3000])
    assert torch.equal(back["f"], torch.full((700,), -2.0))


def test_a_rank_gathers_its_nvme_master_range_in_chunks(nvme) -> None:
    """Rank 1's range [2048, numel) of the master, on NVMe, read in 1024-element chunks and
    copied at its offset; the rest comes from rank 0 through all_gather."""
    model = _NvmeModel()
    unit = Unit(0, "u0", model, [("w", model.w, 0), ("f", model.f, -1)], BF16,
                torch.device("cpu"))
    unit.adopt(nvme, Tier.DEVICE, persistent=True)
    n = unit.numel
    full = torch.arange(n, dtype=F32) * 0.25
    opt = UnitOptimState(unit, None, None, _nvme_store(nvme, "u0.master", full[2048:]), None,
                         shard=(2048, n))
    comm = _Comm(1, others={0: [((0, 2048), full[:2048])]})
    state = _state(model, BF16, comm=comm, units=[unit], manager=nvme, unit_states=[opt],
                   lendable_pools=[BufferPool(nvme, 4096, 2, "lent")])
    lay = pw.unit_layouts(state)[0]
    gathered = pw._gathered_master(state, lay, ChunkPool(nvme, state.lendable_pools))
    assert torch.equal(gathered[:n], full)


def test_an_fp32_save_over_ranks_gathers_an_nvme_master(tmp_path: Path, nvme) -> None:
    """save_pretrained at rank 0 of 2, its master range [0, 2048) on NVMe (read through the
    chunk pool), rank 1's from all_gather: the file holds the whole master's values."""
    model = _NvmeModel()
    unit = Unit(0, "u0", model, [("w", model.w, 0), ("f", model.f, -1)], BF16,
                torch.device("cpu"))
    unit.adopt(nvme, Tier.DEVICE, persistent=True)
    n = unit.numel
    full = torch.arange(n, dtype=F32) * 0.75
    opt = UnitOptimState(unit, None, None, _nvme_store(nvme, "u0.master", full[:2048]), None,
                         shard=(0, 2048))
    comm = _Comm(0, others={0: [((2048, n), full[2048:])]})
    state = _state(model, BF16, comm=comm, units=[unit], manager=nvme, unit_states=[opt],
                   lendable_pools=[BufferPool(nvme, 4096, 2, "lent")])
    save_pretrained(state, tmp_path / "o", dtype=F32)
    back = _load(tmp_path / "o")
    assert torch.equal(back["w"], full[:3000])
    assert torch.equal(back["f"], torch.full((700,), -2.0))


# -- from a checkpoint ---------------------------------------------------------------------
W = torch.arange(12, dtype=F32).reshape(3, 4) + 0.5


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    writer = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for name, values in tensors.items():
        writer.append(name, values.reshape(-1))
    writer.close()
    return path


def _checkpoint(directory: Path, model_files=None, **manifest_keys) -> None:
    """Two ranks: ``w`` (3 x 4) as slices w#0 and w#5, an int buffer and a bf16 frozen one;
    ``manifest_keys`` added to the manifest."""
    directory.mkdir(parents=True)
    flat = W.reshape(-1)
    parts = [{"w#0": flat[:5], "ids": torch.tensor([7, 8]),
              "f": torch.tensor([1.25, -2.0], dtype=BF16)}, {"w#5": flat[5:]}]
    files = {}
    for r, tensors in enumerate(parts):
        path = _write(directory / f"rank{r}_model.safetensors", tensors)
        data = path.read_bytes()
        files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": FORMAT, "version": VERSION, "world_size": 2, "files": files,
                "params": {"w": {"shape": [3, 4]}}}
    if model_files is not None:
        manifest["model_files"] = model_files
    manifest.update(manifest_keys)
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_an_export_writes_each_tensor_in_the_dtype_asked_with_the_saved_config(
        tmp_path: Path, monkeypatch, infinity_log) -> None:
    """Floating tensors in ``dtype``, integer ones as stored; read in pieces (a piece smaller
    than a tensor); the manifest's config.json with the dtype written in, its other plain
    file names kept, a path-like or non-text entry dropped; no warning with a config."""
    monkeypatch.setattr(pw, "EXPORT_PIECE_BYTES", 20)     # w: pieces of 5, 5 and 2
    _checkpoint(tmp_path / "ck", {"config.json": '{"torch_dtype": "float32"}',
                                  "generation_config.json": "gen", "../evil.json": "x",
                                  "tokenizer.json": 3})
    out = tmp_path / "hf"
    with infinity_log.at_level(logging.WARNING, logger="infinity"):
        assert export_pretrained(tmp_path / "ck", out, dtype=BF16, max_shard_size=16) == out
    assert infinity_log.records == []
    back = _load(out)
    assert torch.equal(back["w"], W.to(BF16)) and back["w"].dtype == BF16
    assert torch.equal(back["ids"], torch.tensor([7, 8]))
    assert back["f"].dtype == BF16 and torch.equal(back["f"], torch.tensor([1.25, -2.0]).to(BF16))
    assert json.loads((out / "config.json").read_text()) == {"dtype": "bfloat16",
                                                             "torch_dtype": "bfloat16"}
    assert (out / "generation_config.json").read_text() == "gen"
    assert not (tmp_path / "evil.json").exists() and not (out / "tokenizer.json").exists()
    assert (out / "model.safetensors.index.json").exists()


def test_an_export_as_stored_keeps_dtypes_and_the_given_config(tmp_path: Path) -> None:
    """dtype None: each tensor as stored, config.json as given (texts win over the manifest's,
    and no dtype is written into it); the checkpoint found by its tag."""
    _checkpoint(tmp_path / "step4", {"config.json": '{"a": 1}'})
    out = tmp_path / "hf"
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("tok")
    export_pretrained(tmp_path, out, tag="step4", dtype=None, texts={"config.json": "mine"},
                      carry_from=src)
    back = _load(out)
    assert back["f"].dtype == BF16 and back["w"].dtype == F32 and torch.equal(back["w"], W)
    assert (out / "config.json").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json"]
    with pytest.raises(CheckpointError) as info:
        export_pretrained(src, tmp_path / "none")
    assert str(info.value) == (f"{src} holds no checkpoint manifest and no 'latest' file; pass "
                               "a checkpoint directory or --tag")


def test_an_export_without_a_config_warns_and_checks_checksums(tmp_path: Path,
                                                               infinity_log) -> None:
    _checkpoint(tmp_path / "ck")
    with infinity_log.at_level(logging.WARNING, logger="infinity"):
        export_pretrained(tmp_path / "ck", tmp_path / "hf")
    [record] = infinity_log.records
    assert record.getMessage() == (
        f"export {tmp_path / 'ck'}: the checkpoint holds no config.json (its model was not a "
        "transformers model, or an older infinity saved it): pass --config")
    assert torch.equal(_load(tmp_path / "hf")["w"], W)
    path = tmp_path / "ck" / "rank1_model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank1_model.safetensors"):
        export_pretrained(tmp_path / "ck", tmp_path / "hf2")
    export_pretrained(tmp_path / "ck", tmp_path / "hf3", verify_checksums=False)
    assert torch.equal(_load(tmp_path / "hf3")["w"].reshape(-1)[:11], W.reshape(-1)[:11])


def test_a_failed_export_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    _checkpoint(tmp_path / "ck")
    monkeypatch.setattr(sw, "write_model_files",
                        lambda *a: (_ for _ in ()).throw(OSError(5, "EIO")))
    out = tmp_path / "hf"
    with pytest.raises(OSError, match="EIO"):
        export_pretrained(tmp_path / "ck", out)
    # the weights were renamed into place before the texts failed; no partial file is left
    assert not [p for p in out.iterdir() if p.name.endswith(".partial")]


def test_an_export_carries_the_tokenizer_from_where_the_model_was_loaded(
        tmp_path: Path, infinity_info_log) -> None:
    """The manifest's ``model_source``, still a directory: its tokenizer files are carried
    over, which the log says; gone: a warning that the export has none and how to give them;
    not a path (empty, not a string): nothing carried, nothing said."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("tok")
    config = {"config.json": "{}"}
    _checkpoint(tmp_path / "ck", config, model_source=str(src))
    export_pretrained(tmp_path / "ck", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == "tok"
    assert [r.getMessage() for r in infinity_info_log.records] == [
        (f"export {tmp_path / 'ck'}: the tokenizer files from {src}, where its model was loaded "
         "from")]
    infinity_info_log.clear()
    gone = tmp_path / "gone"
    _checkpoint(tmp_path / "ck2", config, model_source=str(gone))
    export_pretrained(tmp_path / "ck2", tmp_path / "hf2")
    assert [(r.levelno, r.getMessage()) for r in infinity_info_log.records] == [
        (logging.WARNING, (f"export {tmp_path / 'ck2'}: its model was loaded from {gone}, "
                           "which is not there any more: the export has no tokenizer files; "
                           "pass --config DIR (a directory holding them)"))]
    assert sorted(p.name for p in (tmp_path / "hf2").iterdir()) == ["config.json",
                                                                    "model.safetensors"]
    for i, recorded in enumerate(("", 5)):
        infinity_info_log.clear()
        _checkpoint(tmp_path / f"ck{i + 3}", config, model_source=recorded)
        export_pretrained(tmp_path / f"ck{i + 3}", tmp_path / f"hf{i + 3}")
        assert infinity_info_log.records == [], recorded
        assert sorted(p.name for p in (tmp_path / f"hf{i + 3}").iterdir()) == [
            "config.json", "model.safetensors"]


# -- transformers' Hub layout: renamed and split tensors ------------------------------------
def _rows(name: str, value: torch.Tensor):
    """A Hub split of the test: ``w`` and ``f`` by rows (``f`` into its two elements),
    ``drop`` into nothing, anything else not split."""
    if name in ("w", "f"):
        return [(f"{name}.{i}", value[i]) for i in range(value.shape[0])]
    return [] if name == "drop" else None


def test_the_hub_table_renames_splits_and_drops_tensors() -> None:
    """Each tensor split by ``hub_split`` (given its name and a meta tensor of its shape and
    dtype) becomes its parts in place, in order; one split into nothing is dropped; the others
    renamed by ``hub_name``; the split ones' shapes by their own names."""
    seen = []

    def split(name: str, value: torch.Tensor):
        seen.append((name, value.device.type, value.dtype, tuple(value.shape)))
        return _rows(name, value)

    tensors = [("ids", torch.int64, (2,)), ("w", BF16, (3, 4)), ("drop", F32, (5,)),
               ("f", F32, (2,))]
    table, splits = hub_table(tensors, lambda n: "hub." + n, split)
    assert table == [("hub.ids", torch.int64, (2,)), ("w.0", BF16, (4,)), ("w.1", BF16, (4,)),
                     ("w.2", BF16, (4,)), ("f.0", F32, ()), ("f.1", F32, ())]
    assert splits == {"w": (3, 4), "drop": (5,), "f": (2,)}
    assert seen == [("ids", "meta", torch.int64, (2,)), ("w", "meta", BF16, (3, 4)),
                    ("drop", "meta", F32, (5,)), ("f", "meta", F32, (2,))]
    assert hub_table(tensors, lambda n: "hub." + n, None) == (
        [("hub." + n, d, s) for n, d, s in tensors], {})
    assert hub_table(tensors, None, None) == (tensors, {})
    assert hub_table(tensors, None, split)[0][0] == ("ids", torch.int64, (2,))


class _HubNames:
    """The interface of engine/hf_conversions.HubNames that an export uses."""

    def __init__(self) -> None:
        self.to_hub = lambda name: {"ids": "input_ids"}.get(name, name)
        self.split = _rows


def test_an_export_writes_the_hub_layout_from_pieces(tmp_path: Path, monkeypatch) -> None:
    """hub_names_of(the config as written, dtype included) gives the conversions: ``ids``
    renamed, ``w`` (read in pieces of two elements, gathered whole) and ``f`` (in one piece)
    split by rows, in the dtype asked; the index lists the Hub's names only."""
    monkeypatch.setattr(pw, "EXPORT_PIECE_BYTES", 8)   # w: 2 fp32, ids: 1 int64, f: 4 bf16
    _checkpoint(tmp_path / "ck", {"config.json": '{"model_type": "x"}'})
    configs = []

    def hub_names_of(text: str):
        configs.append(json.loads(text))
        return _HubNames()

    out = tmp_path / "hf"
    export_pretrained(tmp_path / "ck", out, dtype=BF16, max_shard_size=16,
                      hub_names_of=hub_names_of)
    assert configs == [{"model_type": "x", "dtype": "bfloat16"}]
    back = _load(out)
    assert sorted(back) == ["f.0", "f.1", "input_ids", "w.0", "w.1", "w.2"]
    for i in range(3):
        assert back[f"w.{i}"].dtype == BF16 and torch.equal(back[f"w.{i}"], W[i].to(BF16))
    assert torch.equal(back["f.0"], torch.tensor(1.25, dtype=BF16))
    assert torch.equal(back["f.1"], torch.tensor(-2.0, dtype=BF16))
    assert torch.equal(back["input_ids"], torch.tensor([7, 8]))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(back)


def test_an_export_without_a_config_has_no_hub_conversions(tmp_path: Path) -> None:
    """No config.json to read them from: hub_names_of is not asked, the names are as stored."""
    _checkpoint(tmp_path / "ck")

    def hub_names_of(text: str):
        raise AssertionError("asked without a config")

    export_pretrained(tmp_path / "ck", tmp_path / "hf", hub_names_of=hub_names_of)
    assert sorted(_load(tmp_path / "hf")) == ["f", "ids", "w"]


def test_an_engine_saves_the_hub_layout(tmp_path: Path) -> None:
    """save_pretrained with ``hub_name`` and ``hub_split``: ``a`` split by rows, the others
    (a persistent buffer too) renamed; with only one of the two given, that one applies; a
    rank that writes nothing takes part without writing."""
    model = _Model()
    state = _state(model)

    def split(name: str, value: torch.Tensor):
        return [(f"a.{i}", value[i]) for i in range(2)] if name == "a" else None

    def rename(name: str) -> str:
        return "hub." + name

    save_pretrained(state, tmp_path / "both", hub_name=rename, hub_split=split)
    back = _load(tmp_path / "both")
    assert sorted(back) == ["a.0", "a.1", "hub.b", "hub.empty", "hub.frozen", "hub.running"]
    assert torch.equal(back["a.0"], model.a.detach()[0])
    assert torch.equal(back["a.1"], model.a.detach()[1])
    assert torch.equal(back["hub.b"], model.b.detach())
    assert torch.equal(back["hub.running"], torch.tensor([1.5, 2.5]))
    save_pretrained(state, tmp_path / "renamed", hub_name=rename)
    assert sorted(_load(tmp_path / "renamed")) == ["hub.a", "hub.b", "hub.empty", "hub.frozen",
                                                   "hub.running"]
    save_pretrained(state, tmp_path / "split", hub_split=split)
    back = _load(tmp_path / "split")
    assert sorted(back) == ["a.0", "a.1", "b", "empty", "frozen", "running"]
    assert torch.equal(back["a.1"], model.a.detach()[1])
    save_pretrained(_state(model, comm=_Comm(1)), tmp_path / "r1", hub_name=rename,
                    hub_split=split)
    assert not (tmp_path / "r1").exists()


def test_an_export_config_of_another_model_is_refused() -> None:
    """``infinity export --config`` of a 3-layer model over a 2-layer checkpoint: the export
    wrote it, and transformers built 3 layers over 2 layers' weights, the third random. Keys
    that decide the parameters must agree where both configs give them; others may differ."""
    import json

    from infinity.checkpoint.pretrained_write import check_config_matches

    saved = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
             "num_hidden_layers": 2, "hidden_size": 64, "bos_token_id": 1}
    given = {**saved, "num_hidden_layers": 3}
    with pytest.raises(ValueError, match="num_hidden_layers 2 in the checkpoint, 3 given"):
        check_config_matches(json.dumps(saved), json.dumps(given), Path("ck"))
    alike = {k: v for k, v in saved.items() if k != "architectures"}    # a config's own save
    check_config_matches(json.dumps(saved), json.dumps({**alike, "bos_token_id": 5}), Path("ck"))
    check_config_matches(None, json.dumps(given), Path("ck"))     # nothing saved to compare
