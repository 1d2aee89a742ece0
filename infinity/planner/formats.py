"""What each Adam state format would change in a plan (issue 38): beside the recommended config,
``infinity plan`` lists, for fp32 states, bf16 moments, int8 moments and int8 moments with a bf16
master (and the config's own format, when it is none of these), the bytes per rank and tier, the
NVMe bytes per step, the predicted step (target plans) and whether it fits -- and a shallower
rung or offload the format makes fit.

Each row is planned as the plan itself is (``try_rung`` and ``predict_step`` for a target,
``plan_memory`` for this machine), with only ``infinity.optimizer_moments`` and
``optimizer_master`` changed. A format the engine would refuse here (``run_plan.
state_format_refusal``) is marked as such, with its reason; a bf16 master on GPUs, which the
engine does not run yet, is planned as a projection and said to be one.

Pure: importable from anywhere, like the rest of the planner.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infinity.base.sizes import format_bytes
from infinity.config import InfinityConfig
from infinity.planner.decide import RUNGS, format_refusal, rung_number, try_rung
from infinity.planner.inputs import Hardware, ModelStats
from infinity.planner.placement import place
from infinity.planner.plan import plan_memory, recommend_config
from infinity.planner.run_plan import state_format_refusal
from infinity.planner.state_format import COMPARED_FORMATS, Int8SubGroupError, StateFormat
from infinity.planner.step_time import predict_step
from infinity.planner.tiers import TIERS, Tier

if TYPE_CHECKING:
    from infinity.planner.decide import Decision
    from infinity.planner.rank_memory import RankMemory
    from infinity.planner.step_time import StepTime

__all__ = ["FormatRow", "target_formats", "local_formats", "render_formats", "with_format",
           "config_format"]


@dataclass(frozen=True, kw_only=True)
class FormatRow:
    """One Adam state format in a plan's comparison."""

    format: StateFormat
    current: bool
    """The plan's own format (the config's)."""
    refused: str | None = None
    """Why the engine cannot run it here (no figures then)."""
    projected: bool = False
    """Planned though the engine does not run it here yet (a bf16 master on GPUs)."""
    per_rank: dict[str, int] | None = None
    """tier -> bytes of one rank (states, pools, runtime)."""
    nvme_read: int = 0
    nvme_write: int = 0
    """NVMe bytes per optimizer step: per node for a target, per rank for this machine."""
    step_s: float | None = None
    """The predicted step (target plans, where it fits)."""
    fits: bool = False
    shallower: str | None = None
    """A shallower rung (a target's, numbered) or offload that fits with this format."""

    def as_dict(self) -> dict[str, Any]:
        return {"format": self.format.label, "optimizer_moments": self.format.moments,
                "optimizer_master": self.format.master, "current": self.current,
                "refused": self.refused, "projected": self.projected,
                "per_rank": self.per_rank,
                "nvme_bytes_per_step": {"read": self.nvme_read, "write": self.nvme_write},
                "predicted_step_s": self.step_s, "fits": self.fits,
                "fits_shallower": self.shallower}


def config_format(cfg: InfinityConfig) -> StateFormat:
    """The Adam state format ``cfg`` asks for (every param group's default)."""
    return StateFormat(cfg.infinity.optimizer_moments, cfg.infinity.optimizer_master)


def with_format(cfg: InfinityConfig, fmt: StateFormat) -> InfinityConfig:
    """``cfg`` with ``fmt`` as its Adam state format."""
    return dataclasses.replace(cfg, infinity=dataclasses.replace(
        cfg.infinity, optimizer_moments=fmt.moments, optimizer_master=fmt.master))


def _compared(current: StateFormat) -> list[StateFormat]:
    formats = list(COMPARED_FORMATS)
    if current not in formats:
        formats.insert(0, current)
    return formats


