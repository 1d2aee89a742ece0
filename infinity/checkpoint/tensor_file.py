"""Tensor files in the safetensors format, written and read a piece at a time.

A checkpoint of an out-of-core model cannot be gathered into one dict first (the ``safetensors``
package's ``save_file`` needs every tensor in memory), so the writer takes the table of tensors
up front, writes the header, then takes each tensor's bytes in order, in as many pieces as the
caller has, hashing as it goes. The reader parses and checks the header and reads any range of
a tensor into a caller's buffer with ``pread``. Files are plain safetensors: the ``safetensors``
package (and anything built on it) opens them.

Layout: an 8-byte little-endian header length, the JSON header (padded with spaces to a multiple
of 8 bytes), then the tensors' bytes back to back in header order.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import queue
import struct
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# safetensors' dtype names
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.complex64: "C64",     # a RoPE table kept as a complex buffer
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
MAX_HEADER_BYTES = 256 << 20      # a header is a table of names and shapes, never this big
HASH_CHUNK = 8 << 20
PARALLEL_HASH_BYTES = 1 << 20   # pieces this large are hashed while they are written


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not match the model."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: dtype, shape and its byte range in the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _HashThread:
    """One daemon thread that runs hash updates handed to it, in order (hashlib releases the
    GIL, so a piece is hashed while the caller writes or reads the next).

    Not a ThreadPoolExecutor: its worker is not a daemon, and concurrent.futures registers it
    for the join at exit only after it has started, so a Ctrl-C landing in between (a load
    interrupted as it begins to hash) left a worker nothing would ever stop, and the
    interpreter waited for it forever at exit (found by the crash test)."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="checkpoint-hash", daemon=True).start()

    def submit(self, update: Callable[[Any], None], data: Any) -> Future:
        done: Future = Future()
        self._work.put((done, update, data))
        return done

    def _run(self) -> None:
        while True:
            done, update, data = self._work.get()
            try:
                update(data)
            except BaseException as exc:        # handed to the waiting caller
                done.set_exception(exc)
            else:
                done.set_result(None)


@functools.lru_cache(maxsize=1)
def _hash_thread() -> _HashThread:
    return _HashThread()


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _as_bytes(values: torch.Tensor) -> memoryview:
    """A host tensor's bytes, without a copy when it is contiguous."""
    flat = values.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


