"""Checkpoint directories: tags, the manifest, the ``latest`` pointer, and crash-safe commits.

A save writes every file of a tag into a hidden staging directory next to it, fsyncs them and
the directory, and only then puts it in the tag's place: a new tag by a rename, an older save of
the same tag by an atomic exchange of the two directories (``renameat2(RENAME_EXCHANGE)``), then
points ``latest`` at it with an atomic rename of its own. A crash at any moment leaves the
previous checkpoint and ``latest`` as they were: at worst a staging directory is left behind,
which the next save in that directory cleans up (the next save of that tag adopts it, with any
files of the user's carried into it). (On a filesystem without the exchange, the old tag is
renamed aside first; a load that finds the tag missing but its renamed-aside copy whole uses
that copy.) One writer at a time: a save holds the directory's save lock
(checkpoint/writer_lock.py), and each writer stages under a name of its own.

Nothing is removed but the names a save writes (``WRITTEN_FILE``), and of an earlier
checkpoint only those of them its manifest lists, each unlinked through the directory's file
descriptor: a manifest naming ``../x`` or an absolute path (edited, or downloaded) removes
nothing outside. Files a user put in a tag's directory move with the tag to each new save.

The manifest (``manifest.json``) says what a checkpoint holds: its files with sizes and
sha256, the engine's counters, each parameter's shape and step count, the optimizer's
hyperparameters, the LR scheduler and loss scaler states and the user's ``client_state``.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from infinity.checkpoint.tensor_file import CheckpointError
from infinity.base.log import get_logger

log = get_logger("checkpoint")

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "infinity-checkpoint"
VERSION = 2
"""The newest manifest version this infinity writes and reads. Version 2: the moments (and a
bf16 master) may be stored in a state format (checkpoint/moment_files.py); a checkpoint whose
states are all fp32 is still written as version 1, in its layout, so an older infinity loads
it, and refuses (as newer) the ones it would misread."""
FP32_STATES_VERSION = 1
"""The version of a checkpoint whose Adam states are all fp32 (what every version reads)."""
SAVE_ID = "save_id"
"""[Note: which save a file belongs to]
Every save draws a random id; its manifest and the ``__metadata__`` of each of its tensor files
carry it (under this key), and a load refuses a file whose id is not its manifest's, checksums
verified or not. A file of another save of the same model has the same size and tensors, so
without the id only its sha256 told it apart, and ``verify_checksums=False`` (a resume of a
large checkpoint that skips hashing it) loaded it: the weights of one save with the moments of
another. Such a file gets there when a user or a sync tool copies rank files between
checkpoint directories; the engine's own saves never mix (checkpoint/pinned.py). A manifest
without an id (an older infinity's save) is loaded as before."""
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*\Z")   # \Z: "$" would let "tag\n" through


MAX_TAG_BYTES = 200
"""A tag's longest: its staging name (``.<tag>.partial.<8 hex>``) and aside name must fit the
file systems' 255-byte names (a 300-character tag failed with a bare "File name too long")."""


def check_tag(tag: str) -> str:
    """A tag names a directory: letters, digits and ``_.+=-``, not starting with a dot, at most
    MAX_TAG_BYTES long."""
    tag = str(tag)
    if not _TAG.match(tag) or tag == LATEST:
        raise ValueError(f"checkpoint tag {tag!r} cannot name a directory: use letters, digits "
                         f"and _.+=- (not starting with '.', and not {LATEST!r}), e.g. "
                         "\"global_step100\"")
    if len(tag) > MAX_TAG_BYTES:
        raise ValueError(f"checkpoint tag of {len(tag)} characters ({tag[:24]}...): at most "
                         f"{MAX_TAG_BYTES}, so that the save's hidden names fit the file "
                         "system's 255-byte names; choose a shorter tag")
    return tag


WRITTEN_FILE = re.compile(r"manifest\.json|rank\d+_(model|optim)\.safetensors")
"""The names a save writes into a checkpoint directory, and so the only names ever removed from
one; a file kind added later is added here, nowhere else."""

_STAGING = re.compile(r"^\.(?P<tag>.+)\.partial\.[0-9a-f]{8}\Z")
"""A staging directory: ``.<tag>.partial.<writer's token>``. The token is what tells one from a
user's directory: a hidden ``.dataset.partial`` (the name before the token was added, and a
name other tools use) is not ours, and neither a save nor ``infinity clean`` touches it (it was
taken for one: the files of a save's names in it removed, the others moved into ``dataset``)."""


def is_written_name(name: str) -> bool:
    """Whether ``name`` is a file a save writes (see ``WRITTEN_FILE``)."""
    return WRITTEN_FILE.fullmatch(name) is not None


def staging_dir(save_dir: Path, tag: str) -> Path:
    """A fresh staging name for ``tag``, of this writer's own."""
    return save_dir / f".{tag}.partial.{secrets.token_hex(4)}"


def staging_dirs(save_dir: Path, tag: str | None = None) -> list[Path]:
    """Staging directories in ``save_dir`` (of ``tag`` only, when given), real directories only."""
    found = []
    try:
        names = sorted(os.listdir(save_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        match = _STAGING.match(name)
        if match is None or (tag is not None and match.group("tag") != tag):
            continue
        try:
            if stat.S_ISDIR(os.lstat(save_dir / name).st_mode):
                found.append(save_dir / name)
        except FileNotFoundError:
            continue
    return found


def replaced_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.replaced"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically; False where the system or filesystem cannot."""
    libc = _libc()
    renameat2 = getattr(libc, "renameat2", None) if libc is not None else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_staging(save_dir: Path, tag: str) -> Path:
    """A staging directory of this writer's own for ``tag``, empty of checkpoint files. The
    caller holds the save lock (``ensure_save_dir`` first), so every other staging directory
    there was left by a save that did not finish: they are cleaned up (``clean_stale_staging``),
    and one of ``tag`` is adopted, with the files of the user's it carries going into the tag
    with this save."""
    staging = staging_dir(save_dir, tag)
    for path in (save_dir / tag, staging):
        _refuse_link(path)
    left = staging_dirs(save_dir, tag)
    clean_stale_staging(save_dir, keep=left[:1])
    if left:
        os.rename(left[0], staging)
        remove_checkpoint_files(staging, ours_only=False, keep_dir=True)
    else:
        staging.mkdir()
    return staging


def ensure_save_dir(save_dir: Path) -> None:
    """Create ``save_dir`` if needed; a clear error when it cannot be written."""
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create the checkpoint directory {save_dir}: "
                                 f"{exc.strerror}; choose a writable save_dir") from exc
    if not os.access(save_dir, os.W_OK | os.X_OK):
        raise PermissionError(f"the checkpoint directory {save_dir} is not writable; choose "
                              "another save_dir or fix its permissions")


def staging_target(staging: Path) -> Path:
    """The tag directory a staging directory (``staging_dirs``) was to become."""
    return staging.parent / _STAGING.match(staging.name).group("tag")


_PENDING_LATEST = re.compile(rf"\.{LATEST}\.[0-9a-f]{{8}}\.pending")
"""The name ``write_latest`` gives its new ``latest`` before the rename."""


def pending_latest(save_dir: Path) -> list[Path]:
    """The new ``latest`` files saves killed before their rename left (``write_latest``):
    ours by their name, plain files."""
    return sorted(p for p in save_dir.glob(f".{LATEST}.*.pending")
                  if _PENDING_LATEST.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def clean_stale_staging(save_dir: Path, keep: list[Path] = ()) -> list[Path]:
    """Remove the staging directories a save that did not finish left in ``save_dir`` (all
    but ``keep``); returns those removed. Only the names a save writes are deleted; files of
    the user's (carried in from the tag just before it was to be replaced) go back into the
    tag's directory, and a directory still holding anything else is kept, with a warning.
    The caller holds the save lock, so no live writer is staging there."""
    removed = []
    for pending in pending_latest(save_dir):
        # the caller's lock says no save is writing one now
        pending.unlink()
        removed.append(pending)
        log.info("removed %s, left by a save that did not finish", pending)
    for staging in staging_dirs(save_dir):
        if staging in keep:
            continue
        final = staging_target(staging)
        aside = replaced_dir(save_dir, final.name)
        if _TAG.match(final.name) and not os.path.lexists(final) and \
                not aside.is_symlink() and (aside / MANIFEST).is_file():
            # a save of this tag stopped between its two renames (no exchange on this file
            # system): its previous save goes back in place, so the user's files carried into
            # the staging can go back to it too (they stayed hidden until the tag was saved
            # again)
            os.rename(aside, final)
            log.info("%s put back from %s, left by a save that did not finish", final, aside)
        if _TAG.match(final.name) and final.is_dir() and not final.is_symlink():
            _carry_user_files(staging, final, keep_ours=False)
        remove_checkpoint_files(staging, ours_only=False)
        if not staging.exists():
            removed.append(staging)
            log.info("removed %s, left by a save that did not finish", staging)
    return removed


def _refuse_link(path: Path) -> None:
    """A tag (or its staging name) that is a symbolic link would have the save replace and clean
    the directory it points to -- another checkpoint, often the one ``latest`` names."""
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)}); a checkpoint "
                              "tag must be a directory of its own: choose another tag or remove "
                              "the link (its target is left alone)")


