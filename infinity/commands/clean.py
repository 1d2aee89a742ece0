"""``infinity clean PATH``: remove swap files left by a killed run, by hand.

PATH is either one private swap directory (``.../infinity-swap-r0-p1234-ab12cd``) or the
``nvme_path`` that holds them. Only directories with an infinity marker whose owner is dead are
touched, and in them only the files the marker lists; a directory without a marker, or whose
owner still runs (or runs on another host), is refused with exit code 2. A directory that holds
nothing but the temporary marker (a run killed while creating it) is recognised and removed.
Given a parent, every directory in it is tried: one that is refused (or cannot be read, another
user's 0700 directory) is reported and the rest are still reclaimed; the exit code is 2 at the end.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infinity.cli import UsageError
from infinity.sizes import format_bytes
from infinity.storage.swap_dir import (DIR_PREFIX, MARKER_NAME, MARKER_TMP_NAME, NotOursError,
                                       OwnerAliveError, Removal, find_swap_dirs, reclaim)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path,
                        help="a private swap directory, or the nvme_path holding such directories")
    parser.add_argument("--dry-run", action="store_true",
                        help="only say what would be removed")


def _describe(result: Removal, dry_run: bool) -> str:
    verb = "would free" if dry_run else "freed"
    line = (f"{result.path}: {verb} {format_bytes(result.bytes_freed)} in {result.files_removed} "
            f"swap files ({result.reason})")
    if result.leftovers:
        line += f"; directory kept, it holds files infinity did not create: {', '.join(result.leftovers)}"
    return line


def run(args: argparse.Namespace) -> int:
    path: Path = args.path
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
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
    if not candidates:
        raise NotOursError(f"{path} has no {MARKER_NAME} marker and holds no infinity swap "
                           "directories; nothing was touched")
    refused = 0
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
