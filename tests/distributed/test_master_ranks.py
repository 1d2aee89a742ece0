"""Changes by hand to a bf16 engine's weights at 2 ranks (gloo, localhost): the fp32 masters
are the source rank's values on both ranks' shards. Before: each rank's shard took its own
(a rebind on rank 1 alone reached rank 0's shard only as the bf16 copy's rounding; a
load_state_dict of per-rank dicts left each shard with its own dict's values)."""
from __future__ import annotations

import json

import pytest

from ranks import check_ranks, launch

pytestmark = pytest.mark.distributed


def test_a_change_by_hand_reaches_every_ranks_master_as_the_source_made_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    check_ranks(launch(2, "master_ranks_worker.py", [str(out)], timeout=300))
    result = json.loads((out / "rank0.json").read_text())
    assert result["rebound_equal"], result
    assert result["loaded_equal"], result
