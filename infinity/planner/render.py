"""The plan as a text table for people (``infinity plan``; ``Plan.render``)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from infinity.base.sizes import format_bytes
from infinity.planner.inputs import nearest_existing
from infinity.planner.tiers import TIERS

if TYPE_CHECKING:
    from infinity.planner.plan import Plan

__all__ = ["render_plan"]


def render_plan(plan: "Plan") -> str:
    """A text table for people (``Plan.render``)."""
    s, hw, z, sz = plan.stats, plan.hardware, plan.config.zero, plan.sizes
    gpu = (f"GPU {hw.gpu_name} {format_bytes(hw.gpu_free_bytes or 0)} free of "
           f"{format_bytes(hw.gpu_total_bytes or 0)}") if hw.has_gpu else \
        "no GPU (the device is a pool in host RAM)"
    disk = "" if hw.disk_free_bytes is None else \
        f", {format_bytes(hw.disk_free_bytes)} free at {_existing(hw.nvme_path)}"
    lines = [
        f"model     {_count(s.total_params)} params ({_count(s.trainable_params)} trainable), "
        f"{s.n_units} units, largest unit {_count(s.largest_unit_params)}",
        f"machine   {hw.cpu_cores} cores, host {format_bytes(hw.host_available_bytes)} available of "
        f"{format_bytes(hw.host_total_bytes)}, {gpu}{disk}",
        f"config    ZeRO stage {z.stage}, offload_param {z.offload_param.device}, offload_optimizer "
        f"{z.offload_optimizer.device}, compute {sz.compute_dtype}, early step "
        f"{'on' if sz.early_step else 'off'}, Adam states {plan.state_format.label}, world size "
        f"{plan.config.world_size} (bytes per rank)",
        "",
        f"{'':18}{'device':>14}{'host':>14}{'nvme':>14}",
    ]
    for comp, row in plan.table().items():
        lines.append(f"{comp.replace('_', ' '):18}" + "".join(f"{_cell(row[t]):>14}" for t in TIERS))
    lines.append(f"{'total':18}" + "".join(f"{_cell(plan.bytes(tier=t)):>14}" for t in TIERS))
    budgets = (*plan.budgets, hw.disk_free_bytes)
    lines.append(f"{'budget':18}" + "".join(
        f"{'-' if b is None else format_bytes(b):>14}" for b in budgets))
    lines += [
        "",
        f"predicted peak host RSS {format_bytes(plan.peak_host_rss_bytes)} "
        f"(activations not included); NVMe traffic per step: read "
        f"{format_bytes(plan.nvme_read_bytes_per_step)}, write {format_bytes(plan.nvme_write_bytes_per_step)}",
        f"sizes     sub_group_size {sz.sub_group_size:,} (stepped {plan.stepped_sub_group:,}); "
        f"param buffers {sz.param_buffer_count} x {sz.param_buffer_size:,}; prefetch {sz.prefetch_bucket_size:,}; "
        f"max live {sz.max_live_parameters:,}; persistence threshold {sz.persistence_threshold:,}; "
        f"reduce bucket {sz.reduce_bucket_size:,} (elements)",
        "",
        "details:",
    ]
    lines += [f"  {i.tier:6} {format_bytes(i.nbytes):>12}  {i.component}: {i.note}" for i in plan.items]
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"WARNING: {w}" for w in plan.warnings] or ["fits: every tier is within its budget"]
    return "\n".join(lines)


def _cell(nbytes: int) -> str:
    return "-" if nbytes == 0 else format_bytes(nbytes)


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def _existing(path: str | None) -> str:
    """``path``, or where its free space was measured when it does not exist yet (its nearest
    existing directory: an unmounted /mnt/nvme is measured on the disk under it)."""
    if path is None or Path(path).exists():
        return str(path)
    return f"{nearest_existing(path)} ({path} does not exist yet)"
