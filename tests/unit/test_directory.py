"""Checkpoint directories (checkpoint/directory.py): that a re-save of a tag swaps the directories in one step where the filesystem can
(the tag never goes missing), which directories count as tags, and the whole module at unit
level."""
from __future__ import annotations

import ctypes
import errno
import json
import os
from pathlib import Path

import pytest

from infinity.checkpoint import directory as d


def _can_exchange(base: Path) -> bool:
    a, b = base / "probe-a", base / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "renameat2", None)
        return fn is not None and fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0
    finally:
        a.rmdir()
        b.rmdir()


def _staged(save_dir: Path, tag: str, step: int) -> Path:
    staging = d.prepare_staging(save_dir, tag)
    (staging / d.MANIFEST).write_text(json.dumps({"format": d.FORMAT, "version": d.VERSION,
                                                  "step": step}))
    return staging


def test_a_resave_swaps_the_tag_in_one_step_where_the_filesystem_can(tmp_path: Path,
                                                                     monkeypatch) -> None:
    if not _can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange directories (RENAME_EXCHANGE)")
    d.ensure_save_dir(tmp_path)
    d.commit(_staged(tmp_path, "t", 1), tmp_path, "t")
    (tmp_path / "t" / "notes.txt").write_text("the user's")
    renames = []
    real_rename = os.rename

    def watched_rename(src, dst, *a, **kw):
        renames.append((Path(src).name, Path(dst).name))
        assert (tmp_path / "t").is_dir(), "the tag went missing during a re-save"
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", watched_rename)
    staging = _staged(tmp_path, "t", 2)
    final = d.commit(staging, tmp_path, "t")
    assert final == tmp_path / "t"
    assert json.loads((final / d.MANIFEST).read_text())["step"] == 2
    assert (final / "notes.txt").read_text() == "the user's"
    assert ("t", d.replaced_dir(tmp_path, "t").name) not in renames
    assert not d.replaced_dir(tmp_path, "t").exists()


def test_only_visible_directories_with_a_manifest_are_tags(tmp_path: Path) -> None:
    for name in ("b", "a", ".a.partial.0123abcd", ".hidden", "no_manifest"):
        (tmp_path / name).mkdir()
    for name in ("b", "a", ".a.partial.0123abcd", ".hidden"):
        (tmp_path / name / d.MANIFEST).write_text("{}")
    (tmp_path / "file").write_text("")
    assert d.available_tags(tmp_path) == ["a", "b"]
    assert d.available_tags(tmp_path / "missing") == []


def _manifest(files: list[str]) -> str:
    return json.dumps({"format": d.FORMAT, "version": d.VERSION,
                       "files": {name: {"bytes": 1, "sha256": "0" * 64} for name in files}})