def target_formats(decision: "Decision", step: "StepTime | None", base: InfinityConfig,
                   nvme_path: str | None, as_written: bool) -> tuple[FormatRow, ...]:
    """Each format at the plan's rung (the chosen one, or the deepest when none fits), and the
    shallowest rung above it that the format makes fit (none for a config as written)."""
    d = decision
    ref = d.chosen or d.rungs[-1].memory
    current = config_format(base)
    z = ref.candidate.zero
    number = rung_number(ref)
    label = d.rungs[-1].label
    path = nvme_path or z.swap_path
    rows = []
    for fmt in _compared(current):
        projected = fmt.master == "bf16"        # the devices are GPUs
        cfg = with_format(base, fmt)
        refusal = format_refusal(with_format(ref.candidate, fmt), d.stats, d.target, projected)
        if refusal is not None:
            rows.append(FormatRow(format=fmt, current=fmt == current, refused=refusal[0]))
            continue
        if fmt == current and (d.project_gpu_master or not projected):
            # the plan's own rung as planned
            memory = ref
            its_step = step or predict_step(ref, d.shape, d.target, d.workload)
        else:
            try:
                memory = try_rung(cfg, d.stats, d.shape, d.target, d.workload, label, z.stage,
                                  z.offload_param.device, z.offload_optimizer.device, path,
                                  projected).memory
            except Int8SubGroupError:
                rows.append(FormatRow(format=fmt, current=False, refused=Int8SubGroupError.short))
                continue
            its_step = predict_step(memory, d.shape, d.target, d.workload)
        links = {link.name: link.amount for link in its_step.links}
        shallower = None
        if not as_written and number is not None and number > 1:
            for i, (rung, stage, param, opt) in enumerate(RUNGS[:number - 1], 1):
                if opt == "none" and not fmt.is_default:
                    continue            # refused: formats are stepped by the CPU Adam
                if try_rung(cfg, d.stats, d.shape, d.target, d.workload, rung, stage, param, opt,
                            path, projected).fits:
                    shallower = f"rung {i}"
                    break
        rows.append(FormatRow(
            format=fmt, current=fmt == current, projected=projected,
            per_rank=dict(memory.per_tier()), nvme_read=int(links.get("NVMe read", 0)),
            nvme_write=int(links.get("NVMe write", 0)),
            step_s=its_step.predicted_s if memory.fits else None, fits=memory.fits,
            shallower=shallower))
    return tuple(rows)


def local_formats(cfg: InfinityConfig, stats: ModelStats, hw: Hardware,
                  recommend: bool) -> tuple[FormatRow, ...]:
    """Each format under ``cfg`` (the plan's config, its sizes "auto") on this machine, and
    (``recommend``) the shallower offload it makes fit."""
    current = config_format(cfg)
    base_offload = _offload(cfg)
    rows = []
    for fmt in _compared(current):
        candidate = with_format(cfg, fmt)
        refusal = state_format_refusal(candidate, place(candidate, stats, hw), not hw.has_gpu)
        if refusal is not None:
            rows.append(FormatRow(format=fmt, current=fmt == current, refused=refusal[0]))
            continue
        try:
            plan = plan_memory(candidate, stats, hw)
        except Int8SubGroupError:
            if fmt == current:
                raise       # the config's own format: the plan's error, as the engine's
            rows.append(FormatRow(format=fmt, current=False, refused=Int8SubGroupError.short))
            continue
        shallower = None
        if recommend:
            chosen = recommend_config(stats, hw, candidate)
            if _offload(chosen) != base_offload and plan_memory(chosen, stats, hw).fits:
                z = chosen.zero
                shallower = (f"stage {z.stage}, offload_param {z.offload_param.device}, "
                             f"offload_optimizer {z.offload_optimizer.device}")
        rows.append(FormatRow(
            format=fmt, current=fmt == current,
            per_rank={tier: plan.bytes(tier=tier) for tier in TIERS},
            nvme_read=plan.nvme_read_bytes_per_step, nvme_write=plan.nvme_write_bytes_per_step,
            fits=plan.fits, shallower=shallower))
    return tuple(rows)


def _offload(cfg: InfinityConfig) -> tuple[int, str, str]:
    z = cfg.zero
    return z.stage, z.offload_param.device, z.offload_optimizer.device


def render_formats(rows: tuple[FormatRow, ...], target: bool) -> list[str]:
    """The comparison as lines of text (``infinity plan``)."""
    if not rows:
        return []
    where = "this rung" if target else "this config"
    nvme = "NVMe r + w / step" + (" (node)" if target else "")
    lines = [f"Adam state formats at {where} (infinity.optimizer_moments / optimizer_master; "
             "bytes per rank; * = this plan's):",
             f"  {'format':22}{'GPU' if target else 'device':>11}{'host':>11}{'NVMe':>11}"
             f"  {nvme:<24}" + (f"{'step':>9}" if target else "") + "  fit"]
    for row in rows:
        name = f"{row.format.label}{' *' if row.current else ''}"
        if row.refused is not None:
            lines.append(f"  {name:22}not possible here: {row.refused}")
            continue
        tiers = row.per_rank or {}
        show = _tb if target else format_bytes    # a target's links are in GB, as its drives
        io = f"{show(row.nvme_read)} + {show(row.nvme_write)}" \
            if row.nvme_read or row.nvme_write else "-"
        step = "" if not target else f"{row.step_s:>8.0f}s" if row.step_s is not None \
            else f"{'-':>9}"
        fit = "ok" if row.fits else "INFEASIBLE"
        if row.projected:
            fit += " (projected: not available on GPUs yet)"
        if row.shallower:
            fit += f"; also fits at {row.shallower}"
        lines.append(f"  {name:22}" + "".join(f"{format_bytes(tiers.get(t, 0)):>11}"
                                             for t in (Tier.DEVICE, Tier.HOST, Tier.NVME))
                     + f"  {io:<24}{step}  {fit}")
    return lines


def _tb(nbytes: int) -> str:
    """Bytes in decimal units, as the drives' rates are (GB/s)."""
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB")):
        if nbytes >= div:
            return f"{nbytes / div:.2f} {unit}"
    return f"{nbytes} B"