def checkpoint_files(directory: Path, ours_only: bool = True) -> set[str]:
    """The names in ``directory`` a save wrote: the written names (``WRITTEN_FILE``) its
    manifest lists, and the manifest (without ``ours_only``, of a staging directory: the
    written names that are there)."""
    if ours_only:
        manifest = our_manifest(directory)
        if manifest is None:
            return set()        # a user's manifest.json (or none): nothing here is ours
        listed = manifest.get("files", {})
        names = {MANIFEST}
        for name in listed if isinstance(listed, dict) else ():
            if isinstance(name, str) and is_written_name(name):
                names.add(name)
            else:
                log.warning("the manifest of %s lists %r, which is not a file a save writes; "
                            "it is left alone", directory, name)
        return names
    # only the names a save writes: a user's own .safetensors (an adapter) carried in from the
    # tag's directory must survive a failed or interrupted save
    return {p.name for p in directory.iterdir() if is_written_name(p.name)}


def remove_checkpoint_files(directory: Path, ours_only: bool = True, keep_dir: bool = False) -> None:
    """Remove the files a save wrote from ``directory`` (see ``checkpoint_files``), each through
    the directory's file descriptor, then the directory unless ``keep_dir`` or other files are
    in it."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:     # a symbolic link (ELOOP, ENOTDIR): never followed
        log.warning("not cleaning %s: %s", directory, exc)
        return
    try:
        for name in checkpoint_files(directory, ours_only):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                pass            # a directory under a written name is not ours
    finally:
        os.close(dir_fd)
    if keep_dir:
        return
    try:
        directory.rmdir()
    except OSError:
        left = sorted(p.name for p in directory.iterdir())
        log.warning("kept %s: it holds files a checkpoint does not write (%s)", directory,
                    ", ".join(left[:5]))


def _carry_user_files(old: Path, new: Path, keep_ours: bool = True) -> None:
    """Move what a user put in the old checkpoint's directory into the new one (``keep_ours``:
    the names the old one's manifest lists stay; else every written name stays)."""
    ours = checkpoint_files(old, ours_only=keep_ours)
    for entry in old.iterdir():
        if entry.name not in ours and not (new / entry.name).exists():
            os.rename(entry, new / entry.name)


