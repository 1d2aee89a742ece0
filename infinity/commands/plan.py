"""``infinity plan``: predict memory per tier, and the settings, for a model on this machine.

    infinity plan --model-size 7B [--config ds.json] [--host-budget 16GiB] [--nvme-path /mnt/nvme]
    infinity plan --hf-config config.json --json
    infinity plan --params 3e9 --layers 26
    infinity plan --params 1T --gpus 8 --gpu H100 --nvme 4x7TB --optimizer-moments int8

Without --config the shallowest offload that fits is chosen (``planner.recommend_config``); with
it, that config is planned as written (its "auto" values taking defaults, as for layout only).
``--optimizer-moments`` / ``--optimizer-master`` set the Adam state formats (the config's
``infinity.optimizer_moments`` / ``optimizer_master``); either way the plan lists what each
format would change beside it (``planner.formats``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from infinity.base.sizes import parse_bytes
from infinity.commands.plan_target import add_target_arguments, target_from_args
from infinity.config import InfinityConfig
from infinity.engine.guards import unusable_swap_paths
from infinity.planner.formats import local_formats, render_formats, with_format
from infinity.planner.inputs import (
    ModelStats,
    detect_hardware,
    llama_stats,
    nearest_existing,
    shape_stats,
)
from infinity.planner.plan import DEFAULT_SWAP_DIR, plan_memory, recommend_config
from infinity.planner.state_format import MASTER_FORMATS, MOMENTS_FORMATS, StateFormat
from infinity.planner.shape import (
    ModelShape,
    config_int,
    estimated_shape,
    shape_from_hf_config,
    shape_from_llama_kwargs,
)
from infinity.planner.target_plan import plan_target
from infinity.train.models import preset_kwargs, preset_names
from infinity.train.run_config import read_config_file

INFEASIBLE_EXIT = 1
"""``infinity plan``'s exit status when nothing fits (the plan and what to add printed all the
same), so that ``infinity plan ... && infinity train ...`` stops there; 2 is bad input."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "gpt2", "org/name"
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def _param_count(text: str) -> int:
    match = _COUNT.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a parameter count; write e.g. 7e9 or 7B")
    count = int(float(match.group(1)) * _SUFFIX[match.group(2).lower()])
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is {count} parameters: a model has at least one")
    if count > MAX_PARAMS:
        # the shape's depth grows with the count (and a plan lists every unit): 1e30 ran for
        # minutes without an answer
        raise argparse.ArgumentTypeError(f"{text!r} is {count:.3g} parameters, over the "
                                         f"{MAX_PARAMS:.0e} this planner plans for")
    return count


