"""A target plan as text for people (``TargetPlan.render``): the target, the decision path line
by line, the chosen config's bytes per parameter, per rank and per node, the step time per
link, the ds_config; or "infeasible" with what to add."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from infinity.base.sizes import format_bytes
from infinity.planner.formats import render_formats
from infinity.planner.step_time import OVERLAP_FACTOR

if TYPE_CHECKING:
    from infinity.planner.target_plan import TargetPlan

__all__ = ["render_target_plan"]


def _count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.0f}"


def _amount(amount: float, unit: str) -> str:
    if unit == "FLOP":
        return f"{amount / 1e15:.2f} PFLOP"
    if unit == "param":
        return f"{_count(amount)} params"
    return f"{amount / 1e9:,.1f} GB"


def render_target_plan(plan: "TargetPlan") -> str:
    d = plan.decision
    t, s, sh, w = d.target, d.stats, d.shape, d.workload
    gpu = t.gpu
    nvlink = f", NVLink {gpu.nvlink_GBps:g} GB/s" if gpu.nvlink_GBps else ", no NVLink"
    nvme = (f"NVMe {format_bytes(t.nvme_bytes)} ({t.nvme_drives} drive{'s' * (t.nvme_drives > 1)}, "
            f"read {t.nvme_read_GBps:g} / write {t.nvme_write_GBps:g} GB/s)") if t.nvme_bytes else "no NVMe"
    lines = [
        f"model     {_count(s.total_params)} params ({_count(s.trainable_params)} trainable), "
        f"{s.n_units} units, largest unit {_count(s.largest_unit_params)}; width {sh.hidden}, "
        f"MLP {sh.intermediate}, {sh.layers} layers, vocabulary {sh.vocab}"
        + (" (estimated)" if sh.estimated else ""),
        f"target    {t.nodes} node{'s' * (t.nodes > 1)} x {t.gpus_per_node} {gpu.name} "
        f"({format_bytes(gpu.memory_bytes)}, {gpu.peak_tflops:g} TFLOPS {gpu.dtype}, PCIe "
        f"{gpu.pcie_GBps:g} GB/s{nvlink}) = world size {t.world_size}; per node "
        f"{format_bytes(t.host_memory_bytes)} host memory, {t.cpu_cores} cores, {nvme}"
        + (f", network {t.net_GBps:g} GB/s" if t.nodes > 1 else ""),
        f"workload  {w.seq_len} tokens x micro-batch {w.micro_batch} x accumulation "
        f"{w.gradient_accumulation_steps} per GPU per step, activation checkpointing "
        f"{w.activation_checkpointing}",
        "",
        "decision path (shallowest first; bytes per GPU and per node):",
    ]
    for i, rung in enumerate(d.rungs, 1):
        lines.append(f"  {i}. {rung.label}: {rung.why()}")
    ref = plan.reference
    if plan.chosen is None:
        lines += ["", f"INFEASIBLE: no rung fits this target (the deepest, {d.rungs[-1].label}, "
                      "is over as said above). What would make it fit, one change at a time:"]
        lines += [f"  - {a}" for a in d.additions] or ["  - nothing tried did (more GPUs, host "
                                                      "memory, NVMe, GPU memory up to 16x)"]
    elif plan.projection:
        lines += ["", f"projected (a bf16 master is not available on GPUs yet): "
                      f"{d.rungs[-1].label}"]
    else:
        lines += ["", f"recommended: {d.rungs[-1].label}"]
    per = ref.bytes_per_param()
    kept = "fp32 gradients" if per["grads"] else "no gradient home: the early step"
    params = "16-bit params" if not ref.placement.single_copy else \
        f"{ref.placement.compute_dtype} params, also the master"
    lines += [
        "",
        f"model states  {sum(per.values()):g} B/param stored = {per['params']} ({params}) + "
        f"{per['optimizer_states']:g} ({ref.states_note()}) + {per['grads']} ({kept}); the "
        f"paper's 16 = 2 + 2 + 12: {format_bytes(ref.model_states_bytes)} for the model",
        f"per GPU       device {format_bytes(ref.device_total)} of {format_bytes(t.device_budget_bytes)}: "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in ref.device.items()),
        f"per rank      host {format_bytes(ref.host_total)}: "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in ref.host.items())
        + f"; NVMe {format_bytes(ref.nvme)}",
        f"per node      host {format_bytes(ref.node_host)} of {format_bytes(t.host_memory_bytes)}; "
        f"NVMe {format_bytes(ref.node_nvme)} of {format_bytes(t.nvme_bytes)}",
    ]
    es = ref.engine
    slots = (f"; fetch slots {es.fetch_slots} x {format_bytes(es.fetch_slot_bytes)}"
             if ref.placement.param_tier == "nvme" else "")
    grads = "no gradient home" if ref.placement.early_step else f"gradients on {es.grad_tier}"
    lines.append(f"sizes         sub-group {es.sub_group_numel:,} elements{slots}; prefetch "
                 f"{ref.derived.prefetch_bucket_size:,} elements; {grads}")
    if plan.step is not None:
        st = plan.step
        lines += ["", f"step time (one optimizer step: {w.tokens_per_step:,} tokens per GPU)",
                  f"  {'link':24}{'per':>6}{'amount':>18}{'seconds':>11}  note"]
        for link in st.links:
            mark = " <- bottleneck" if link.name == st.bottleneck else ""
            lines.append(f"  {link.name:24}{link.per:>6}{_amount(link.amount, link.unit):>18}"
                         f"{link.seconds:>11.2f}  {link.note}{mark}")
        lines.append(f"  bound {st.bound_s:.2f} s ({st.bottleneck}) x {OVERLAP_FACTOR} (the engine's "
                     f"measured overlap) = predicted {st.predicted_s:.2f} s/step; "
                     f"{st.tokens_per_s:,.0f} tokens/s; {st.tflops_per_gpu:.1f} TFLOPS per GPU "
                     f"({st.tflops_per_gpu / gpu.peak_tflops:.1%} of peak)")
    if plan.formats:
        lines += [""] + render_formats(plan.formats, target=True)
    lines += [f"note: {n}" for n in plan.notes]
    cfg = plan.ds_config()
    if cfg:
        lines += ["", "ds_config (copy into your ds_config.json):", json.dumps(cfg, indent=2)]
    return "\n".join(lines)
