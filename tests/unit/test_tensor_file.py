"""The streamed safetensors writer and reader (infinity/checkpoint/tensor_file.py): pieces in
any sizes make a file the ``safetensors`` package reads, and damage is found at open; the
whole-file checksum the manifest records, and that an aborted writer lets go of its file."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from infinity.checkpoint import tensor_file as tf
from infinity.checkpoint.tensor_file import (CheckpointError, TensorFileReader, TensorFileWriter,
                                             sha256_of_file)


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


# -- the whole-file checksum; an aborted writer's file -------------------------------------------

def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("size", [0, 1, 4095, tf.HASH_CHUNK, 2 * tf.HASH_CHUNK + 12345])
def test_sha256_of_file_matches_hashlib(tmp_path: Path, size: int) -> None:
    """Across the 8 MiB pieces it reads (two buffers, one hashed while the other is filled)."""
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_of_file(path) == hashlib.sha256(data).hexdigest()


def test_sha256_of_file_is_the_writers_checksum(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    big = torch.arange(3 * (1 << 20) // 4, dtype=torch.float32)   # > PARALLEL_HASH_BYTES
    w = TensorFileWriter(path, [("a", torch.float32, tuple(big.shape)), ("b", torch.int8, (3,))])
    w.append("a", big)
    w.append("b", torch.tensor([1, 2, 3], dtype=torch.int8))
    nbytes, digest = w.close()
    assert nbytes == path.stat().st_size
    assert digest == sha256_of_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_abort_lets_go_of_the_file(tmp_path: Path) -> None:
    before = _open_fds()
    w = TensorFileWriter(tmp_path / "t.safetensors", [("a", torch.float32, (4,))])
    assert _open_fds() == before + 1
    w.abort()
    assert _open_fds() == before
    w.abort()   # twice is harmless
    assert _open_fds() == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_an_incomplete_close_lets_go_of_the_file(tmp_path: Path) -> None:
    before = _open_fds()
    w = TensorFileWriter(tmp_path / "t.safetensors", [("a", torch.float32, (4,)),
                                                      ("b", torch.float32, (2,))])
    w.append("a", torch.zeros(4))
    with pytest.raises(ValueError, match="tensor b and 0 after it were not written"):
        w.close()
    assert _open_fds() == before


def test_reader_round_trip_of_every_dtype(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    tensors = {}
    for dtype in tf.DTYPE_NAMES:
        if dtype.is_floating_point or dtype.is_complex:
            t = torch.arange(6, dtype=torch.float32).to(dtype).reshape(2, 3)
        elif dtype == torch.bool:
            t = torch.tensor([[True, False, True], [False, True, False]])
        else:
            t = torch.arange(6).to(dtype).reshape(2, 3)
        tensors[tf.DTYPE_NAMES[dtype]] = t
    w = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                         metadata={"format": "pt"})
    for n, t in tensors.items():
        w.append(n, t)
    w.close()
    with TensorFileReader(path) as r:
        assert r.metadata == {"format": "pt"}
        for n, t in tensors.items():
            got = r.read(n)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def _file_of(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    w = TensorFileWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for n, t in tensors.items():
        w.append(n, t)
    w.close()
    return path


def test_read_into_ranges_of_non_float32_tensors(tmp_path: Path) -> None:
    """A range's byte offset is counted in the tensor's own element size."""
    i8 = torch.arange(10, dtype=torch.int8)
    f64 = torch.arange(10, dtype=torch.float64) / 3
    path = _file_of(tmp_path / "t.safetensors", {"i8": i8, "f64": f64})
    with TensorFileReader(path) as r:
        out8 = torch.empty(3, dtype=torch.int8)
        r.read_into("i8", out8, start=5)
        assert out8.tolist() == [5, 6, 7]
        out64 = torch.empty(4, dtype=torch.float64)
        r.read_into("f64", out64, start=6)
        assert torch.equal(out64, f64[6:10])


def test_read_into_refuses_ranges_outside_the_tensor_and_wrong_dtypes(tmp_path: Path) -> None:
    path = _file_of(tmp_path / "t.safetensors", {"a": torch.arange(5, dtype=torch.float32)})
    with TensorFileReader(path) as r:
        with pytest.raises(ValueError, match=r"tensor a has 5 elements; asked for \[2, 6\)"):
            r.read_into("a", torch.empty(4), start=2)
        with pytest.raises(ValueError, match=r"asked for \[-1, 1\)"):
            r.read_into("a", torch.empty(2), start=-1)
        with pytest.raises(TypeError, match="tensor a is torch.float32, asked into torch.float16"):
            r.read_into("a", torch.empty(2, dtype=torch.float16))
        with pytest.raises(tf.CheckpointError, match="has no tensor b"):
            r.read("b")
        r.read_into("a", torch.empty(5))     # the whole tensor is in range
        r.read_into("a", torch.empty(0), start=5)


def test_short_reads_from_the_os_are_continued_where_they_stopped(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """preadv may return fewer bytes than asked (large reads, signals): the rest is read from
    where it stopped -- here 3 bytes at a time, the last piece a single byte."""
    data = torch.arange(7, dtype=torch.int8) + 10
    path = _file_of(tmp_path / "t.safetensors", {"pad": torch.zeros(3, dtype=torch.int8),
                                                  "a": data})
    real = os.preadv
    calls = []

    def short_preadv(fd, buffers, offset):
        (buf,) = buffers
        calls.append(offset)
        return real(fd, [buf[:3]], offset)

    with TensorFileReader(path) as r:
        monkeypatch.setattr(os, "preadv", short_preadv)
        out = torch.empty(7, dtype=torch.int8)
        r.read_into("a", out)
        assert out.tolist() == data.tolist()
        assert len(calls) == 3 and calls[1] - calls[0] == 3 and calls[2] - calls[1] == 3


def test_a_file_that_shrinks_while_read_is_a_checkpoint_error_at_the_byte(tmp_path: Path) -> None:
    path = _file_of(tmp_path / "t.safetensors", {"a": torch.arange(4, dtype=torch.float32)})
    with TensorFileReader(path) as r:
        at = r.data_start + 5
        os.truncate(path, at)
        with pytest.raises(tf.CheckpointError, match=f"short read of tensor a at byte {at}: "
                                                     "the file shrank"):
            r.read_into("a", torch.empty(4))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_closing_a_reader_twice_closes_nothing_else(tmp_path: Path) -> None:
    path = _file_of(tmp_path / "t.safetensors", {"a": torch.zeros(2)})
    before = _open_fds()
    r = TensorFileReader(path)
    r.close()
    assert _open_fds() == before
    other = os.open(path, os.O_RDONLY)    # likely takes the number the reader had
    try:
        count = _open_fds()
        r.close()
        with r:
            pass
        assert _open_fds() == count
        for fd in (0, 1, 2, other):
            os.fstat(fd)
    finally:
        os.close(other)


def _raw_file(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    import struct
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


GOOD_A = '"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'


def test_writer_refuses_more_data_once_complete_and_counts_later_tensors_on_their_own(
        tmp_path: Path) -> None:
    w = TensorFileWriter(tmp_path / "t.safetensors", [("a", torch.float32, (2,)),
                                                      ("b", torch.float32, (2,))])
    w.append("a", torch.zeros(2))
    with pytest.raises(ValueError, match=r"tensor b is written now \(0 of 8 bytes\); got a"):
        w.append("a", torch.zeros(1))
    with pytest.raises(ValueError, match="tensor b has 8 bytes; 12 were given"):
        w.append("b", torch.zeros(3))
    w.append("b", torch.zeros(1))
    with pytest.raises(ValueError, match="tensor b has 8 bytes; 12 were given"):
        w.append("b", torch.zeros(2))
    w.append("b", torch.zeros(1))
    with pytest.raises(ValueError, match="every tensor is complete; got more for b"):
        w.append("b", torch.zeros(1))
    w.close()


def test_a_file_without_tensor_data_is_read(tmp_path: Path) -> None:
    """A table with no tensors, or only empty ones: the header runs to the end of the file."""
    path = tmp_path / "empty.safetensors"
    w = TensorFileWriter(path, [], metadata={"k": "v"})
    w.close()
    with TensorFileReader(path) as r:
        assert r.tensors == {} and r.metadata == {"k": "v"}
    path2 = tmp_path / "zero.safetensors"
    w = TensorFileWriter(path2, [("e", torch.float32, (0, 3))])
    w.close()
    with TensorFileReader(path2) as r:
        assert r.read("e").shape == (0, 3)
        assert r.data_start == path2.stat().st_size


def test_a_header_length_past_the_end_of_the_file_is_refused_as_such(tmp_path: Path) -> None:
    header = ("{" + GOOD_A + "}").encode()
    for length in (len(header) + 8 + 1, len(header) + 8 + 4, 1 << 63, (1 << 64) - 1):
        path = _raw_file(tmp_path / f"t{length}.safetensors", header, bytes(8), length=length)
        size = path.stat().st_size
        with pytest.raises(tf.CheckpointError,
                           match=f"header length {length} does not fit in the file's {size} bytes"):
            TensorFileReader(path)


def test_a_size_mismatch_names_both_sizes(tmp_path: Path) -> None:
    header = ("{" + GOOD_A + "}").encode()
    path = _raw_file(tmp_path / "t.safetensors", header, bytes(12))
    with pytest.raises(tf.CheckpointError, match=f"has {8 + len(header) + 12} bytes but its header "
                                                 f"describes {8 + len(header) + 8}: the file is "
                                                 "truncated"):
        TensorFileReader(path)


def test_header_errors_show_the_offending_part(tmp_path: Path) -> None:
    cases = [
        ('{"b": {%s}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}, "b": {%s}}'
         % (GOOD_A[6:-1], GOOD_A[6:-1]), "key 'b' appears twice"),
        ('{"__metadata__": {"k": 7}}', "it is {'k': 7}"),
        ('{"a": {"dtype": "F32"}}', "tensor a (no data_offsets, shape): {'dtype': 'F32'}"),
        ('{"a": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}}',
         "dtype 'F31' is none of BF16, BOOL, C64"),
        ('{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}',
         "tensor a spans [0, 8), which does not match F32 [4]"),
    ]
    for i, (header, says) in enumerate(cases):
        path = _raw_file(tmp_path / f"t{i}.safetensors", header.encode(), bytes(8))
        with pytest.raises(tf.CheckpointError) as caught:
            TensorFileReader(path)
        assert says in str(caught.value), (header, str(caught.value))


def test_tensor_infos_carry_their_names(tmp_path: Path) -> None:
    path = _file_of(tmp_path / "t.safetensors", {"w": torch.zeros(2), "b": torch.zeros(1)})
    with TensorFileReader(path) as r:
        assert {n: i.name for n, i in r.tensors.items()} == {"w": "w", "b": "b"}
        assert r.info("b") == tf.TensorInfo("b", torch.float32, (1,), 8, 12)


def test_writer_table_and_duplicate_names(tmp_path: Path) -> None:
    table = [("a", torch.float32, (2, 3)), ("b", torch.int8, (5,)), ("c", torch.bfloat16, ())]
    w = TensorFileWriter(tmp_path / "t.safetensors", table)
    assert [(t.name, t.dtype, t.shape, t.begin, t.end) for t in w.tensors] == [
        ("a", torch.float32, (2, 3), 0, 24), ("b", torch.int8, (5,), 24, 29),
        ("c", torch.bfloat16, (), 29, 31)]
    assert [t.numel for t in w.tensors] == [6, 5, 1]
    w.abort()
    with pytest.raises(ValueError, match="tensor a appears twice in one file"):
        TensorFileWriter(tmp_path / "u.safetensors", [("a", torch.float32, (1,))] * 2)


@pytest.mark.parametrize("name", ["a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "w" * 8])
def test_the_data_section_starts_8_byte_aligned(tmp_path: Path, name: str) -> None:
    """The header is padded with spaces to a multiple of 8 bytes (as safetensors' own writer), so
    the tensors' bytes start aligned for views of the mapped file."""
    path = _file_of(tmp_path / "t.safetensors", {name: torch.arange(3, dtype=torch.float32)})
    with TensorFileReader(path) as r:
        assert r.data_start % 8 == 0
        assert torch.equal(r.read(name), torch.arange(3, dtype=torch.float32))
    raw = path.read_bytes()
    header = raw[8:r.data_start]
    assert header.rstrip(b" ").endswith(b"}") and set(header[len(header.rstrip(b" ")):]) <= {32}