MAX_PARAMS = 10**15
"""The largest ``--params``: a quadrillion, 1000x the 1T ZeRO-Infinity planned on one node."""
SHAPE_TOLERANCE = 0.10
"""How far the count of the shape planned for ``--params`` may be from it: the widths step by
128 (and the depth may be given), so a toy count or a very deep narrow one cannot be met."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-size", choices=preset_names(),
                       help="the model `infinity train --model-size` builds (a Llama preset with "
                            "its byte vocabulary); for another vocabulary use --hf-config or "
                            "--params")
    model.add_argument("--hf-config", metavar="CONFIG_JSON",
                       help="a Hugging Face config.json (model built on the meta device: needs transformers)")
    model.add_argument("--params", type=_param_count, metavar="N",
                       help="a parameter count (7e9, 7B), planned as a Llama of the depth and "
                            "width published models of that size have (GPT-3, Llama, "
                            "ZeRO-Infinity's 1T: 128 layers)")
    parser.add_argument("--layers", type=int, default=None,
                        help="with --params: the depth (default: from published models of the "
                             "count); the width follows from the count")
    parser.add_argument("--config", metavar="DS_JSON", help="plan this ds_config.json instead of recommending one")
    parser.add_argument("--host-budget", help="host memory budget, e.g. 16GiB (default 80%% of MemAvailable)")
    parser.add_argument("--device-budget", help="device memory budget, e.g. 20GiB")
    parser.add_argument("--nvme-path", help="swap directory (free space is checked there)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks sharing the model states (default 1; with target flags "
                             "--gpus x --nodes)")
    parser.add_argument("--optimizer-moments", choices=MOMENTS_FORMATS,
                        help="storage of Adam's m and v: fp32 (8 B/param), bf16 (4) or int8 "
                             "(2, blockwise, scales in host memory); sets the config's "
                             "infinity.optimizer_moments (default: the config's, fp32)")
    parser.add_argument("--optimizer-master", choices=MASTER_FORMATS,
                        help="the master weights: fp32 (4 B/param), or bf16 (the bf16 parameter "
                             "is the master: needs bf16 compute on a CPU device; on GPUs "
                             "planned as a projection); sets infinity.optimizer_master")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--dry-run", action="store_true",
                        help="also run the engine's own units and coordinator over the model "
                             "built on the meta device, byte-free, on a simulated clock: the "
                             "fetch/prefetch/release order, peak bytes per tier, I/O per step, "
                             "the simulated step time (needs --hf-config or --model-size)")
    parser.add_argument("--trace", metavar="FILE.json",
                        help="with --dry-run: write its timeline (compute, waits, "
                             "host-to-device and device-to-host copies, NVMe, CPU Adam, "
                             "collectives: one row each) as a Chrome trace-event file "
                             "(open it in https://ui.perfetto.dev or chrome://tracing)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="with --dry-run: draw the last step's timeline (needs matplotlib)")
    add_target_arguments(parser)


def _stats(args: argparse.Namespace, unit_modules: tuple[str, ...] | None) -> tuple[ModelStats, ModelShape]:
    if args.layers is not None and args.params is None:
        raise ValueError("--layers goes with --params (the model of --model-size or --hf-config "
                         "has its own layers)")
    if args.model_size:
        # what `infinity train --model-size` builds, not the 32000-vocabulary shape of the name
        # (the two differed: plan's 85M was another model than the demo's)
        kwargs = preset_kwargs(args.model_size, seq_len=0)
        return llama_stats(kwargs), shape_from_llama_kwargs(kwargs)
    if args.params is not None:
        if args.layers is not None and args.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {args.layers}")
        # depth and width of published models at this count, unless --layers is given; planned
        # parameter by parameter, so a block too large to fetch can be split as for a config
        shape = estimated_shape(args.params, args.layers)
        stats = shape_stats(shape)
        if abs(stats.total_params - args.params) > SHAPE_TOLERANCE * args.params:
            depth = f"{shape.layers} layer{'s' if shape.layers > 1 else ''}" + \
                (" (--layers)" if args.layers else "")
            raise ValueError(
                f"--params {args.params:,}: the Llama shape planned for it ({depth}, hidden "
                f"{shape.hidden}, intermediate {shape.intermediate}, vocabulary {shape.vocab}) "
                f"has {stats.total_params:,} parameters, more than {SHAPE_TOLERANCE:.0%} off "
                "(the widths step by 128): "
                + ("give fewer --layers, or none (the depth of published models of the count)"
                   if args.layers else "give a larger count, or the model itself (--hf-config)"))
        return stats, shape
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ValueError(f"--hf-config needs transformers ({exc}); use --params or --model-size") from None
    hf_config = _hf_config(args.hf_config, transformers)
    from infinity.train.models import causal_lm_from_config

    with torch.device("meta"):
        model = causal_lm_from_config(hf_config)
    stats = ModelStats.from_module(model, unit_modules)
    layers = max(1, stats.n_units - 2)
    return stats, shape_from_hf_config(hf_config) or estimated_shape(stats.total_params, layers)


def _hf_config(arg: str, transformers: Any) -> Any:
    """A local config.json (or its directory), else a Hugging Face hub model id such as "org/name".

    Anything that looks like a path (ends in .json, starts with / . ~, or has more than one
    separator) is read locally only: a missing file is said to be missing instead of being
    looked up on the hub (minutes of retries offline), and a bad one is named with its parse
    error (``infinity.train.models.read_hf_config``, shared with ``infinity train``).
    """
    from infinity.train.models import read_hf_config

    path = Path(arg).expanduser()
    if path.exists() or arg.endswith(".json") or not _HUB_ID.match(arg):
        return read_hf_config(path)[0]
    try:
        return transformers.AutoConfig.from_pretrained(arg, local_files_only=True)  # the cache
    except (OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("0", "", "false", "no"):
        print(f"infinity plan: looking {arg} up on the Hugging Face hub (offline, transformers "
              "retries for a while; HF_HUB_OFFLINE=1 fails at once)", file=sys.stderr)
    try:
        return transformers.AutoConfig.from_pretrained(arg)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"--hf-config {arg}: no such local file or directory, and transformers "
                         f"cannot load it as a Hugging Face hub model id ({first}); pass the path "
                         "of a config.json") from None


def _missing_nvme_notes(cfg: InfinityConfig) -> tuple[str, ...]:
    """A note per NVMe nvme_path that does not exist (yet): the plan still sizes everything (its
    free space is that of the nearest existing directory, see ``detect_hardware``), but a run
    fails on it, since ``infinity train`` does not create the swap path."""
    notes = []
    sections = (cfg.zero.offload_param, cfg.zero.offload_optimizer)
    for path in dict.fromkeys(s.nvme_path for s in sections if s.device == "nvme" and s.nvme_path):
        if Path(path).exists():
            continue
        notes.append(f"nvme_path {path} does not exist yet: the free space shown is that of "
                     f"{nearest_existing(path)}; create it (mkdir -p {path}) before training, infinity train "
                     "does not")
    return tuple(notes)


def _config_file(args: argparse.Namespace) -> dict:
    """``--config``'s dict with ``--nvme-path`` in its NVMe sections before it is read (read
    first, a config with ``offload_activations: "nvme"`` and no path of its own was refused at
    the config, though the flag gave one, as infinity train's does)."""
    raw = read_config_file(args.config)
    zero = raw.get("zero_optimization")
    if args.nvme_path and isinstance(zero, dict):
        for name in ("offload_optimizer", "offload_param"):
            section = zero.get(name)
            if isinstance(section, dict) and section.get("device") == "nvme":
                section["nvme_path"] = args.nvme_path
    return raw


