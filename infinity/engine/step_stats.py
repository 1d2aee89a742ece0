"""What ``engine.step_stats()`` reports for the last step: where its time went and what it moved.

Why here: the tools (tools/bench, ``infinity train``'s metrics) read these names; one place
builds them from the tier manager's counters and the optimizer's timers.
"""
from __future__ import annotations

from typing import Mapping

from infinity.comm.collectives import CommCounters
from infinity.optim.records import OptimTimers
from infinity.storage.manager import TierManager


def step_stats(step_s: float, manager: TierManager, timers: OptimTimers,
               fetch_stats: Mapping[str, int], comm: CommCounters | None = None
               ) -> dict[str, float]:
    """The stats of a step that took ``step_s`` seconds (counters are cumulative where the
    manager's and the coordinator's ``fetch_stats`` are: the prefetch hit ratio is the share
    of NVMe fetches a prefetch had issued, since the engine started)."""
    nvme_fetches = fetch_stats["nvme_fetches"]
    prefetch_hit_ratio = fetch_stats["prefetch_hits"] / nvme_fetches if nvme_fetches else 1.0
    c = manager.counters
    tiers = manager.tier_bytes()
    optimizer_s = timers.optimizer_s + timers.grad_s
    io_wait = c.io_wait_s
    comm = comm or CommCounters()
    return {
        "step_s": step_s, "io_wait_s": io_wait, "optimizer_s": optimizer_s,
        "compute_s": max(0.0, step_s - optimizer_s - io_wait - comm.comm_s),
        "comm_s": comm.comm_s, "comm_sent_bytes": comm.sent_bytes,
        "comm_received_bytes": comm.received_bytes,
        "device_bytes": tiers["device"], "host_bytes": tiers["host"], "nvme_bytes": tiers["nvme"],
        "io_read_bytes": c.nvme_read_bytes, "io_write_bytes": c.nvme_write_bytes,
        "prefetch_hit_ratio": prefetch_hit_ratio,
        "optimizer_background_s": timers.background_s, "grad_wait_s": timers.grad_wait_s,
        "optimizer_kernel_s": timers.kernel_s,
        "device_write_wait_s": timers.device_write_wait_s,
    }
