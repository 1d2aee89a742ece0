"""The ranks of one load divide the checksum reading (checkpoint/pinned.py ``PinnedSave.verify``
``share``): rank r of w hashes the needed files r, r + w, ...; sizes are checked by every rank."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from infinity.checkpoint import CheckpointError
from infinity.checkpoint.directory import FORMAT, MANIFEST, VERSION
from infinity.checkpoint.pinned import PinnedSave

NAMES = [f"rank{r}_{kind}.safetensors" for kind in ("model", "optim") for r in range(3)]


def _checkpoint(tmp_path: Path) -> dict:
    files = {}
    for i, name in enumerate(NAMES):
        data = bytes([i]) * 100
        (tmp_path / name).write_bytes(data)
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {"files": files}


def verify_files(directory: Path, manifest: dict, checksums: bool, needed: list[str],
                 share: tuple[int, int]) -> None:
    """The files checked through a pin of ``directory`` with ``manifest`` as its manifest."""
    (directory / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                                  **manifest}))
    with PinnedSave(directory) as save:
        save.verify(needed, checksums, share=share)


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8])
def test_exactly_one_rank_finds_each_damaged_file(tmp_path: Path, world: int) -> None:
    manifest = _checkpoint(tmp_path)
    for damaged in NAMES:
        good = (tmp_path / damaged).read_bytes()
        (tmp_path / damaged).write_bytes(b"\xff" + good[1:])     # same size
        finders = []
        for rank in range(world):
            try:
                verify_files(tmp_path, manifest, True, NAMES, share=(rank, world))
            except CheckpointError as exc:
                assert damaged in str(exc) and "sha256" in str(exc), exc
                finders.append(rank)
        assert finders == [NAMES.index(damaged) % world], (damaged, world, finders)
        (tmp_path / damaged).write_bytes(good)


def test_every_rank_checks_every_size(tmp_path: Path) -> None:
    manifest = _checkpoint(tmp_path)
    (tmp_path / NAMES[1]).write_bytes(b"short")
    for rank in range(4):
        with pytest.raises(CheckpointError, match="has 5 bytes, its manifest says 100"):
            verify_files(tmp_path, manifest, False, NAMES, share=(rank, 4))


@pytest.mark.parametrize("share", [(2, 2), (-1, 2), (0, 0)])
def test_a_share_outside_the_ranks_is_refused(tmp_path: Path, share) -> None:
    manifest = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"share must be \(rank, world size\)"):
        verify_files(tmp_path, manifest, True, NAMES, share=share)
