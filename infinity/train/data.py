"""Training text for ``infinity train``: the shipped corpus or the user's file, as byte tokens.

Why bytes: a byte-level vocabulary (256 byte values plus a few special ids) needs no tokenizer
download and no tokenizer file, so the default run works offline on any text. ``--data`` takes a
plain-text file, or JSON lines with a ``text`` field (one document per line; documents are joined
with an end-of-text id). Batches are random windows of the token stream, drawn from a seeded
generator so that two runs with the same seed see the same batches.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any
from importlib import resources
from pathlib import Path

import torch

from infinity.base.log import get_logger

BYTE_IDS = 256
"""Ids 0..255 are the bytes of the text."""
BOS_ID = 256
"""Beginning of text (unused by the default stream, reserved for callers)."""
EOS_ID = 257
"""End of a document (separates JSON-lines documents)."""
PAD_ID = 258
"""Padding (reserved)."""
VOCAB_SIZE = 260
"""Byte ids plus the special ids, rounded up to a multiple of 4."""

DEFAULT_CORPUS = "kjv_excerpt.txt"
"""File name of the shipped corpus under ``infinity/data`` (see infinity/data/README.md)."""

_log = get_logger("train")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


@dataclass(frozen=True)
class Corpus:
    """A token stream and where it came from."""

    tokens: torch.Tensor
    """int64 ids, one per byte (plus EOS between JSON-lines documents)."""
    source: str
    """The path it was read from (for logs and the summary)."""
    documents: int
    """Documents read (1 for plain text)."""
    tokenizer: str | None = None
    """The tokenizer's directory when the text was tokenized (``--pretrained``); None: bytes."""
    digest: str = ""
    """sha256 of the file's bytes: what a resumed run checks its data by (a path names the
    same file in many ways, and another file under the same name)."""


def default_corpus_path() -> Path:
    """The shipped public-domain corpus (package data, installed with the wheel)."""
    path = Path(str(resources.files("infinity").joinpath("data", DEFAULT_CORPUS)))
    if not path.is_file():
        raise FileNotFoundError(f"the shipped corpus {path} is missing from this installation; "
                                "reinstall infinity or pass --data FILE")
    return path


def load_corpus(path: str | Path | None = None, tokenizer: Any = None) -> Corpus:
    """Read ``path`` (``None``: the shipped corpus) into byte tokens, or into ``tokenizer``'s
    ids (a transformers tokenizer; documents joined by its end-of-text id when it has one).

    JSON lines are recognised by the suffix (.jsonl, .ndjson, .json) or by a first non-blank line
    that is a JSON object with a ``text`` field (a text file whose first line is code starting
    with ``{`` stays text). Raises FileNotFoundError for a missing file and ValueError for a
    directory, an empty corpus, or a JSON line without a string ``text`` field.
    """
    source = default_corpus_path() if path is None else Path(path)
    if not source.exists():
        raise FileNotFoundError(f"data file {source} does not exist; pass --data with a plain-text "
                                "file or a JSON-lines file with a \"text\" field")
    if source.is_dir():
        raise ValueError(f"data path {source} is a directory; pass --data with one file "
                         "(plain text, or JSON lines with a \"text\" field)")
    raw = source.read_bytes()
    if tokenizer is not None:
        return _tokenized(source, raw, tokenizer)
    if _looks_like_jsonl(source, raw):
        texts = _jsonl_texts(source, raw)
        documents = len(texts)
        pieces: list[torch.Tensor] = []
        for text in texts:
            pieces.append(_bytes_to_tokens(text.encode("utf-8")))
            pieces.append(torch.tensor([EOS_ID], dtype=torch.int64))
        tokens = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        content = sum(len(t) for t in texts)
    else:
        documents = 1
        tokens = _bytes_to_tokens(raw)
        content = len(raw.strip())
    if content == 0:
        raise ValueError(f"data file {source} is empty (no text in {len(raw)} bytes); pass --data "
                         "with a file that holds some text")
    return Corpus(tokens=tokens, source=str(source), documents=documents,
                  digest=hashlib.sha256(raw).hexdigest())


def _tokenized(source: Path, raw: bytes, tokenizer: Any) -> Corpus:
    """The documents of ``source`` (JSON lines, or the whole file as one) as ``tokenizer``'s ids."""
    if _looks_like_jsonl(source, raw):
        texts = _jsonl_texts(source, raw)
    else:
        texts = [raw.decode("utf-8", errors="replace")] if raw.strip() else []
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for text in texts:
        # verbose=False: a corpus is longer than the model's window on purpose
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if eos is not None and len(texts) > 1:
            ids.append(eos)
    if not ids:
        raise ValueError(f"data file {source} is empty (no text in {len(raw)} bytes); pass --data "
                         "with a file that holds some text")
    return Corpus(tokens=torch.tensor(ids, dtype=torch.int64), source=str(source),
                  documents=len(texts),
                  tokenizer=str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
                  digest=hashlib.sha256(raw).hexdigest())


