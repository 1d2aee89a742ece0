"""Crash consistency of checkpoints and swap space, in the SQLite style: kill a training process
at random points and check what survives (issue 23). Used by test_crash_consistency.py (short)
and tools/crash_test.py (long).

One run: an uninterrupted reference life first (crash_child.py: the sha256 of every step's
checkpoint files up to the cap, the calls each phase makes, the disk use of a start and of a
save), then one child life per kill point, each resuming from ``latest``:

  sigkill-trap   the child SIGKILLs itself at the n-th write / fsync / rename / unlink / file read
                 / aio completion of its k-th save, step, load or engine start; in a save that
                 replaces a tag committed before (a kill between a commit's renames left it in
                 place beyond latest), also just after the exchange of the two directories
  sigkill-delay  the harness SIGKILLs it a random time after its engine is up
  sigint-delay   the harness sends SIGINT a random time after its engine is up (Ctrl-C: the
                 engine holds it until a step is whole; the child then exits)
  sigint-trap    the child SIGINTs itself at a trapped call (lands inside a save's commit)
  enospc         the disk fills up, on a small loop-mounted ext4 (when mount works here): the
                 child fills it (a fallocated file) at the n-th write of its k-th save, leaving
                 less than the save still writes (ENOSPC mid-file, at its fsync or manifest);
                 or a filler leaves room for k saves, not the next (the save's check refuses
                 it); or not even for the swap files (the start fails). Without a small disk,
                 the checkpoint writer's n-th write or an fsync fails with ENOSPC
  eio            an aio request of a step, save or load completes with EIO (or a checkpoint
                 write / read fails with it); the child then exits, or loads latest in the same
                 process and goes on (or retries a failed load)

After each life, from its event log (crash_child.EventLog) and the directories:
  * ``latest`` names the last checkpoint whose save returned (or one whose save was under way
    when the child died), and it is whole: every file of its manifest, with that sha256;
  * every checkpoint a life committed equals the reference run's at that step, bit for bit
    (a resumed run, or one recovered in process, is the uninterrupted run), and so does what
    a life saved right after its load (the load's round trip);
  * every committed checkpoint the harness did not prune is still there, whole;
  * nothing outside the engine's directories changed (a sibling directory, the save dir's
    parent, a user's file in the save dir and in the swap path: names, sizes, sha256), and a
    life that died before its first save left the save directory as it was (a load writes
    nothing there);
  * the next life loads ``latest`` (it must be loadable when one checkpoint was committed) and
    at its start finds only its own swap directory under the swap path (a dead owner's was
    reclaimed); a life that exited (not SIGKILLed) after its start left no swap directory.
The harness prunes checkpoints older than the last three and starts over (an empty save
directory) once ``latest`` reaches the cap, so the reference covers every step.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from checkpoint_bytes import content_sha256

CHILD = Path(__file__).with_name("crash_child.py")
RANK_FILES = ("rank0_model.safetensors", "rank0_optim.safetensors")
SWAP_PREFIX = "infinity-swap-"
MODES = ("sigkill-trap", "sigkill-delay", "sigint-delay", "sigint-trap", "enospc", "eio")
WEIGHTS = (30, 15, 10, 10, 15, 20)
TRAPS = {   # mode -> (phase, function) a trap may sit at (those the census finds calls of)
    "sigkill-trap": [("save", f) for f in ("write", "fsync", "rename", "unlink", "aio")]
    + [("step", "aio"), ("load", "read"), ("load", "aio"), ("init", "fsync"), ("init", "rename")],
    "sigint-trap": [("save", f) for f in ("write", "fsync", "rename", "unlink")]
    + [("step", "aio"), ("load", "read")],
    "eio": [("step", "aio"), ("step", "aio"), ("save", "aio"), ("load", "aio"), ("save", "write"),
            ("load", "read")],
    "enospc": [("save", "write"), ("save", "fsync")],       # when no small disk can be mounted
}
# The short CI schedule: every mode, and each kind of window, at least once.
CI_SCHEDULE = [
    dict(mode="sigkill-trap", phase="save", func="write"),
    dict(mode="sigkill-trap", phase="save", func="rename"),
    dict(mode="sigkill-trap", phase="save", func="fsync"),
    dict(mode="sigkill-trap", phase="step", func="aio"),
    dict(mode="sigkill-trap", phase="load", func="read"),
    # between a commit's renames (its tag in place, latest not), then in the next life's
    # save of that tag, just after it exchanged the new directory with the old one
    dict(mode="sigkill-trap", phase="save", func="rename", n="before-latest", k=1),
    dict(mode="sigkill-trap", phase="save", func="exchange", n=1, k=1),
    dict(mode="sigkill-delay"),
    dict(mode="sigkill-delay"),
    # after the load: a Ctrl-C as the load starts its hash thread hangs the process at exit
    # (the xfail test in test_crash_consistency.py); the long run keeps that window
    dict(mode="sigint-delay", after="loaded"),
    dict(mode="sigint-trap", phase="save", func="rename"),
    dict(mode="enospc", phase="save", func="write", where="write", full_saves=0),
    dict(mode="enospc", phase="save", func="fsync", where="write", full_saves=1),
    dict(mode="eio", phase="step", func="aio", recover=True),
    dict(mode="eio", phase="save", func="aio", recover=False),
    dict(mode="eio", phase="load", func="aio", recover=True),
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, object]:
    """Every entry under ``root`` but ``skip``: name -> "dir" or (size, sha256)."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        here = Path(dirpath)
        dirs[:] = sorted(d for d in dirs if here / d not in skip)
        for d in dirs:
            out[str((here / d).relative_to(root)) + "/"] = "dir"
        for f in sorted(files):
            p = here / f
            if p not in skip:
                out[str(p.relative_to(root))] = (p.stat().st_size, sha256(p))
    return out


