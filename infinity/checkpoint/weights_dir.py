"""A transformers weights directory replaced as a whole: what a reader of it loads, and how a
save changes it so that a reader loads the earlier save whole or the new one whole, never a mix.

Why: an export or ``save_pretrained`` over an earlier one used to rename its shards one by one
over the old files of the same names and write the index last; with the same shard count the
old index already named every new file, so a kill between two renames left a directory that
loaded without a word with tensors from two saves.

[Note: committing a weights directory]
* What a reader loads is transformers' rule, which ``pretrained_files.weight_map`` follows too:
  ``model.safetensors`` when it is there, else the shards ``model.safetensors.index.json``
  names. So a save has one commit point, a single rename or unlink; everything it does before
  is unread, everything after is cleaning up files no reader opens.
* Every file is written under a hidden name (``.NAME.partial``) and fsync'd first.
* A single-file save renames its file onto ``model.safetensors``: the commit (an earlier
  single file is replaced atomically; an earlier index stops being read). The earlier save's
  index and shards are removed after.
* A sharded save names its shards so that none is a name the directory holds (transformers'
  ``model-00001-of-00003.safetensors``, or ``model-<token>-00001-of-00003.safetensors`` when an
  earlier save has those names), renames them in (no index names them: unread), fsyncs the
  directory, then renames its index onto the index name. That is the commit, unless an earlier
  single-file save is there: then the unlink of ``model.safetensors`` that follows is. The
  earlier save's shards are removed after.
* ``config.json``, the generation config and the tokenizer files are not weights: each is
  replaced atomically on its own, before the commit, so a committed save has all of them; a
  save killed before its commit can leave the new config beside the earlier weights (each
  whole). The weights are never a mix.
* One writer at a time: the save holds the directory's save lock (checkpoint/writer_lock.py)
  from its first file to its last removal, so the hidden files found when it starts were left
  by a save that died: it removes them (so does ``infinity clean DIR``). Only names of this
  layout are ever removed (``is_weight_file``, ``is_partial``); the user's other files stay.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Iterable, Sequence

from infinity.base.log import get_logger
from infinity.checkpoint.pretrained_files import INDEX_NAME, SINGLE_NAME

log = get_logger("checkpoint")

# files of a pretrained directory besides weights and config that a save carries over
CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "added_tokens.json", "chat_template.jinja", "chat_template.json",
                 "preprocessor_config.json", "spiece.model", "vocab.txt")
MODEL_TEXTS = ("config.json", "generation_config.json")
# the token only with a shard suffix (``shard_names`` writes no other): ``model-20240101``
# and ``model-deadbeef.safetensors`` are a user's files, which a save must leave alone
_WEIGHT_FILE = re.compile(r"model(?:(?:-[0-9a-f]{8})?-\d{5}-of-\d{5})?\.safetensors")
_PARTIAL = re.compile(r"\.(?P<name>.+)\.partial")


def is_weight_file(name: str) -> bool:
    """Whether ``name`` is a weight file of the layout a save writes (``model.safetensors``,
    ``model-00001-of-00003.safetensors``, ``model-<token>-00001-of-00003.safetensors``)."""
    return _WEIGHT_FILE.fullmatch(name) is not None


def is_written_name(name: str) -> bool:
    """Whether a save into a weights directory writes files of this name."""
    return (is_weight_file(name) or name in (INDEX_NAME, *MODEL_TEXTS, *CARRIED_FILES))


def partial_path(directory: Path, name: str) -> Path:
    """The hidden name ``name`` is written under before it is renamed into place."""
    return directory / f".{name}.partial"


def _hidden(name: str) -> str | None:
    """The file name ``name`` is the hidden ``.NAME.partial`` of, else None."""
    match = _PARTIAL.fullmatch(name)
    return None if match is None else match.group("name")


def is_partial(name: str) -> bool:
    """Whether ``name`` is the hidden name of a file a save writes (one a killed save left)."""
    hidden = _hidden(name)
    return hidden is not None and is_written_name(hidden)


def holds_weights(directory: Path) -> bool:
    """Whether ``directory`` is a weights directory: it holds weight files, an index, or the
    hidden file of a weight file (a first save that did not finish). What ``infinity clean``
    asks before it removes hidden files of other written names there (``.config.json.partial``,
    ``.tokenizer.json.partial``), which in any other directory (an nvme_path, /var/tmp) may be
    another program's."""
    try:
        names = [e.name for e in os.scandir(directory)]
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(is_weight_file(name) or name == INDEX_NAME or
               is_weight_file(_hidden(name) or "") for name in names)


