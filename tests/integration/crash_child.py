"""The process the crash-consistency harness kills (see crash_harness.py): one "life" of a run.

Run by the harness only: ``python crash_child.py '<json spec>'``. A life builds a TinyLM under
ZeRO stage 3 with parameters and optimizer on NVMe, loads ``latest`` from the save directory (if
there is one), optionally saves what it loaded to a probe directory (the load's round trip), then
trains one step and saves ``global_step<N>`` (``save_latest``) a few times. The batch of step N
depends on N only, so every life that reaches step N holds the same state there as the
uninterrupted reference run, bit for bit.

Events go, one JSON object a line, to the spec's log (opened O_APPEND, each line fsync'd before
the life goes on): the record the harness judges the save directory against. A "commit" line
is written only after ``save_checkpoint`` returned, with the sha256 of the files it wrote.

Faults come from a trap (``spec["trap"]``): at the n-th call of one function (``write``: the
tensor-file writer's writes; ``fsync``; ``rename``: os.rename/os.replace; ``exchange``: just
after the atomic exchange of a re-saved tag's directories; ``unlink``; ``read``: the tensor-file
reader; ``aio``: the completion of an I/O engine request) inside the k-th instance of one phase
(``init``: the engine's start, ``load``, ``step``, ``save``), the child SIGKILLs or SIGINTs
itself, fills the disk (``fill``), or the call fails with EIO or ENOSPC (an aio request then
completes with that error, as a failing device would report it). The reference life logs the
calls of each phase instance instead (the harness's census of trap sites).

Exit codes: 0 done, 3 the load failed, 4 a step or save failed, 5 the recovery load failed,
6 no engine (no room for the swap files), 130 Ctrl-C (SIGINT).
"""
from __future__ import annotations

import errno
import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

from checkpoint_bytes import content_sha256

RANK_FILES = ("rank0_model.safetensors", "rank0_optim.safetensors")


class EventLog:
    """Append-only, each line fsync'd: what the harness reads after the kill."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lock = threading.Lock()
        self._fsync = os.fsync      # the real one: the traps wrap os.fsync

    def __call__(self, ev: str, **fields) -> None:
        line = json.dumps({"ev": ev, "t": round(time.monotonic(), 4), **fields}) + "\n"
        with self.lock:
            os.write(self.fd, line.encode())
            self._fsync(self.fd)


class Traps:
    """Counts calls per phase instance and fires the spec's fault at its call (see module)."""

    def __init__(self, spec: dict | None, log: EventLog, census: bool) -> None:
        self.spec = spec
        self.census = census
        self.log = log
        self.phase = "init"
        self.instances: Counter = Counter(init=1)
        self.calls: Counter = Counter()
        self.fired = False
        self.lock = threading.Lock()

    def begin(self, phase: str) -> None:
        with self.lock:
            if self.census and self.phase in ("init", "load", "step", "save"):
                self.log("census", phase=self.phase, k=self.instances[self.phase],
                         counts=dict(self.calls))
            self.phase = phase
            self.instances[phase] += 1
            self.calls = Counter()

    def hit(self, func: str) -> str | None:
        """Count a call of ``func``; the action to take now, if the trap fires here."""
        with self.lock:
            self.calls[func] += 1
            s = self.spec
            if (s is None or self.fired or self.phase != s["phase"] or func != s["func"]
                    or self.instances[self.phase] != s["k"] or self.calls[func] != s["n"]):
                return None
            self.fired = True
        self.log("trap", phase=self.phase, k=s["k"], func=func, n=s["n"], action=s["action"])
        if s["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        if s["action"] == "sigint":
            os.kill(os.getpid(), signal.SIGINT)   # raised in the main thread at its next bytecode
            return None
        if s["action"] == "fill":                 # another process fills the disk, now
            fill_disk(s["filler"], s["leave"], self.log)
            return None
        return s["action"]


def fill_disk(path: str, leave: int, log: EventLog) -> None:
    """Allocate a file at ``path`` that leaves ``leave`` bytes free on its filesystem."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        size = free_bytes(os.path.dirname(path)) - leave
        if size > 0:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    log("filled", leave=leave, free=free_bytes(os.path.dirname(path)))


def raised_at(exc: BaseException) -> str:
    """The innermost frame of the engine (or else of anything) the exception came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f"{os.sep}infinity{os.sep}" in f.filename] or frames
    f = ours[-1] if ours else None
    return "" if f is None else f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _error(action: str, what: str) -> OSError:
    code = errno.EIO if action == "eio" else errno.ENOSPC
    return OSError(code, f"{os.strerror(code)} (injected by the crash test: {what})")