def _with_format_flags(args: argparse.Namespace, cfg: InfinityConfig) -> InfinityConfig:
    """``cfg`` with the Adam state formats --optimizer-moments / --optimizer-master give."""
    moments = args.optimizer_moments or cfg.infinity.optimizer_moments
    master = args.optimizer_master or cfg.infinity.optimizer_master
    return with_format(cfg, StateFormat(moments, master))


def _run_target(args: argparse.Namespace, target: Any, workload: Any) -> int:
    """Plan for the target machine the flags describe (``infinity.planner.target_plan``)."""
    if args.host_budget or args.device_budget:
        raise ValueError("--host-budget and --device-budget are this machine's budgets: for a "
                         "target give --host-memory (per node) and --gpu-memory")
    base = (InfinityConfig.load(_config_file(args), world_size=target.world_size,
                                auto_defaults=True) if args.config
            else InfinityConfig(world_size=target.world_size))
    base = _with_format_flags(args, base)
    stats, shape = _stats(args, base.infinity.unit_modules)
    plan = plan_target(stats, shape, target, workload, base, args.nvme_path,
                       as_written=bool(args.config))
    report = None
    if args.dry_run and plan.chosen is not None:
        from infinity.commands.dry_run import dry_run, target_setup

        setup, rates = target_setup(plan.chosen, target, workload)
        report = dry_run(_meta_model(args), setup, rates, seq_len=workload.seq_len,
                         micro_batch=workload.micro_batch, shape=shape,
                         analytical_s=plan.step.predicted_s if plan.step else None,
                         accumulate=workload.gradient_accumulation_steps)
        _timeline_files(args, report)
    if args.json:
        data = plan.as_dict()
        if args.dry_run:
            data["dry_run"] = report.as_dict() if report is not None else None
        print(json.dumps(data, indent=2))
    else:
        print("infinity plan: for the target machine described (not this one)")
        print(plan.render())
        if report is not None:
            print(report.render())
        elif args.dry_run:
            print("dry run: none (the plan is infeasible)")
    return 0 if plan.decision.feasible else INFEASIBLE_EXIT