def _bytes_to_tokens(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def _looks_like_jsonl(path: Path, raw: bytes) -> bool:
    if path.suffix.lower() in _JSONL_SUFFIXES:
        return True
    for line in raw.splitlines():
        if line.strip():
            # a record with a "text" field; plain text whose first line is code starting with
            # "{" stays plain text
            try:
                record = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                return False
            return isinstance(record, dict) and "text" in record
    return False


def _jsonl_texts(path: Path, raw: bytes) -> list[str]:
    texts = []
    if raw.startswith(b"\xef\xbb\xbf"):      # a byte-order mark (editors on Windows): not text
        raw = raw[3:]
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        # JSON is UTF-8; the bytes that are not are read as U+FFFD (3 bytes each in the tokens)
        decoded = raw.decode("utf-8", errors="replace")
        line = raw.count(b"\n", 0, exc.start) + 1
        _log.warning("%s is not UTF-8 (first bad byte at offset %d, line %d): such bytes are read "
                     "as U+FFFD; JSON lines must be UTF-8 (a plain-text file keeps its bytes as "
                     "they are)", path, exc.start, line)
    for number, line in enumerate(decoded.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not valid JSON ({exc.msg} at column "
                             f"{exc.colno}); JSON-lines data needs one object per line with a "
                             "\"text\" field") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path} line {number}: expected an object with a string \"text\" "
                             f"field, got {line[:80]!r}")
        if text:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{path} line {number}: the \"text\" holds {text[exc.start]!r} "
                                 f"at character {exc.start}, half of a UTF-16 pair (a lone "
                                 "surrogate, escaped as \\ud8xx in the JSON), which is no "
                                 "character: fix or drop that line") from None
            texts.append(text)
    return texts


class BatchSampler:
    """Random windows of ``seq_len`` tokens, ``micro_batch`` at a time, from a seeded generator.

    The labels of a causal LM are its inputs (the model shifts them), so one window serves both.

    [Note: batches over ranks] The generator draws one sequence of micro-batches whatever the
    world size; rank r of ``world_size`` trains on micro-batches r, r + N, r + 2N, ... of it (each
    rank draws all N and keeps its own, so every generator stays in step). An optimizer step of
    N ranks x A accumulation steps thus trains on N x A consecutive micro-batches, the same ones a
    single rank with accumulation N x A trains on: the global batch (``train_batch_size`` = micro
    x accumulation x world size) and its data do not depend on how it is split over ranks, and
    ``drawn`` (micro-batches of the sequence consumed, all ranks together) lets a checkpoint
    resume at another world size with the same global batch.
    """

    def __init__(self, corpus: Corpus, seq_len: int, micro_batch: int, seed: int, *,
                 rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}: expected 0 <= rank < "
                             "world size")
        if seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2, got {seq_len}")
        if micro_batch < 1:
            raise ValueError(f"--micro-batch must be at least 1, got {micro_batch}")
        n = int(corpus.tokens.numel())
        if n < seq_len:
            unit = " (bytes)" if corpus.tokenizer is None else ""
            raise ValueError(f"data file {corpus.source} has {n} tokens{unit}, fewer than "
                             f"--seq-len {seq_len}; pass more text or a smaller --seq-len")
        self.tokens = corpus.tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self._starts = n - seq_len + 1
        self._generator = torch.Generator().manual_seed(seed)
        self.rank = rank
        self.world_size = world_size
        # micro-batches of the sequence drawn so far, by all ranks together (a resumed run skips
        # as many to continue the sequence)
        self.drawn = 0

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one micro-batch."""
        return self.seq_len * self.micro_batch

    def next_batch(self) -> torch.Tensor:
        """This rank's next ``[micro_batch, seq_len]`` int64 tensor of token ids (see
        [Note: batches over ranks])."""
        starts = torch.empty(0, dtype=torch.int64)
        for r in range(self.world_size):
            drawn = torch.randint(0, self._starts, (self.micro_batch,), generator=self._generator)
            if r == self.rank:
                starts = drawn
        self.drawn += self.world_size
        offsets = torch.arange(self.seq_len)
        return self.tokens[starts[:, None] + offsets[None, :]]

    def skip(self, batches: int) -> None:
        """Draw and drop ``batches`` micro-batches of the sequence (all ranks' together, as
        ``drawn`` counts them): the next one is the one a run that drew them would get next."""
        for _ in range(batches):
            torch.randint(0, self._starts, (self.micro_batch,), generator=self._generator)
        self.drawn += batches
