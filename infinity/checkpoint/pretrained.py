"""The weights of a Hugging Face model directory, read straight into the engine's units.

A pretrained directory holds ``model.safetensors``, or shards named by
``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``). ``PretrainedWeights``
opens it, checks it whole before anything is built (every file the index names is there and
holds the tensors it is said to; the tensors match the model's parameters by name and shape:
missing, unexpected and mismatched ones are listed in one error), then serves as the
engine's ``UnitValues`` (zero/protocols.py): each unit, as it is placed in its home tier, has
the range its home holds (its own shard at stage 3 with several ranks) read from the files
into its buffer, converted to the compute dtype on the way. Nothing is initialised then
overwritten, so an NVMe home is written once.

Memory: the files are read with O_DIRECT (no page cache) through a few bounded buffers
(``CONVERT_BYTES``), ahead of the conversions into the units by a helper thread (see [Note:
reads ahead of conversions]), so what a load holds is about one unit, whatever the size of
the model. Names: a parameter matches the checkpoint under any of its names (tied weights:
``lm_head.weight`` is ``model.embed_tokens.weight``), and the model's ``base_model_prefix`` is
added or removed when the checkpoint was saved from the base model or the model with a head
(as transformers does). Keys the model class says to ignore (``_keys_to_ignore_on_load_*``)
and keys naming non-persistent buffers (an old checkpoint's rotary ``inv_freq``) are not
unexpected.
"""
from __future__ import annotations

import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.checkpoint.pretrained_files import (
    INDEX_NAME,
    OPEN_ATTEMPTS,
    commit_point,
    weight_map,
)
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader, TensorInfo
from infinity.io.buffers import aligned_empty
from infinity.zero.persistent_buffers import all_persistent_buffers

log = get_logger("checkpoint")

READ_PIECE_BYTES = 32 << 20     # buffered reads: pages dropped from the page cache behind each
CONVERT_BYTES = 16 << 20        # the buffers a read goes through (O_DIRECT, or a cast)
RING = 3                        # how many (the reader runs up to RING - 1 pieces ahead)
DIRECT_ALIGN = 4096             # O_DIRECT offsets and lengths
LISTED = 20                     # names listed in an error, per kind
FUSED_KEPT = 2                  # fused tensors kept for a unit's next piece


class PretrainedMismatchError(CheckpointError):
    """The checkpoint's tensors do not match the model's parameters (names or shapes)."""


@dataclass
class _Source:
    """Where a parameter's values are: a tensor of one file."""

    reader: TensorFileReader
    info: TensorInfo
    direct_fd: int | None = None       # the file opened with O_DIRECT, where it can be
    fused: Any = None                  # (Fusion, its parts' sources): see [Note: fused tensors]


TIE_COMPARE_BYTES = 32 << 20
"""The piece of each tensor read at a time when a tied parameter's copies are compared."""


