"""A save of a weights directory over an earlier one is atomic as a whole (issue 34): a fault at
every file operation of ``engine.save_pretrained``, ``export_pretrained`` (``infinity export``)
and ``save_16bit_model`` over earlier saves with fewer, as many and more shards leaves the
earlier save or the new one, bit for bit, never a mix (weights_crash.py); and a checkpoint load
beside a writer re-saving its tag reads one save (manifest and tensors of the same save)."""
from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import infinity
from parity import make_model, zero_config
from weights_crash import KINDS, Killed, Saves, hidden_files, trap


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    work = Path(tmp_path_factory.mktemp("weights"))
    s = Saves(work)
    yield s
    s.close()


def test_a_fault_at_every_operation_leaves_the_earlier_save_or_the_new_one(saves) -> None:
    directory = saves.work / "out"
    outcomes: Counter = Counter()
    for case in saves.cases(few=True):
        at = 1
        while True:
            case.reset(directory)
            try:
                with trap(at) as seen:
                    saves.save(case.kind, "B", directory, case.new_shards)
            except Killed:
                pass
            fired = "fired" in seen
            outcomes[(case.kind, case.check(directory), fired)] += 1
            # the next save (the lock a dead writer held taken over) cleans up and completes
            saves.save(case.kind, "B", directory, case.new_shards)
            assert case.check(directory) == "new", (case, at)
            assert hidden_files(directory) == [], (case, at, hidden_files(directory))
            if not fired:
                break
            at += 1
        assert at > 8, f"{case}: only {at} operations: the trap did not see the save"
    for kind in KINDS:     # both outcomes were reached: the kills landed before and after the commit
        assert outcomes[(kind, "old", True)] and outcomes[(kind, "new", True)], outcomes


def test_infinity_clean_removes_what_a_killed_export_left(saves, tmp_path: Path) -> None:
    case = next(c for c in saves.cases() if c.kind == "export" and c.new_shards == 3)
    directory = tmp_path / "out"
    case.reset(directory)
    # a real kill -9 (in process the lock's owner, this pid, would still be running)
    # (weights_crash_child.py: an export SIGKILLed at its 6th file operation)
    child = Path(__file__).with_name("weights_crash_child.py")
    killed = subprocess.run([sys.executable, str(child), "export", str(saves.ckpt["B"]),
                             str(directory), str(saves.sizes[3]), str(tmp_path / "swap"), "6"],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert any(name.endswith(".partial") for name in hidden_files(directory))
    out = subprocess.run([sys.executable, "-m", "infinity.cli", "clean", str(directory)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert hidden_files(directory) == [] and case.check(directory) == "old"
    assert "left by a save that did not finish" in out.stdout


def test_a_full_disk_names_the_directory_and_keeps_the_earlier_save(saves, tmp_path: Path,
                                                                   monkeypatch) -> None:
    from infinity.checkpoint import sharded_writer

    case = next(c for c in saves.cases() if c.kind == "save_pretrained" and c.old_shards == 3)
    directory = tmp_path / "out"
    case.reset(directory)
    monkeypatch.setattr(sharded_writer, "free_bytes", lambda path: 1000)
    with pytest.raises(OSError) as info:
        saves.save("save_pretrained", "B", directory, 1)
    message = str(info.value)
    assert str(directory) in message and "1000 B free" in message, message
    assert "the earlier save there is unchanged" in message, message
    assert case.check(directory) == "old" and hidden_files(directory) == []


def test_infinity_export_into_a_full_disk_is_one_line_and_exit_2(saves, tmp_path: Path) -> None:
    # sitecustomize-free: the CLI run with a free-space probe that says the disk is full
    script = ("import sys; from infinity.checkpoint import sharded_writer as sw; "
              "sw.free_bytes = lambda path: 10; from infinity.cli import main; "
              "sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", script, "export", str(saves.ckpt["B"]),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "needs" in out.stderr, out.stderr
    assert "nothing was written and the earlier save there is unchanged" in out.stderr


_RESAVER = """
import sys
import infinity
sys.path.insert(0, sys.argv[3])
from parity import make_model, train_random, zero_config
from test_weights_dir_faults import fingerprint
ds = zero_config(3, "nvme", "nvme", sys.argv[2])
ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
engine, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
saves = 0
for line in sys.stdin:          # one save of tag "t" per line asked
    train_random(engine, 1, seed=saves)
    saves += 1
    engine.save_checkpoint(sys.argv[1], tag="t", save_latest=saves == 1,
                           client_state={"save": saves, "weights": fingerprint(engine)})
    print(saves, flush=True)
engine.close()
"""


def fingerprint(engine) -> list[float]:
    """Each weight's sum in float64, in name order: the same values give the same numbers."""
    state = engine.module.state_dict()
    return [float(state[k].double().sum()) for k in sorted(state)]


def loads_beside_a_resaver(work: Path, loads: int) -> dict[str, int]:
    """Load tag "t" ``loads`` times while another process re-saves it in the middle of each
    load: after the load has pinned its save (read the manifest, opened the files) and before
    it reads the first tensor, the writer commits a new save of the tag and the load goes on.
    Every load's client_state (written by the save with the fingerprint of the weights it
    saved) must match the weights loaded: a load taking one save's manifest and another's
    tensors fails it (before the fix, 8 of 49 loads of a free-running loop did). Returns the
    counts of loads, mixed loads and re-saves met."""
    from infinity.checkpoint import pinned

    save_dir = work / "ckpt"
    for name in ("swap-w", "swap-r"):
        (work / name).mkdir(parents=True, exist_ok=True)
    writer = subprocess.Popen([sys.executable, "-c", _RESAVER, str(save_dir),
                               str(work / "swap-w"), str(Path(__file__).parent)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    counts = {"loaded": 0, "mixed": 0, "resaved_mid_load": 0}

    def resave() -> int:
        writer.stdin.write("save\n")
        writer.stdin.flush()
        line = writer.stdout.readline().strip()
        if not line.isdigit():
            raise AssertionError(f"the writer did not save: {line!r}")
        return int(line)

    reader = pinned.PinnedSave.reader
    pending = []

    def reader_after_a_resave(save, name):
        if pending:
            pending.pop()
            resave()
            counts["resaved_mid_load"] += 1
        return reader(save, name)

    ds = zero_config(3, "cpu", "cpu", str(work / "swap-r"))
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    engine, *_ = infinity.initialize(model=make_model("llama", layers=2), config=ds)
    pinned.PinnedSave.reader = reader_after_a_resave
    try:
        resave()
        for _ in range(loads):
            pending.append(True)
            _, client = engine.load_checkpoint(save_dir, tag="t")
            counts["loaded"] += 1
            if fingerprint(engine) != client["weights"]:
                counts["mixed"] += 1
    finally:
        pinned.PinnedSave.reader = reader
        engine.close()
        writer.stdin.close()
        writer.wait(timeout=300)
    return counts


def test_a_load_beside_a_writer_resaving_its_tag_reads_one_save(tmp_path: Path) -> None:
    counts = loads_beside_a_resaver(tmp_path, loads=3)
    assert counts == {"loaded": 3, "mixed": 0, "resaved_mid_load": 3}, counts
