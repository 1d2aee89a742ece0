"""infinity.train.data: the shipped corpus, --data files (text, JSON lines), batches, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infinity.train import data


def test_shipped_corpus_is_real_text_of_the_promised_size() -> None:
    corpus = data.load_corpus()
    n = corpus.tokens.numel()
    assert 200_000 <= n <= 1_000_000, n
    assert corpus.tokens.dtype == torch.int64
    assert int(corpus.tokens.max()) < data.BYTE_IDS  # plain bytes, no special ids
    text = bytes(corpus.tokens.to(torch.uint8).tolist()).decode("ascii")
    assert text.startswith("THE BOOK OF GENESIS")
    assert "In the beginning God created the heaven and the earth." in text
    readme = Path(corpus.source).with_name("README.md").read_text()
    assert "public domain" in readme.lower() and data.DEFAULT_CORPUS in readme


def test_plain_text_is_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes("héllo\n".encode())
    corpus = data.load_corpus(path)
    assert corpus.tokens.tolist() == list("héllo\n".encode())
    assert corpus.documents == 1 and corpus.source == str(path)


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.txt"])  # by suffix, and by content
def test_json_lines_join_documents_with_eos(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(json.dumps({"text": "ab", "id": 1}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    corpus = data.load_corpus(path)
    assert corpus.tokens.tolist() == [97, 98, data.EOS_ID, 99, data.EOS_ID]
    assert corpus.documents == 2


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        data.load_corpus(tmp_path / "nope.txt")


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory"):
        data.load_corpus(tmp_path)


@pytest.mark.parametrize("content", [b"", b"  \n\t\n", b'{"text": ""}\n'])
def test_empty_corpus_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is empty"):
        data.load_corpus(path)


def test_bad_json_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        data.load_corpus(path)


def test_a_byte_order_mark_is_skipped_and_a_lone_surrogate_names_its_line(
        tmp_path: Path) -> None:
    """A BOM before the first JSON line (it was refused as bad JSON); a "\\ud800" escape, which
    decodes to no character (it was a bare UnicodeEncodeError naming no file)."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "hi"}).encode() + b"\n")
    assert data.load_corpus(path).tokens.tolist() == [ord("h"), ord("i"), data.EOS_ID]
    path.write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n')
    with pytest.raises(ValueError, match=r"line 2: the \"text\" holds .* lone surrogate"):
        data.load_corpus(path)


def test_json_line_without_text_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "no text field"}\n')
    with pytest.raises(ValueError, match='line 1: expected an object with a string "text"'):
        data.load_corpus(path)


def _corpus(n: int) -> data.Corpus:
    return data.Corpus(tokens=torch.arange(n, dtype=torch.int64), source="mem", documents=1)


def test_batches_are_windows_of_the_stream_and_repeat_with_the_seed() -> None:
    corpus = _corpus(1000)
    a = data.BatchSampler(corpus, seq_len=16, micro_batch=3, seed=7)
    b = data.BatchSampler(corpus, seq_len=16, micro_batch=3, seed=7)
    c = data.BatchSampler(corpus, seq_len=16, micro_batch=3, seed=8)
    xa, xb, xc = a.next_batch(), b.next_batch(), c.next_batch()
    assert xa.shape == (3, 16) and xa.dtype == torch.int64
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    for row in xa:  # contiguous slices of the corpus
        assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 16))
    assert a.tokens_per_batch == 48


def test_ranks_take_turns_on_one_sequence_of_micro_batches() -> None:
    """[Note: batches over ranks]: rank r of N gets micro-batches r, r + N, ... of the sequence a
    single rank draws, so N ranks x A micro-steps train on what 1 rank x N*A micro-steps does;
    ``drawn`` counts the sequence (all ranks), and skip() continues it at any world size."""
    corpus = _corpus(1000)
    single = data.BatchSampler(corpus, seq_len=8, micro_batch=2, seed=3)
    sequence = [single.next_batch() for _ in range(6)]
    ranks = [data.BatchSampler(corpus, seq_len=8, micro_batch=2, seed=3, rank=r, world_size=2)
             for r in range(2)]
    for k in range(3):
        for r, sampler in enumerate(ranks):
            assert torch.equal(sampler.next_batch(), sequence[2 * k + r]), (k, r)
    assert [s.drawn for s in ranks] == [6, 6] and single.drawn == 6
    resumed = data.BatchSampler(corpus, seq_len=8, micro_batch=2, seed=3, rank=1, world_size=2)
    resumed.skip(4)
    assert torch.equal(resumed.next_batch(), sequence[5])
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        data.BatchSampler(corpus, seq_len=8, micro_batch=2, seed=3, rank=2, world_size=2)


def test_every_start_is_reachable_including_the_last() -> None:
    sampler = data.BatchSampler(_corpus(10), seq_len=9, micro_batch=64, seed=0)
    starts = set(sampler.next_batch()[:, 0].tolist())
    assert starts == {0, 1}


def test_corpus_shorter_than_a_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="has 10 tokens .* fewer than --seq-len 11"):
        data.BatchSampler(_corpus(10), seq_len=11, micro_batch=1, seed=0)


@pytest.mark.parametrize("seq_len, micro, match", [(1, 1, "--seq-len"), (8, 0, "--micro-batch")])
def test_sampler_sizes_are_checked(seq_len: int, micro: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        data.BatchSampler(_corpus(100), seq_len=seq_len, micro_batch=micro, seed=0)


def test_text_that_starts_like_json_stays_text_and_bad_utf8_in_json_lines_is_warned(
        tmp_path: Path, infinity_log) -> None:
    """A .txt of code whose first line starts with "{" was parsed as JSON lines and refused;
    invalid UTF-8 in JSON lines was replaced silently."""
    import logging
    code = tmp_path / "code.txt"
    code.write_bytes(b"{ int x = 1; }\nreturn x;\n")
    assert data.load_corpus(code).tokens.tolist() == list(code.read_bytes())
    dirty = tmp_path / "dirty.jsonl"
    dirty.write_bytes(b'{"text": "ok"}\n{"text": "bad \xff byte"}\n')
    with infinity_log.at_level(logging.WARNING):
        corpus = data.load_corpus(dirty)
    assert corpus.documents == 2
    assert "dirty.jsonl is not UTF-8 (first bad byte at offset 29, line 2)" in infinity_log.text
