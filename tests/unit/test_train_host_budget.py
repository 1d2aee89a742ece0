"""infinity train's host budget check: clearly too small is refused before the engine starts;
under the planner's (cautious) estimate but within reach is only warned about."""
from __future__ import annotations

import pytest

from infinity.config import InfinityConfig
from infinity.planner.inputs import ModelStats, detect_hardware
from infinity.planner.plan import REFUSE_BELOW_FRACTION, minimum_host_budget
from infinity.train.host_budget import check_host_budget

STATS = ModelStats.from_counts(10_000_000, 1_000_000, 10, 10_000_000)


def _config(budget: int | None, nvme: str) -> InfinityConfig:
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
          "gradient_clipping": 1.0}
    if budget is not None:
        ds["infinity"] = {"host_memory_budget": budget}
    return InfinityConfig.from_dict(ds)


def test_clearly_too_small_is_refused_and_near_misses_are_warned(tmp_path, infinity_log) -> None:
    least = minimum_host_budget(_config(None, str(tmp_path)), STATS, detect_hardware(str(tmp_path)))
    assert least is not None
    check_host_budget(_config(least, str(tmp_path)), STATS, "X")         # fits: silent
    assert "under the planner's estimate" not in infinity_log.text
    near = int(least * (1 + REFUSE_BELOW_FRACTION) / 2)
    check_host_budget(_config(near, str(tmp_path)), STATS, "NEAR (--host-budget)")
    assert "NEAR (--host-budget) is under the planner's estimate" in infinity_log.text
    with pytest.raises(ValueError, match=r"budget 1B \(--host-budget\) is too small.*at least"):
        check_host_budget(_config(1, str(tmp_path)), STATS, "1B (--host-budget)")