def _timeline_files(args: argparse.Namespace, report: Any) -> None:
    """--trace / --plot: the dry run's timeline, written where asked (the paths are noted)."""
    from infinity.commands.dry_run_trace import plot_timeline, write_trace

    if args.trace:
        write_trace(report, args.trace)
        report.notes.append(f"timeline written to {args.trace} (Chrome trace: "
                            "https://ui.perfetto.dev)")
    if args.plot:
        plot_timeline(report, args.plot)
        report.notes.append(f"last step's timeline drawn in {args.plot}")


def _meta_model(args: argparse.Namespace) -> Any:
    """The model of --hf-config or --model-size on the meta device (--dry-run)."""
    if args.params is not None:
        raise ValueError("--dry-run runs the model's own modules: give it as --hf-config or "
                         "--model-size, not --params")
    import torch
    import transformers

    if args.hf_config:
        config = _hf_config(args.hf_config, transformers)
    else:
        from infinity.train.models import preset_config

        config = preset_config(args.model_size, seq_len=0)
    from infinity.train.models import causal_lm_from_config

    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return causal_lm_from_config(config)


def run(args: argparse.Namespace) -> int:
    if (args.trace or args.plot) and not args.dry_run:
        raise ValueError(f"{'--trace' if args.trace else '--plot'} draws the dry run's timeline: "
                         "add --dry-run (with --hf-config or --model-size)")
    if args.dry_run and args.params is not None:
        _meta_model(args)           # refused before any planning: --dry-run needs the modules
    from infinity.train.metrics import check_plot_path, check_writable

    # before the dry run, not after it (a picture matplotlib cannot write was refused after
    # the trace was written)
    if args.trace:
        check_writable(Path(args.trace), "--trace", example="step.json")
    if args.plot:
        check_plot_path(Path(args.plot), example="step.png")
    described = target_from_args(args)
    if described is not None:
        return _run_target(args, *described)
    args.world_size = 1 if args.world_size is None else args.world_size
    if args.dry_run and args.world_size != 1:
        raise ValueError(f"--dry-run on this machine runs one rank, and --world-size is "
                         f"{args.world_size}: drop --world-size for the dry run, or describe "
                         "the machines (--gpus N, --nodes M ...) to dry-run several ranks")
    budgets = {}
    if args.host_budget:
        budgets["host_memory_budget"] = parse_bytes(args.host_budget, "--host-budget")
    if args.device_budget:
        budgets["device_memory_budget"] = parse_bytes(args.device_budget, "--device-budget")
    if args.config:
        base = InfinityConfig.load(_config_file(args), world_size=args.world_size,
                                   auto_defaults=True)
    else:
        base = InfinityConfig(world_size=args.world_size)
    base = dataclasses.replace(base, infinity=dataclasses.replace(base.infinity, **budgets))
    base = _with_format_flags(args, base)
    if args.nvme_path:
        z = base.zero
        base = dataclasses.replace(base, zero=dataclasses.replace(z, **{
            name: dataclasses.replace(section, nvme_path=args.nvme_path)
            for name, section in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param))
            if section.device == "nvme"}))
    stats, shape = _stats(args, base.infinity.unit_modules)
    nvme_path = args.nvme_path or base.zero.swap_path     # the path the engine's swap space takes
    hw = detect_hardware(nvme_path or (None if args.config else DEFAULT_SWAP_DIR))
    cfg = base if args.config else recommend_config(stats, hw, base, nvme_path)
    plan = plan_memory(cfg, stats, hw)
    report = None
    if args.dry_run and plan.fits:      # an infeasible plan has no engine to run
        from infinity.commands.dry_run import dry_run, local_analytical_s, local_setup
        from infinity.planner.target import Workload

        model = _meta_model(args)
        workload = Workload()
        # the default sequence, or the model's longest (GPT-2, BERT: 512), which it can run
        longest = config_int(getattr(model, "config", None), "max_position_embeddings",
                             "n_positions")
        if longest is not None and longest < workload.seq_len:
            workload = dataclasses.replace(workload, seq_len=longest)
        setup, rates = local_setup(cfg, stats, hw, shape,   # as the engine would size it
                                   workload.seq_len * workload.micro_batch)
        report = dry_run(model, setup, rates, seq_len=workload.seq_len,
                         micro_batch=workload.micro_batch, shape=shape,
                         analytical_s=local_analytical_s(cfg, stats, shape, hw, rates,
                                                         workload))
        report.notes.append(f"this machine's rates: {rates.compute_flops_per_s / 1e9:.0f} GFLOP/s "
                            f"in {setup.plan.compute_dtype} (measured now), NVMe "
                            f"{rates.nvme_read_GBps:g} GB/s and CPU Adam assumed (infinity "
                            f"nvme-tune measures the disk); sequence {workload.seq_len}, "
                            f"micro-batch {workload.micro_batch}")
        _timeline_files(args, report)
    missing = _missing_nvme_notes(plan.config)
    unusable = unusable_swap_paths(plan.config)
    if missing or unusable:
        plan = dataclasses.replace(plan, notes=plan.notes + missing,
                                   warnings=plan.warnings + unusable)
    # no candidate fits: the deepest one is shown as the reason, never as a recommendation
    infeasible = not args.config and not plan.fits
    formats = local_formats(cfg, stats, hw, recommend=not args.config)
    if args.json:
        extra = {"dry_run": report.as_dict()} if report is not None else {}
        print(json.dumps({"recommended": not args.config and not infeasible,
                          "feasible": plan.fits, **plan.as_dict(),
                          "formats": [row.as_dict() for row in formats], **extra}, indent=2))
        return 0 if plan.fits else INFEASIBLE_EXIT
    if infeasible:
        print("infinity plan: INFEASIBLE on this machine: no offload fits (the deepest, stage 3 "
              "with parameters and optimizer states on NVMe, is planned below with what is over)")
        print(plan.render())
        print("\n" + "\n".join(render_formats(formats, target=False)))
        print("\nno ds_config is recommended; what to add is in the warnings above")
    else:
        source = f"config {args.config}" if args.config else "recommended config (no --config given)"
        print(f"infinity plan: {source}")
        print(plan.render())
        print("\n" + "\n".join(render_formats(formats, target=False)))
        if not args.config:
            uses_nvme = "nvme" in (cfg.zero.offload_param.device, cfg.zero.offload_optimizer.device)
            if uses_nvme and not nvme_path:
                print(f"note: swap files planned in {DEFAULT_SWAP_DIR}; pass --nvme-path for a faster disk")
            print("\nds_config (copy into your ds_config.json):")
            print(json.dumps({k: plan.ds_config[k] for k in ("zero_optimization", "infinity")},
                             indent=2))
    if report is not None:
        print()
        print(report.render())
    elif args.dry_run:
        print("\ndry run: none (the plan is infeasible)")
    return 0 if plan.fits else INFEASIBLE_EXIT
