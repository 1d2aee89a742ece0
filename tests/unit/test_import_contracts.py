"""The layer order of DESIGN.md, checked as code: the import-linter contracts in pyproject.toml
(type-checking imports included). A back-import (checkpoint importing the engine, zero
importing optim, config importing storage) fails here instead of waiting for a reviewer."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_the_layers_contract_is_kept(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True,
                              no_logo=True)
    assert status == 0, out.getvalue()[-4000:]
    assert "1 kept, 0 broken" in out.getvalue(), out.getvalue()[-2000:]
