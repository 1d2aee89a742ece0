"""Kill points in a save of a transformers weights directory over an earlier one (issue 34):
``engine.save_pretrained``, ``export_pretrained`` (``infinity export``) and
``save_16bit_model``, each over an earlier save with fewer, as many and more shards. After each
kill the directory must load, by transformers' rule (``model.safetensors`` first, else the
index; read here with the ``safetensors`` package, not the engine's reader), as the earlier
save or the new one, bit for bit; the user's file in it is unchanged; and the next save
completes and leaves no hidden file. Used by test_weights_dir_faults.py (in process: the n-th
file operation raises, and every one after it, as if the process were gone) and
tools/crash_test.py --exports (a child SIGKILLed at the n-th operation or after a random delay).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file

from infinity.checkpoint.tensor_file import TensorFileWriter
from infinity.checkpoint.writer_lock import SaveLock

USER_FILE = "README.md"
KINDS = ("save_pretrained", "export", "save_16bit_model")


class Killed(BaseException):
    """The process is gone: raised at the trapped operation and at every one after it."""


@contextlib.contextmanager
def trap(at: int, on_fire: Callable[[], None] | None = None) -> Iterator[list[str]]:
    """Count the file operations a save makes (renames, unlinks, fsyncs, tensor-file writes);
    at the ``at``-th, ``on_fire()`` (a SIGKILL in a child) or raise ``Killed`` there and at
    every later one. Yields the list of operations seen (``"fired"`` appended when it fired)."""
    seen: list[str] = []
    patched = {"replace": os.replace, "rename": os.rename, "unlink": os.unlink,
               "fsync": os.fsync}
    raw = TensorFileWriter._raw

    def counted(name: str, real):
        def call(*args, **kwargs):
            if "fired" in seen:
                raise Killed(name)
            seen.append(name)
            if len(seen) == at:
                if on_fire is not None:
                    on_fire()
                seen.append("fired")
                raise Killed(name)
            return real(*args, **kwargs)
        return call

    for name, real in patched.items():
        setattr(os, name, counted(name, real))
    writes = counted("write", raw)
    TensorFileWriter._raw = lambda self, data: writes(self, data)
    acquire = SaveLock.acquire.__func__
    taken: list[SaveLock] = []

    def recorded(cls, save_dir):
        lock = acquire(cls, save_dir)
        taken.append(lock)
        return lock
    SaveLock.acquire = classmethod(recorded)
    try:
        yield seen
    finally:
        for name, real in patched.items():
            setattr(os, name, real)
        TensorFileWriter._raw = raw
        SaveLock.acquire = classmethod(acquire)
        if "fired" in seen:
            _die_holding(taken)


def _die_holding(locks: list[SaveLock]) -> None:
    """What the kernel does for a killed process: its descriptors close (the flock goes), the
    lock file stays, naming this pid (the next save of this process takes it over)."""
    for lock in locks:
        if lock._fd is not None:
            os.close(lock._fd)
            lock._fd = None
            os.close(lock._dir_fd)


def read_view(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors a transformers reader loads from ``directory`` (its rule: model.safetensors
    when it is a file, else the shards of model.safetensors.index.json)."""
    single = directory / "model.safetensors"
    if single.is_file():
        return load_file(single)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(set(index["weight_map"].values()))
    for file in files:
        loaded = load_file(directory / file)
        tensors.update({k: v for k, v in loaded.items() if index["weight_map"].get(k) == file})
    missing = set(index["weight_map"]) - set(tensors)
    if missing:
        raise AssertionError(f"{directory}: the index names {sorted(missing)[:3]}, not in its files")
    return tensors


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def hidden_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@dataclass
class Case:
    """One save over an earlier one: the earlier directory (copied in before each kill) and
    what a reader must see, the earlier save or the new one."""

    kind: str
    old_shards: int
    new_shards: int
    earlier: Path
    new: Path

    def check(self, directory: Path) -> str:
        """Which save ``directory`` holds ("old" or "new"); raises when it is neither, or the
        user's file changed."""
        if (directory / USER_FILE).read_text() != f"mine {self.kind}\n":
            raise AssertionError(f"{directory}: the user's {USER_FILE} changed")
        view = read_view(directory)
        if same(view, read_view(self.earlier)):
            return "old"
        if same(view, read_view(self.new)):
            return "new"
        raise AssertionError(f"{directory} ({self.kind}, {self.old_shards} -> {self.new_shards} "
                             f"shards) loads as neither save: {sorted(os.listdir(directory))}")

    def reset(self, directory: Path) -> None:
        """``directory`` as the earlier save left it, with the user's file."""
        if directory.exists():
            shutil.rmtree(directory)
        shutil.copytree(self.earlier, directory)
        (directory / USER_FILE).write_text(f"mine {self.kind}\n")