class SavedError(OSError):
    """A save whose checkpoint is in place, whole (committed), failed afterwards (tidying the
    replaced save away, a directory fsync, pointing ``latest`` at it): said as such, never as a
    save that changed nothing, and never turned into "the previous checkpoint is unchanged"."""


def _after_commit(exc: OSError, final: Path, what: str, then: str = "") -> SavedError:
    return SavedError(exc.errno, f"checkpoint {final.name} is saved whole in {final} (committed), "
                                 f"but {what} failed afterwards ({exc.strerror or exc}){then}")


def commit(staging: Path, save_dir: Path, tag: str) -> Path:
    """Make the staged checkpoint the tag's (see the module docstring); returns its path. A
    failure after the commit point raises ``SavedError``."""
    dir_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in checkpoint_files(staging, ours_only=False):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    final = save_dir / tag
    aside = replaced_dir(save_dir, tag)
    for path in (final, staging, aside):
        _refuse_link(path)
    if final.exists() and our_manifest(final) is None:
        what = (f"its {MANIFEST} is not an infinity checkpoint's" if (final / MANIFEST).exists()
                else f"no {MANIFEST}")
        raise CheckpointError(
            f"{final} exists and is not a checkpoint ({what}); it is left alone: "
            "choose another tag or move it away")
    old: Path | None = None
    if not final.exists():
        os.rename(staging, final)
    else:
        _carry_user_files(final, staging)
        try:
            exchanged = _exchange(staging, final)
        except BaseException:
            _carry_user_files(staging, final)      # the old tag keeps the user's files
            raise
        if exchanged:
            old = staging
        else:
            if aside.exists():
                _carry_user_files(aside, staging)
                remove_checkpoint_files(aside)
            os.rename(final, aside)
            os.rename(staging, final)
            old = aside
    try:        # committed: the tag is the new save whatever fails now
        _fsync_dir(save_dir)
        if old is not None:
            remove_checkpoint_files(old)
            _fsync_dir(save_dir)
        if aside.exists():      # left by a save of this tag that stopped between its renames
            _carry_user_files(aside, final)
            remove_checkpoint_files(aside)
    except OSError as exc:
        raise _after_commit(exc, final, "tidying the save it replaced away",
                            f"; {LATEST} was not pointed at it: load it with tag={tag!r}, "
                            "or save again") from exc
    return final