def install(traps: Traps) -> None:
    """Wrap the trapped functions (module attributes, looked up at call time by the engine)."""
    from infinity.checkpoint import directory
    from infinity.checkpoint.tensor_file import TensorFileReader, TensorFileWriter
    from infinity.io.aio import IORequest

    def plain(func: str, original, after: bool = False):
        """The trap acts before the call (after it with ``after``: the call has happened)."""
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs) if after else None
            action = traps.hit(func)
            if action is not None:
                raise _error(action, f"{func} {args[:1]}")
            return result if after else original(*args, **kwargs)
        return wrapper

    os.rename = plain("rename", os.rename)
    os.replace = plain("rename", os.replace)
    os.fsync = plain("fsync", os.fsync)
    os.unlink = plain("unlink", os.unlink)
    if hasattr(directory, "_exchange"):
        directory._exchange = plain("exchange", directory._exchange, after=True)
    TensorFileWriter._raw = plain("write", TensorFileWriter._raw)
    TensorFileReader.read_into = plain("read", TensorFileReader.read_into)

    if hasattr(IORequest, "_collect"):
        collect = IORequest._collect

        def collected(self) -> None:
            pending = self._handle is not None
            collect(self)
            if pending and self._handle is None:
                action = traps.hit("aio")
                if action is not None and self._error is None:
                    err = _error(action, self._describe())
                    self._error = (err.errno, err.strerror)
        IORequest._collect = collected


def sha256_files(directory: Path) -> dict[str, str]:
    """The sha256 of each rank file, as its manifest has it."""
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
            for name in RANK_FILES}


def content_files(directory: Path) -> dict[str, str]:
    """The sha256 of each rank file but its save's id: equal for two saves of one state."""
    return {name: content_sha256(directory / name) for name in RANK_FILES}


def fast_optimizer_init() -> None:
    """torch imports torch._dynamo (~1.8 s) at the first optimizer's add_param_group only to
    exclude it from compilation; a child never compiles, so mark those functions done."""
    import torch

    for name in dir(torch.optim.Optimizer):
        f = getattr(torch.optim.Optimizer, name, None)
        inner = getattr(f, "__wrapped__", None)
        if inner is not None and getattr(f, "__code__", None) is not None \
                and f.__code__.co_filename.endswith("_compile.py"):
            inner.__dynamo_disable = inner


def build_engine(spec: dict):
    import torch

    import infinity
    from parity import TinyLM, zero_config

    torch.manual_seed(spec["seed"])
    model = TinyLM(width=spec["width"], depth=spec["depth"])
    ds = zero_config(3, "nvme", "nvme", spec["nvme"])
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    return engine


