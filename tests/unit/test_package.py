"""The package's public names resolve from a plain ``import infinity`` in a fresh process (they
are loaded lazily, on first use), and ``import infinity`` alone stays cheap (no torch)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import infinity


def test_each_public_name_resolves_in_a_fresh_process() -> None:
    """(``infinity.checkpoint.consolidated_state_dict(dir)``, README's "no engine needed" call,
    failed so: nothing else had imported the subpackage.)"""
    code = ("import infinity\n"
            f"for name in {sorted(infinity._LAZY)!r}:\n"
            "    getattr(infinity, name)\n"
            "print(infinity.checkpoint.consolidated_state_dict.__name__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "consolidated_state_dict", result.stderr[-2000:]


def test_import_alone_does_not_load_torch() -> None:
    code = "import sys, infinity; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


def test_deepspeed_checkpointing_is_pointed_at_what_does_it_here() -> None:
    """``infinity.checkpointing`` (deepspeed.checkpointing's habit) was a bare AttributeError,
    while ``infinity.checkpoint`` (the training checkpoints) sat one letter away."""
    with pytest.raises(AttributeError, match="torch.utils.checkpoint.checkpoint.*"
                                             "infinity.offload_activations"):
        infinity.checkpointing
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'$"):
        infinity.nothing_here
