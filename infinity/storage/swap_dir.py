"""One rank's private swap directory: creation, owner marker, removal, reclaim after a killed run.

Why: swap files can be hundreds of GiB, and a run killed with SIGKILL (or a node reboot) cannot
remove its own. Each rank therefore works in a private directory under the user's ``nvme_path``
(mode 0700) holding a marker file that names its owner (pid, boot id, process start time, rank,
hostname) and lists every file the engine created there. A later start (``reclaim_stale``) or
``infinity clean`` can then tell a dead owner's directory from a live one and from a user's
directory, and remove exactly what we created:

* only the files listed in the marker, then the marker, are unlinked (through a directory file
  descriptor opened with O_NOFOLLOW, so a swapped-in symlink cannot redirect the deletes);
* then ``rmdir``, which fails safely (the directory is left, with a warning) if anyone put other
  files in it; there is never a recursive delete;
* an owner is dead when the boot id differs (the machine rebooted), the pid is gone, or the pid now
  belongs to a process with another start time (pid reuse); a marker from another host is never
  judged (we cannot see its processes) and is left alone.
"""
from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infinity.base import machine
from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes

DIR_PREFIX = "infinity-swap-"
MARKER_NAME = "infinity-swap.json"
MARKER_FORMAT = "infinity-swap-marker/1"
MARKER_TMP_NAME = MARKER_NAME + ".tmp"
"""The marker is written here, then renamed: a process killed in between leaves only this file."""
_MARKER_TMP = MARKER_TMP_NAME
_DIR_NAME = re.compile(rf"^{re.escape(DIR_PREFIX)}r(\d+)-p(\d+)-[0-9a-f]{{6}}\Z")
ORPHAN_GRACE_S = 60.0
"""A temporary marker that cannot be read is left alone this long (its writer may still run)."""
# The only names we create in a private dir: the swap space's files (storage/swap.py) and
# nvme-tune's test file. A marker is a file on disk anyone can write, so it is believed only
# for names of these kinds: one listing "thesis.tex" in a directory named like ours removed it.
_FILE_NAME = re.compile(r"^(?:swap|tune)-\d{1,9}\.bin\Z")   # \Z: "$" also matches before a final "\n"
_BOOT_ID_PATH = machine.BOOT_ID_PATH

_log = get_logger("storage.swap_dir")


class SwapDirError(ValueError):
    """A swap directory cannot be used or reclaimed (the message says why and what to do)."""


class NotOursError(SwapDirError):
    """The directory has no valid marker: it was not created by infinity, so it is not touched."""


class OwnerAliveError(SwapDirError):
    """The directory's owner is still running (or runs on another host): it is not touched."""


class Liveness(enum.Enum):
    """What we can tell about a marker's owner from this machine."""

    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"  # another host: its processes are not visible from here


def boot_id() -> str:
    """This boot's id (changes at every reboot), or "" when the kernel does not expose it."""
    return machine.boot_id(_BOOT_ID_PATH)


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (comm) may hold spaces and parentheses: split after the last ')'. The rest starts at
    # field 3 (the state), so field 22 is index 19.
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None     # a zombie: it has exited, only its parent has not reaped it yet
    return int(fields[19])


@dataclass(frozen=True)
class Owner:
    """The process that created a swap directory."""

    pid: int
    boot_id: str
    start_time: int
    """Clock ticks since boot when the process started; tells a reused pid apart."""
    rank: int
    hostname: str

    @classmethod
    def of_this_process(cls, rank: int) -> Owner:
        pid = os.getpid()
        return cls(pid=pid, boot_id=boot_id(), start_time=process_start_time(pid) or 0,
                   rank=rank, hostname=socket.gethostname())

    def liveness(self) -> tuple[Liveness, str]:
        """Whether the owner still runs, with the reason in words."""
        here = socket.gethostname()
        if self.hostname != here:
            return Liveness.UNKNOWN, (f"it belongs to host {self.hostname!r} (this is {here!r}), "
                                      "whose processes cannot be seen from here")
        current_boot = boot_id()
        if self.boot_id and current_boot and self.boot_id != current_boot:
            return Liveness.DEAD, "the machine has rebooted since it was created"
        started = process_start_time(self.pid)
        if started is None:
            return Liveness.DEAD, f"its owner pid {self.pid} is gone"
        if self.start_time and started != self.start_time:
            return Liveness.DEAD, (f"pid {self.pid} now belongs to another process (start time "
                                   f"{started}, owner's was {self.start_time})")
        return Liveness.ALIVE, f"its owner pid {self.pid} (rank {self.rank}) is still running"


