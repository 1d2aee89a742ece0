"""A checkpoint's weights as a plain ``state_dict``, without an engine (DeepSpeed's
``zero_to_fp32``): to load into a model built without infinity, or to publish."""
from __future__ import annotations

from pathlib import Path

import torch

from infinity.checkpoint.directory import read_manifest_file, resolve, verify_files
from infinity.checkpoint.layout import model_file
from infinity.checkpoint.tensor_file import CheckpointError, TensorFileReader


def consolidated_state_dict(checkpoint_dir: str | Path, tag: str | None = None,
                            verify_checksums: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter (trainable ones in fp32) and persistent buffer of the checkpoint by its
    ``state_dict`` name, tied parameters under each of their names (sharing one tensor).
    ``checkpoint_dir`` is a save directory (then ``tag`` or ``latest`` picks the checkpoint)
    or one checkpoint's directory."""
    root = Path(checkpoint_dir)
    directory = root if (root / "manifest.json").is_file() and tag is None else resolve(root, tag)
    if directory is None:
        raise CheckpointError(f"{root} holds no checkpoint manifest and no 'latest' file; pass "
                              "a checkpoint directory or tag=")
    manifest = read_manifest_file(directory)
    verify_files(directory, manifest, verify_checksums)
    with TensorFileReader(directory / model_file(0)) as reader:
        state = {name: reader.read(name) for name in reader.tensors}
    for alias, name in manifest.get("aliases", {}).items():
        state[alias] = state[name]
    return state