def diff(before: dict, after: dict) -> list[str]:
    return ([f"removed {k}" for k in before if k not in after]
            + [f"added {k}" for k in after if k not in before]
            + [f"changed {k}" for k in before if k in after and before[k] != after[k]])


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def remove_tree(path: Path, inside: Path) -> None:
    """Remove a directory the harness made (never outside its own temporary tree)."""
    assert inside in path.parents, (path, inside)
    shutil.rmtree(path, ignore_errors=False)


@dataclass
class Workspace:
    """Where a run happens: ``root`` on a small loop-mounted ext4 when one can be mounted (real
    ENOSPC), else a directory on /var/tmp; ``logs`` always on the real disk."""
    base: Path
    root: Path
    logs: Path
    enospc: str                 # "real (...)" or "injected (...)"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def save_dir(self) -> Path:
        return self.work / "ckpt"

    @property
    def nvme(self) -> Path:
        return self.work / "nvme"

    @property
    def probe(self) -> Path:
        return self.work / "probe"

    @property
    def filler(self) -> Path:
        return self.root / "filler"

    @property
    def real_enospc(self) -> bool:
        return self.enospc.startswith("real")


def _try_mount(base: Path, size_mib: int) -> tuple[Path, Path] | str:
    """(image, mount point) of a fresh ext4 loop mount, or why not."""
    if os.geteuid() != 0:
        return "not root"
    image, point = base / "fs.img", base / "mnt"
    point.mkdir()
    try:
        with open(image, "wb") as f:
            f.truncate(size_mib << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True,
                       capture_output=True, timeout=60)
        subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True,
                       capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        image.unlink(missing_ok=True)
        point.rmdir()
        detail = getattr(exc, "stderr", b"") or b""
        return f"mount failed: {exc} {detail.decode(errors='replace').strip()}"
    return image, point