def write_latest(save_dir: Path, tag: str) -> None:
    """Point ``latest`` at ``tag``, atomically: written to a file of a fresh name, created by
    this call (never through a link or over a file there before; the umask's permissions),
    then renamed over ``latest``. A kill between the two leaves that small file
    (``.latest.<hex>.pending``)."""
    pending: Path | None = None
    try:
        path = save_dir / f".{LATEST}.{secrets.token_hex(4)}.pending"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666)
        pending = path
        with os.fdopen(fd, "w") as f:
            f.write(tag)       # no newline: DeepSpeed's, which scripts read as it is
            f.flush()
            os.fsync(f.fileno())
        os.replace(pending, save_dir / LATEST)
    except BaseException as exc:
        if pending is not None:     # ours: the old ``latest`` is left as it was
            pending.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            previous = read_latest_quietly(save_dir)
            raise SavedError(exc.errno, f"checkpoint {tag} is saved whole in {save_dir / tag}, but "
                                     f"{save_dir / LATEST} could not be pointed at it "
                                     f"({exc.strerror or exc}); latest still names "
                                     f"{previous or 'no checkpoint'}. Load it with tag="
                                     f"{tag!r}, or fix the cause and save again") from exc
        raise
    try:
        _fsync_dir(save_dir)
    except OSError as exc:      # latest names the tag now; this fsync makes that durable
        raise _after_commit(exc, save_dir / tag, f"making {LATEST} (which names it now) "
                                                 "durable") from exc


def read_latest_quietly(load_dir: Path) -> str | None:
    """The tag ``latest`` names, or None when there is none or it cannot be read (for a message)."""
    try:
        return read_latest(load_dir)
    except CheckpointError:
        return None


def read_latest(load_dir: Path) -> str | None:
    """The tag ``latest`` names, or None without one."""
    if load_dir.exists() and not load_dir.is_dir():
        raise CheckpointError(f"{load_dir} is a file, not a checkpoint directory")
    try:
        tag = (load_dir / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"{load_dir / LATEST} is unreadable ({exc}); pass tag=") from None
    try:
        return check_tag(tag)
    except ValueError as exc:
        raise CheckpointError(f"{load_dir / LATEST} names no tag ({exc}): it was damaged; "
                              f"pass tag= (checkpoints there: "
                              f"{', '.join(available_tags(load_dir)) or 'none'})") from None


def available_tags(load_dir: Path) -> list[str]:
    """Tags under ``load_dir`` that hold a manifest."""
    if not load_dir.is_dir():
        return []
    return sorted(p.name for p in load_dir.iterdir()
                  if not p.name.startswith(".") and (p / MANIFEST).is_file())


MANIFEST_SUM = "manifest_sha256"
"""The manifest's own checksum (``manifest_sum``): the tensor files are checked against the
sums it holds, and nothing checked the manifest itself -- a changed byte loaded silently in one
case of seven (a renamed key reset the step counters to 0, an lr or weight decay changed)."""


def manifest_sum(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's fields but its own checksum, in one canonical JSON (keys
    sorted): the same after a parse, whatever the file's layout."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_SUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=True).encode()).hexdigest()


def resummed(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its checksum of its fields as they are now (for tools, and tests, that
    write a manifest of their own making)."""
    return {**manifest, MANIFEST_SUM: manifest_sum(manifest)}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    text = json.dumps(resummed(manifest), indent=1, allow_nan=True)
    with open(directory / MANIFEST, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def our_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory`` where a save of infinity's wrote it (its format ours, of
    any version: a save replaces an older checkpoint too), else None: a user's own
    ``manifest.json`` in a directory named like a tag is theirs, never replaced or removed
    (the manifest is written whole by a rename, so one that does not parse is not ours)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def read_manifest_file(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory``, read by path (a load reads it through its pin instead,
    checkpoint/pinned.py)."""
    path = directory / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no {MANIFEST}: it is not a checkpoint, or its "
                              "save did not finish") from None
    return parse_manifest(raw, path)


