"""``infinity export CKPT_DIR OUT_DIR``: a checkpoint's weights as a transformers directory.

No engine and no model are built: each tensor is read from the slices every rank saved (a
checkpoint of any world size) and written into ``model.safetensors`` or its shards with
``model.safetensors.index.json``, a piece at a time (memory stays at a few MiB whatever the
model's size), in fp32 by default (trainable parameters from their fp32 masters: DeepSpeed's
``zero_to_fp32``). ``config.json`` comes from the checkpoint (engines over a transformers
model keep it in the manifest) or from ``--config``, which also carries a directory's
tokenizer and generation config files. The result loads with ``transformers``'
``from_pretrained`` and ``infinity.from_pretrained``.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from infinity.base.sizes import format_bytes
from infinity.checkpoint.directory import our_manifest
from infinity.checkpoint.pretrained_write import (
    DEFAULT_MAX_SHARD_SIZE,
    export_pretrained,
    out_dtype,
    shard_bytes,
)
from infinity.commands import UsageError
from infinity.engine.hf_conversions import hub_names_of_config


_WRITTEN = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
"""The weight files an export writes (transformers' names), counted in its summary line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path,
                        help="a save directory (its 'latest' checkpoint, or --tag) or one "
                             "checkpoint's directory")
    parser.add_argument("out", type=Path, help="the directory to write (created if needed)")
    parser.add_argument("--tag", default=None, help="the checkpoint tag in CHECKPOINT to export")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16", "stored"),
                        help="dtype of the weights written (stored: as the checkpoint holds "
                             "them, fp32 masters and frozen ones in the compute dtype); "
                             "default fp32")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help=f"largest weight file, e.g. 5GB or 500MiB (default "
                             f"{DEFAULT_MAX_SHARD_SIZE}); larger models get shards and an index")
    parser.add_argument("--config", type=Path, default=None,
                        help="the model's config.json, or a directory holding it (its "
                             "tokenizer and generation config files are copied too); default: "
                             "the config the checkpoint holds")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the sha256 check of the checkpoint's files")


def run(args: argparse.Namespace) -> int:
    if not args.checkpoint.exists():
        raise FileNotFoundError(f"{args.checkpoint} does not exist")
    try:
        max_shard = shard_bytes(args.max_shard_size)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    inside = args.out.resolve()
    if our_manifest(args.out) is not None or any(
            inside.is_relative_to(p.resolve()) for p in (args.checkpoint,) if p.is_dir()):
        raise UsageError(f"{args.out} is a checkpoint or inside one ({args.checkpoint}): the "
                         "export would write model files among the checkpoint's; choose an "
                         "output directory of its own")
    texts, carry = {}, None
    if args.config is not None:
        config_file = args.config / "config.json" if args.config.is_dir() else args.config
        if not config_file.is_file():
            raise FileNotFoundError(f"--config {args.config}: no config.json there")
        texts["config.json"] = config_file.read_text()
        carry = args.config if args.config.is_dir() else None
    dtype = None if args.dtype == "stored" else out_dtype(args.dtype, None)
    out = export_pretrained(args.checkpoint, args.out, tag=args.tag, dtype=dtype,
                            max_shard_size=max_shard, texts=texts, carry_from=carry,
                            verify_checksums=not args.no_verify,
                            hub_names_of=hub_names_of_config)
    files = sorted(p.name for p in out.iterdir() if _WRITTEN.fullmatch(p.name))  # not a user's
    size = sum((out / f).stat().st_size for f in files)
    print(f"{out}: {len(files)} weight file(s), {format_bytes(size)}"
          + ("" if (out / "config.json").is_file() else
             " (no config.json: pass --config to load it with from_pretrained)"))
    return 0
