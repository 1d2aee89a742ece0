"""The files of a pretrained (transformers) directory: which hold its weights
(``weight_map``: ``model.safetensors``, or the shards ``model.safetensors.index.json`` names, in
transformers' order), what a path is when it is no regular file to read (``not_a_file``: a
FIFO, a dangling or looping link), and the file whose rename committed the save a reader sees
(``commit_point``: a load of a directory another process keeps saving over opens it again).
Kept apart from the reading and matching of the tensors (checkpoint/pretrained.py), which the
writers of such directories (weights_dir.py, sharded_writer.py) do not need."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def weight_map(source: Path) -> tuple[Path, dict[str, str]]:
    """(directory, {tensor name: file name}) of a pretrained ``source``: a directory with
    ``model.safetensors.index.json`` or ``model.safetensors``, or one ``.safetensors`` file.
    The files are not opened here (``PretrainedWeights`` checks them)."""
    if source.is_file():
        if source.name == INDEX_NAME:
            return weight_map(source.parent)
        if source.suffix != ".safetensors":
            raise CheckpointError(f"{source}: not a safetensors file; infinity reads safetensors "
                                  "only (no pickle): pass the model's directory or its "
                                  "*.safetensors file")
        with TensorFileReader(source) as reader:
            return source.parent, {name: source.name for name in reader.tensors}
    if not source.is_dir():
        raise FileNotFoundError(f"{source} does not exist: pass a local directory saved with "
                                "save_pretrained (download a Hub model first, e.g. `hf download "
                                "<repo> --local-dir DIR`)")
    # transformers' order: model.safetensors when it is there, else the index (a save over an
    # earlier one relies on it, see [Note: committing a weights directory] in weights_dir.py)
    single = source / SINGLE_NAME
    if single.is_file():
        return weight_map(single)
    index = source / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index}: not valid JSON ({exc})") from None
        mapping = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(mapping, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise CheckpointError(f"{index}: no \"weight_map\" of tensor names to file names")
        for name in set(mapping.values()):
            if Path(name).name != name:
                raise CheckpointError(f"{index}: file {name!r} is not a file name in {source}")
        return source, dict(mapping)
    for path in (single, index):
        what = not_a_file(path)
        if what is not None:
            raise CheckpointError(f"{path} is {what}, not a file: infinity reads the weights "
                                  "from regular files. Replace it with the file itself (copy "
                                  "the model directory again)")
    others = sorted(p.name for p in source.iterdir()
                    if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    hint = ""
    if any(not n.endswith(".safetensors") for n in others):
        hint = (" It holds pickle files (pytorch_model.bin): infinity reads safetensors only; "
                "convert them once with transformers (from_pretrained, then "
                "save_pretrained)")
    elif others:
        hint = f" It holds {', '.join(others[:5])}: pass one of them as the path."
    raise CheckpointError(f"{source} has no {SINGLE_NAME} and no {INDEX_NAME}.{hint}")


def not_a_file(path: Path) -> str | None:
    """What ``path`` is when it exists (as a name) but is no regular file to read -- "a FIFO
    (named pipe)", "a symbolic link that loops (to model.safetensors)" -- else None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        target = os.readlink(path)
        try:
            os.stat(path)
        except FileNotFoundError:
            return f"a symbolic link to {target}, which does not exist"
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"a symbolic link that loops (to {target})"
            return f"a symbolic link to {target}, which cannot be read ({exc.strerror})"
        inner = not_a_file(Path(os.path.realpath(path)))
        return None if inner is None else f"a symbolic link to {inner}"
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), None)


OPEN_ATTEMPTS = 3
"""Times a load opens a directory that another process keeps saving over, before refusing."""


def commit_point(source: Path) -> tuple[str, int, int, int, int] | None:
    """The file whose rename committed the save a reader of ``source`` sees (a directory's
    ``model.safetensors`` when it is a file, else its index; or ``source`` itself), as (name,
    device, inode, size, mtime): a save that commits meanwhile replaces it by a new file
    (infinity's saves), or rewrites it in place (a writer that does not rename)."""
    candidates = [source] if not source.is_dir() else [source / SINGLE_NAME, source / INDEX_NAME]
    for path in candidates:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if stat.S_ISREG(st.st_mode):
            return path.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
    return None