class TensorFileWriter:
    """Writes ``tensors`` (name, dtype, shape), in that order, to ``path`` in safetensors form.

    ``append(name, values)`` adds the next bytes of tensor ``name`` (the current one, or the
    next one once the current is complete); ``close()`` checks every tensor is complete, fsyncs
    and returns (bytes, sha256 of the whole file).
    """

    def __init__(self, path: Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self.tensors: list[TensorInfo] = []
        offset = 0
        for name, dtype, shape in tensors:
            if dtype not in DTYPE_NAMES:
                raise TypeError(
                    f"tensor {name}: dtype {dtype} has no safetensors name, so it cannot go in a "
                    f"checkpoint (safetensors holds {', '.join(sorted(DTYPES_BY_NAME))}). If it "
                    "is a buffer the model rebuilds itself, register it with persistent=False; "
                    "else keep it in a dtype of that list")
            if name in header:
                raise ValueError(f"tensor {name} appears twice in one file")
            size = itemsize(dtype)
            for d in shape:
                size *= d
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self.tensors.append(TensorInfo(name, dtype, tuple(shape), offset, offset + size))
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.path = path
        self._hash = hashlib.sha256()
        self._file = open(path, "xb")     # noqa: SIM115 - closed in close()/abort()
        self._bytes = 0
        self._index = 0       # the tensor being written
        self._written = 0     # its bytes written so far
        self._raw(struct.pack("<Q", len(encoded)) + encoded)
        self._skip_empty()

    def _raw(self, data) -> None:
        if len(data) >= PARALLEL_HASH_BYTES:
            # both release the GIL: hash on a helper thread while this one writes
            hashed = _hash_thread().submit(self._hash.update, data)
            try:
                self._file.write(data)
            finally:
                hashed.result()
        else:
            self._file.write(data)
            self._hash.update(data)
        self._bytes += len(data)

    def _skip_empty(self) -> None:
        while self._index < len(self.tensors) and \
                self.tensors[self._index].end == self.tensors[self._index].begin:
            self._index += 1

    @property
    def complete(self) -> bool:
        """Every tensor has all its bytes."""
        return self._index >= len(self.tensors)

    def append(self, name: str, values: torch.Tensor) -> None:
        """The next ``values.numel()`` elements of tensor ``name`` (in the file's dtype)."""
        if self._index >= len(self.tensors):
            raise ValueError(f"{self.path.name}: every tensor is complete; got more for {name}")
        current = self.tensors[self._index]
        if current.name != name:
            raise ValueError(f"{self.path.name}: tensor {current.name} is written now "
                             f"({self._written} of {current.end - current.begin} bytes); got {name}")
        if values.dtype != current.dtype:
            raise TypeError(f"{self.path.name}: tensor {name} is {current.dtype}, got {values.dtype}")
        data = _as_bytes(values)
        if self._written + len(data) > current.end - current.begin:
            raise ValueError(f"{self.path.name}: tensor {name} has {current.end - current.begin} "
                             f"bytes; {self._written + len(data)} were given")
        self._raw(data)
        self._written += len(data)
        if self._written == current.end - current.begin:
            self._index += 1
            self._written = 0
            self._skip_empty()

    def close(self) -> tuple[int, str]:
        """Check completeness, flush to disk; (file bytes, sha256 hex)."""
        if self._index < len(self.tensors):
            missing = self.tensors[self._index].name
            self.abort()
            raise ValueError(f"{self.path.name}: tensor {missing} and {len(self.tensors) - self._index - 1} "
                             "after it were not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        _drop_from_page_cache(self._file.fileno())
        self._file.close()
        return self._bytes, self._hash.hexdigest()

    def abort(self) -> None:
        """Close without checks (the caller removes the file with its directory)."""
        if not self._file.closed:
            self._file.close()


class TensorFileReader:
    """The table of a safetensors file, checked, and ``read_into`` for any tensor range."""

    def __init__(self, path: Path, fd: int | None = None) -> None:
        """``fd``: the file already open (a checkpoint's pinned save), owned from here on;
        else ``path`` is opened."""
        self.path = path
        if fd is not None:
            self._fd = fd
        else:
            try:
                self._fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint file {path} is missing") from None
        try:
            self.tensors, self.metadata, self.data_start = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{self.path} is truncated ({size} bytes): not a tensor file")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{self.path}: header length {length} does not fit in the "
                                  f"file's {size} bytes: the file is truncated or not a tensor file")
        tensors, metadata = _parse_header(self.path, os.pread(self._fd, length, 8))
        data_bytes = max((t.end for t in tensors.values()), default=0)
        if 8 + length + data_bytes != size:
            raise CheckpointError(
                f"{self.path} has {size} bytes but its header describes {8 + length + data_bytes}: "
                "the file is truncated (an interrupted save?) or was changed")
        return tensors, metadata, 8 + length

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name}") from None

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Fill host tensor ``out`` with elements [start, start + out.numel()) of ``name``
        (``out`` has the file's dtype and is contiguous)."""
        info = self.info(name)
        if out.dtype != info.dtype:
            raise TypeError(f"{self.path}: tensor {name} is {info.dtype}, asked into {out.dtype}")
        if start < 0 or start + out.numel() > info.numel:
            raise ValueError(f"{self.path}: tensor {name} has {info.numel} elements; asked for "
                             f"[{start}, {start + out.numel()})")
        view = memoryview(out.view(torch.uint8).numpy())
        offset = self.data_start + info.begin + start * itemsize(info.dtype)
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path}: short read of tensor {name} at byte "
                                      f"{offset + done}: the file shrank while being read")
            done += n

    def drop_cached(self, name: str, start: int, count: int) -> None:
        """Drop the page-cache pages of elements [start, start + count) of ``name``: a tensor
        read once (a pretrained load) should not fill memory with its file's pages."""
        info = self.info(name)
        size = itemsize(info.dtype)
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd, self.data_start + info.begin + start * size,
                                 count * size, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor (for small ones: buffers, exports)."""
        info = self.info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        if info.numel:
            self.read_into(name, out.reshape(-1))
        return out

    def close(self) -> None:
        if self._fd >= 0:
            _drop_from_page_cache(self._fd)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "TensorFileReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"key {twice[0]!r} appears twice")
    return dict(pairs)


def _is_int(value: object) -> bool:
    return type(value) is int       # JSON's integers; not a float, a string or a bool


def _parse_header(path: Path, raw: bytes) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The table of tensors and the metadata of a header, every part of it checked.

    A header is read from a file that may be damaged or not ours (its checksum may have been
    rewritten to match, or checking turned off), so valid JSON of the wrong shape (a list, an
    entry that is a string, offsets that are floats) is a CheckpointError naming the file, never
    a TypeError from deep inside. Entries are checked the way the ``safetensors`` package does:
    an object of tensor name -> {dtype, shape, data_offsets} plus an optional ``__metadata__`` of
    strings, whole non-negative numbers, and byte ranges that tile the data section in order.
    """
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:   # JSONDecodeError too
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise CheckpointError(f"{path}: unreadable header ({what}): the file is damaged or not "
                              "a tensor file") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is a JSON {type(header).__name__}, not an "
                              "object of tensors: the file is damaged or not a tensor file")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: the header's __metadata__ must be an object of strings; "
                              f"it is {str(metadata)[:200]}")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        def malformed(why: str, name: str = name, entry: object = entry) -> CheckpointError:
            return CheckpointError(f"{path}: malformed entry for tensor {name} ({why}): "
                                   f"{str(entry)[:200]}")
        if not isinstance(entry, dict):
            raise malformed(f"a JSON {type(entry).__name__}, not an object")
        missing = {"dtype", "shape", "data_offsets"} - entry.keys()
        if missing:
            raise malformed(f"no {', '.join(sorted(missing))}")
        dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES_BY_NAME:
            raise malformed(f"dtype {dtype_name!r} is none of {', '.join(sorted(DTYPES_BY_NAME))}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise malformed("shape is not a list of whole numbers >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_int(x) and x >= 0 for x in offsets)):
            raise malformed("data_offsets is not two whole numbers >= 0")
        dtype, (begin, end) = DTYPES_BY_NAME[dtype_name], offsets
        info = TensorInfo(name, dtype, tuple(shape), begin, end)
        if end - begin != info.numel * itemsize(dtype):
            raise CheckpointError(f"{path}: tensor {name} spans [{begin}, {end}), which does not "
                                  f"match {dtype_name} {shape}")
        tensors[name] = info
    expected = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != expected:
            raise CheckpointError(
                f"{path}: tensor {info.name} starts at byte {info.begin} of the data, but the "
                f"tensors before it end at {expected}: tensors overlap or leave a gap, so the "
                "header is damaged")
        expected = info.end
    return tensors, metadata


def sha256_of_file(path: Path) -> str:
    """The sha256 of the file at ``path`` (``sha256_of_fd``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return sha256_of_fd(fd)
    finally:
        os.close(fd)


def sha256_of_fd(fd: int) -> str:
    """The sha256 of an open file, from its first byte (its offset is not used), read in
    8 MiB pieces, each hashed on a helper thread while the next is read (and dropped from the
    page cache after)."""
    digest = hashlib.sha256()
    buffers = (bytearray(HASH_CHUNK), bytearray(HASH_CHUNK))
    hashing = None
    offset = 0
    for i in itertools.count():
        buf = buffers[i & 1]         # the other one may be being hashed
        n = os.preadv(fd, [buf], offset)
        offset += n
        if hashing is not None:
            hashing.result()
        if not n:
            break
        hashing = _hash_thread().submit(digest.update, memoryview(buf)[:n])
    _drop_from_page_cache(fd)
    return digest.hexdigest()


def _drop_from_page_cache(fd: int) -> None:
    """A checkpoint is written or read once: its pages should not push the training's out."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
