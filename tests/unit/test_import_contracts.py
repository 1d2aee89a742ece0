"""The layer order of DESIGN.md, checked as code: the import-linter contracts in pyproject.toml
(type-checking imports included). A back-import (checkpoint importing the engine, zero
importing optim, config importing storage, the engine importing the dry run's simulate) fails
here instead of waiting for a reviewer, and so does a command importing storage directly
(only clean may: the swap directory's marker rule)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process: import-linter configures logging with dictConfig, which disables every
# logger that exists (the package's among them), so later tests' caplog saw nothing.
_LINT = ("import sys\n"
         "from importlinter.cli import lint_imports\n"
         "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))\n")


def test_the_layers_contract_is_kept() -> None:
    proc = subprocess.run([sys.executable, "-c", _LINT, str(ROOT / "pyproject.toml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]