def _refuse_two_values_for_a_tie(names: list[str], first_key: str, first: _Source,
                                 other_key: str, other: _Source) -> None:
    """The model ties ``names`` into one parameter (``tie_word_embeddings``) and the checkpoint
    holds two of them: the same values (a save that wrote both) load as one; different ones
    are refused. transformers unties them then (its load keeps both), so serving the tie from
    the first would change the model's outputs, silently (a head 30 logits away). Compared a
    piece at a time (a large vocabulary's embedding is gigabytes)."""
    same = first.fused is None and other.fused is None and \
        first.info.shape == other.info.shape and first.info.dtype == other.info.dtype
    n = first.info.numel
    step = max(1, TIE_COMPARE_BYTES // max(1, first.info.dtype.itemsize))
    pieces = [torch.empty(min(step, n), dtype=first.info.dtype) for _ in range(2)] if same \
        else []
    start = 0
    while same and start < n:
        count = min(step, n - start)
        a, b = (piece[:count] for piece in pieces)
        first.reader.read_into(first.info.name, a, start)
        other.reader.read_into(other.info.name, b, start)
        same = torch.equal(a, b)
        start += count
    if not same:
        raise PretrainedMismatchError(
            f"the model ties {' and '.join(names)} into one parameter, but the checkpoint holds "
            f"{first_key} ({first.reader.path.name}) and {other_key} "
            f"({other.reader.path.name}) with different values (transformers keeps both then, "
            "untied): pass tie_word_embeddings=False to infinity.from_pretrained (a config "
            "override, as with transformers' from_pretrained), or set it in config.json")


@dataclass
class MatchReport:
    """How the checkpoint's tensors matched the model (what ``strict=False`` lets pass)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    missing_buffers: list[str] = field(default_factory=list)


class PretrainedWeights:
    """A pretrained directory's tensors, checked and matched to a model, served to the units
    being placed (``provides`` / ``fill``, see ``UnitValues`` in zero/protocols.py)."""

    def __init__(self, source: str | Path, *, drop_cache: bool = True,
                 direct_io: bool = True) -> None:
        self.directory, mapping = weight_map(Path(source))
        self.drop_cache = drop_cache
        self.direct_io = direct_io
        self._direct_fds: dict[str, int] = {}
        self._readers: dict[str, TensorFileReader] = {}
        self._indexed: set[str] = set()
        self._tensors: dict[str, _Source] = {}
        self._params: dict[str, _Source] = {}        # every name of each matched parameter
        self._buffers: dict[str, _Source] = {}
        self._ring: list[torch.Tensor] | None = None      # see [Note: reads ahead of conversions]
        self._fused_kept: dict[str, torch.Tensor] = {}    # see [Note: fused tensors]
        self._reader: ThreadPoolExecutor | None = None
        self.bytes_read = 0
        try:
            self._open_one_save(Path(source), mapping)
        except BaseException:
            self.close()
            raise

    def _open_one_save(self, source: Path, mapping: dict[str, str]) -> None:
        """Open the files of one save: where the commit point (``model.safetensors``, or the
        index) changed while the shards were being opened, another process saved over the
        directory, and the files opened may be two saves' (weights_dir.py gives a new save's
        shards names the index before it does not name, but a third save may take the first
        one's names again): open them again, from the new commit."""
        for _ in range(OPEN_ATTEMPTS):
            seen = commit_point(source)
            try:
                self._open(mapping)
            except (CheckpointError, FileNotFoundError):
                if commit_point(source) == seen:
                    raise
            else:
                if commit_point(source) == seen:
                    return
            log.info("%s was saved over while it was being opened; opening it again",
                     self.directory)
            self.close()
            self._tensors.clear()
            self.directory, mapping = weight_map(source)
        raise CheckpointError(f"{self.directory} was saved over {OPEN_ATTEMPTS} times while it "
                              "was being opened: another process keeps saving into it; load "
                              "it when that save is done, or from a copy")

    def _open(self, mapping: dict[str, str]) -> None:
        self._indexed = set(mapping)      # the names as the files give them (before renames)
        by_file: dict[str, list[str]] = {}
        for name, file in mapping.items():
            by_file.setdefault(file, []).append(name)
        absent = {f: names for f, names in by_file.items() if not (self.directory / f).is_file()}
        if absent:
            listed = "; ".join(f"{f} (holds {len(n)} tensors, e.g. {sorted(n)[0]})"
                               for f, n in sorted(absent.items()))
            raise CheckpointError(f"{self.directory}: the shard file(s) that {INDEX_NAME} "
                                  f"names are missing: {listed}. Copy the whole directory "
                                  "again (an interrupted download?)")
        for file, names in sorted(by_file.items()):
            reader = TensorFileReader(self.directory / file)
            self._readers[file] = reader
            direct_fd = self._open_direct(self.directory / file)
            lacking = sorted(set(names) - set(reader.tensors))
            if lacking:
                raise CheckpointError(
                    f"{self.directory / file} lacks {len(lacking)} tensor(s) that {INDEX_NAME} "
                    f"says it holds: {', '.join(lacking[:LISTED])}. The directory is damaged "
                    "or its shards come from different saves")
            for name in names:
                self._tensors[name] = _Source(reader, reader.tensors[name], direct_fd)

    def _open_direct(self, path: Path) -> int | None:
        """A second descriptor of ``path`` with O_DIRECT, or None where the filesystem refuses
        it (tmpfs) or ``direct_io`` is off (see [Note: reads ahead of conversions])."""
        if not self.direct_io or not hasattr(os, "O_DIRECT"):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return None
        self._direct_fds[str(path)] = fd
        return fd

    # -- the match ----------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Every tensor name of the checkpoint."""
        return list(self._tensors)

    def file_of(self, key: str) -> Path:
        return self._tensors[key].reader.path

    def match(self, model: nn.Module, *, strict: bool = True,
              ignore_mismatched_sizes: bool = False, prefix: str = "",
              ignore_unexpected: Sequence[str] = (),
              ignore_missing: Sequence[str] = (),
              renamed: Callable[[str], str] | None = None,
              fusions: Callable[[Iterable[str]], Mapping[str, Any]] | None = None
              ) -> MatchReport:
        """Match the checkpoint to ``model``'s parameters (their full shapes: a model on the
        meta device or under ``zero.Init``) and persistent buffers. Raises
        ``PretrainedMismatchError`` listing what is wrong: shapes that differ (unless
        ``ignore_mismatched_sizes``: those parameters keep the model's init), and, with
        ``strict``, parameters the checkpoint lacks and tensors the model lacks. Unmatched
        parameters keep the model's init, as transformers leaves them (logged). ``prefix``:
        the model's ``base_model_prefix``; ``ignore_unexpected`` / ``ignore_missing``:
        patterns (regular expressions) of names that are neither. ``renamed``: a checkpoint
        key -> the model's name for it (transformers' load-time renamings, see
        engine/hf_conversions.py); ``fusions``: the (renamed) keys -> the model tensors
        transformers fuses from them (``Fusion``: target, parts, build), served as one tensor
        built from its parts (see [Note: fused tensors])."""
        if renamed is not None:
            self._rename_keys(renamed)
        if fusions is not None:
            self._fuse(fusions(list(self._tensors)))
        key_for = _key_mapper(model, self._tensors, prefix)
        names_of: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
            params[id(p)] = p
        report = MatchReport()
        used: set[str] = set()
        for pid, names in names_of.items():
            keys = [key_for(n) for n in names]
            present = [k for k in keys if k in self._tensors]
            used.update(present)
            if not present:
                report.missing.append(names[0])
                continue
            source = self._tensors[present[0]]
            shape = tuple(params[pid].shape)
            if source.info.shape != shape:
                report.mismatched.append(
                    f"{names[0]}: checkpoint {list(source.info.shape)} in "
                    f"{source.reader.path.name}, model {list(shape)}")
                continue
            if not source.info.dtype.is_floating_point:
                raise PretrainedMismatchError(
                    f"{present[0]} in {source.reader.path} is {source.info.dtype}, but the "
                    f"model's {names[0]} is a floating point parameter")
            for other in present[1:]:
                _refuse_two_values_for_a_tie(names, present[0], source, other,
                                             self._tensors[other])
            for n in names:
                self._params[n] = source
        persistent = all_persistent_buffers(model)
        persistent_names = {n for n, _ in persistent}
        for name, buf in persistent:
            key = key_for(name)
            if key not in self._tensors:
                report.missing_buffers.append(name)
                continue
            used.add(key)
            source = self._tensors[key]
            if source.info.shape != tuple(buf.shape):
                report.mismatched.append(f"{name} (buffer): checkpoint {list(source.info.shape)} "
                                         f"in {source.reader.path.name}, model {list(buf.shape)}")
                continue
            self._buffers[name] = source
        for name, _ in model.named_buffers(remove_duplicate=False):
            if name not in persistent_names and key_for(name) in self._tensors:
                used.add(key_for(name))       # rebuilt by the model: the saved copy is ignored
        skip_unexpected = [re.compile(p) for p in ignore_unexpected]
        skip_missing = [re.compile(p) for p in ignore_missing]
        report.unexpected = sorted(k for k in self._tensors if k not in used
                                   and not any(p.search(k) for p in skip_unexpected))
        report.missing = [n for n in report.missing if not any(p.search(n) for p in skip_missing)]
        self._check(report, strict, ignore_mismatched_sizes)
        return report

    def _rename_keys(self, renamed: Callable[[str], str]) -> None:
        """The tensors under the model's names for them (the files keep theirs)."""
        by_name: dict[str, _Source] = {}
        for key, source in self._tensors.items():
            name = renamed(key)
            if name in by_name:
                raise PretrainedMismatchError(
                    f"{self.directory}: two tensors of the checkpoint are the model's {name} "
                    f"after transformers' load-time renaming ({key} in {source.reader.path.name}"
                    f" and another): the directory mixes two layouts; save it again")
            by_name[name] = source
        self._tensors = by_name

    # [Note: fused tensors]
    # transformers fuses some checkpoint tensors into one model tensor while loading (a MoE's
    # per-expert w1 / w3 into experts.gate_up_proj). Such a tensor is a source of its own: its
    # shape and dtype from building it on the meta device, its values built with transformers'
    # operations from its parts, read whole (a unit's experts, about what the unit holds), when
    # a unit asks for any of its range; kept for the next piece of the same unit (FUSED_KEPT
    # tensors), since a unit's range may come in several pieces.
    def _fuse(self, fusions: Mapping[str, Any]) -> None:
        for target, fusion in fusions.items():
            parts = {k: self._tensors.pop(k) for k in fusion.parts}
            meta = fusion.build(lambda k: torch.empty(parts[k].info.shape,
                                                      dtype=parts[k].info.dtype, device="meta"))
            first = parts[fusion.parts[0]]
            info = TensorInfo(name=target, dtype=meta.dtype, shape=tuple(meta.shape),
                              begin=0, end=0)
            self._tensors[target] = _Source(first.reader, info, fused=(fusion, parts))

    def _fused_value(self, source: _Source) -> torch.Tensor:
        fusion, parts = source.fused
        kept = self._fused_kept.get(fusion.target)
        if kept is not None:
            return kept

        value = fusion.build(lambda key: self._read_whole(parts[key])).contiguous()
        self._fused_kept[fusion.target] = value
        while len(self._fused_kept) > FUSED_KEPT:
            self._fused_kept.pop(next(iter(self._fused_kept)))
        return value

    def _check(self, report: MatchReport, strict: bool, ignore_mismatched: bool) -> None:
        problems = []
        if report.mismatched and not ignore_mismatched:
            problems.append(f"{len(report.mismatched)} shape(s) differ: "
                            + "; ".join(report.mismatched[:LISTED]))
        if strict and report.missing:
            # tensors a shard holds that the index does not list: the likely reason
            unindexed = sorted(f"{n} ({file})" for file, reader in self._readers.items()
                               for n in reader.tensors if n not in self._indexed)
            problems.append(f"{len(report.missing)} parameter(s) of the model are not in it: "
                            + ", ".join(report.missing[:LISTED])
                            + (f" (the shard files hold {len(unindexed)} tensor(s) that "
                               f"{INDEX_NAME} does not list, e.g. {unindexed[0]}: an index that "
                               "names only part of the weights)" if unindexed else ""))
        if strict and report.unexpected:
            problems.append(f"{len(report.unexpected)} tensor(s) of it are not in the model: "
                            + ", ".join(f"{k} ({self.file_of(k).name})"
                                        for k in report.unexpected[:LISTED]))
        if problems:
            fixes = []
            if report.mismatched and not ignore_mismatched:
                fixes.append("ignore_mismatched_sizes=True initialises the mismatched ones")
            if strict and (report.missing or report.unexpected):
                fixes.append("strict=False loads what matches and leaves the rest at a random "
                             "init")
            raise PretrainedMismatchError(
                f"the checkpoint in {self.directory} does not match the model: "
                + " | ".join(problems) + " (nothing was loaded; " + "; ".join(fixes) + ")")
        if report.mismatched:
            log.warning("%s: %d parameter(s) of another shape keep the model's init: %s",
                        self.directory, len(report.mismatched), "; ".join(report.mismatched[:5]))
        if report.missing:
            log.warning("%s: %d parameter(s) not in the checkpoint were not loaded and are "
                        "random (the model's init): %s", self.directory, len(report.missing),
                        ", ".join(report.missing[:5]))
        if report.unexpected:
            log.warning("%s: %d tensor(s) not in the model were not loaded: %s",
                        self.directory, len(report.unexpected), ", ".join(report.unexpected[:5]))
        if report.missing_buffers:
            log.info("%s: buffer(s) not in the checkpoint keep the model's values: %s",
                     self.directory, ", ".join(report.missing_buffers[:5]))

    def rename(self, names: Mapping[str, str]) -> None:
        """The model's parameters were renamed (wrapped in another module): ``names`` maps each
        new name to the old one; the matched parameters are served under the new names."""
        self._params = {new: self._params[old] for new, old in names.items()
                        if old in self._params}

    # -- UnitValues ---------------------------------------------------------------------
    def provides(self, name: str) -> bool:
        return name in self._params

    def numel_of(self, name: str) -> int | None:
        """The elements the checkpoint holds for parameter ``name`` (None: assembled from
        several tensors, [Note: fused tensors])."""
        source = self._params[name]
        return None if source.fused is not None else source.info.numel

    def fill(self, pieces: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """See [Note: reads ahead of conversions] and [Note: fused tensors]."""
        plain = []
        for name, start, out in pieces:
            source = self._params[name]
            if source.fused is None:
                plain.append(self._jobs(source, start, out))
                continue
            piece = self._fused_value(source).reshape(-1)[start:start + out.numel()]
            out.copy_(piece.reshape(out.shape))       # cast to the unit's dtype
        self._run(plain)

    def load_buffers(self, model: nn.Module) -> None:
        """Copy the checkpoint's persistent buffers into ``model``'s (small: read whole)."""
        buffers = dict(all_persistent_buffers(model))
        with torch.no_grad():
            for name, source in self._buffers.items():
                buffers[name].copy_(self._read_whole(source))

    def _read_whole(self, source: _Source) -> torch.Tensor:
        """A source's whole tensor, in its own dtype (a fused one built from its parts)."""
        if source.fused is not None:
            return self._fused_value(source)
        value = torch.empty(source.info.shape, dtype=source.info.dtype)
        self._run([self._jobs(source, 0, value.reshape(-1))])
        return value

    # [Note: reads ahead of conversions]
    # A unit's pieces are cut in jobs of at most CONVERT_BYTES, each read into one of RING
    # page-aligned host buffers with O_DIRECT (the aligned blocks around the piece: the disk
    # writes straight into the buffer, no page cache, no kernel copy), then copied into the
    # unit's buffer with the cast. One reader thread runs the preads (which release the GIL)
    # up to RING - 1 jobs ahead of the caller, who copies: reading the files and converting
    # overlap. A ring buffer is reused only after its copy (the reader is never more than
    # RING - 1 jobs ahead), and a failure waits for every read in flight. Where O_DIRECT is
    # refused (tmpfs) the reads go through the page cache, straight into the unit's buffer
    # when the dtypes agree, and each piece's pages are dropped behind it.
    def _jobs(self, source: _Source, start: int, out: torch.Tensor) -> list[tuple]:
        n = out.numel()
        info = source.info
        if start + n > info.numel:      # never the bytes of the tensor after it in the file
            raise CheckpointError(f"{info.name}: elements [{start}, {start + n}) asked of a "
                                  f"tensor of {info.numel} ({list(info.shape)}): the parameter "
                                  "is larger than the checkpoint's tensor")
        item = info.dtype.itemsize
        if source.direct_fd is not None:
            mode = "direct"
        elif out.device.type == "cpu" and out.dtype == info.dtype and out.is_contiguous():
            mode = "straight"
        else:
            mode = "ring"
        step = max(1, (READ_PIECE_BYTES if mode == "straight" else CONVERT_BYTES) // item)
        flat = out.reshape(-1) if out.is_contiguous() else out
        return [(source, start + a, min(step, n - a), flat[a:a + min(step, n - a)], mode)
                for a in range(0, n, step)]

    def _run(self, groups: list[list[tuple]]) -> None:
        jobs = [job for group in groups for job in group]
        if not jobs:
            return
        if self._ring is None:
            self._ring = [aligned_empty(CONVERT_BYTES + 2 * DIRECT_ALIGN, pin=False)
                          for _ in range(RING)]
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="pretrained-read")
        in_flight: deque = deque()

        def submit(i: int) -> None:
            source, first, count, out, mode = jobs[i]
            buf = out if mode == "straight" else self._ring[i % RING]
            in_flight.append((jobs[i], self._reader.submit(self._pread, source, first, count,
                                                           buf, mode)))

        ahead = 0
        try:
            while ahead < min(RING - 1, len(jobs)):
                submit(ahead)
                ahead += 1
            for _ in range(len(jobs)):
                (_, _, _, out, mode), read = in_flight.popleft()
                values = read.result()
                if ahead < len(jobs):
                    submit(ahead)
                    ahead += 1
                if mode != "straight":
                    out.copy_(values)
        finally:
            for _, read in in_flight:
                read.exception()         # waits; the error raised first is the one reported

    def _pread(self, source: _Source, first: int, count: int, buf: torch.Tensor,
               mode: str) -> torch.Tensor:
        """Elements [first, first + count) of the source's tensor: read into ``buf`` (the
        target itself when ``mode`` is "straight"); the tensor holding them."""
        reader, info = source.reader, source.info
        item = info.dtype.itemsize
        self.bytes_read += count * item
        if mode == "direct":
            start = reader.data_start + info.begin + first * item
            end = start + count * item
            a0 = start - start % DIRECT_ALIGN
            a1 = -(-end // DIRECT_ALIGN) * DIRECT_ALIGN
            view = memoryview(buf.numpy())[:a1 - a0]
            done = 0
            while done < end - a0:
                try:
                    n = os.preadv(source.direct_fd, [view[done:]], a0 + done)
                except OSError as exc:
                    raise OSError(exc.errno, f"reading {a1 - a0} bytes at {a0} from "
                                             f"{reader.path}: {exc.strerror}") from None
                if n <= 0:
                    raise CheckpointError(f"{reader.path}: short read of tensor {info.name} at "
                                          f"byte {a0 + done}: the file shrank while being read")
                done += n
            raw = buf[start - a0:end - a0]
            if (start - a0) % item:      # a tensor not aligned to its element size
                raw = raw.clone()
            return raw.view(info.dtype)
        target = buf if mode == "straight" else buf[:count * item].view(info.dtype)
        reader.read_into(info.name, target, first)
        if self.drop_cache:
            reader.drop_cached(info.name, first, count)
        return target

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        for fd in self._direct_fds.values():
            os.close(fd)
        self._direct_fds.clear()
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._ring = None
        self._fused_kept.clear()

    def __enter__(self) -> "PretrainedWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key_mapper(model: nn.Module, keys: Iterable[str], prefix: str):
    """name in the model -> its key in the checkpoint: the same, or with ``prefix`` (the
    model's ``base_model_prefix``) removed (the checkpoint is a base model's, the model has a
    head) or added (the other way), as transformers maps them."""
    keys = set(keys)
    if not prefix:
        return lambda name: name
    dot = prefix + "."
    checkpoint_has = any(k.startswith(dot) for k in keys)
    model_has = any(n.startswith(dot) for n, _ in model.named_parameters())
    if model_has and not checkpoint_has:
        return lambda name: name[len(dot):] if name.startswith(dot) else name
    if checkpoint_has and not model_has:
        return lambda name: dot + name
    return lambda name: name

