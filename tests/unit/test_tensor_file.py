"""The streamed safetensors writer and reader (infinity/checkpoint/tensor_file.py): pieces in
any sizes make a file the ``safetensors`` package reads, and damage is found at open."""
from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open

from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader, TensorFileWriter

TABLE = [("a", torch.float32, (3, 5)), ("empty", torch.float32, (0,)),
         ("b", torch.bfloat16, (7,)), ("c", torch.int64, (2, 2)), ("d", torch.float16, ())]


def _values() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a": torch.randn(3, 5), "empty": torch.empty(0), "b": torch.randn(7).bfloat16(),
            "c": torch.arange(4).reshape(2, 2), "d": torch.tensor(1.5, dtype=torch.float16)}


def _write(path, values, piece: int = 4):
    writer = TensorFileWriter(path, TABLE, {"note": "x"})
    for name, _, _ in TABLE:
        flat = values[name].reshape(-1)
        for start in range(0, flat.numel(), piece):
            writer.append(name, flat[start:start + piece])
    return writer.close()


@pytest.mark.parametrize("piece", [1, 4, 100])
def test_pieces_make_a_safetensors_file(tmp_path, piece):
    values = _values()
    path = tmp_path / "t.safetensors"
    nbytes, digest = _write(path, values, piece)
    assert nbytes == path.stat().st_size
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(values)
        assert f.metadata() == {"note": "x"}
        for name, expected in values.items():
            assert torch.equal(f.get_tensor(name), expected)
    with TensorFileReader(path) as reader:
        for name, expected in values.items():
            assert torch.equal(reader.read(name), expected)
        part = torch.empty(6)
        reader.read_into("a", part, start=4)
        assert torch.equal(part, values["a"].reshape(-1)[4:10])


def test_writer_refuses_out_of_order_wrong_dtype_and_incomplete(tmp_path):
    writer = TensorFileWriter(tmp_path / "t.safetensors", TABLE)
    with pytest.raises(ValueError, match="tensor a is written now"):
        writer.append("b", torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float32"):
        writer.append("a", torch.zeros(15, dtype=torch.float64))
    with pytest.raises(ValueError, match="has 60 bytes"):
        writer.append("a", torch.zeros(16))
    writer.append("a", torch.zeros(15))
    with pytest.raises(ValueError, match="tensor b and 2 after it were not written"):
        writer.close()


def test_truncated_and_damaged_files_are_refused_at_open(tmp_path):
    path = tmp_path / "t.safetensors"
    _write(path, _values())
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(CheckpointError, match="truncated"):
        TensorFileReader(path)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        TensorFileReader(path)
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="unreadable header"):
        TensorFileReader(path)
    with pytest.raises(CheckpointError, match="is missing"):
        TensorFileReader(tmp_path / "nope.safetensors")


def test_complex_unsigned_and_float8_tensors_round_trip(tmp_path):
    """A RoPE table kept as a complex64 persistent buffer made every save fail; the dtypes
    safetensors names (C64, U16-U64, F8) are written and read back bit-exact, and safetensors
    itself reads them. One it does not name is refused with what to do."""
    from safetensors.torch import load_file
    tensors = {
        "freqs_cis": torch.polar(torch.ones(4, 3), torch.randn(4, 3)),
        "u16": torch.tensor([1, 2, 65535], dtype=torch.int32).to(torch.uint16),
        "u64": torch.tensor([2**40, 7], dtype=torch.int64).to(torch.uint64),
        "f8": torch.randn(5).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "x.safetensors"
    writer = TensorFileWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
                              {"format": "pt"})
    for name, value in tensors.items():
        writer.append(name, value)
    writer.close()
    with TensorFileReader(path) as reader:
        for name, value in tensors.items():
            got = reader.read(name)
            assert got.dtype == value.dtype and torch.equal(got.view(torch.uint8),
                                                            value.view(torch.uint8)), name
    loaded = load_file(str(path))
    assert loaded["freqs_cis"].dtype == torch.complex64
    assert torch.equal(loaded["freqs_cis"], tensors["freqs_cis"])
    with pytest.raises(TypeError, match="complex128 has no safetensors name.*persistent=False"):
        TensorFileWriter(tmp_path / "y.safetensors", [("z", torch.complex128, (2,))], {})


def _with_header(path, header, data: bytes = b"") -> None:
    """A tensor file whose header is ``header`` (any JSON text), then ``data``."""
    import struct
    encoded = header.encode() if isinstance(header, str) else header
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


GOOD = '"dtype": "F32", "shape": [2], "data_offsets": [0, 8]'


@pytest.mark.parametrize("header, says", [
    ('[1, 2]', "header is a JSON list, not an object"),
    ('"x"', "header is a JSON str"),
    ('{"a": [1]}', "tensor a (a JSON list, not an object)"),
    ('{"a": "F32"}', "tensor a (a JSON str, not an object)"),
    ('{"a": {"dtype": "F32", "shape": [2]}}', "tensor a (no data_offsets)"),
    ('{"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}', "dtype ['F32'] is none"),
    ('{"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}', "shape is not a list"),
    ('{"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}', "shape is not a list"),
    ('{"a": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}', "shape is not a list"),
    ('{"a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}', "shape is not a list"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}', "data_offsets is not two"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}', "data_offsets is not two"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}', "data_offsets is not two"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": {"0": 8}}}', "data_offsets is not two"),
    ('{"__metadata__": [1], "a": {%s}}' % GOOD, "__metadata__ must be an object of strings"),
    ('{"__metadata__": {"k": 1}, "a": {%s}}' % GOOD, "__metadata__ must be an object of strings"),
    ('{"a": {%s}, "a": {%s}}' % (GOOD, GOOD), "key 'a' appears twice"),
    ('{"a": {%s}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}' % GOOD,
     "tensors overlap or leave a gap"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
], ids=lambda text: text[:40])
def test_a_header_of_the_wrong_shape_is_a_checkpoint_error_naming_the_file(tmp_path, header, says):
    """Valid JSON of the wrong shape (a checksum rewritten to match, or checks turned off)
    raised TypeError (or was read with floats cut to ints, bools as 1); every part of the
    header is checked and a damaged one is a CheckpointError that names the file."""
    path = tmp_path / "t.safetensors"
    _with_header(path, header, bytes(12))
    with pytest.raises(CheckpointError) as caught:
        TensorFileReader(path)
    assert str(path) in str(caught.value) and says in str(caught.value)


def test_a_header_written_by_safetensors_in_its_own_order_is_read(tmp_path):
    """Tensors listed out of byte order (safetensors sorts its header by name) are fine."""
    from safetensors.torch import save_file
    values = {"z": torch.arange(3.0), "a": torch.arange(5, dtype=torch.int64), "m": torch.ones(2, 2)}
    path = tmp_path / "s.safetensors"
    save_file(values, str(path), metadata={"k": "v"})
    with TensorFileReader(path) as reader:
        assert reader.metadata == {"k": "v"}
        for name, value in values.items():
            assert torch.equal(reader.read(name), value)
