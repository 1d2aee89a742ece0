"""transformers' weight layout, written and read without a model: shard sizes and plans, the
sharded writer (index, stale files, aborts), the reader's checks of a directory and its piece
reads (read ahead of conversions, straight reads, casts)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from infinity.checkpoint import pretrained
from infinity.checkpoint.pretrained import PretrainedWeights
from infinity.checkpoint.pretrained_files import weight_map
from infinity.checkpoint.pretrained_write import (
    config_with_dtype,
    out_dtype,
    shard_bytes,
)
from infinity.checkpoint.sharded_writer import (
    ShardedWriter,
    plan_shards,
)
from infinity.checkpoint.tensor_file import CheckpointError


def test_shard_sizes_read_as_transformers_reads_them() -> None:
    assert shard_bytes("5GB") == 5 * 10**9
    assert shard_bytes("500MiB") == 500 << 20
    assert shard_bytes("40KB") == 40_000
    assert shard_bytes(" 2 gib ") == 2 << 30
    assert shard_bytes(1234) == 1234
    for bad in ("5 parsecs", "", "-1GB", 0, 1.5, True):
        with pytest.raises((ValueError, TypeError)):
            shard_bytes(bad)


def test_dtypes_by_name() -> None:
    assert out_dtype(None, torch.bfloat16) is torch.bfloat16
    assert out_dtype("fp32", torch.bfloat16) is torch.float32
    assert out_dtype("torch.float16", torch.float32) is torch.float16
    assert out_dtype(torch.bfloat16, torch.float32) is torch.bfloat16
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        out_dtype("int8", torch.float32)


def test_a_shard_closes_before_the_tensor_that_would_overflow_it() -> None:
    f32 = torch.float32
    table = [("a", f32, (10,)), ("b", f32, (10,)), ("c", f32, (100,)), ("d", f32, (1,)),
             ("e", f32, (0,))]
    plan = plan_shards(table, 80)
    assert [[t[0] for t in shard] for shard in plan] == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards(table, 10**9) == [table]


def _table(tensors: dict[str, torch.Tensor]):
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def _write(directory, tensors: dict[str, torch.Tensor], max_bytes: int, pieces: int = 3):
    writer = ShardedWriter(directory, _table(tensors), max_bytes)
    for name, value in tensors.items():
        flat = value.reshape(-1)
        step = max(1, -(-flat.numel() // pieces))
        for a in range(0, flat.numel(), step):
            writer.append(name, flat[a:a + step])
    return writer.close()


def _read(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_the_sharded_writer_round_trips_and_replaces_an_earlier_save(tmp_path) -> None:
    tensors = {"w": torch.randn(64, 8), "b": torch.zeros(0), "h": torch.randn(50).bfloat16(),
               "ids": torch.arange(7), "big": torch.randn(300)}
    files = _write(tmp_path, tensors, 1000)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    back = _read(tmp_path)
    for name, value in tensors.items():
        assert torch.equal(back[name], value), name
    # one file now: the shards and the index of the first save go
    _write(tmp_path, {"w": tensors["w"]}, 10**9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    # a file of the user's that looks like neither stays
    (tmp_path / "model-notes.safetensors.txt").write_text("mine")
    _write(tmp_path, tensors, 1000)
    assert (tmp_path / "model-notes.safetensors.txt").exists()
    assert not (tmp_path / "model.safetensors").exists()


def test_an_aborted_write_leaves_the_earlier_save(tmp_path) -> None:
    tensors = {"w": torch.randn(64, 8), "v": torch.randn(64)}
    _write(tmp_path, tensors, 10**9)
    before = sorted(p.name for p in tmp_path.iterdir())
    writer = ShardedWriter(tmp_path, _table(tensors), 100)
    writer.append("w", tensors["w"].reshape(-1)[:10])
    with pytest.raises(ValueError, match="not every tensor"):
        writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert torch.equal(_read(tmp_path)["w"], tensors["w"])


def test_config_dtype_is_rewritten() -> None:
    text = config_with_dtype('{"model_type": "llama", "torch_dtype": "float32"}', torch.bfloat16)
    data = json.loads(text)
    assert data["dtype"] == data["torch_dtype"] == "bfloat16"


# -- reading -------------------------------------------------------------------------------
def _shards(directory, files: dict[str, dict[str, torch.Tensor]], index: dict | None = None):
    directory.mkdir(exist_ok=True)
    for name, tensors in files.items():
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
    if index is None:
        index = {k: name for name, tensors in files.items() for k in tensors}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return directory


def test_an_index_naming_a_tensor_its_file_lacks_is_refused(tmp_path) -> None:
    src = _shards(tmp_path / "m", {"a.safetensors": {"x": torch.zeros(3)}},
                  {"x": "a.safetensors", "y": "a.safetensors"})
    with pytest.raises(CheckpointError, match=r"a\.safetensors lacks 1 tensor.*: y"):
        PretrainedWeights(src)
    src = _shards(tmp_path / "n", {"a.safetensors": {"x": torch.zeros(3)}},
                  {"x": "../a.safetensors"})
    with pytest.raises(CheckpointError, match="is not a file name"):
        weight_map(src)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        weight_map(tmp_path / "nowhere")


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("piece_bytes", [8, 64, 1 << 20])
def test_pieces_are_read_ahead_and_cast_in_order(tmp_path, monkeypatch, piece_bytes,
                                                 direct_io) -> None:
    """Reads through the ring of buffers (many pieces: the reader runs ahead), with O_DIRECT
    (aligned blocks around each piece) or through the page cache (straight into the target
    when the dtypes agree), give the file's values; a piece may start inside a tensor."""
    monkeypatch.setattr(pretrained, "CONVERT_BYTES", piece_bytes)
    monkeypatch.setattr(pretrained, "READ_PIECE_BYTES", piece_bytes)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, 5, generator=gen).bfloat16()
    b = torch.randn(101, generator=gen)
    src = _shards(tmp_path / "m", {"one.safetensors": {"a": a}, "two.safetensors": {"b": b}})
    with PretrainedWeights(src, direct_io=direct_io) as weights:
        weights._params = {"a": weights._tensors["a"], "b": weights._tensors["b"]}
        out_a = torch.empty(a.numel() - 3)                     # cast bf16 -> fp32
        out_b = torch.empty(b.numel())                         # straight read
        out_b16 = torch.empty(50, dtype=torch.bfloat16)        # cast fp32 -> bf16
        weights.fill([("a", 3, out_a), ("b", 0, out_b), ("b", 51, out_b16)])
        assert torch.equal(out_a, a.reshape(-1)[3:].float())
        assert torch.equal(out_b, b)
        assert torch.equal(out_b16, b[51:].bfloat16())
        assert weights.bytes_read == (a.numel() - 3) * 2 + b.numel() * 4 + 50 * 4


