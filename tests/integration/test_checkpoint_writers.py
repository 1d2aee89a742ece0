"""One writer per checkpoint directory, and nothing outside a checkpoint removed by a save.

A re-save of a tag removes the files the old save wrote; which ones it takes from the old
manifest, a file anyone can edit (a downloaded checkpoint): only the names a save writes are
taken from it. Two processes saving into one directory at once (a scheduler's retry while the
first job runs) used to share a staging directory and leave no loadable checkpoint; the second
is now refused, naming the first, and a dead writer's lock and staging directory are taken over
and cleaned up by the next save."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import infinity
from infinity.checkpoint import directory
from infinity.checkpoint import writer_lock
from infinity.checkpoint.writer_lock import LOCK_NAME, SaveDirBusyError, SaveLock
from parity import checkpoint_engine, train_random


@pytest.fixture
def engine(disk_dir):
    eng = checkpoint_engine(disk_dir, "cpu", steps=1)
    yield eng
    eng.close()


def _train(engine, steps: int) -> None:
    train_random(engine, steps, seed=engine.global_steps)


def _edit_manifest(tag_dir, files_extra: dict) -> None:
    path = tag_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"].update(files_extra)
    path.write_text(json.dumps(manifest))


def test_a_resave_never_removes_a_file_its_old_manifest_names_outside(engine, disk_dir):
    """A manifest listing ``../x``, an absolute path or a name a save does not write: the
    re-save of that tag removed those files (they were unlinked as ``tag_dir / name``)."""
    ckpt = disk_dir / "ckpt"
    outside = disk_dir / "precious.txt"
    outside.write_text("user data")
    sibling = ckpt / "notes.txt"
    tag_dir = engine.save_checkpoint(ckpt, tag="t")
    sibling.write_text("mine too")
    (tag_dir / "adapter.bin").write_text("adapter")
    entry = {"bytes": 1, "sha256": "0" * 64}
    _edit_manifest(tag_dir, {"../../precious.txt": entry, str(outside): entry,
                             "../notes.txt": entry, "adapter.bin": entry})
    _train(engine, 1)
    engine.save_checkpoint(ckpt, tag="t")
    assert outside.read_text() == "user data"
    assert sibling.read_text() == "mine too"
    assert (tag_dir / "adapter.bin").read_text() == "adapter"      # carried with the tag
    assert json.loads((tag_dir / "manifest.json").read_text())["engine"]["global_steps"] == 2
    assert engine.load_checkpoint(ckpt)[0].endswith("/t")


def test_written_names_are_one_list():
    assert directory.is_written_name("manifest.json")
    assert directory.is_written_name("rank0_model.safetensors")
    assert directory.is_written_name("rank12_optim.safetensors")
    for name in ("../rank0_model.safetensors", "/abs/manifest.json", "rank0_model.safetensors/x",
                 "adapter.safetensors", "rank_model.safetensors", "x/manifest.json", ".."):
        assert not directory.is_written_name(name), name


_HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from infinity.checkpoint.writer_lock import SaveLock
    lock = SaveLock.acquire(Path(sys.argv[1]))
    print("held", flush=True)
    sys.stdin.read()        # hold it until the parent closes stdin or kills us
    lock.release()
""")


