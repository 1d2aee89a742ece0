"""The ``infinity`` command: ``train``, ``plan``, ``nvme-tune``, ``clean``, ``export``.

Each subcommand lives in ``infinity/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; this module only dispatches. Bad input exits with code 2 and one clear line.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import sys

from infinity.base.budget import BudgetExceededError
from infinity.base.log import get_logger
from infinity.commands import UsageError

SUBCOMMANDS = {
    "train": ("infinity.commands.train", "train a model out of core (default: a demo model on NVMe)"),
    "plan": ("infinity.commands.plan", "predict memory per tier and the settings for a model size"),
    "nvme-tune": ("infinity.commands.nvme_tune", "measure a swap path and recommend an \"aio\" section"),
    "clean": ("infinity.commands.clean", "remove swap files (or an unfinished save's files) left by a killed run"),
    "export": ("infinity.commands.export", "write a checkpoint's weights as a transformers directory"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infinity", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, PermissionError, FileExistsError,
            IsADirectoryError, NotADirectoryError,   # a path given that is the wrong kind
            BudgetExceededError) as exc:    # a budget too small for the run: its message says so
        get_logger("cli").debug("usage error", exc_info=True)
        print(f"infinity {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        # a full disk (or quota), a file larger than allowed (ulimit -f) are the user's to fix,
        # not a bug: the saves' and files' own messages name the place and the bytes
        get_logger("cli").debug("disk full", exc_info=True)
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"infinity {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"infinity {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