def test_a_load_opened_across_two_saves_over_it_opens_the_last_one_whole(tmp_path: Path,
                                                                         monkeypatch) -> None:
    """A load reads save 1's index, and while it opens the shards two saves commit over the
    directory (the second takes save 1's standard names back): the files it opened are two
    saves'; it sees the index replaced and opens the last save, whole."""
    pt = pretrained

    def save(value: float) -> None:
        _write(tmp_path, {n: torch.full((64,), value) for n in ("a", "b", "c")}, 300)
    save(1.0)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    opened = []
    real = pt.TensorFileReader

    def reader_meanwhile_saved_over(path, *args, **kwargs):
        opened.append(Path(path).name)
        if len(opened) == 2:
            save(2.0)      # token names: the standard ones are taken
            save(3.0)      # the standard names again
        return real(path, *args, **kwargs)
    monkeypatch.setattr(pt, "TensorFileReader", reader_meanwhile_saved_over)
    with pt.PretrainedWeights(tmp_path, direct_io=False) as weights:
        model = nn.Module()
        for n in ("a", "b", "c"):
            model.register_parameter(n, nn.Parameter(torch.zeros(64)))
        weights.match(model)
        got = {}
        for n in ("a", "b", "c"):
            out = torch.empty(64)
            weights.fill([(n, 0, out)])
            got[n] = out
    assert len(opened) > 3, opened          # opened again after the saves
    assert all(torch.equal(v, torch.full((64,), 3.0)) for v in got.values()), got
