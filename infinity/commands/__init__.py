"""The subcommands of the ``infinity`` CLI (one module each: ``add_arguments`` and ``run``) and
their helpers (``plan_target``: the target flags; ``dry_run`` and ``dry_run_trace``: ``plan
--dry-run``'s orchestration and its timeline).

What the commands run lives below them: the dry run's byte-free backend in ``infinity.simulate``,
the nvme-tune sweep in ``infinity.train.nvme_tune``, the swap-path checks behind the engine
(``engine.guards``). No command imports ``infinity.storage`` except ``clean``, which deletes only
what storage's swap-directory marker says is ours (pyproject.toml's second import contract).
"""


class UsageError(Exception):
    """Bad user input: printed as one line, exit code 2."""