def parse_manifest(raw: bytes, path: Path) -> dict[str, Any]:
    """The manifest read from ``path`` as bytes, checked to be an infinity checkpoint's of
    this version."""
    try:
        manifest = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc}): the checkpoint is "
                              "damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an infinity checkpoint manifest (format "
                              f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") not in (FP32_STATES_VERSION, VERSION):
        newer = isinstance(manifest.get("version"), int) and manifest["version"] > VERSION
        raise CheckpointError(f"{path} has format version {manifest.get('version')}; this "
                              f"version of infinity reads versions {FP32_STATES_VERSION} and {VERSION}"
                              + ("; it was written by a newer infinity: upgrade infinity to load "
                                 "it" if newer else ""))
    stored = manifest.get(MANIFEST_SUM)     # absent: a save of an infinity before it
    if stored is not None and stored != manifest_sum(manifest):
        raise CheckpointError(f"{path} was changed after its save (its checksum does not match "
                              "its fields): the checkpoint is damaged; load another tag, or "
                              "restore the file from a copy")
    return manifest


def checkpoint_directory(path: Path, tag: str | None) -> Path | None:
    """``path`` itself when it is one checkpoint's directory (what ``save_checkpoint`` returns)
    and no tag is given, else ``resolve(path, tag)``."""
    if tag is None and (path / MANIFEST).is_file():
        return path
    return resolve(path, tag)


_DEEPSPEED_FILE = re.compile(r"(mp_rank_\d+_model_states|(bf16_)?zero_pp_rank_\d+_mp_rank_\d+"
                             r"_(optim|model)_states)\.pt")
"""The files of a DeepSpeed checkpoint's tag directory (its engine's ``save_checkpoint``)."""

DEEPSPEED_CHECKPOINT = (
    "{directory} is a DeepSpeed checkpoint (mp_rank_*_model_states.pt, zero_pp_rank_*): "
    "infinity's load_checkpoint reads its own format (manifest.json and safetensors, no "
    "pickle), so it cannot resume DeepSpeed's optimizer states. To go on from its weights: "
    "run the zero_to_fp32.py script DeepSpeed saved beside it (see its --help) and load the result with "
    "model.load_state_dict(...) or from_pretrained before or after infinity.initialize; the "
    "Adam moments start again from zero")


def resolve(load_dir: Path, tag: str | None) -> Path | None:
    """The checkpoint directory to load: ``tag``'s, or the one ``latest`` names (None when
    there is no ``latest``). Raises when the named checkpoint is not there."""
    if tag is None or tag == LATEST:        # tag="latest": the tag latest names, not a tag
        tag = read_latest(load_dir)
        if tag is None:
            if load_dir.is_dir() and any(_DEEPSPEED_FILE.fullmatch(p.name)
                                         for p in load_dir.iterdir()):
                raise CheckpointError(DEEPSPEED_CHECKPOINT.format(directory=load_dir))
            return None
    directory = load_dir / check_tag(tag)
    aside = replaced_dir(load_dir, tag)
    if not directory.exists() and (aside / MANIFEST).is_file():
        # a save of this tag stopped between its two renames (see the module docstring)
        log.warning("checkpoint %s is missing but its previous save is whole in %s: loading "
                    "that", directory, aside)
        return aside
    if not (directory / MANIFEST).is_file():
        tags = available_tags(load_dir)
        if directory.is_dir():
            present = sorted(p.name for p in directory.iterdir())
            if any(_DEEPSPEED_FILE.fullmatch(name) for name in present):
                raise CheckpointError(DEEPSPEED_CHECKPOINT.format(directory=directory))
            raise CheckpointError(
                f"{directory} has no {MANIFEST}, so it cannot be loaded as checkpoint {tag!r}: "
                "the manifest says what the checkpoint holds and the checksums of its files, and "
                f"it was deleted or never written (the directory holds: "
                f"{', '.join(present[:6]) or 'nothing'}{', ...' if len(present) > 6 else ''})"
                + (f"; other checkpoints there: {', '.join(t for t in tags if t != tag)}"
                   if [t for t in tags if t != tag] else "")
                + ". Pass tag= to load another one, or restore the manifest")
        partial = bool(staging_dirs(load_dir, tag))
        raise CheckpointError(
            f"no checkpoint {tag!r} in {load_dir}"
            + (" (a save of it was interrupted: its staging directory is there)" if partial else "")
            + (f"; checkpoints there: {', '.join(tags)}" if tags else "; there are none")
            + ". Pass tag= to load another one")
    return directory