def _holder(save_dir):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(save_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_naming_the_first_and_a_dead_ones_lock_is_taken_over(
        engine, disk_dir):
    ckpt = disk_dir / "ckpt"
    first = engine.save_checkpoint(ckpt, tag="t")
    saved = (first / "rank0_model.safetensors").read_bytes()
    proc = _holder(ckpt)
    try:
        _train(engine, 1)
        with pytest.raises(SaveDirBusyError, match=rf"another process \(pid {proc.pid} on host"):
            engine.save_checkpoint(ckpt, tag="t")
        # the first writer's checkpoint and latest are untouched, nothing was staged
        assert (first / "rank0_model.safetensors").read_bytes() == saved
        assert sorted(p.name for p in ckpt.iterdir()) == [LOCK_NAME, "latest", "t"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # killed with its lock file in place: the next save takes it over and removes it after
    assert (ckpt / LOCK_NAME).exists()
    engine.save_checkpoint(ckpt, tag="t")
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "t"]
    assert json.loads((first / "manifest.json").read_text())["engine"]["global_steps"] == 2


def test_without_flock_a_live_owner_in_the_lock_file_is_refused(engine, disk_dir, monkeypatch):
    """On a filesystem without flock the owner named in the lock file decides, by the swap
    directory's rules: a live one is refused, a dead one taken over."""
    ckpt = disk_dir / "ckpt"
    engine.save_checkpoint(ckpt, tag="a")
    proc = _holder(ckpt)     # a live process, whose lock file names it
    try:
        def no_flock(fd, op):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(writer_lock.fcntl, "flock", no_flock)
        with pytest.raises(SaveDirBusyError, match=rf"pid {proc.pid} .*is still running.*remove"):
            engine.save_checkpoint(ckpt, tag="b")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    engine.save_checkpoint(ckpt, tag="b")       # its owner is dead now
    assert sorted(p.name for p in ckpt.iterdir()) == ["a", "b", "latest"]


def test_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_kept(engine, disk_dir):
    ckpt = disk_dir / "ckpt"
    ckpt.mkdir()
    target = disk_dir / "target.txt"
    target.write_text("keep")
    (ckpt / LOCK_NAME).symlink_to(target)
    with pytest.raises(infinity.checkpoint.CheckpointError, match="symbolic link"):
        engine.save_checkpoint(ckpt, tag="t")
    assert target.read_text() == "keep"


def test_the_lock_is_released_when_a_save_fails(engine, disk_dir, monkeypatch):
    ckpt = disk_dir / "ckpt"

    def failing_commit(*args, **kwargs):
        raise OSError(errno.EIO, "injected commit error")

    from infinity.checkpoint import save as save_module
    monkeypatch.setattr(save_module, "commit", failing_commit)
    with pytest.raises(OSError, match="injected"):
        engine.save_checkpoint(ckpt, tag="t")
    assert not (ckpt / LOCK_NAME).exists()
    lock = SaveLock.acquire(ckpt)       # free again, within this process too
    lock.release()


def test_staging_names_are_unique_per_writer(tmp_path):
    names = {directory.staging_dir(tmp_path, "t").name for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(".t.partial.") for n in names)


def test_a_dead_writers_staging_directories_are_removed_by_the_next_save(engine, disk_dir):
    """Hidden ``.<tag>.partial`` directories of a save killed with kill -9 stayed forever; the
    next save (of any tag) removes the files a save writes from them, gives the user's files
    back to their tag and removes them."""
    ckpt = disk_dir / "ckpt"
    engine.save_checkpoint(ckpt, tag="old")
    killed = ckpt / ".old.partial.0123abcd"        # killed after carrying notes.txt in
    killed.mkdir()
    (killed / "rank0_model.safetensors").write_bytes(b"half a file")
    (killed / "notes.txt").write_text("the user's")
    gone = ckpt / ".gone.partial.76543210"          # a tag never made
    gone.mkdir()
    (gone / "rank0_optim.safetensors").write_bytes(b"half")
    users = ckpt / ".dataset.partial"               # no token: not a save's; left alone
    users.mkdir()
    (users / "manifest.json").write_text("{}")
    kept = ckpt / ".other.partial.89abcdef"         # a file we do not write: kept, warned
    kept.mkdir()
    (kept / "mine.txt").write_text("x")
    engine.save_checkpoint(ckpt, tag="new")
    assert not killed.exists() and not gone.exists()
    assert sorted(p.name for p in users.iterdir()) == ["manifest.json"]
    assert (ckpt / "old" / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in kept.iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in ckpt.iterdir()) == [".dataset.partial",
                                                     ".other.partial.89abcdef", "latest",
                                                     "new", "old"]


def test_a_directory_without_its_manifest_is_named_as_such(engine, disk_dir):
    ckpt = disk_dir / "ckpt"
    engine.save_checkpoint(ckpt, tag="global_step2")
    os.unlink(ckpt / "global_step2" / "manifest.json")
    with pytest.raises(infinity.checkpoint.CheckpointError,
                       match="global_step2 has no manifest.json.*deleted or never written.*"
                             "rank0_model.safetensors"):
        engine.load_checkpoint(ckpt)


_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from parity import checkpoint_engine, train_random
    from infinity.checkpoint.writer_lock import SaveDirBusyError
    engine = checkpoint_engine(sys.argv[2], "cpu", steps=0)
    saved = refused = 0
    for i in range(12):
        train_random(engine, 1, seed=i)
        try:
            engine.save_checkpoint(sys.argv[1], tag="t")
            saved += 1
        except SaveDirBusyError:
            refused += 1
    engine.close()
    print(saved, refused)
""")


@pytest.mark.slow
def test_two_processes_saving_one_tag_always_leave_a_loadable_checkpoint(engine, disk_dir):
    """The issue's case: two jobs saving the same tag at once. Before the lock, their shared
    staging directory was cleaned by one while the other wrote, and no loadable checkpoint
    remained (3 of 3 trials). Whatever the interleaving, each save now either commits whole or
    is refused, and ``latest`` loads with its checksums verified. The split between saved and
    refused is the scheduler's and is not asserted."""
    ckpt = disk_dir / "ckpt"
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(ckpt), str(disk_dir / f"s{i}"),
                               tests_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-2000:]
    counts = [tuple(map(int, out.split())) for out, _ in results]
    # How many saves each side wins depends on the scheduler; that at least one wins does not
    # (a save is refused only while the other process holds the lock, i.e. is saving).
    assert all(saved + refused == 12 for saved, refused in counts), counts
    assert sum(saved for saved, _ in counts) >= 1, counts
    path, _ = engine.load_checkpoint(ckpt)
    assert path.endswith("/t")
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "t"]


def test_a_save_dir_that_is_a_symbolic_link_is_saved_into(engine, disk_dir):
    """A save_dir the user links to a scratch disk is theirs to name (only tags and the lock
    file are refused as links)."""
    real = disk_dir / "scratch"
    real.mkdir()
    (disk_dir / "out").symlink_to(real)
    engine.save_checkpoint(disk_dir / "out", tag="t")
    assert sorted(p.name for p in real.iterdir()) == ["latest", "t"]
    assert engine.load_checkpoint(disk_dir / "out")[0].endswith("/t")
