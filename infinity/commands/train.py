"""``infinity train``: train a causal LM out of core; with no arguments, the demo run.

The demo: an 85M-parameter byte-level Llama (random init) on the public-domain text shipped in
the package, ZeRO stage 3 with parameters and optimizer states in a temporary swap directory
under /var/tmp (removed at the end), a host budget smaller than half the model states. Flags
override the model, data, ds_config and sizes; ``--engine torch`` runs the in-memory baseline.
The work is in ``infinity.train.loop``; this module only parses arguments.
"""
from __future__ import annotations

import argparse
import os

from infinity.train.defaults import (DEFAULT_FINETUNE_LR, DEFAULT_HOST_BUDGET, DEFAULT_LR,
                                     DEFAULT_MICRO_BATCH, DEFAULT_NVME_PATH, DEFAULT_PRESET,
                                     DEFAULT_SEQ_LEN, DEFAULT_STEPS)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, except where it is None: those flags name theirs in their help
    (the demo's value, which the config may change)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsFormatter
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model-size", metavar="NAME", default=None,
                       help=f"Llama preset with the byte vocabulary (tiny, {DEFAULT_PRESET}, 1B, "
                            f"7B, ...; default {DEFAULT_PRESET})")
    model.add_argument("--hf-config", metavar="PATH", default=None,
                       help="a transformers config.json of any causal LM (random init)")
    model.add_argument("--pretrained", metavar="DIR", default=None,
                       help="fine-tune the transformers model saved in DIR (config.json and "
                            "safetensors weights); its tokenizer when DIR has one, else bytes")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="DeepSpeed-format ds_config.json (default: stage 3, params and "
                             "optimizer on NVMe)")
    # the deepspeed launcher and torch.distributed.launch append --local_rank=N
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--data", metavar="FILE", default=None,
                        help="plain text, or JSON lines with a \"text\" field (default: the "
                             "shipped public-domain corpus)")
    parser.add_argument("--export", metavar="DIR", default=None,
                        help="write the trained model to DIR at the end, as a directory "
                             "from_pretrained loads (with the --pretrained tokenizer)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                        help="tokens per sample (bytes, or the --pretrained tokenizer's)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help=f"samples per forward (default: the config's; the demo: "
                             f"{DEFAULT_MICRO_BATCH})")
    parser.add_argument("--nvme-path", metavar="DIR", default=None,
                        help=f"directory for the swap directory (default: the config's, else "
                             f"{DEFAULT_NVME_PATH})")
    parser.add_argument("--host-budget", metavar="SIZE", default=None,
                        help=f"host memory budget, e.g. 2GiB (default: the config's; the demo: "
                             f"{DEFAULT_HOST_BUDGET})")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"peak learning rate (default: the config's; the demo: {DEFAULT_LR}, "
                             f"{DEFAULT_FINETUNE_LR} with --pretrained)")
    parser.add_argument("--optimizer-moments", choices=("fp32", "bf16", "int8"), default=None,
                        help="storage format of Adam's m and v (default: the config's, else "
                             "fp32); see docs/optimizer-formats.md")
    parser.add_argument("--optimizer-master", choices=("fp32", "bf16"), default=None,
                        help="bf16: the bf16 parameters are their own master, updated with "
                             "stochastic rounding (needs bf16 compute and bf16/int8 moments)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and the batches")
    parser.add_argument("--metrics", metavar="FILE", default=None,
                        help="write one JSON line per step here")
    parser.add_argument("--plot", metavar="FILE", default=None,
                        help="PNG of the loss and the step-time split (needs matplotlib; default: "
                             "next to --metrics when matplotlib is installed, else off; "
                             "--plot off: none)")
    parser.add_argument("--engine", choices=("infinity", "torch"), default="infinity",
                        help="infinity: the out-of-core engine; torch: the in-memory baseline "
                             "(plain PyTorch + AdamW), for comparison")
    parser.add_argument("--progress-every", type=int, default=None, metavar="N",
                        help="when stderr is not a terminal, print progress every N steps "
                             "(default: about 20 lines per run)")


    parser.add_argument("--save-dir", metavar="DIR", default=None,
                        help="write checkpoints here: after the last step, and every "
                             "--save-interval steps")
    parser.add_argument("--save-interval", type=int, default=None, metavar="N",
                        help="optimizer steps between checkpoints (default: only at the end)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --save-dir (start fresh "
                             "when there is none)")


def run(args: argparse.Namespace) -> int:
    from infinity.train.loop import TrainOptions, run_training  # torch: only when training

    if args.local_rank is not None:     # the deepspeed launcher's (torchrun sets the variable)
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    opts = TrainOptions(
        engine=args.engine, config=args.config, model_size=args.model_size,
        hf_config=args.hf_config, pretrained=args.pretrained, export=args.export,
        data=args.data, steps=args.steps, seq_len=args.seq_len,
        micro_batch=args.micro_batch, nvme_path=args.nvme_path, host_budget=args.host_budget,
        lr=args.lr, seed=args.seed, optimizer_moments=args.optimizer_moments,
        optimizer_master=args.optimizer_master, metrics=args.metrics, plot=args.plot,
        progress_every=args.progress_every, save_dir=args.save_dir,
        save_interval=args.save_interval, resume=args.resume)
    run_training(opts)
    return 0
