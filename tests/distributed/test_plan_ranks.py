"""The plan is the engine on two ranks (issue 35; one rank: tests/integration/
test_plan_is_the_engine.py): each rank is built from its own run plan and holds what it says."""
from __future__ import annotations

import pytest

from infinity.planner.alignment import SHARD_ALIGN_NUMEL
from plan_check import check, check_ranks_states
from ranks import check_ranks, launch, read_results


@pytest.mark.distributed
def test_each_of_two_ranks_holds_what_its_plan_shows(tmp_path, disk_dir) -> None:
    """Two gloo ranks, five configs (stages 1-3, host and NVMe tiers, both schedules): each
    rank's pools are its plan's (its own shard sizes the step stream's sub-group), its
    decisions those ``infinity plan`` takes from the counts, and its states' bytes per tier the
    plan's even share, each store at most its shard's padding (2048 elements) over it."""
    check_ranks(launch(2, "plan_ranks_worker.py", [str(tmp_path), str(disk_dir)], timeout=600))
    results = read_results(tmp_path, 2)
    assert len(results) == 2 and all(len(r) == 5 for r in results)
    # a store's shard is padded to SHARD_ALIGN_NUMEL elements: the ranks' shards of one store
    # exceed its elements by at most that many per rank (float32, the widest state)
    padding = 2 * SHARD_ALIGN_NUMEL * 4
    for name in results[0]:
        for when in ("first", "after"):
            for rank, per_config in enumerate(results):
                try:
                    check(per_config[name][when], padding=padding)
                except AssertionError as exc:
                    raise AssertionError(f"rank {rank}, {name}, {when}: {exc}") from exc
            check_ranks_states([r[name][when] for r in results], padding)
        for rank, per_config in enumerate(results):
            assert per_config[name]["after"] == per_config[name]["first"], (rank, name)
