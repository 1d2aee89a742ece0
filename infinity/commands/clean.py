"""``infinity clean PATH``: remove swap files left by a killed run, by hand.

PATH is either one private swap directory (``.../infinity-swap-r0-p1234-ab12cd``) or the
``nvme_path`` that holds them, or a checkpoint directory (``save_dir``), where the hidden
staging directories of saves that did not finish are removed, or a weights directory
(``save_pretrained``, ``infinity export``, ``save_16bit_model``), where the hidden files of a
save that did not finish are (under the save lock, so never a running save's; only the files a
save writes). Only directories with an infinity marker whose owner is dead are
touched, and in them only the files the marker lists; a directory without a marker, or whose
owner still runs (or runs on another host), is refused with exit code 2. A directory that holds
nothing but the temporary marker (a run killed while creating it) is recognised and removed.
Given a parent, every directory in it is tried: one that is refused (or cannot be read, another
user's 0700 directory) is reported and the rest are still reclaimed; the exit code is 2 at the end.
A parent holding nothing of ours is nothing to do: it says so and exits 0.

Why this command imports ``infinity.storage`` (the one command that does; pyproject.toml's
second contract keeps it so): what may be deleted is decided by the swap directory's marker --
its name, its owner's liveness, the files it lists -- and that rule must have one copy, storage's
``swap_dir``, which makes the directories and reclaims a killed run's at every start. A copy of
it here could drift and let ``clean`` delete what the engine would not (a user's directory
that looks like ours); a module in a layer between that only forwarded it would hide where the
rule lives.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from infinity.commands import UsageError
from infinity.checkpoint.directory import (clean_stale_staging, pending_latest, staging_dirs,
                                          staging_target)
from infinity.checkpoint.weights_dir import holds_weights, remove_stale_partials, stale_partials
from infinity.checkpoint.writer_lock import SaveDirBusyError, SaveLock
from infinity.base.sizes import format_bytes
from infinity.storage.swap_dir import (DIR_PREFIX, MARKER_NAME, MARKER_TMP_NAME, NotOursError,
                                       OwnerAliveError, Removal, find_swap_dirs, reclaim)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path,
                        help="a private swap directory, the nvme_path holding such directories, a "
                             "checkpoint save_dir or a weights directory (what its unfinished "
                             "saves left)")
    parser.add_argument("--dry-run", action="store_true",
                        help="only say what would be removed")


def _describe(result: Removal, dry_run: bool) -> str:
    verb = "would free" if dry_run else "freed"
    line = (f"{result.path}: {verb} {format_bytes(result.bytes_freed)} in {result.files_removed} "
            f"swap files ({result.reason})")
    if result.leftovers:
        line += f"; directory kept, it holds files infinity did not create: {', '.join(result.leftovers)}"
    return line


def _clean_unfinished_saves(save_dir: Path, staging: list[Path], partials: list[Path],
                            dry_run: bool) -> int:
    """Remove what saves that did not finish (killed with kill -9) left in ``save_dir``: the
    staging directories of checkpoint saves, and the hidden files of a weights directory's save
    (save_pretrained, export, save_16bit_model); under the directory's save lock, so never a
    live save's. Returns 1 when refused or when some could not be removed, else 0."""
    if dry_run:
        for path in staging:
            if path.is_file():      # a new ``latest`` never renamed into place
                print(f"{path}: would remove it, left by a checkpoint save that did not finish")
                continue
            print(f"{path}: would remove the files a checkpoint save left there (a save that "
                  f"did not finish); files of other names in it would go back into "
                  f"{staging_target(path)} where that is a directory (put back first from its "
                  f"hidden .replaced copy when a save stopped between its renames), else stay")
        for path in partials:
            print(f"{path}: would remove it, left by a save that did not finish")
        return 0
    try:
        with SaveLock.acquire(save_dir):
            removed = clean_stale_staging(save_dir)
            removed_partials = remove_stale_partials(save_dir) if partials else []
    except SaveDirBusyError as exc:
        print(f"infinity clean: refused: {exc}", file=sys.stderr)
        return 1
    for path in removed:
        print(f"{path}: removed, left by a checkpoint save that did not finish")
    for path in removed_partials:
        print(f"{path}: removed, left by a save that did not finish")
    return 0 if len(removed) == len(staging) and len(removed_partials) == len(partials) else 1


def run(args: argparse.Namespace) -> int:
    # "." or "dir/." has no name of its own: the directory it names, its link kept (a private
    # directory given as "." was taken for a parent holding none: "nothing to clean")
    path = Path(os.path.abspath(args.path))
    if not path.exists():
        raise FileNotFoundError(f"{args.path} does not exist")
    private = path.name.startswith(DIR_PREFIX) and (
        (path / MARKER_NAME).exists() or (path / MARKER_TMP_NAME).exists() or path.is_symlink())
    if private or not path.is_dir():
        # One private directory: refusals propagate (ValueError -> one line, exit 2).
        print(_describe(reclaim(path, dry_run=args.dry_run), args.dry_run))
        return 0
    # a parent (an nvme_path): through a symbolic link too (/scratch -> /mnt/nvme), and whatever
    # files of the user's it holds (one named like our marker included)
    try:
        candidates = find_swap_dirs(path.resolve())
    except OSError as exc:
        raise UsageError(f"cannot list {path} to find its swap directories: "
                         f"{exc.strerror or exc} (errno {exc.errno}); run clean as a user who "
                         "may read it, or name one swap directory in it") from exc
    staging = staging_dirs(path) + pending_latest(path)
    partials = stale_partials(path) if holds_weights(path) else []
    if not candidates and not staging and not partials and path.name.startswith(DIR_PREFIX):
        raise NotOursError(f"{path} is named like an infinity swap directory but has no "
                           f"{MARKER_NAME} marker: not ours, nothing was touched")
    if not candidates and not staging and not partials:
        # nothing left is what clean is for (a run that closed removed its own): exit 0, so a
        # cleanup script's `infinity clean "$NVME" || fail` passes after a clean run
        print(f"{path}: nothing to clean: it holds no infinity swap directories, no checkpoint "
              "staging directories and no hidden files of an unfinished weights save; nothing "
              "was touched")
        return 0
    refused = (_clean_unfinished_saves(path, staging, partials, args.dry_run)
               if staging or partials else 0)
    for candidate in candidates:
        try:
            print(_describe(reclaim(candidate, dry_run=args.dry_run), args.dry_run))
        except (NotOursError, OwnerAliveError) as exc:
            refused += 1
            print(f"infinity clean: refused: {exc}", file=sys.stderr)
        except OSError as exc:
            # unreadable (another user's 0700 directory) or gone meanwhile: like the engine's
            # start-up reclaim, go on with the others rather than leave them all behind
            refused += 1
            print(f"infinity clean: refused: {candidate} could not be checked: "
                  f"{exc.strerror or exc} (errno {exc.errno}); it was left as it is",
                  file=sys.stderr)
    return 2 if refused else 0