def train_step(engine, seed: int) -> None:
    import torch

    from parity import VOCAB

    gen = torch.Generator().manual_seed(seed * 100003 + engine.global_steps)
    x = torch.randint(0, VOCAB, (2, 16), generator=gen)
    engine.backward(engine(input_ids=x, labels=x))
    engine.step()


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def life(spec: dict, log: EventLog, traps: Traps) -> int:
    save_dir = Path(spec["save_dir"])
    try:
        engine = build_engine(spec)
    except (OSError, ValueError) as exc:       # a full disk: no room for the swap files
        log("error", phase="init", errno=getattr(exc, "errno", None), msg=str(exc)[:400],
            type=type(exc).__name__, at=raised_at(exc))
        return 6
    swap = sorted(os.listdir(spec["nvme"]))
    log("ready", swap_dirs=swap, free=free_bytes(spec["save_dir"]))
    ready_fd = spec.get("ready_fd")
    if ready_fd is not None:
        os.write(ready_fd, b"r")      # the engine is up ("l" follows once latest is loaded)

    def load(why: str) -> str | None:
        nonlocal engine
        traps.begin("load")
        try:
            path, _ = engine.load_checkpoint(save_dir)
        except (OSError, RuntimeError, ValueError) as exc:
            log("error", phase="load", why=why, errno=getattr(exc, "errno", None),
                msg=str(exc)[:400], type=type(exc).__name__, at=raised_at(exc))
            raise
        traps.begin("idle")
        tag = None if path is None else Path(path).name
        log("loaded", why=why, tag=tag, global_steps=engine.global_steps)
        return tag

    try:
        tag = load("start")
    except (OSError, RuntimeError, ValueError):
        if not (spec.get("recover") and traps.fired):
            return 3
        tag = load("retry")          # the injected fault is spent: the load must work now
    if ready_fd is not None:
        os.write(ready_fd, b"l")
        os.close(ready_fd)
    if tag is not None and spec.get("probe"):
        traps.begin("probe")
        probe = engine.save_checkpoint(spec["probe_dir"], tag="probe", save_latest=False)
        log("probe", tag=tag, files=content_files(probe))
        traps.begin("idle")
    saves = 0
    while saves < spec["saves"] and engine.global_steps < spec["cap"]:
        try:
            traps.begin("step")
            train_step(engine, spec["seed"])
            tag = f"global_step{engine.global_steps}"
            traps.begin("save")
            log("begin", tag=tag)
            path = engine.save_checkpoint(save_dir, tag=tag, client_state={"life": spec["life"]})
            traps.begin("idle")
            manifest = json.loads((path / "manifest.json").read_text())
            log("commit", tag=tag, files=content_files(path), raw=sha256_files(path),
                manifest_files={k: v["sha256"] for k, v in manifest["files"].items()},
                free=free_bytes(spec["save_dir"]))
            saves += 1
        except (OSError, RuntimeError) as exc:
            phase = traps.phase
            log("error", phase=phase, errno=getattr(exc, "errno", None), msg=str(exc)[:400],
                type=type(exc).__name__, at=raised_at(exc))
            if not (spec.get("recover") and traps.fired):
                return 4
            spec["recover"] = False        # one recovery
            if phase == "save":
                continue     # a failed save leaves the engine as it was: train on, save again
            # a failed step leaves the states half-written: as its error says, close the
            # engine, build a new one (in this process) and load latest
            traps.begin("close")
            engine.close()
            traps.begin("init")
            engine = build_engine(spec)
            log("rebuilt", swap_dirs=sorted(os.listdir(spec["nvme"])))
            try:
                if load("recover") is None:
                    return 4              # nothing committed yet to go back to
            except (OSError, RuntimeError, ValueError):
                return 5
    traps.begin("close")
    engine.close()
    traps.begin("idle")
    log("end", global_steps=engine.global_steps, swap_left=sorted(os.listdir(spec["nvme"])))
    return 0


def reference(spec: dict, log: EventLog, traps: Traps) -> int:
    """The uninterrupted run: a save at every step up to the cap (the digests every life must
    reproduce), the call counts of each phase, the disk use of the start and of a save."""
    log("free", where="before", free=free_bytes(spec["save_dir"]))
    engine = build_engine(spec)
    log("ready", swap_dirs=sorted(os.listdir(spec["nvme"])), free=free_bytes(spec["save_dir"]))
    save_dir = Path(spec["save_dir"])
    while engine.global_steps < spec["cap"]:
        traps.begin("step")
        started = time.monotonic()
        train_step(engine, spec["seed"])
        tag = f"global_step{engine.global_steps}"
        traps.begin("save")
        path = engine.save_checkpoint(save_dir, tag=tag)
        traps.begin("idle")
        log("commit", tag=tag, files=content_files(path), raw=sha256_files(path),
            seconds=time.monotonic() - started,
            free=free_bytes(spec["save_dir"]),
            bytes=sum(v["bytes"] for v in json.loads((path / "manifest.json").read_text())
                      ["files"].values()),
            headers=sum(8 + int.from_bytes((path / n).read_bytes()[:8], "little")
                        for n in RANK_FILES))
    for _ in range(2):
        traps.begin("load")
        started = time.monotonic()
        engine.load_checkpoint(save_dir, tag=f"global_step{spec['cap'] // 2}")
        traps.begin("idle")
        log("loaded", tag=f"global_step{spec['cap'] // 2}", seconds=time.monotonic() - started)
    engine.close()
    log("end", global_steps=engine.global_steps, swap_left=sorted(os.listdir(spec["nvme"])))
    return 0


def main() -> int:
    # Ctrl-C as at a terminal: a harness started in the background (``cmd &``) passes SIGINT
    # down ignored, and Python then installs no handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # the harness's look at a hang
    spec = json.loads(sys.argv[1])
    log = EventLog(spec["log"])
    log("start", pid=os.getpid(), life=spec.get("life"))
    traps = Traps(spec.get("trap"), log, census=bool(spec.get("reference")))
    try:
        import torch

        torch.set_num_threads(1)
        fast_optimizer_init()
        install(traps)
        return (reference if spec.get("reference") else life)(spec, log, traps)
    except KeyboardInterrupt:
        log("sigint", phase=traps.phase)
        return 130


if __name__ == "__main__":
    sys.exit(main())
