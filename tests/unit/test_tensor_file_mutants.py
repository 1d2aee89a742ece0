"""Tensor files: behaviours that mutation testing (tools/mutation.py, issue 23) found unchecked by
test_tensor_file.py -- the whole-file checksum the manifest records, and that an aborted writer lets
go of its file."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from infinity.checkpoint import tensor_file as tf
from infinity.checkpoint.tensor_file import TensorFileReader, TensorFileWriter, sha256_of_file


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