def test_a_resave_carries_the_users_files_but_no_file_of_the_old_checkpoint(tmp_path: Path) -> None:
    """The old tag's manifest listed a rank-1 shard (a save at world size 2); the new save has
    rank 0 only: the old shard must not come along into the new checkpoint, the user's file
    and a written-like name the old manifest did not list (not the old save's) do."""
    d.ensure_save_dir(tmp_path)
    first = d.prepare_staging(tmp_path, "t")
    for name in ("rank0_model.safetensors", "rank1_model.safetensors"):
        (first / name).write_text("old " + name)
    (first / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors",
                                               "rank1_model.safetensors"]))
    d.commit(first, tmp_path, "t")
    (tmp_path / "t" / "adapter.safetensors").write_text("the user's")
    (tmp_path / "t" / "rank7_optim.safetensors").write_text("not listed: the user's")
    second = d.prepare_staging(tmp_path, "t")
    (second / "rank0_model.safetensors").write_text("new")
    (second / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors"]))
    final = d.commit(second, tmp_path, "t")
    assert sorted(p.name for p in final.iterdir()) == [
        "adapter.safetensors", d.MANIFEST, "rank0_model.safetensors", "rank7_optim.safetensors"]
    assert (final / "rank0_model.safetensors").read_text() == "new"


def test_a_failed_exchange_names_both_directories(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    with pytest.raises(OSError) as caught:
        d._exchange(tmp_path / "missing", tmp_path / "b")
    assert caught.value.errno == 2
    assert f"cannot exchange {tmp_path / 'missing'} and {tmp_path / 'b'}: No such file" in str(caught.value)


# -- the whole module at unit level, on real directories (no engine) --------------------------------

def _write_tag(save_dir: Path, tag: str, files: dict[str, str], listed=None) -> Path:
    """A committed-looking tag: the files, and a manifest listing ``listed`` (default: files)."""
    path = save_dir / tag
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    (path / d.MANIFEST).write_text(_manifest(list(files) if listed is None else listed))
    return path


def test_check_tag_accepts_directory_names_and_refuses_the_rest() -> None:
    for tag in ("global_step100", "a", "0", "_x", "v1.2+3=4-5", "A_b.c"):
        assert d.check_tag(tag) == tag
    assert d.check_tag(7) == "7"
    for tag in ("", ".hidden", "a/b", "../x", "latest", "-x", "+x", "=x", "a b", "a\n", "é"):
        with pytest.raises(ValueError) as info:
            d.check_tag(tag)
        assert f"checkpoint tag {tag!r} cannot name a directory" in str(info.value)
        assert "'latest'" in str(info.value) and "global_step100" in str(info.value)
    assert d.check_tag("t" * d.MAX_TAG_BYTES) == "t" * d.MAX_TAG_BYTES
    with pytest.raises(ValueError, match="checkpoint tag of 300 characters .*at most 200"):
        d.check_tag("t" * 300)       # a bare "File name too long" from the staging name


def test_load_tag_latest_is_the_tag_latest_names(tmp_path: Path) -> None:
    (tmp_path / "step3").mkdir()
    (tmp_path / "step3" / d.MANIFEST).write_text("{}")
    d.write_latest(tmp_path, "step3")
    assert d.resolve(tmp_path, "latest") == d.resolve(tmp_path, None) == tmp_path / "step3"


def test_written_names_are_exactly_the_manifest_and_rank_shards() -> None:
    for name in ("manifest.json", "rank0_model.safetensors", "rank12_optim.safetensors"):
        assert d.is_written_name(name)
    for name in ("manifest.jsonx", "xmanifest.json", "manifestXjson", "rank_model.safetensors",
                 "rank0_model.safetensors.tmp", "rank0_other.safetensors", "rankX_optim.safetensors",
                 "adapter.safetensors", "latest", ""):
        assert not d.is_written_name(name)


def test_staging_names_are_hidden_per_writer_and_found_by_tag(tmp_path: Path) -> None:
    a, b = d.staging_dir(tmp_path, "t"), d.staging_dir(tmp_path, "t")
    assert a != b and a.parent == tmp_path and b.parent == tmp_path
    for path in (a, b):
        assert path.name.startswith(".t.partial.") and len(path.name) == len(".t.partial.") + 8
        int(path.name.rsplit(".", 1)[1], 16)
        path.mkdir()
    legacy = tmp_path / ".t.partial"
    legacy.mkdir()
    other = tmp_path / ".u.partial.0123abcd"
    other.mkdir()
    (tmp_path / ".t.partial.99999999").write_text("a file, not a staging directory")
    (tmp_path / ".t.partial.nothex00").mkdir()
    os.symlink(other, tmp_path / ".t.partial.aaaaaaaa")
    # ".t.partial" without a token is not a staging directory (a user's, or another tool's)
    assert d.staging_dirs(tmp_path, "t") == sorted([a, b])
    assert d.staging_dirs(tmp_path) == sorted([a, b, other])
    assert d.staging_dirs(tmp_path / "missing") == []
    assert d.staging_dirs(tmp_path / ".t.partial.99999999") == []
    assert d.replaced_dir(tmp_path, "t") == tmp_path / ".t.replaced"


def test_staging_dirs_skips_an_entry_removed_while_listing(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / ".t.partial.0123abcd").mkdir()
    (tmp_path / ".t.partial.89abcdef").mkdir()
    real_lstat = os.lstat

    def lstat(path, *a, **kw):
        if Path(path).name == ".t.partial.0123abcd":
            raise FileNotFoundError(2, "gone", str(path))
        return real_lstat(path, *a, **kw)

    monkeypatch.setattr(d.os, "lstat", lstat)
    assert d.staging_dirs(tmp_path, "t") == [tmp_path / ".t.partial.89abcdef"]


def test_exchange_swaps_two_directories_or_says_it_cannot(tmp_path: Path, monkeypatch) -> None:
    if not _can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange directories (RENAME_EXCHANGE)")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "in_a").write_text("")
    assert d._exchange(a, b) is True
    assert os.listdir(b) == ["in_a"] and os.listdir(a) == []

    class NoRenameat2:
        pass
    monkeypatch.setattr(d, "_libc", lambda: NoRenameat2())
    assert d._exchange(a, b) is False
    monkeypatch.setattr(d, "_libc", lambda: None)
    assert d._exchange(a, b) is False
    for code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        class Unsupported:
            @staticmethod
            def renameat2(*args):
                ctypes.set_errno(code)
                return -1
        monkeypatch.setattr(d, "_libc", lambda: Unsupported())
        assert d._exchange(a, b) is False
    assert os.listdir(b) == ["in_a"]


def test_libc_is_loaded_once() -> None:
    assert d._libc() is d._libc()


def _fsync_paths(monkeypatch) -> list[str]:
    """Record what every os.fsync call syncs (the path behind the file descriptor)."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(d.os, "fsync", fsync)
    return synced


def test_commit_syncs_every_staged_file_the_staging_dir_and_the_save_dir(tmp_path: Path,
                                                                         monkeypatch) -> None:
    staging = d.prepare_staging(tmp_path, "t")
    (staging / "rank0_model.safetensors").write_text("m")
    (staging / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors"]))
    synced = _fsync_paths(monkeypatch)
    final = d.commit(staging, tmp_path, "t")
    assert str(staging / "rank0_model.safetensors") in synced
    assert str(staging / d.MANIFEST) in synced and str(staging) in synced
    assert synced[-1] == str(tmp_path) and final == tmp_path / "t"
    assert synced.index(str(staging)) > synced.index(str(staging / d.MANIFEST))


def test_write_latest_syncs_the_pointer_and_the_directory(tmp_path: Path, monkeypatch) -> None:
    synced = _fsync_paths(monkeypatch)
    d.write_latest(tmp_path, "t")
    assert len(synced) == 2 and synced[1] == str(tmp_path)
    pending = Path(synced[0])       # a file of its own, renamed over latest
    assert pending.parent == tmp_path and pending.name.startswith(".latest.")
    assert (tmp_path / d.LATEST).read_text() == "t"       # bare, as DeepSpeed writes it
    assert sorted(os.listdir(tmp_path)) == [d.LATEST]


def test_write_manifest_syncs_and_never_overwrites(tmp_path: Path, monkeypatch) -> None:
    synced = _fsync_paths(monkeypatch)
    d.write_manifest(tmp_path, {"format": d.FORMAT, "version": d.VERSION, "loss": float("nan")})
    assert synced == [str(tmp_path / d.MANIFEST)]
    text = (tmp_path / d.MANIFEST).read_text()
    assert "NaN" in text and text.startswith('{\n "format"')
    assert d.read_manifest_file(tmp_path)["version"] == d.VERSION
    with pytest.raises(FileExistsError):
        d.write_manifest(tmp_path, {})


def test_prepare_staging_makes_a_fresh_empty_directory_of_its_own(tmp_path: Path) -> None:
    staging = d.prepare_staging(tmp_path, "t")
    assert staging.is_dir() and os.listdir(staging) == [] and staging.parent == tmp_path
    assert d._STAGING.match(staging.name).group("tag") == "t"
    assert d.staging_dirs(tmp_path, "t") == [staging]


def test_prepare_staging_adopts_a_left_staging_dir_of_the_tag_and_cleans_the_others(
        tmp_path: Path, infinity_info_log) -> None:
    left = tmp_path / ".t.partial.0123abcd"
    left.mkdir()
    (left / "rank0_model.safetensors").write_text("half written")
    (left / "notes.txt").write_text("the user's, carried in from the tag")
    other = tmp_path / ".u.partial.89abcdef"
    other.mkdir()
    (other / "rank0_optim.safetensors").write_text("x")
    staging = d.prepare_staging(tmp_path, "t")
    assert staging != left and not left.exists() and not other.exists()
    assert os.listdir(staging) == ["notes.txt"]
    assert f"removed {other}, left by a save that did not finish" in infinity_info_log.text


def test_prepare_staging_and_commit_refuse_a_symlinked_tag(tmp_path: Path) -> None:
    target = _write_tag(tmp_path, "real", {"rank0_model.safetensors": "keep"})
    os.symlink(target, tmp_path / "t")
    with pytest.raises(d.CheckpointError) as info:
        d.prepare_staging(tmp_path, "t")
    assert f"{tmp_path / 't'} is a symbolic link (to {target})" in str(info.value)
    assert "a checkpoint tag must be a directory of its own" in str(info.value)
    staging = d.staging_dir(tmp_path, "u")
    staging.mkdir()
    (staging / d.MANIFEST).write_text(_manifest([]))
    os.symlink(target, tmp_path / "u")
    with pytest.raises(d.CheckpointError, match="is a symbolic link"):
        d.commit(staging, tmp_path, "u")
    os.symlink(target, d.replaced_dir(tmp_path, "v"))
    staging_v = d.staging_dir(tmp_path, "v")
    staging_v.mkdir()
    (staging_v / d.MANIFEST).write_text(_manifest([]))
    with pytest.raises(d.CheckpointError, match=r"\.v\.replaced is a symbolic link"):
        d.commit(staging_v, tmp_path, "v")
    assert (target / "rank0_model.safetensors").read_text() == "keep"


def test_ensure_save_dir_creates_parents_and_names_a_dir_it_cannot_use(tmp_path: Path,
                                                                       monkeypatch) -> None:
    nested = tmp_path / "a" / "b"
    d.ensure_save_dir(nested)
    assert nested.is_dir()
    d.ensure_save_dir(nested)     # exists already: fine
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError) as info:
        d.ensure_save_dir(blocker / "sub")
    assert info.value.errno in (errno.ENOTDIR, errno.EEXIST)
    assert f"cannot create the checkpoint directory {blocker / 'sub'}" in str(info.value)
    assert "choose a writable save_dir" in str(info.value)
    real_access = os.access
    for missing in (os.W_OK, os.X_OK):      # no write, or no search permission
        monkeypatch.setattr(d.os, "access",
                            lambda p, mode, missing=missing: not (mode & missing)
                            and real_access(p, mode))
        with pytest.raises(PermissionError, match=f"the checkpoint directory {nested} is not "
                                                  "writable"):
            d.ensure_save_dir(nested)


def test_clean_stale_staging_returns_what_it_removed_and_gives_user_files_back(
        tmp_path: Path, infinity_info_log) -> None:
    tag = _write_tag(tmp_path, "t", {"rank0_model.safetensors": "committed"})
    stale = tmp_path / ".t.partial.0123abcd"
    stale.mkdir()
    (stale / "rank0_model.safetensors").write_text("stale")
    (stale / "adapter.safetensors").write_text("the user's")
    kept = tmp_path / ".t.partial.89abcdef"
    kept.mkdir()
    (kept / "rank0_model.safetensors").write_text("kept")
    stuck = tmp_path / ".gone.partial.aaaaaaaa"        # its tag does not exist
    stuck.mkdir()
    (stuck / "other.bin").write_text("not a written name")
    removed = d.clean_stale_staging(tmp_path, keep=[kept])
    assert removed == [stale]
    assert (tag / "adapter.safetensors").read_text() == "the user's"
    assert (tag / "rank0_model.safetensors").read_text() == "committed"
    assert (kept / "rank0_model.safetensors").read_text() == "kept"
    assert os.listdir(stuck) == ["other.bin"]
    assert f"kept {stuck}: it holds files a checkpoint does not write (other.bin)" in infinity_info_log.text
    assert d.clean_stale_staging(tmp_path) == [kept]


def test_a_save_stopped_between_its_renames_gets_its_previous_save_and_user_files_back(
        tmp_path: Path) -> None:
    """No exchange on the file system: the tag renamed aside, the kill before the staging took
    its place; the user's file carried into the staging stayed hidden until that tag was saved
    again. The next save's clean (any tag) puts the previous save back and the file in it."""
    aside = _write_tag(tmp_path, "t", {"rank0_model.safetensors": "previous"})
    aside.rename(d.replaced_dir(tmp_path, "t"))
    stale = tmp_path / ".t.partial.0123abcd"
    stale.mkdir()
    (stale / "rank0_model.safetensors").write_text("new, not committed")
    (stale / "notes.txt").write_text("the user's")
    assert d.clean_stale_staging(tmp_path) == [stale]
    assert (tmp_path / "t" / "rank0_model.safetensors").read_text() == "previous"
    assert (tmp_path / "t" / "notes.txt").read_text() == "the user's"
    assert not d.replaced_dir(tmp_path, "t").exists()


def test_clean_stale_staging_never_carries_into_a_symlinked_tag(tmp_path: Path) -> None:
    elsewhere = _write_tag(tmp_path, "elsewhere", {})
    os.symlink(elsewhere, tmp_path / "t")
    stale = tmp_path / ".t.partial.0123abcd"
    stale.mkdir()
    (stale / "notes.txt").write_text("the user's")
    assert d.clean_stale_staging(tmp_path) == []
    assert os.listdir(stale) == ["notes.txt"] and "notes.txt" not in os.listdir(elsewhere)


def test_checkpoint_files_are_the_listed_written_names(tmp_path: Path, infinity_info_log) -> None:
    tag = _write_tag(tmp_path, "t", {"rank0_model.safetensors": "", "adapter.safetensors": ""},
                     listed=["rank0_model.safetensors", "../outside", "adapter.safetensors"])
    (tag / "rank1_model.safetensors").write_text("not listed")
    assert d.checkpoint_files(tag) == {d.MANIFEST, "rank0_model.safetensors"}
    assert f"the manifest of {tag} lists '../outside', which is not a file a save writes" in infinity_info_log.text
    assert "'adapter.safetensors'" in infinity_info_log.text
    assert d.checkpoint_files(tag, ours_only=False) == {
        d.MANIFEST, "rank0_model.safetensors", "rank1_model.safetensors"}
    (tag / d.MANIFEST).write_text(json.dumps({"format": d.FORMAT, "version": d.VERSION,
                                              "files": ["rank0_model.safetensors"]}))
    assert d.checkpoint_files(tag) == {d.MANIFEST}
    (tag / d.MANIFEST).write_text(json.dumps({"format": d.FORMAT, "version": d.VERSION,
                                              "files": {"1": {}, "rank0_optim.safetensors": {}}}))
    assert d.checkpoint_files(tag) == {d.MANIFEST, "rank0_optim.safetensors"}
    (tag / d.MANIFEST).write_text("not json")      # written whole by a rename: not ours
    assert d.checkpoint_files(tag) == set()
    (tag / d.MANIFEST).write_text(json.dumps({"format": d.FORMAT, "version": d.VERSION}))
    assert d.checkpoint_files(tag) == {d.MANIFEST}


def test_remove_checkpoint_files_removes_only_ours_and_the_dir_when_empty(tmp_path: Path,
                                                                         infinity_info_log) -> None:
    tag = _write_tag(tmp_path, "t", {"rank0_model.safetensors": "", "rank0_optim.safetensors": ""})
    d.remove_checkpoint_files(tag)
    assert not tag.exists()
    tag = _write_tag(tmp_path, "u", {"rank0_model.safetensors": "", "notes.txt": "",
                                     "rank1_model.safetensors": ""},
                     listed=["rank0_model.safetensors"])
    (tag / "rank0_optim.safetensors").mkdir()     # a directory under a written name
    d.remove_checkpoint_files(tag)
    assert sorted(os.listdir(tag)) == ["notes.txt", "rank0_optim.safetensors",
                                       "rank1_model.safetensors"]
    assert f"kept {tag}: it holds files a checkpoint does not write (notes.txt, " in infinity_info_log.text
    kept = _write_tag(tmp_path, "v", {"rank0_model.safetensors": ""})
    d.remove_checkpoint_files(kept, keep_dir=True)
    assert kept.is_dir() and os.listdir(kept) == []
    d.remove_checkpoint_files(tmp_path / "missing")


def test_remove_checkpoint_files_never_follows_a_symlinked_directory(tmp_path: Path,
                                                                     infinity_info_log) -> None:
    real = _write_tag(tmp_path, "real", {"rank0_model.safetensors": "keep"})
    link = tmp_path / "link"
    os.symlink(real, link)
    d.remove_checkpoint_files(link)
    assert (real / "rank0_model.safetensors").read_text() == "keep" and link.is_symlink()
    assert f"not cleaning {link}:" in infinity_info_log.text


def test_remove_checkpoint_files_lists_at_most_five_leftovers(tmp_path: Path, infinity_info_log) -> None:
    tag = _write_tag(tmp_path, "t", {f"user{i}.txt": "" for i in range(7)}, listed=[])
    d.remove_checkpoint_files(tag)
    assert "(user0.txt, user1.txt, user2.txt, user3.txt, user4.txt)" in infinity_info_log.text


def test_carry_user_files_moves_only_the_users_and_never_overwrites(tmp_path: Path) -> None:
    old = _write_tag(tmp_path, "old", {"rank0_model.safetensors": "old", "notes.txt": "old notes",
                                       "rank1_model.safetensors": "unlisted",
                                       "clash.txt": "old clash"},
                     listed=["rank0_model.safetensors"])
    new = tmp_path / "new"
    new.mkdir()
    (new / "clash.txt").write_text("new clash")
    d._carry_user_files(old, new)
    assert sorted(os.listdir(new)) == ["clash.txt", "notes.txt", "rank1_model.safetensors"]
    assert (new / "clash.txt").read_text() == "new clash"
    assert sorted(os.listdir(old)) == ["clash.txt", d.MANIFEST, "rank0_model.safetensors"]
    staging = tmp_path / "staging"
    staging.mkdir()
    for name in ("rank2_optim.safetensors", "adapter.bin"):
        (staging / name).write_text("")
    newer = tmp_path / "newer"
    newer.mkdir()
    d._carry_user_files(staging, newer, keep_ours=False)
    assert os.listdir(newer) == ["adapter.bin"]


def test_commit_of_a_new_tag_and_a_resave_without_the_exchange(tmp_path: Path, monkeypatch) -> None:
    first = d.prepare_staging(tmp_path, "t")
    (first / "rank0_model.safetensors").write_text("1")
    (first / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors"]))
    assert d.commit(first, tmp_path, "t") == tmp_path / "t" and not first.exists()
    (tmp_path / "t" / "notes.txt").write_text("the user's")
    monkeypatch.setattr(d, "_exchange", lambda a, b: False)
    second = d.prepare_staging(tmp_path, "t")
    (second / "rank0_model.safetensors").write_text("2")
    (second / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors"]))
    final = d.commit(second, tmp_path, "t")
    assert (final / "rank0_model.safetensors").read_text() == "2"
    assert (final / "notes.txt").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["t"]


def test_commit_finishes_a_resave_that_stopped_between_its_renames(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Left by a save without the exchange that stopped after renaming the tag aside: the aside
    copy (with a file of the user's) and no tag; and again with the tag there too."""
    monkeypatch.setattr(d, "_exchange", lambda a, b: False)
    for tag_there in (False, True):
        aside = _write_tag(tmp_path, ".t.replaced", {"rank0_model.safetensors": "old",
                                                   "notes.txt": "the user's"},
                           listed=["rank0_model.safetensors"])
        if tag_there:
            _write_tag(tmp_path, "t", {"rank0_model.safetensors": "older"})
        staging = d.prepare_staging(tmp_path, "t")
        (staging / "rank0_model.safetensors").write_text("new")
        (staging / d.MANIFEST).write_text(_manifest(["rank0_model.safetensors"]))
        final = d.commit(staging, tmp_path, "t")
        assert not aside.exists()
        assert sorted(os.listdir(final)) == [d.MANIFEST, "notes.txt", "rank0_model.safetensors"]
        assert (final / "rank0_model.safetensors").read_text() == "new"
        d.remove_checkpoint_files(final)
        (final / "notes.txt").unlink()
        final.rmdir()
        assert os.listdir(tmp_path) == []


def test_a_failing_exchange_leaves_the_old_tag_with_the_users_files(tmp_path: Path,
                                                                    monkeypatch) -> None:
    _write_tag(tmp_path, "t", {"rank0_model.safetensors": "old", "notes.txt": "the user's"},
               listed=["rank0_model.safetensors"])
    staging = d.prepare_staging(tmp_path, "t")
    (staging / d.MANIFEST).write_text(_manifest([]))

    def failing(a, b):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(d, "_exchange", failing)
    with pytest.raises(OSError, match="I/O error"):
        d.commit(staging, tmp_path, "t")
    assert sorted(os.listdir(tmp_path / "t")) == [d.MANIFEST, "notes.txt", "rank0_model.safetensors"]
    assert (tmp_path / "t" / "rank0_model.safetensors").read_text() == "old"


def test_commit_refuses_a_tag_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "mine.txt").write_text("keep")
    staging = d.prepare_staging(tmp_path, "t")
    (staging / d.MANIFEST).write_text(_manifest([]))
    with pytest.raises(d.CheckpointError) as info:
        d.commit(staging, tmp_path, "t")
    assert f"{tmp_path / 't'} exists and is not a checkpoint (no {d.MANIFEST})" in str(info.value)
    assert os.listdir(tmp_path / "t") == ["mine.txt"]


@pytest.mark.parametrize("theirs", ['{"dataset": "mine"}', "not json", '["a list"]'])
def test_commit_leaves_a_tag_directory_whose_manifest_is_a_users(tmp_path: Path,
                                                                 theirs: str) -> None:
    """A ``manifest.json`` of the user's own in a directory named like the tag: the save
    replaced it with infinity's (and removed theirs with the old checkpoint's files). Refused,
    the directory as it was; nothing of it counts as a save's files."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / d.MANIFEST).write_text(theirs)
    (tmp_path / "t" / "notes.txt").write_text("keep")
    assert d.checkpoint_files(tmp_path / "t") == set()
    staging = d.prepare_staging(tmp_path, "t")
    (staging / d.MANIFEST).write_text(_manifest([]))
    with pytest.raises(d.CheckpointError, match=f"its {d.MANIFEST} is not an infinity "
                                                "checkpoint's.*left alone"):
        d.commit(staging, tmp_path, "t")
    assert sorted(os.listdir(tmp_path / "t")) == [d.MANIFEST, "notes.txt"]
    assert (tmp_path / "t" / d.MANIFEST).read_text() == theirs


def test_write_latest_failure_names_the_saved_tag_and_what_latest_still_names(
        tmp_path: Path, monkeypatch) -> None:
    d.write_latest(tmp_path, "old")
    real_replace = os.replace

    def failing(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(d.os, "replace", failing)
    with pytest.raises(OSError) as info:
        d.write_latest(tmp_path, "new")
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert f"checkpoint new is saved whole in {tmp_path / 'new'}" in message
    assert f"{tmp_path / d.LATEST} could not be pointed at it (No space left on device)" in message
    assert "latest still names old. Load it with tag='new'" in message
    assert sorted(os.listdir(tmp_path)) == [d.LATEST]
    (tmp_path / d.LATEST).unlink()
    with pytest.raises(OSError, match="latest still names no checkpoint"):
        d.write_latest(tmp_path, "new")

    def interrupted(src, dst):
        raise KeyboardInterrupt
    monkeypatch.setattr(d.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        d.write_latest(tmp_path, "new")
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(d.os, "replace", real_replace)


@pytest.mark.parametrize("replacing", [False, True])
def test_a_failure_after_the_commit_says_the_save_is_in_place(tmp_path: Path, monkeypatch,
                                                               replacing: bool) -> None:
    """A directory fsync failing after the rename (a full or failing disk) was reported as a
    bare OSError, or rewritten into "the previous checkpoint and latest are unchanged" while
    the tag already held the new save."""
    if replacing:
        old = tmp_path / "t"
        old.mkdir()
        (old / d.MANIFEST).write_text(_manifest([]))
    staging = d.prepare_staging(tmp_path, "t")
    (staging / d.MANIFEST).write_text('{"new": 1}')

    def failing(path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(d, "_fsync_dir", failing)
    with pytest.raises(d.SavedError, match=r"checkpoint t is saved whole in .*/t \(committed\)"):
        d.commit(staging, tmp_path, "t")
    assert (tmp_path / "t" / d.MANIFEST).read_text() == '{"new": 1}'
    with pytest.raises(d.SavedError, match=r"making latest \(which names it now\) durable"):
        d.write_latest(tmp_path, "t")
    assert d.read_latest(tmp_path) == "t"


def test_read_latest_and_its_errors(tmp_path: Path) -> None:
    assert d.read_latest(tmp_path) is None and d.read_latest(tmp_path / "missing") is None
    (tmp_path / d.LATEST).write_text("  t1\n")
    assert d.read_latest(tmp_path) == "t1"
    (tmp_path / d.LATEST).write_bytes(b"\xff\xfe")
    with pytest.raises(d.CheckpointError, match=f"{tmp_path / d.LATEST} is unreadable .*; pass tag="):
        d.read_latest(tmp_path)
    assert d.read_latest_quietly(tmp_path) is None
    _write_tag(tmp_path, "a", {})
    _write_tag(tmp_path, "b", {})
    (tmp_path / d.LATEST).write_text("../etc")
    with pytest.raises(d.CheckpointError) as info:
        d.read_latest(tmp_path)
    assert f"{tmp_path / d.LATEST} names no tag (checkpoint tag '../etc'" in str(info.value)
    assert "(checkpoints there: a, b)" in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / d.LATEST).write_text(".x")
    with pytest.raises(d.CheckpointError, match=r"\(checkpoints there: none\)"):
        d.read_latest(empty)
    (empty / d.LATEST).unlink()
    (empty / d.LATEST).mkdir()     # an OSError other than a missing file
    with pytest.raises(d.CheckpointError, match="is unreadable"):
        d.read_latest(empty)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(d.CheckpointError, match=f"{a_file} is a file, not a checkpoint directory"):
        d.read_latest(a_file)
    (tmp_path / d.LATEST).write_text("b\n")
    assert d.read_latest_quietly(tmp_path) == "b"


def test_read_manifest_file_errors_name_the_file_and_the_cause(tmp_path: Path) -> None:
    with pytest.raises(d.CheckpointError, match=f"{tmp_path} has no {d.MANIFEST}: it is not a "
                                                "checkpoint, or its save did not finish"):
        d.read_manifest_file(tmp_path)
    path = tmp_path / d.MANIFEST
    for content, expected in (
            (b"{", f"{path} is not readable JSON (Expecting"),
            (b"\xff", f"{path} is not readable JSON ("),
            (b"[1]", f"{path} is not an infinity checkpoint manifest (format None)"),
            (b'{"format": "other"}', f"{path} is not an infinity checkpoint manifest (format 'other')"),
            (b'{"format": "infinity-checkpoint"}', f"{path} has format version None; this version "
                                                   f"of infinity reads versions "
                                                   f"{d.FP32_STATES_VERSION} and {d.VERSION}"),
            (b'{"format": "infinity-checkpoint", "version": 0}', "has format version 0;"),
    ):
        path.write_bytes(content)
        with pytest.raises(d.CheckpointError) as info:
            d.read_manifest_file(tmp_path)
        assert expected in str(info.value)
        assert "newer infinity" not in str(info.value)
    for version in (d.VERSION + 1, str(d.VERSION)):
        path.write_text(json.dumps({"format": d.FORMAT, "version": version}))
        with pytest.raises(d.CheckpointError) as info:
            d.read_manifest_file(tmp_path)
        newer = isinstance(version, int)
        assert ("it was written by a newer infinity: upgrade infinity to load it"
                in str(info.value)) is newer
    path.write_text(json.dumps({"format": d.FORMAT, "version": d.VERSION, "x": 1}))
    assert d.read_manifest_file(tmp_path) == {"format": d.FORMAT, "version": d.VERSION, "x": 1}


def test_checkpoint_directory_takes_a_tags_own_directory_or_resolves(tmp_path: Path) -> None:
    tag = _write_tag(tmp_path, "t", {})
    assert d.checkpoint_directory(tag, None) == tag
    assert d.checkpoint_directory(tmp_path, "t") == tag
    assert d.checkpoint_directory(tmp_path, None) is None
    d.write_latest(tmp_path, "t")
    assert d.checkpoint_directory(tmp_path, None) == tag
    with pytest.raises(d.CheckpointError, match="no checkpoint 'x'"):
        d.checkpoint_directory(tag, "x")


def test_resolve_falls_back_to_a_whole_aside_copy_with_a_warning(tmp_path: Path, infinity_info_log) -> None:
    aside = _write_tag(tmp_path, ".t.replaced", {})
    assert d.resolve(tmp_path, "t") == aside
    assert (f"checkpoint {tmp_path / 't'} is missing but its previous save is whole in {aside}"
            in infinity_info_log.text)
    _write_tag(tmp_path, "t", {})
    assert d.resolve(tmp_path, "t") == tmp_path / "t"
    (aside / d.MANIFEST).unlink()
    with pytest.raises(d.CheckpointError, match="no checkpoint 'u'"):
        d.resolve(tmp_path, "u")
    with pytest.raises(ValueError):
        d.resolve(tmp_path, "../t")


def test_resolve_errors_say_what_is_there(tmp_path: Path) -> None:
    with pytest.raises(d.CheckpointError) as info:
        d.resolve(tmp_path, "t")
    assert str(info.value) == f"no checkpoint 't' in {tmp_path}; there are none. Pass tag= to load another one"
    _write_tag(tmp_path, "a", {})
    (tmp_path / ".t.partial.0123abcd").mkdir()
    with pytest.raises(d.CheckpointError) as info:
        d.resolve(tmp_path, "t")
    assert str(info.value) == (f"no checkpoint 't' in {tmp_path} (a save of it was interrupted: "
                               "its staging directory is there); checkpoints there: a. Pass tag= "
                               "to load another one")
    tag = tmp_path / "t"
    tag.mkdir()
    with pytest.raises(d.CheckpointError) as info:
        d.resolve(tmp_path, "t")
    message = str(info.value)
    assert message.startswith(f"{tag} has no {d.MANIFEST}, so it cannot be loaded as checkpoint 't'")
    assert "(the directory holds: nothing); other checkpoints there: a. Pass tag=" in message
    for i in range(7):
        (tag / f"rank{i}_model.safetensors").write_text("")
    with pytest.raises(d.CheckpointError) as info:
        d.resolve(tmp_path, "t")
    assert ("(the directory holds: " + ", ".join(f"rank{i}_model.safetensors" for i in range(6))
            + ", ...); other checkpoints there: a") in str(info.value)
    (tmp_path / "a" / d.MANIFEST).unlink()
    with pytest.raises(d.CheckpointError) as info:
        d.resolve(tmp_path, "t")
    assert "rank5_model.safetensors, ...). Pass tag= to load another one, or restore the manifest" in str(info.value)
    for i in range(1, 7):
        (tag / f"rank{i}_model.safetensors").unlink()
    with pytest.raises(d.CheckpointError, match=r"holds: rank0_model.safetensors\)\. Pass"):
        d.resolve(tmp_path, "t")


def test_a_tag_ending_in_a_newline_is_refused(tmp_path: Path) -> None:
    """Bug found by the unit tests above: the tag pattern ended in "$", which also matches before
    a final newline, so "t\\n" was a valid tag; ``latest`` (written "t\\n\\n", read stripped)
    then named "t" -- another checkpoint, or none."""
    with pytest.raises(ValueError, match="cannot name a directory"):
        d.check_tag("t\n")
    (tmp_path / ".t.partial.0123abcd\n").mkdir()     # not a staging name of ours either
    assert d.staging_dirs(tmp_path) == []


# -- relative paths, stagings left behind, and what each message names ---------------------------

def test_exchange_works_on_relative_paths(tmp_path: Path, monkeypatch) -> None:
    """A save_dir given relative to the working directory (``save_checkpoint("ckpt", ...)``)."""
    if not _can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange directories (RENAME_EXCHANGE)")
    monkeypatch.chdir(tmp_path)
    Path("a").mkdir()
    Path("b").mkdir()
    Path("a", "in_a").write_text("")
    assert d._exchange(Path("a"), Path("b")) is True
    assert os.listdir(tmp_path / "b") == ["in_a"]


def test_prepare_staging_adopts_only_its_own_tags_staging(tmp_path: Path) -> None:
    other = tmp_path / ".a.partial.0123abcd"        # sorts before the tag's own
    other.mkdir()
    (other / "notes.txt").write_text("a user's file of tag a, whose directory is gone")
    own = tmp_path / ".t.partial.89abcdef"
    own.mkdir()
    (own / "rank0_model.safetensors").write_text("half written")
    staging = d.prepare_staging(tmp_path, "t")
    assert staging.is_dir() and os.listdir(staging) == []      # adopted own, emptied, kept
    assert not own.exists()
    assert os.listdir(other) == ["notes.txt"]                  # not adopted into tag t


def test_prepare_staging_cleans_every_other_left_staging_of_the_tag(tmp_path: Path) -> None:
    for token in ("0123abcd", "89abcdef", "aaaaaaaa"):
        (tmp_path / f".t.partial.{token}").mkdir()
        (tmp_path / f".t.partial.{token}" / "rank0_optim.safetensors").write_text(token)
    staging = d.prepare_staging(tmp_path, "t")
    assert d.staging_dirs(tmp_path) == [staging] and os.listdir(staging) == []


def test_a_stale_stagings_half_written_shards_never_go_into_the_tag(tmp_path: Path) -> None:
    """A save killed before its manifest: its shards are not the committed tag's, even where
    the tag has no file of that name (it was saved at another world size)."""
    tag = _write_tag(tmp_path, "t", {"rank0_model.safetensors": "committed"})
    stale = tmp_path / ".t.partial.0123abcd"
    stale.mkdir()
    (stale / "rank1_model.safetensors").write_text("half written")     # and no manifest yet
    (stale / "notes.txt").write_text("the user's")
    assert d.clean_stale_staging(tmp_path) == [stale]
    assert sorted(os.listdir(tag)) == [d.MANIFEST, "notes.txt", "rank0_model.safetensors"]


def test_remove_checkpoint_files_of_a_regular_file_warns_and_leaves_it(tmp_path: Path,
                                                                      infinity_info_log) -> None:
    path = tmp_path / "rank0_model.safetensors"
    path.write_text("keep")
    d.remove_checkpoint_files(path)
    assert path.read_text() == "keep"
    assert f"not cleaning {path}: [Errno {errno.ENOTDIR}]" in infinity_info_log.text


def test_not_cleaning_a_symlinked_directory_says_why(tmp_path: Path, infinity_info_log) -> None:
    real = _write_tag(tmp_path, "real", {})
    link = tmp_path / "link"
    os.symlink(real, link)
    d.remove_checkpoint_files(link)
    assert f"not cleaning {link}: [Errno " in infinity_info_log.text


def test_a_version_mismatch_message_ends_with_the_version_read(tmp_path: Path) -> None:
    (tmp_path / d.MANIFEST).write_text(json.dumps({"format": d.FORMAT, "version": 0}))
    with pytest.raises(d.CheckpointError) as info:
        d.read_manifest_file(tmp_path)
    assert str(info.value).endswith(
        f"this version of infinity reads versions {d.FP32_STATES_VERSION} and {d.VERSION}")


def test_resolve_messages_list_tags_and_entries_exactly(tmp_path: Path) -> None:
    for tag in ("a", "b"):
        _write_tag(tmp_path, tag, {})
    (tmp_path / ".u.partial.0123abcd").mkdir()      # another tag's interrupted save
    with pytest.raises(d.CheckpointError) as info:
        d.resolve(tmp_path, "t")
    assert str(info.value) == (f"no checkpoint 't' in {tmp_path}; checkpoints there: a, b. "
                               "Pass tag= to load another one")
    tag = tmp_path / "t"
    tag.mkdir()
    for i in range(6):
        (tag / f"rank{i}_model.safetensors").write_text("")
    with pytest.raises(d.CheckpointError) as info:
        d.resolve(tmp_path, "t")
    listed = ", ".join(f"rank{i}_model.safetensors" for i in range(6))
    assert f"(the directory holds: {listed}); other checkpoints there: a, b. Pass" in str(info.value)


def test_write_latest_that_cannot_create_its_file_reports_that(tmp_path: Path) -> None:
    gone = tmp_path / "removed-meanwhile"
    with pytest.raises(OSError) as info:
        d.write_latest(gone, "t")
    assert info.value.errno == errno.ENOENT
    assert f"checkpoint t is saved whole in {gone / 't'}, but {gone / d.LATEST} could not" in str(info.value)


def test_write_latest_never_writes_through_a_link_or_over_a_file(tmp_path: Path) -> None:
    """A link or a file at the names an earlier version wrote ``latest`` through is left as it
    is, and so is what it points at: the pointer is written to a file this call creates."""
    precious = tmp_path / "elsewhere.txt"
    precious.write_text("the user's\n")
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / ".latest.partial").symlink_to(precious)
    (save_dir / ".latest.pending").write_text("a file of the user's\n")
    d.write_latest(save_dir, "t")
    assert precious.read_text() == "the user's\n"
    assert (save_dir / ".latest.partial").is_symlink()
    assert (save_dir / ".latest.pending").read_text() == "a file of the user's\n"
    assert not (save_dir / d.LATEST).is_symlink()
    assert (save_dir / d.LATEST).read_text() == "t"
    assert sorted(os.listdir(save_dir)) == [".latest.partial", ".latest.pending", d.LATEST]


def test_latest_takes_the_umask_s_permissions(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        d.write_latest(tmp_path, "t")
    finally:
        os.umask(old)
    assert (tmp_path / d.LATEST).stat().st_mode & 0o777 == 0o640
