"""A rank that finished exits with its gloo group gone, its threads with it, where the script
made the group and destroyed it, and a torch module imported after it held it in a default
argument (left to the interpreter's teardown, such a group could abort the finished rank:
"terminate called without an active exception"; see [Note: a group kept alive by a default
argument])."""
from __future__ import annotations

import json

import pytest

from ranks import check_ranks, launch

pytestmark = pytest.mark.distributed


def test_a_group_the_script_made_is_gone_at_exit_with_its_threads(tmp_path):
    check_ranks(launch(2, "exit_ranks_worker.py", [str(tmp_path)], timeout=300))
    for rank in range(2):
        at_exit = json.loads((tmp_path / f"exit{rank}.json").read_text())
        assert at_exit["gloo_threads_before"], at_exit    # the check below can see them
        assert at_exit["initialized"] is False and at_exit["gloo_threads"] == [], at_exit