@contextlib.contextmanager
def workspace(base_dir: str | None = None, mount: bool = True,
              size_mib: int = 64) -> Iterator[Workspace]:
    base = Path(tempfile.mkdtemp(prefix="infinity-crash-",
                                 dir=base_dir or os.environ.get("INFINITY_TEST_DISK", "/var/tmp")))
    mounted = _try_mount(base, size_mib) if mount else "not asked to mount"
    try:
        if isinstance(mounted, tuple):
            root = mounted[1]
            ws = Workspace(base, root, base / "logs",
                           f"real (a {size_mib} MiB ext4 image loop-mounted at {root})")
        else:
            root = base / "root"
            root.mkdir()
            ws = Workspace(base, root, base / "logs",
                           f"injected (ENOSPC raised at the checkpoint writer's writes or fsync; "
                           f"no small disk: {mounted})")
        ws.logs.mkdir()
        yield ws
    finally:
        if isinstance(mounted, tuple):
            for attempt in range(20):
                if subprocess.run(["umount", str(mounted[1])], capture_output=True).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                subprocess.run(["umount", "-l", str(mounted[1])], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class Point:
    index: int
    mode: str
    trap: dict | None = None
    delay: float | None = None
    recover: bool = False
    probe: bool = False
    saves: int = 3
    filler: int = 0
    full_saves: int | None = None
    resave: str | None = None        # a tag in place beyond latest, which this life re-saves
    after: str = "ready"             # a delay counts from the engine's start, or "loaded"


class CrashRun:
    """One run of the crash test (see the module docstring)."""

    def __init__(self, ws: Workspace, seed: int, say: Callable[[str], None] = print,
                 width: int = 32, depth: int = 2, cap: int = 12, timeout: float = 120.0) -> None:
        self.ws, self.seed, self.say = ws, seed, say
        self.rng = random.Random(seed)
        self.width, self.depth, self.cap, self.timeout = width, depth, cap, timeout
        self.history: list[dict] = []        # events of the lives since the last reset
        self.pruned: set[str] = set()
        self.expected_latest: str | None = None
        self.lives = 0
        self.paces: list[float] = []
        self.results: list[dict] = []
        for d in (ws.save_dir, ws.nvme, ws.probe, ws.work / "bystander" / "sub"):
            d.mkdir(parents=True, exist_ok=True)
        (ws.work / "bystander" / "a.txt").write_text("a user's notes\n" * 50)
        (ws.work / "bystander" / "b.bin").write_bytes(random.Random(seed).randbytes(65536))
        (ws.work / "bystander" / "sub" / "c.txt").write_text("c\n")
        (ws.work / "notes.txt").write_text("beside the save directory\n")
        (ws.save_dir / "user-notes.txt").write_text("a user's file in the save directory\n")
        (ws.nvme / "keep.me").write_text("a user's file in the swap path\n")
        self.outside = self._outside()

    # -- children -------------------------------------------------------------------------------
    def _spec(self, **extra) -> dict:
        return dict(seed=self.seed, width=self.width, depth=self.depth, cap=self.cap,
                    save_dir=str(self.ws.save_dir), nvme=str(self.ws.nvme),
                    probe_dir=str(self.ws.probe), **extra)

    def _launch(self, spec: dict, log: Path, err: Path, ready: bool):
        r = w = None
        if ready:
            r, w = os.pipe()
            spec["ready_fd"] = w
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(err, "wb") as stderr:
            # (-S as this process: a run against a copy of the sources, not the editable install)
            flags = ["-S"] if sys.flags.no_site else []
            proc = subprocess.Popen([sys.executable, *flags, str(CHILD), json.dumps(spec)],
                                    stdout=stderr, stderr=subprocess.STDOUT, env=env,
                                    pass_fds=(w,) if ready else (), cwd=str(CHILD.parent))
        if w is not None:
            os.close(w)
        return proc, r

    @staticmethod
    def events(log: Path) -> list[dict]:
        out = []
        if log.exists():
            for line in log.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass          # a line cut by the kill (its fsync never returned)
        return out

    def reference(self) -> None:
        """The uninterrupted run, in a save dir of its own (removed after)."""
        ref_dir = self.ws.root / "reference"
        log, err = self.ws.logs / "reference.jsonl", self.ws.logs / "reference.out"
        spec = self._spec(reference=True, log=str(log), life=0)
        spec["save_dir"] = str(ref_dir)
        ref_dir.mkdir()
        proc, _ = self._launch(spec, log, err, ready=False)
        rc = proc.wait(timeout=600)
        evs = self.events(log)
        if rc != 0:
            raise RuntimeError(f"the reference run failed (rc {rc}):\n{err.read_text()[-3000:]}")
        remove_tree(ref_dir, self.ws.root)
        commits = [e for e in evs if e["ev"] == "commit"]
        self.digests = {e["tag"]: e["files"] for e in commits}
        self.census: dict[tuple[str, str], int] = {}
        for e in evs:
            if e["ev"] == "census" and not (e["phase"] == "step" and e["k"] == 1):
                for func, n in e["counts"].items():
                    key = (e["phase"], func)
                    self.census[key] = min(self.census.get(key, n), n)
        ready = next(e for e in evs if e["ev"] == "ready")
        before = next(e for e in evs if e["ev"] == "free")["free"]
        self.swap_use = before - ready["free"]
        uses = [a["free"] - b["free"] for a, b in zip(commits, commits[1:])]
        self.save_use = sorted(uses)[len(uses) // 2]
        self.save_need = commits[-1]["bytes"] - commits[-1]["headers"]   # the save's check
        step_save = sorted(e["seconds"] for e in commits)[len(commits) // 2]
        load = max(e["seconds"] for e in evs if e["ev"] == "loaded")
        self.window = (load, step_save)
        self.say(f"reference: {len(commits)} steps; {step_save * 1000:.0f} ms per step+save, "
                 f"{load * 1000:.0f} ms per load; a start uses {self.swap_use >> 10} KiB, a save "
                 f"{self.save_use >> 10} KiB of disk; trap sites: "
                 + ", ".join(f"{p}/{f}={n}" for (p, f), n in sorted(self.census.items())))

    # -- planning -------------------------------------------------------------------------------
    def plan(self, index: int, fixed: dict | None) -> Point:
        rng = self.rng
        fixed = dict(fixed or {})
        mode = fixed.pop("mode", None) or rng.choices(MODES, WEIGHTS)[0]
        self._start_over_at_cap()
        latest = self._latest()
        room = self.cap - (0 if latest is None else int(latest.removeprefix("global_step")))
        p = Point(index, mode, saves=min(rng.randint(2, 4), room))
        p.resave = self._pending_tag(latest)
        p.probe = mode != "enospc" and rng.random() < 0.6
        p.recover = fixed.pop("recover", rng.random() < 0.5)
        if mode in ("sigkill-delay", "sigint-delay"):
            p.after = fixed.pop("after", "ready")
            p.delay = rng.uniform(0.0, self._seconds_per_save() * (p.saves + 1))
        elif mode == "enospc" and self.ws.real_enospc:
            fixed.pop("phase", None), fixed.pop("func", None)     # the injected mode's site
            p.full_saves = fixed.pop("full_saves", rng.choice([0, 0, 1, 1, 2][:p.saves + 1]))
            where = fixed.pop("where", None) or rng.choices(["write", "check", "init"],
                                                            [60, 25, 15])[0]
            if where == "write":   # the disk fills while the k-th save writes its files
                k = min(p.full_saves + 1, p.saves)
                p.trap = dict(phase="save", func="write", k=k, action="fill",
                              n=rng.randint(1, self.census[("save", "write")]),
                              filler=str(self.ws.filler), leave=rng.randint(0, 65536))
            elif where == "check":  # room for k saves, not for the next: its check refuses
                room = (self.swap_use + p.full_saves * self.save_use
                        + rng.randint(self.save_need // 2, self.save_need * 9 // 10))
                p.filler = max(0, free_bytes(self.ws.root) - room)
            else:                   # not even room for the swap files
                p.full_saves = -1
                p.filler = max(0, free_bytes(self.ws.root)
                               - rng.randint(0, self.swap_use * 9 // 10))
        else:
            fixed.pop("full_saves", None), fixed.pop("where", None)     # the real mode's
            choices = [(ph, f) for ph, f in TRAPS[mode]
                       if self.census.get((ph, f), 0) > 0 and (ph != "load" or latest)]
            phase, func = fixed.pop("phase", None), fixed.pop("func", None)
            n, k = fixed.pop("n", None), fixed.pop("k", None)
            # a tag committed but not yet latest (a kill between the commit's renames): the
            # life's first save replaces it, through the exchange of the two directories
            if phase is None and p.resave and mode != "enospc" and rng.random() < 0.5:
                phase, k = "save", 1
                func = rng.choice(["exchange", "exchange", "rename", "unlink", "fsync"])
                n = 1 if func == "exchange" else rng.randint(1, self.census[("save", func)] + 2)
            if phase is None or (phase == "load" and not latest):
                phase, func = rng.choice(choices)
            if n == "before-latest":   # the rename of latest: the commit's rename (or the
                n = 1 if p.resave else 2   # exchange of a re-saved tag) comes first
            n = n or rng.randint(1, self.census[(phase, func)])
            k = k or (1 if phase in ("load", "init") else rng.randint(1, p.saves))
            action = {"sigkill-trap": "kill", "sigint-trap": "sigint", "eio": "eio",
                      "enospc": "enospc"}[mode]
            p.trap = dict(phase=phase, func=func, n=n, k=k, action=action)
        assert not fixed, fixed
        return p

    # -- one kill point -------------------------------------------------------------------------
    def point(self, p: Point, final: bool = False) -> dict:
        ws = self.ws
        self.lives += 1
        log, err = ws.logs / f"life{self.lives:04d}.jsonl", ws.logs / f"life{self.lives:04d}.out"
        save_before = snapshot(ws.save_dir)
        if p.filler:
            with open(ws.filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, p.filler)
                os.fsync(f.fileno())
        spec = self._spec(log=str(log), life=self.lives, trap=p.trap, recover=p.recover,
                          probe=p.probe, saves=0 if final else p.saves)
        started = time.monotonic()
        proc, ready_fd = self._launch(spec, log, err, ready=p.delay is not None)
        signalled, sent_at = None, None
        try:
            if p.delay is not None:     # from the engine's start, or the end of its load
                want = b"l" if p.after == "loaded" else b"r"
                got = b""
                while want not in got:
                    readable, _, _ = select.select([ready_fd], [], [], self.timeout)
                    byte = os.read(ready_fd, 1) if readable else b""
                    if not byte:
                        break            # the child died before (EOF), or a hang
                    got += byte
                if want in got:
                    time.sleep(p.delay)
                    sig = signal.SIGKILL if p.mode == "sigkill-delay" else signal.SIGINT
                    if proc.poll() is None:
                        proc.send_signal(sig)
                        signalled, sent_at = sig.name, time.monotonic()
            rc = proc.wait(timeout=self.timeout)
            hang = False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)     # every thread's stack into its output
            time.sleep(2)
            proc.kill()
            rc, hang = proc.wait(), True
        finally:
            if ready_fd is not None:
                os.close(ready_fd)
            if ws.filler.exists():
                ws.filler.unlink()
        evs = self.events(log)
        rec = self.judge(p, evs, rc, hang, signalled, save_before, err)
        if signalled == "SIGINT":    # Ctrl-C waits for a step to be whole, not for the run
            late = [e for e in evs if e["t"] > sent_at + 2.0 and e["ev"] in
                    ("loaded", "probe", "begin", "commit")]
            if late:
                rec["failures"].append(f"SIGINT ignored: {late[0]['ev']} "
                                       f"{late[0]['t'] - sent_at:.1f} s after it")
        rec["seconds"] = round(time.monotonic() - started, 2)
        self._housekeeping()
        if not rec["failures"]:
            log.unlink()
            err.unlink()
        return rec

    def judge(self, p: Point, evs: list[dict], rc: int, hang: bool, signalled: str | None,
              save_before: dict, err: Path) -> dict:
        ws, fails = self.ws, []
        kinds = Counter(e["ev"] for e in evs)
        trap = next((e for e in evs if e["ev"] == "trap"), None)
        errors = [e for e in evs if e["ev"] == "error"]
        start = next((e for e in evs if e["ev"] == "start"), {})
        ready = next((e for e in evs if e["ev"] == "ready"), None)
        outcome = {-9: "sigkill", -2: "sigint", 130: "sigint", 0: "clean", 3: "error", 4: "error",
                   5: "error", 6: "error"}.get(rc, f"rc {rc}")
        if hang:
            last = next((e for e in reversed(evs)), {"ev": "nothing"})
            fails.append(f"hang: the child did not exit within {self.timeout} s (its last event: "
                         f"{last['ev']} in {last.get('phase', '-')}; stacks in {err})")
        if outcome.startswith("rc"):
            fails.append(f"unexpected exit {rc}: {err.read_text()[-1500:]}")
        enospc = [e for e in errors if e.get("errno") == errno.ENOSPC
                  or (e["phase"] == "init" and "free" in e["msg"])]
        fired = (bool(trap) and trap["action"] != "fill" or signalled is not None
                 or bool(enospc and ws.real_enospc))
        # the life's load: latest as the last life left it
        loaded = [e for e in evs if e["ev"] == "loaded"]
        load_err = [e for e in errors if e["phase"] == "load"]
        if loaded and loaded[0]["why"] == "start" and loaded[0]["tag"] != self.expected_latest:
            fails.append(f"loaded {loaded[0]['tag']}, latest was {self.expected_latest}")
        if load_err and not trap:
            fails.append(f"latest ({self.expected_latest}) did not load: {load_err[0]['msg']}")
        # swap space: only this life's directory at its start; none left after an exit
        if ready is not None:
            swap = [d for d in ready["swap_dirs"] if d.startswith(SWAP_PREFIX)]
            if len(swap) != 1 or f"-p{start.get('pid')}-" not in swap[0]:
                fails.append(f"swap dirs at the start of pid {start.get('pid')}: {swap}")
            for e in evs:
                if e["ev"] == "rebuilt":    # a second engine of the process, after close()
                    swap = [d for d in e["swap_dirs"] if d.startswith(SWAP_PREFIX)]
                    if len(swap) != 1 or f"-p{start.get('pid')}-" not in swap[0]:
                        fails.append(f"swap dirs at the rebuild in pid {start.get('pid')}: {swap}")
            sigint_at = next((e["phase"] for e in evs if e["ev"] == "sigint"), None)
            if outcome != "sigkill" and sigint_at not in ("init", "close"):
                left = [d for d in os.listdir(ws.nvme) if d.startswith(SWAP_PREFIX)]
                if left:
                    fails.append(f"the child exited ({outcome}) and left swap dirs {left}")
        # bit for bit: every commit and probe equals the reference at its step
        for e in evs:
            if e["ev"] in ("commit", "probe") and e["files"] != self.digests.get(e["tag"]):
                fails.append(f"{e['ev']} of {e['tag']} differs from the uninterrupted run")
            if e["ev"] == "commit" and e["manifest_files"] != e["raw"]:
                fails.append(f"commit of {e['tag']}: files differ from their manifest's sha256")
        fails += self._check_directory(evs)
        # outside the engine's directories nothing changed; a load changes nothing at all
        changed = diff(self.outside, self._outside())
        fails += [f"outside the engine's directories: {c}" for c in changed]
        if not kinds["begin"]:
            fails += [f"save dir changed by a life that saved nothing: {c}"
                      for c in diff(save_before, snapshot(ws.save_dir))]
        stale = {k.rstrip("/") for k in save_before if k.startswith(".") and ".partial" in k
                 and "/" not in k.rstrip("/")}
        if kinds["commit"]:     # the next save removes what dead writers staged
            fails += [f"{n}, staged by a dead writer, survived a save"
                      for n in sorted(stale & set(os.listdir(ws.save_dir)))]
        self.history += evs
        self.expected_latest = self._latest()
        end = next((e for e in evs if e["ev"] == "end"), None)
        if ready is not None and end is not None and kinds["commit"]:
            self.paces.append((end["t"] - ready["t"]) / (kinds["commit"] + 1))
        where = trap and f"{trap['phase']}/{trap['func']}#{trap['n']}"
        window = trap and trap["phase"]
        if p.delay is not None:        # the last event the child logged before the signal
            last = next((e for e in reversed(evs) if e["ev"] not in ("sigint", "error")),
                        {"ev": "nothing"})
            where = f"after {last['ev']}" + (f" {last['tag']}" if last.get("tag") else "")
            window = {"ready": "load", "loaded": "probe/step", "probe": "step", "begin": "save",
                      "commit": "step", "end": "exit"}.get(last["ev"], "start-up")
        if p.mode == "enospc" and ws.real_enospc:
            where = (f"{enospc[0]['phase']}: {enospc[0]['msg'][:90]}" if enospc
                     else f"no ENOSPC ({kinds['commit']} saves fitted)")
            window = ("none" if not enospc else "init" if enospc[0]["phase"] == "init" else
                      "save-write" if "filled up" in enospc[0]["msg"] else
                      "save-check" if "needs" in enospc[0]["msg"] else enospc[0]["phase"])
        stale = sorted(n for n in os.listdir(ws.save_dir) if n.startswith("."))
        return dict(point=p.index, mode=p.mode, trap=p.trap, delay=p.delay and round(p.delay, 3),
                    signalled=signalled, recover=p.recover, probe=p.probe, saves=p.saves,
                    filler=p.filler, outcome=outcome, rc=rc, fired=fired, where=where,
                    window=window,
                    resave=p.resave, commits=kinds["commit"],
                    errors=[f"{e['msg'][:120]} (at {e.get('at')})" for e in errors],
                    latest=self.expected_latest, hidden_entries=stale, failures=fails)

    def _check_directory(self, evs: list[dict]) -> list[str]:
        """``latest`` is the last committed checkpoint (or one under way at the kill), whole,
        equal to the reference; no committed checkpoint is lost."""
        fails = []
        history = self.history + evs
        commits = [i for i, e in enumerate(history) if e["ev"] == "commit"]
        last = history[commits[-1]] if commits else None
        after = history[commits[-1] + 1:] if commits else history
        allowed: set[str] = set()      # saves under way when a life died (not failed ones)
        under_way = None
        for e in after:
            if e["ev"] == "begin":
                allowed.add(under_way := e["tag"])
            elif e["ev"] == "error" and e["phase"] == "save":
                allowed.discard(under_way)
        if last is not None:
            allowed.add(last["tag"])
        latest = self._latest()
        if latest is None:
            if last is not None:
                return [f"latest is gone; {last['tag']} was committed"]
        elif latest not in allowed:
            fails.append(f"latest names {latest}; the last committed is "
                         f"{last and last['tag']}, under way: {sorted(allowed)}")
        else:
            fails += self._whole(latest, "latest")
            if last is not None and latest == last["tag"]:
                try:
                    now = {n: sha256(self.ws.save_dir / latest / n) for n in RANK_FILES}
                    if now != last["raw"]:      # that save's own files (its save id too)
                        fails.append(f"latest {latest} is not the checkpoint reported committed")
                except OSError as exc:
                    fails.append(f"latest {latest}: {exc}")
        for tag in sorted({history[i]["tag"] for i in commits} - self.pruned - {latest}):
            fails += self._whole(tag, "committed")
        return fails

    def _whole(self, tag: str, what: str) -> list[str]:
        d = self.ws.save_dir / tag
        try:
            manifest = json.loads((d / "manifest.json").read_text())
            for name, entry in manifest["files"].items():
                if sha256(d / name) != entry["sha256"]:
                    return [f"{what} {tag}: {name} does not match its manifest"]
            if {n: content_sha256(d / n) for n in RANK_FILES} != self.digests.get(tag):
                return [f"{what} {tag} differs from the uninterrupted run"]
        except (OSError, ValueError, KeyError) as exc:
            return [f"{what} {tag} is lost or damaged: {exc}"]
        return []

    def _pending_tag(self, latest: str | None) -> str | None:
        """The checkpoint after ``latest`` when it is in the save dir (committed, not latest)."""
        step = 0 if latest is None else int(latest.removeprefix("global_step"))
        tag = f"global_step{step + 1}"
        return tag if (self.ws.save_dir / tag / "manifest.json").is_file() else None

    def _latest(self) -> str | None:
        try:
            return (self.ws.save_dir / "latest").read_text().strip()
        except FileNotFoundError:
            return None

    def _outside(self) -> dict:
        ws = self.ws
        snap = snapshot(ws.root, skip=(ws.save_dir, ws.nvme, ws.probe, ws.filler,
                                       ws.root / "reference", ws.root / "lost+found"))
        snap["ckpt/user-notes.txt"] = sha256(ws.save_dir / "user-notes.txt")
        snap["nvme/keep.me"] = sha256(ws.nvme / "keep.me")
        snap["nvme/"] = sorted(n for n in os.listdir(ws.nvme) if not n.startswith(SWAP_PREFIX))
        return snap

    def _seconds_per_save(self) -> float:
        """A life's seconds from its engine's start to its end, per save (probe and load
        counted as one more), from the lives that ran to their end (the reference at first)."""
        if not self.paces:
            return 2 * sum(self.window)
        recent = sorted(self.paces[-9:])
        return recent[len(recent) // 4]      # a quick life's: the machine's load varies

    def _start_over_at_cap(self) -> None:
        """Once latest reaches the cap, empty the save directory (as a user would)."""
        latest = self.expected_latest
        if latest is not None and int(latest.removeprefix("global_step")) >= self.cap:
            for entry in self.ws.save_dir.iterdir():
                if entry.name != "user-notes.txt":
                    remove_tree(entry, self.ws.root) if entry.is_dir() else entry.unlink()
            self.history, self.pruned, self.expected_latest = [], set(), None

    def _housekeeping(self) -> None:
        """Empty the probe dir; prune checkpoints older than the last three."""
        ws = self.ws
        for entry in ws.probe.iterdir():
            remove_tree(entry, ws.root) if entry.is_dir() else entry.unlink()
        latest = self.expected_latest
        tags = sorted((e.name for e in ws.save_dir.iterdir()
                       if e.is_dir() and e.name.startswith("global_step")),
                      key=lambda t: int(t.removeprefix("global_step")))
        for tag in tags[:-3]:
            if tag != latest:
                remove_tree(ws.save_dir / tag, ws.root)
                self.pruned.add(tag)

    # -- the run --------------------------------------------------------------------------------
    def run(self, points: int, schedule: list[dict] | None = None,
            record: Callable[[dict], None] = lambda r: None) -> dict:
        self.say(f"crash test: {points} kill points, seed {self.seed}; ENOSPC mode: "
                 f"{self.ws.enospc}")
        self.reference()
        for i in range(points):
            p = self.plan(i + 1, schedule[i % len(schedule)] if schedule else None)
            rec = self.point(p)
            self.results.append(rec)
            record(rec)
            self.say(self._line(rec))
        final = self.point(Point(points + 1, "final-load", probe=True), final=True)
        record(final)
        self.say(self._line(final))
        summary = self.summary(final)
        record(summary)
        return summary

    @staticmethod
    def _line(rec: dict) -> str:
        trap = rec["trap"]
        how = (f"{trap['action']}@{trap['phase']}#{trap['k']}/{trap['func']}#{trap['n']}"
               if trap else f"{rec['signalled'] or '-'} after {rec['delay']}s" if rec["delay"]
               is not None else f"filler {rec['filler'] >> 10} KiB" if rec["filler"] else "")
        status = "FAIL " + "; ".join(rec["failures"]) if rec["failures"] else "ok"
        where = (f" [{rec['where']}]" if rec["where"] and (not trap or trap["action"] == "fill")
                 else "")
        return (f"[{rec['point']:4d}] {rec['mode']:<13} {how:<34} -> {rec['outcome']:<7} "
                f"fired={int(rec['fired'])} commits={rec['commits']} latest={rec['latest']} "
                f"{rec['seconds']}s {status}{where}")

    def summary(self, final: dict) -> dict:
        per: dict[str, Counter] = defaultdict(Counter)
        windows: dict[str, Counter] = defaultdict(Counter)
        for r in self.results:
            c = per[r["mode"]]
            c["tried"] += 1
            c["fired"] += r["fired"]
            c["survived"] += not r["failures"]
            windows[r["mode"]][r["window"] or "-"] += 1
        fails = [f for r in self.results + [final] for f in r["failures"]]
        return dict(summary=True, seed=self.seed, points=len(self.results),
                    survived=sum(not r["failures"] for r in self.results),
                    fired=sum(r["fired"] for r in self.results),
                    final_ok=not final["failures"], enospc=self.ws.enospc,
                    per_mode={m: dict(c, windows=dict(windows[m])) for m, c in per.items()},
                    unloadable=sum("did not load" in f or "latest is gone" in f
                                   or "lost or damaged" in f for f in fails),
                    changed_checkpoints=sum("differs" in f or "does not match" in f
                                            or "not the checkpoint" in f for f in fails),
                    changed_outside=sum(f.startswith("outside") for f in fails),
                    max_hidden_entries=max((len(r["hidden_entries"]) for r in self.results),
                                           default=0),
                    failures=fails)