def stale_partials(directory: Path) -> list[Path]:
    """The hidden files of saves that did not finish in ``directory`` (plain files only)."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(Path(e.path) for e in entries
                  if is_partial(e.name) and e.is_file(follow_symlinks=False))


def remove_stale_partials(directory: Path) -> list[Path]:
    """Remove what ``stale_partials`` finds; the caller holds the directory's save lock, so no
    live save is writing them. Returns those removed."""
    removed = []
    for path in stale_partials(directory):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
        log.info("removed %s, left by a save that did not finish", path)
    return removed


def weight_files(directory: Path) -> set[str]:
    """The weight files in ``directory`` (an earlier save's), by name."""
    try:
        return {e.name for e in os.scandir(directory) if is_weight_file(e.name)}
    except FileNotFoundError:
        return set()


def shard_names(count: int, taken: Iterable[str] = ()) -> list[str]:
    """File names for ``count`` shards: ``model.safetensors`` for one; else transformers'
    ``model-0000i-of-0000N.safetensors``, or, when one of those is in ``taken`` (an earlier
    save's file, which the index of that save may name), the same with a fresh token, so that a
    new shard never replaces a file an earlier index names."""
    if count == 1:
        return [SINGLE_NAME]
    taken = set(taken)
    standard = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    while taken.intersection(standard):
        token = secrets.token_hex(4)
        standard = [f"model-{token}-{i:05d}-of-{count:05d}.safetensors"
                    for i in range(1, count + 1)]
    return standard


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` through its hidden name (fsync'd, renamed)."""
    replace_with(path, text.encode())


def replace_with(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through its hidden name, fsync'd, then renamed onto it."""
    partial = partial_path(path.parent, path.name)
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_weights(directory: Path, staged: Sequence[tuple[Path, str]],
                   index: dict | None) -> list[Path]:
    """Make the staged files (``(hidden path, final name)``, each fsync'd) the weights of
    ``directory`` with one commit point (see [Note: committing a weights directory]);
    ``index``: the body of ``model.safetensors.index.json`` for several shards, None for one
    file. The earlier save's weight files and index are removed after the commit. Returns the
    files now in place."""
    names = [name for _, name in staged]
    single = index is None
    if single and names != [SINGLE_NAME]:
        raise ValueError(f"a save without an index is one {SINGLE_NAME}, got {names}")
    earlier = weight_files(directory) - set(names)
    if not single and set(names) & weight_files(directory):
        raise ValueError(f"{directory}: shard names {sorted(set(names) & weight_files(directory))}"
                         " are an earlier save's: the index of that save may name them")
    final = []
    for partial, name in staged:
        os.replace(partial, directory / name)        # single: the commit; shards: unread yet
        final.append(directory / name)
    if not single:
        fsync_dir(directory)                         # the shards' names before an index names them
        write_text(directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        (directory / SINGLE_NAME).unlink(missing_ok=True)   # an earlier single file: the commit
    fsync_dir(directory)
    # nothing reads these now: the earlier save's index (a single file is read first) and files
    if single:
        (directory / INDEX_NAME).unlink(missing_ok=True)
    for name in sorted(earlier):
        (directory / name).unlink(missing_ok=True)
    fsync_dir(directory)
    return final