@dataclass
class Marker:
    """Contents of the marker file: the owner and the files it created."""

    owner: Owner
    files: list[str] = field(default_factory=list)
    created: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"format": MARKER_FORMAT, "owner": asdict(self.owner),
                           "files": self.files, "created": self.created}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Marker:
        try:
            data = json.loads(text)
            if data.get("format") != MARKER_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {MARKER_FORMAT!r}")
            o = data["owner"]
            owner = Owner(pid=int(o["pid"]), boot_id=str(o["boot_id"]),
                          start_time=int(o["start_time"]), rank=int(o["rank"]),
                          hostname=str(o["hostname"]))
            files = [str(name) for name in data["files"]]
            return cls(owner=owner, files=files, created=float(data.get("created", 0.0)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NotOursError(f"{where} is not a valid infinity swap marker ({exc}); the directory "
                               "is left alone: remove it by hand if you know it is stale") from None


@dataclass
class Removal:
    """What removing (or reclaiming) a swap directory did."""

    path: Path
    bytes_freed: int = 0
    """Disk space of the removed files (allocated blocks)."""
    files_removed: int = 0
    dir_removed: bool = False
    leftovers: list[str] = field(default_factory=list)
    """Entries left in the directory that we did not create (so the directory stays)."""
    reason: str = ""


def read_marker(path: str | os.PathLike[str]) -> Marker:
    """The marker of swap directory ``path``; NotOursError when there is none or it is invalid."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotOursError(f"{path} is not a directory (or is a symlink); only infinity swap "
                           "directories are cleaned")
    marker = path / MARKER_NAME
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            raise NotOursError(f"{marker} is not a regular file; {path} is left alone")
        text = marker.read_text()
    except FileNotFoundError:
        raise NotOursError(f"{path} has no {MARKER_NAME} marker, so infinity did not create it; "
                           "nothing there was touched") from None
    return Marker.from_json(text, marker)


def _orphan_marker(path: Path) -> Marker | None:
    """The marker of a directory that ``SwapDir.create`` left holding only its temporary marker
    (the process was killed between writing and renaming it), or None when ``path`` is not
    exactly that: one of our directory names, a real directory, and no entry but that file.

    The owner is read from the temporary marker; when it is cut short (killed while writing),
    from the directory name (rank, pid; this host assumed), and only once the file is older than
    ``ORPHAN_GRACE_S``, so a run creating its directory right now is never raced.
    """
    match = _DIR_NAME.match(path.name)
    if match is None:
        return None
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        entries = os.listdir(path)
        if not entries:
            # killed between mkdir and the first marker write: nothing in it to lose
            return _owner_from_name(path, match, os.lstat(path).st_mtime, "is empty")
        if entries != [_MARKER_TMP]:
            return None
        tmp = path / _MARKER_TMP
        st = os.lstat(tmp)
        if not stat.S_ISREG(st.st_mode):
            return None
        text = tmp.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return Marker.from_json(text, tmp)
    except NotOursError:
        head = '{\n "format": ' + json.dumps(MARKER_FORMAT)   # how Marker.to_json starts
        if not (text.startswith(head) or head.startswith(text)):
            return None   # not a marker of ours cut short: not ours to delete
    return _owner_from_name(path, match, st.st_mtime, f"holds only a partly written {_MARKER_TMP}")


def _owner_from_name(path: Path, match: re.Match[str], mtime: float, state: str) -> Marker:
    """A marker for a directory whose own marker never got written: the owner's rank and pid
    from the directory name (this host assumed), once it is older than ``ORPHAN_GRACE_S``."""
    age = time.time() - mtime
    if age < ORPHAN_GRACE_S:
        raise OwnerAliveError(f"{path} {state} from {age:.0f} s ago: its run may be creating it "
                              "right now; try again in a minute")
    rank, pid = int(match.group(1)), int(match.group(2))
    return Marker(owner=Owner(pid=pid, boot_id="", start_time=0, rank=rank,
                              hostname=socket.gethostname()), created=mtime)


def _remove_listed(path: Path, names: list[str]) -> Removal:
    """Unlink ``names`` and the marker in ``path``, then rmdir it if it is empty."""
    result = Removal(path=path)
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return result
    try:
        for name in [*names, MARKER_NAME, _MARKER_TMP]:
            if not _FILE_NAME.match(name) and name not in (MARKER_NAME, _MARKER_TMP):
                _log.warning("swap dir %s: marker lists %r, which is not a name infinity creates; "
                             "not deleting it", path, name)
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except IsADirectoryError:
                continue  # a directory is never ours: leave it (rmdir below will then fail)
            if name not in (MARKER_NAME, _MARKER_TMP):
                result.files_removed += 1
                result.bytes_freed += st.st_blocks * 512
    finally:
        os.close(dir_fd)
    try:
        os.rmdir(path)
        result.dir_removed = True
    except FileNotFoundError:
        result.dir_removed = True
    except OSError:
        try:
            result.leftovers = sorted(os.listdir(path))
        except OSError:
            result.leftovers = []
        _log.warning("left %s in place: it holds entries infinity did not create (%s); remove them "
                     "and the directory by hand", path, ", ".join(result.leftovers) or "unreadable")
    return result


_HELD_LOCKS: set[int] = set()
"""The directory locks this process holds (``SwapDir._hold_lock``)."""


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker, any helper forked without exec), close the copies
    of the parent's directory locks: an flock lasts while any descriptor of its open file does,
    so a child that outlived its killed parent kept the dead run's directory "alive" -- never
    reclaimed, and refused by ``infinity clean``. The parent's own descriptor keeps its lock."""
    for fd in list(_HELD_LOCKS):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class SwapDir:
    """A private swap directory created by this process; lists its files in the marker."""

    def __init__(self, path: Path, marker: Marker) -> None:
        self.path = path
        self._marker = marker
        self._removed = False
        self._lock_fd: int | None = None
        self._lock_pid = 0        # the process that holds it (a fork's copy is closed)

    def _hold_lock(self) -> None:
        """Hold a shared flock on the directory for as long as this object lives: a pid in the
        marker says nothing to a process in another PID namespace (a container on the same
        host), but the lock does, and it goes away with the process however it ends."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        self._lock_fd, self._lock_pid = fd, os.getpid()
        _HELD_LOCKS.add(fd)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            _HELD_LOCKS.discard(self._lock_fd)
            if self._lock_pid == os.getpid():     # a forked child's copy was closed at fork
                os.close(self._lock_fd)
            self._lock_fd = None

    @classmethod
    def create(cls, parent: str | os.PathLike[str], rank: int = 0) -> SwapDir:
        """Make a fresh private directory (mode 0700) with a marker under ``parent``."""
        parent = Path(parent)
        owner = Owner.of_this_process(rank)
        for _ in range(100):
            path = parent / f"{DIR_PREFIX}r{rank}-p{owner.pid}-{secrets.token_hex(3)}"
            try:
                os.mkdir(path, 0o700)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - 100 random collisions
            raise SwapDirError(f"could not create a fresh swap directory under {parent}")
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; this only ever tightens it
        swap_dir = cls(path, Marker(owner=owner, created=time.time()))
        try:
            swap_dir._hold_lock()
            swap_dir._write_marker()
        except BaseException:
            swap_dir._release_lock()
            # e.g. SIGTERM (SystemExit) between the write and the rename: remove the temporary
            # marker too, or the rmdir fails and hides the first exception
            with contextlib.suppress(OSError):
                os.unlink(path / _MARKER_TMP)
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise
        return swap_dir

    @property
    def owner(self) -> Owner:
        return self._marker.owner

    @property
    def file_names(self) -> list[str]:
        """Names of the files registered (created) in this directory, in order."""
        return list(self._marker.files)

    def register_file(self, name: str) -> Path:
        """Record ``name`` in the marker before the caller creates it; returns its path.

        The marker is updated first, so a crash between the two leaves at worst a listed file that
        does not exist (which reclaim skips), never an unlisted file of ours.
        """
        if not _FILE_NAME.match(name) or name in (MARKER_NAME, _MARKER_TMP):
            raise ValueError(f"swap file name {name!r} is not a name the engine creates "
                             "(swap-<n>.bin, tune-<n>.bin): reclaim would not remove it")
        if self._removed:
            raise SwapDirError(f"swap directory {self.path} was already removed")
        if name in self._marker.files:
            raise ValueError(f"swap file {name!r} is already registered in {self.path}")
        self._marker.files.append(name)
        self._write_marker()
        return self.path / name

    def remove(self) -> Removal:
        """Delete the registered files and the marker, then the directory (idempotent)."""
        if self._removed:
            return Removal(path=self.path, dir_removed=True)
        # marked removed only once it is: a removal interrupted part-way (a second Ctrl-C) is
        # finished by the next call (files already gone are skipped)
        result = _remove_listed(self.path, self._marker.files)
        self._removed = True
        self._release_lock()
        return result

    def _write_marker(self) -> None:
        tmp = self.path / _MARKER_TMP
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, self._marker.to_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path / MARKER_NAME)

    def __repr__(self) -> str:
        return f"SwapDir({self.path}, {len(self._marker.files)} files)"


def reclaim(path: str | os.PathLike[str], *, dry_run: bool = False) -> Removal:
    """Remove the swap directory ``path`` left by a dead run.

    Raises NotOursError (no valid marker) or OwnerAliveError (owner running, or on another host);
    nothing is touched then. A directory holding nothing but the temporary marker of a creation
    that was killed is ours too (``_orphan_marker``). With ``dry_run`` only reports what would be
    freed.
    """
    path = Path(path)
    marker = _orphan_marker(path) or read_marker(path)
    state, reason = judge_owner(marker.owner, _lock_state(path))
    if state is Liveness.ALIVE:
        raise OwnerAliveError(f"{path} is in use: {reason}; stop that run first (it removes its "
                              "own swap files when it exits)")
    if state is Liveness.UNKNOWN:
        raise OwnerAliveError(f"{path} cannot be judged: {reason}; run `infinity clean` on that "
                              "host instead")
    if dry_run:
        size = 0
        for name in marker.files:
            if _FILE_NAME.match(name):
                try:
                    size += os.lstat(path / name).st_blocks * 512
                except FileNotFoundError:
                    pass
        return Removal(path=path, bytes_freed=size, files_removed=len(marker.files), reason=reason)
    result = _remove_listed(path, marker.files)
    result.reason = reason
    return result


def judge_owner(owner: Owner, lock_held: bool | None) -> tuple[Liveness, str]:
    """Whether ``owner`` of a swap directory (or of any resource it marks, a checkpoint
    directory's writer lock say) still runs, with the reason in words. ``lock_held`` is whether
    a process holds the resource's flock (None: cannot be told), which every live owner holds
    and the kernel drops when its process dies.

    The rules, in one place: an owner of another host cannot be judged (UNKNOWN), except one of
    another hostname under this very kernel (the same boot id: a container restarted under a new
    name), which the lock judges; an owner that looks dead by its pid but whose lock a process
    holds is alive (it runs in another PID namespace: a container on this host)."""
    state, reason = owner.liveness()
    if (state is Liveness.UNKNOWN and lock_held is not None and owner.boot_id
            and owner.boot_id == boot_id()):
        if lock_held:
            return Liveness.ALIVE, (f"a process of host {owner.hostname!r} (this kernel) holds "
                                    "its lock")
        return Liveness.DEAD, (f"its owner ran on host {owner.hostname!r} under this kernel "
                               "(same boot id) and no process holds its lock")
    if state is Liveness.DEAD and lock_held:
        return Liveness.ALIVE, (f"{reason}, but a running process holds its lock (its owner "
                                "runs in another PID namespace: a container on this host, say)")
    return state, reason


def _lock_state(path: Path) -> bool | None:
    """True when a process holds the directory's lock, False when none does, None when it
    cannot be told (the directory cannot be opened, or its filesystem has no flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None         # a filesystem without flock: the marker's pid decides
    finally:
        os.close(fd)        # (closing drops a lock we took)
    return False


def find_swap_dirs(parent: str | os.PathLike[str]) -> list[Path]:
    """Entries of ``parent`` named like our private directories (not yet checked for a marker)."""
    parent = Path(parent)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(parent / n for n in names if n.startswith(DIR_PREFIX))


def reclaim_stale(parent: str | os.PathLike[str]) -> list[Removal]:
    """Reclaim every swap directory under ``parent`` whose owner is dead; log what was freed."""
    done = []
    for path in find_swap_dirs(parent):
        try:
            result = reclaim(path)
        except OwnerAliveError as exc:
            _log.debug("not reclaiming %s: %s", path, exc)
            continue
        except (NotOursError, FileNotFoundError) as exc:
            _log.debug("skipping %s: %s", path, exc)
            continue
        except OSError as exc:  # e.g. another user's 0700 directory: never fatal at start
            _log.warning("could not check or reclaim %s (%s); leaving it", path, exc)
            continue
        _log.info("reclaimed swap dir %s left by a killed run (%s): %s freed in %d files",
                  path, result.reason, format_bytes(result.bytes_freed), result.files_removed)
        done.append(result)
    return done