def shard_sizes(reference: Path) -> dict[int, int]:
    """max_shard_size values giving 1, 2 and 3 shards for the tensors of ``reference`` (a
    one-file save), by transformers' rule (sharded_writer.plan_shards)."""
    from infinity.checkpoint.sharded_writer import plan_shards

    tensors = load_file(reference / "model.safetensors")
    table = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    found: dict[int, int] = {}
    for size in range(total, 0, -max(1, total // 400)):
        found.setdefault(len(plan_shards(table, size)), size)
    return {n: found[n] for n in (1, 2, 3)}


def engine_config(swap: str) -> dict:
    """The engine of the saves: stage 3, parameters and optimizer on NVMe under ``swap``."""
    from parity import zero_config

    ds = zero_config(3, "nvme", "nvme", swap)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return ds


class Saves:
    """A tiny transformers Llama under stage 3 on NVMe at two states (A: one step, B: two),
    with checkpoints of both, and the reference saves of every kind and shard count."""

    def __init__(self, work: Path) -> None:
        import infinity
        from parity import make_model, train_random

        self.work = work
        (work / "swap").mkdir(parents=True, exist_ok=True)
        self.engine, *_ = infinity.initialize(model=make_model("llama", layers=2),
                                              config=engine_config(str(work / "swap")))
        self.refs: dict[tuple[str, str, int], Path] = {}
        train_random(self.engine, 1)
        self.ckpt = {"A": Path(self.engine.save_checkpoint(work / "ckpt", tag="A"))}
        self.engine.save_pretrained(work / "probe", max_shard_size="1GB")
        self.sizes = shard_sizes(work / "probe")
        self._references("A")
        train_random(self.engine, 1, seed=2)
        self.ckpt["B"] = Path(self.engine.save_checkpoint(work / "ckpt", tag="B"))
        self._references("B")

    def save(self, kind: str, state: str, directory: Path, shards: int) -> None:
        """A save of ``kind`` of ``state`` (the engine's current one for the engine's saves)."""
        if kind == "save_pretrained":
            self.engine.save_pretrained(directory, max_shard_size=self.sizes[shards])
        elif kind == "export":
            from infinity.checkpoint.pretrained_write import export_pretrained

            export_pretrained(self.ckpt[state], directory, max_shard_size=self.sizes[shards])
        else:
            self.engine.save_16bit_model(directory)

    def _references(self, state: str) -> None:
        for kind in KINDS:
            for shards in ((1,) if kind == "save_16bit_model" else (1, 2, 3)):
                path = self.work / "refs" / f"{kind}-{state}-{shards}"
                self.save(kind, state, path, shards)
                self.refs[(kind, state, shards)] = path

    def cases(self, few: bool = False) -> list[Case]:
        """Every kind over an earlier save of its kind with fewer, as many and more shards
        (save_16bit_model writes one file: over a one-file and a sharded save_pretrained).
        ``few``: one of each shape per kind, split between the two that shard (the unit test's
        share; tools/crash_test.py --exports runs them all)."""
        shapes = {"save_pretrained": ((1, 3), (3, 3), (3, 1), (2, 3), (3, 2), (1, 1)),
                  "export": ((1, 3), (3, 3), (3, 1), (2, 3), (3, 2), (1, 1))}
        if few:
            shapes = {"save_pretrained": ((1, 3), (3, 3), (3, 2)),
                      "export": ((2, 3), (3, 3), (3, 1))}
        out = []
        for kind in ("save_pretrained", "export"):
            for old, new in shapes[kind]:
                out.append(Case(kind, old, new, self.refs[(kind, "A", old)],
                                self.refs[(kind, "B", new)]))
        for old in (1, 3):
            out.append(Case("save_16bit_model", old, 1, self.refs[("save_pretrained", "A", old)],
                            self.refs[("save_16bit_model", "B", 1)]))
        return out

    def close(self) -> None:
        self.engine.close()


def count_operations(saves: Saves, case: Case, directory: Path) -> tuple[int, float]:
    """How many file operations ``trap`` sees in ``case``'s save, uninterrupted, and its
    seconds."""
    import time

    case.reset(directory)
    started = time.monotonic()
    with trap(1 << 30) as seen:
        saves.save(case.kind, "B", directory, case.new_shards)
    return len(seen), time.monotonic() - started


def run_kills(work: Path, points: int, seed: int, say: Callable[[str], None],
              record: Callable[[dict], None]) -> dict:
    """``points`` kills of a child saving over an earlier save (weights_crash_child.py), the
    cases shuffled and cycled: each SIGKILLed at a random file operation of the save, or at a
    random delay after it started (up to 1.5x an uninterrupted save's time in this process, so
    some land after it).
    After each: the directory holds the earlier save or the new one (Case.check), and the next
    save (this process's, taking over the dead child's lock) completes and leaves no hidden
    file. Returns the counts per kind and outcome, and the failures."""
    import random
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(seed)
    saves = Saves(work)
    child = Path(__file__).with_name("weights_crash_child.py")
    directory, swap = work / "out", work / "child-swap"
    swap.mkdir(exist_ok=True)
    cases = saves.cases()
    rng.shuffle(cases)
    measured = {id(c): count_operations(saves, c, directory) for c in cases}
    operations = {key: count for key, (count, _) in measured.items()}
    durations = {key: seconds for key, (_, seconds) in measured.items()}
    summary: dict = {"points": 0, "failures": [], "per_kind": {}}
    try:
        for point in range(points):
            case = cases[point % len(cases)]
            mode = rng.choice(("trap", "delay"))
            case.reset(directory)
            trap_at = rng.randint(1, operations[id(case)]) if mode == "trap" else 0
            argv = [sys.executable, str(child), case.kind, str(saves.ckpt["B"]), str(directory),
                    str(saves.sizes[case.new_shards]), str(swap), str(trap_at)]
            started = time.monotonic()
            log = open(work / "child.log", "w+")
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
            delay = None
            if proc.stdout.readline().strip() != "saving":
                proc.wait(timeout=600)
                summary["failures"].append(f"point {point}: the child did not start saving: "
                                           f"{_tail(log)}")
                continue
            if mode == "delay":
                delay = rng.uniform(0, 1.5 * durations[id(case)])
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
            rc = proc.wait(timeout=600)
            killed = rc == -signal.SIGKILL
            if not killed and rc != 0:
                summary["failures"].append(f"point {point}: the child failed (exit {rc}): "
                                           f"{_tail(log)}")
                continue
            rec = {"point": point, "kind": case.kind, "shards": [case.old_shards,
                                                                 case.new_shards],
                   "mode": mode, "trap_at": trap_at, "of": operations[id(case)],
                   "delay_s": delay, "killed": killed,
                   "seconds": round(time.monotonic() - started, 2)}
            try:
                rec["found"] = case.check(directory)
                rec["hidden_left"] = hidden_files(directory)
                saves.save(case.kind, "B", directory, case.new_shards)
                if case.check(directory) != "new" or hidden_files(directory):
                    raise AssertionError(f"the next save left {hidden_files(directory)} or "
                                         "did not commit")
            except Exception as exc:      # noqa: BLE001 -- recorded, the run goes on
                rec["failure"] = f"{type(exc).__name__}: {exc}"
                summary["failures"].append(f"point {point} ({case.kind} {case.old_shards}->"
                                           f"{case.new_shards}, {mode}): {rec['failure']}")
            record(rec)
            summary["points"] += 1
            key = f"{case.kind} {mode}"
            counts = summary["per_kind"].setdefault(key, {"tried": 0, "killed": 0, "old": 0,
                                                          "new": 0, "failed": 0})
            counts["tried"] += 1
            counts["killed"] += killed
            if "failure" in rec:
                counts["failed"] += 1
            else:
                counts[rec["found"]] += 1
            if point % 20 == 19:
                say(f"{point + 1} points, {len(summary['failures'])} failures")
    finally:
        saves.close()
    return summary


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-2000:]
