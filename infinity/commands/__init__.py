"""The subcommands of the ``infinity`` CLI (one module each: ``add_arguments`` and ``run``)."""


class UsageError(Exception):
    """Bad user input: printed as one line, exit code 2."""
