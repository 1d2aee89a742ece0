"""The training run behind ``infinity train``: data, model, engine, steps, metrics, clean-up.

Why apart from the CLI: tests and tools call ``run_training`` directly, and the command module
stays a thin argument parser. Everything that can fail on user input (data file, model config,
ds_config, swap path, metrics path) is checked before the model is built, so a bad run fails in
a second with one line and leaves nothing behind. The engine is closed in ``finally`` (which
removes its swap directory), also on Ctrl-C.

Under ``torchrun --nproc_per_node N`` every rank runs this same function: each trains on its own
micro-batches ([Note: batches over ranks] in data.py), the loss of a step is the mean over all
ranks' micro-batches, and only rank 0 writes the progress, the summary, ``--metrics`` and
``--plot`` (other ranks log warnings and errors only, see infinity.base.log). The torch baseline
is one process and is refused under a launcher of several ranks.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import torch

from infinity.base.budget import BudgetExceededError
from infinity.base.interrupts import StopSignals
from infinity.checkpoint.sharded_writer import carry_files
from infinity.checkpoint.weights_dir import MODEL_TEXTS
from infinity.base.log import get_logger
from infinity.base.sizes import format_bytes
from infinity.comm.group import env_world_size
from infinity.planner.inputs import local_world_size, nearest_existing
from infinity.train import data as data_mod
from infinity.train import host_budget, models
from infinity.train.baseline import TorchBaselineEngine
from infinity.train.checkpoints import RunCheckpoints
from infinity.train.defaults import DEFAULT_FINETUNE_LR, DEFAULT_SEQ_LEN, DEFAULT_STEPS
from infinity.train.metrics import (MetricsWriter, StepRecord, Summary, check_plot_path,
                                    check_writable, plot_available, render_summary, summarize,
                                    write_plot, write_probe)
from infinity.train.progress import ProgressBar
from infinity.train.run_config import (Overrides, build_ds_config, demo_config, nvme_paths,
                                       read_config_file)

_log = get_logger("train")

EngineKind = Literal["infinity", "torch"]
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, gradient and two Adam moments: what a run must hold somewhere, per parameter."""


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """One run of ``infinity train`` (the command-line flags, typed)."""

    engine: EngineKind = "infinity"
    """"infinity" (the out-of-core engine) or "torch" (the in-memory baseline)."""
    config: str | None = None
    """ds_config.json; None = the demo config (stage 3, params and optimizer on NVMe)."""
    model_size: str | None = None
    """A preset name (see infinity.train.models); None = the demo's 85M."""
    hf_config: str | None = None
    """A transformers config.json of any causal LM (instead of a preset)."""
    pretrained: str | None = None
    """A transformers model directory to fine-tune (its weights; its tokenizer when it has one,
    else bytes), instead of a random init."""
    export: str | None = None
    """Write the trained model here at the end, as a directory ``from_pretrained`` loads."""
    data: str | None = None
    """Plain text or JSON lines with "text"; None = the shipped public-domain corpus."""
    steps: int = DEFAULT_STEPS
    """Optimizer steps."""
    seq_len: int = DEFAULT_SEQ_LEN
    """Tokens (bytes) per sample."""
    micro_batch: int | None = None
    """Samples per forward; None = the config's train_micro_batch_size_per_gpu."""
    nvme_path: str | None = None
    """Parent directory of the swap directory; None = the config's, else /var/tmp."""
    host_budget: str | None = None
    """Host memory budget; None = the config's (the demo: 512MiB)."""
    lr: float | None = None
    """Peak learning rate; None = the config's."""
    optimizer_moments: str | None = None
    """infinity.optimizer_moments (fp32, bf16, int8); None = the config's."""
    optimizer_master: str | None = None
    """infinity.optimizer_master (fp32, bf16); None = the config's."""
    seed: int = 0
    """Seeds the model's initialisation and the batches."""
    metrics: str | None = None
    """Write one JSON line per step here."""
    plot: str | None = None
    """Write a PNG of the loss and the step-time split here (needs matplotlib)."""
    progress_every: int | None = None
    """Off a terminal, print a progress line every this many steps (None: about 20 lines)."""
    save_dir: str | None = None
    """Write checkpoints here (after the last step, and every ``save_interval`` steps)."""
    save_interval: int | None = None
    """Optimizer steps between checkpoints; None = only after the last step."""
    resume: bool = False
    """Continue from the latest checkpoint in ``save_dir`` (start fresh when there is none)."""


@dataclass
class TrainResult:
    """What a run did."""

    records: list[StepRecord]
    summary: Summary | None
    """None when no step was left to take (a finished run resumed)."""
    n_params: int
    swap_dirs: list[str] = field(default_factory=list)
    """The engine's swap directories seen during the run (all removed at the end)."""
    plot: str | None = None
    init_s: float = 0.0
    """Model construction and engine initialisation."""
    wall_s: float = 0.0
    """Whole run, from start to clean-up."""


def run_training(opts: TrainOptions, *, stream: IO[str] | None = None,
                 out: IO[str] | None = None) -> TrainResult:
    """Run ``opts``; the progress goes to ``stream`` (stderr), the summary table to ``out`` (stdout)."""
    started = time.perf_counter()
    stream = stream if stream is not None else sys.stderr
    out = out if out is not None else sys.stdout
    if opts.engine not in ("infinity", "torch"):
        raise ValueError(f"--engine {opts.engine!r}: expected 'infinity' or 'torch'")
    if opts.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {opts.steps}")
    if opts.progress_every is not None and opts.progress_every < 1:
        raise ValueError(f"--progress-every must be at least 1, got {opts.progress_every}")
    if not 0 <= opts.seed < 2**63:        # what torch's generators take, whatever the sign
        raise ValueError(f"--seed must be from 0 to 2**63 - 1, got {opts.seed}")
    rank, world = _launch_ranks()
    if opts.engine == "torch" and world > 1:
        raise ValueError(f"--engine torch is the single-process baseline and this run has "
                         f"{world} ranks (WORLD_SIZE={world}): run it without torchrun, with "
                         "the same global batch (--config with train_batch_size, or a "
                         "gradient_accumulation_steps of N times)")
    first = rank == 0

    # 1. Everything that reads user input, before any big allocation; the cheap checks first
    # (no transformers import), so that bad input fails in a moment.
    if opts.pretrained and (opts.model_size or opts.hf_config):
        raise ValueError("--pretrained and --model-size/--hf-config both given: the model is "
                         "the pretrained one; pass one of them")
    tokenizer = models.load_tokenizer(opts.pretrained) if opts.pretrained else None
    corpus = data_mod.load_corpus(opts.data, tokenizer)
    base = read_config_file(opts.config) if opts.config else demo_config()
    # a fine-tune of the demo config starts from a gentler rate than a random init
    lr = opts.lr if opts.lr is not None or not opts.pretrained or opts.config else \
        DEFAULT_FINETUNE_LR
    ds, config = build_ds_config(base, Overrides(
        micro_batch=opts.micro_batch, lr=lr, nvme_path=opts.nvme_path,
        host_budget=opts.host_budget, steps=opts.steps, optimizer_moments=opts.optimizer_moments,
        optimizer_master=opts.optimizer_master), world_size=world)
    sampler = data_mod.BatchSampler(corpus, opts.seq_len, config.train_micro_batch_size_per_gpu,
                                    opts.seed, rank=rank, world_size=world)
    swap_parents = nvme_paths(ds) if opts.engine == "infinity" else []
    for parent in swap_parents:
        _preflight(parent, direct_io=config.aio.backend != "mmap")
    # the run's outputs are rank 0's (the other ranks' paths need not exist on their nodes)
    writer = MetricsWriter(opts.metrics, append=opts.resume) if opts.metrics and first else None
    plot_path = _plot_path(opts) if first else None
    _refuse_outputs_over_inputs(opts, plot_path)
    if opts.export and first:
        _check_export_dir(Path(opts.export))
    checkpoints = RunCheckpoints.from_options(opts.save_dir, opts.save_interval, opts.resume,
                                              opts.engine, schedule=ds.get("scheduler"))
    model_config = models.pretrained_config(opts.pretrained, opts.seq_len, tokenizer) \
        if opts.pretrained else models.model_config(opts.model_size, opts.hf_config, opts.seq_len)
    stats = models.model_stats(model_config, config.infinity.unit_modules)
    n_params = stats.total_params
    budget_text = host_budget.describe_budget(
        _lookup_budget(ds), opts.host_budget, opts.config)
    if opts.engine == "infinity":
        host_budget.check_host_budget(config, stats, budget_text)
        config = host_budget.keep_activations(config, ds, stats, model_config, opts.seq_len)
    states, swap_need = (host_budget.state_bytes(config, stats) if opts.engine == "infinity"
                         else (STATE_BYTES_PER_PARAM * n_params, 0))
    # every rank of this node swaps to the same disk (the plan's bytes are one rank's)
    swap_need *= local_world_size()     # as the launcher says ("" crashed)
    for parent in swap_parents:
        _check_space(parent, swap_need)
    checkpoints.check_room(n_params)
    if rank == 0:       # the one writer of a save (checkpoint/writer_lock.py)
        checkpoints.check_lock()

    accum = config.gradient_accumulation_steps
    tokens_per_step = sampler.tokens_per_batch * accum * world   # all ranks' together
    _log.info("model: %s%s", models.describe(model_config, n_params),
              f", pretrained from {opts.pretrained}" if opts.pretrained else "")
    if opts.pretrained:
        _log.info("tokens: %s", f"the tokenizer of {opts.pretrained}" if tokenizer is not None
                  else "bytes (the pretrained directory has no tokenizer)")
    _log.info("data: %s (%s tokens, %d document%s); %d steps of %d tokens (%d micro-batch%s of "
              "%d x %d%s)", corpus.source, f"{corpus.tokens.numel():,}", corpus.documents,
              "" if corpus.documents == 1 else "s", opts.steps, tokens_per_step, accum,
              "" if accum == 1 else "es", config.train_micro_batch_size_per_gpu, opts.seq_len,
              f" on each of {world} ranks" if world > 1 else "")
    _log_placement(opts.engine, config, states, swap_parents)

    records: list[StepRecord] = []
    engine: Any = None
    bar = ProgressBar(opts.steps, stream=stream, every=opts.progress_every) if first else None
    swap_dirs: list[str] = []
    init_s = 0.0
    # SIGTERM unwinds like Ctrl-C; a signal dropped inside a finalizer is raised again after
    # the micro-batch ([Note: a signal raised inside a finalizer] in base/interrupts.py)
    stop = StopSignals().install()
    try:
        # 2. Model and engine.
        init_start = time.perf_counter()
        torch.manual_seed(opts.seed)    # the same on every rank: the shards form one model
        try:
            engine = _make_engine(opts.engine, model_config, ds, config, opts.pretrained)
        except BudgetExceededError as exc:
            if "of host memory" not in str(exc) or config.infinity.host_memory_budget is None:
                raise
            raise host_budget.explain(exc, budget_text) from None
        engine.train()
        init_s = time.perf_counter() - init_start
        swap_dirs = _our_swap_dirs(swap_parents)
        _log.info("%s engine ready in %.1f s%s", opts.engine, init_s,
                  f"; swap directory {', '.join(swap_dirs)}" if swap_dirs else "")

        # 3. Steps (a resumed run continues where its checkpoint stopped).
        # the data by its bytes, not its path (the same file named two ways was refused, and
        # another file under the same name resumed silently)
        identity = {"seed": opts.seed, "data_sha256": corpus.digest, "seq_len": opts.seq_len,
                    "micro_batch": sampler.micro_batch}
        if world > 1:
            _check_same_run(identity, engine.comm.all_gather_objects(identity))
        done = checkpoints.resume_into(engine, sampler, identity, opts.steps, corpus.source)
        # infinity's engine logs wall_clock_breakdown itself (engine/monitor.py)
        timers = _PhaseTimers(config.wall_clock_breakdown and opts.engine == "torch",
                              config.steps_per_print)
        for step in range(done + 1, opts.steps + 1):
            lr = engine.get_lr()[0]
            losses = []
            for _ in range(accum):
                # the engine's device: on a GPU the model computes there, the sampler's batches
                # are on the CPU (a no-op on a CPU device)
                batch = sampler.next_batch().to(engine.device)
                with timers.phase("forward"):
                    output = engine(input_ids=batch, labels=batch)
                loss = output.loss if hasattr(output, "loss") else output[0]
                with timers.phase("backward"):
                    engine.backward(loss)
                with timers.phase("step"):
                    engine.step()
                losses.append(float(loss.detach()))
                stop.check()
            mean_loss = _mean_over_ranks(losses, engine, world)
            if not math.isfinite(mean_loss):
                raise FloatingPointError(f"loss is {mean_loss} at step {step}; lower --lr "
                                         f"(now {lr:g}) or add gradient_clipping to the config")
            record = StepRecord.from_stats(step, mean_loss, lr, tokens_per_step, engine.step_stats())
            records.append(record)
            if writer is not None:
                writer.write(record)
            if bar is not None:
                bar.update(record)
            timers.log(step)
            checkpoints.after_step(engine, step, opts.steps, sampler, identity)
        if opts.export:
            _export(engine, opts.export, opts.pretrained)
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
        if engine is not None:
            engine.close()
        left = _our_swap_dirs(swap_parents)
        if left:
            _log.warning("swap directories left behind after close: %s; remove them with "
                         "`infinity clean`", ", ".join(left))
        elif swap_dirs:
            _log.info("removed swap directory %s", ", ".join(swap_dirs))

    summary = summarize(records) if records else None
    wall_s = time.perf_counter() - started
    if first and summary is not None:
        ranks_text = f", {world} ranks" if world > 1 else ""
        tuned = f"fine-tune of {opts.pretrained}, " if opts.pretrained else ""
        out.write(render_summary(summary, f"infinity train ({opts.engine} engine, {tuned}"
                                          f"{n_params / 1e6:.2f}M params{ranks_text}): "
                                          f"{wall_s:.1f} s in all, {init_s:.1f} s to set up")
                  + "\n")
        out.flush()
    written_plot = None
    if plot_path is not None and records:
        written_plot = str(write_plot(records, plot_path))
    return TrainResult(records=records, summary=summary, n_params=n_params, swap_dirs=swap_dirs,
                       plot=written_plot, init_s=init_s, wall_s=wall_s)


def _launch_ranks() -> tuple[int, int]:
    """(rank, world size) of this process: the process group's when one is initialised, else
    the launcher's environment (``torchrun`` sets RANK and WORLD_SIZE; the engine joins the
    group from them), else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = env_world_size()
    raw = os.environ.get("RANK", "0").strip() or "0"
    if not raw.isdigit() or int(raw) >= world:
        raise ValueError(f"RANK={raw!r} in the environment is not a rank of WORLD_SIZE={world}; "
                         "launch with torchrun (which sets both) or unset them")
    return int(raw), world


def _check_same_run(mine: dict[str, Any], everyone: list[dict[str, Any]]) -> None:
    """Every rank reads the same data (by its bytes: a node's own copy that differs), seed and
    sizes: a rank that did not trained on other samples than the run says, without a word (the
    log and the checkpoint hold rank 0's alone)."""
    for rank, theirs in enumerate(everyone):
        differing = {k: (everyone[0][k], theirs[k]) for k in mine if theirs[k] != everyone[0][k]}
        if differing:
            raise ValueError(
                f"rank {rank} was started with another run than rank 0 (rank 0's, rank "
                f"{rank}'s: {differing}): every rank must read the same data (a copy on each "
                "node that differs?), --seed, --seq-len and micro-batch")


def _mean_over_ranks(losses: list[float], engine: Any, world: int) -> float:
    """The step's loss: the mean over every rank's micro-batches (each rank has as many), so a
    run of N ranks logs what one rank with N times the accumulation would; every rank gets the
    same value, so a non-finite loss stops all of them alike. Through the engine's collectives:
    a host scalar, which a group without a CPU backend (NCCL) cannot reduce (see [Note: host
    collectives on a device-only group] in comm/routing.py)."""
    mean = statistics.fmean(losses)
    if world == 1:
        return mean
    return engine.comm.sum_float(mean) / world


def _lookup_budget(ds: dict[str, Any]) -> Any:
    section = ds.get("infinity")
    return section.get("host_memory_budget") if isinstance(section, dict) else None


def _make_engine(kind: EngineKind, model_config: Any, ds: dict[str, Any], config: Any,
                 pretrained: str | None = None) -> Any:
    import infinity

    if pretrained is not None:
        if kind == "torch":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
            return TorchBaselineEngine(model, config)
        # weights streamed into each unit's home (infinity.from_pretrained), read for this
        # world size as initialize reads it
        engine, _, _, _ = infinity.from_pretrained(pretrained, config=ds)
        return engine
    # the checked config (read for this world size: zero.Init would read ``ds`` for one rank,
    # where a train_batch_size of micro x accumulation x N ranks does not add up)
    model = models.build_model(model_config, infinity.zero.Init(config=config))
    if kind == "torch":
        # the same initial weights as the infinity engine: materialised unit by unit, in its
        # order, from the same random stream (a plainly built model draws them in another order)
        from infinity.zero.materialize import materialize_params
        from infinity.zero.partition import partition

        unit_modules = list(config.infinity.unit_modules or []) or None
        for spec in partition(model, unit_modules):
            materialize_params(model, spec.params, torch.device("cpu"))
        return TorchBaselineEngine(model, config)
    engine, _, _, _ = infinity.initialize(model=model, model_parameters=None, config=ds)
    return engine


def _export(engine: Any, directory: str, pretrained: str | None) -> None:
    """``--export``: the trained model as a directory ``from_pretrained`` loads (config.json,
    the pretrained directory's tokenizer and generation config when it had them)."""
    engine.save_pretrained(directory)      # infinity's: every rank takes part; rank 0 writes
    if isinstance(engine, TorchBaselineEngine) and pretrained:
        # transformers' save_pretrained writes the model's files (MODEL_TEXTS), not the
        # tokenizer's, which infinity's engine carries from the directory it loaded
        carry_files(Path(directory), Path(pretrained), written=MODEL_TEXTS)
    _log.info("exported the trained model to %s", directory)


def _preflight(parent: str, direct_io: bool) -> None:
    """The swap path exists, is a writable directory on a disk, and O_DIRECT works there."""
    from infinity.storage.preflight import check_swap_path

    check_swap_path(parent, 0, direct_io=direct_io)


def _check_space(parent: str, need_bytes: int) -> None:
    """Free space for the model states (a run out of space fails late and leaves a mess)."""
    from infinity.storage.preflight import check_free_space

    check_free_space(parent, need_bytes)


def _our_swap_dirs(parents: list[str]) -> list[str]:
    """Swap directories under ``parents`` whose marker names this process as owner."""
    if not parents:
        return []
    from infinity.storage.swap_dir import find_swap_dirs, read_marker

    found = []
    for parent in parents:
        if not Path(parent).is_dir():
            continue
        for path in find_swap_dirs(parent):
            try:
                marker = read_marker(path)
            except (OSError, ValueError):
                continue
            if marker.owner.pid == os.getpid():
                found.append(str(path))
    return found


def _refuse_outputs_over_inputs(opts: TrainOptions, plot_path: Path | None) -> None:
    """--metrics or --plot naming the --data or --config file would overwrite the user's input."""
    inputs = {flag: Path(value) for flag, value in (("--data", opts.data), ("--config", opts.config),
                                                    ("--hf-config", opts.hf_config),
                                                    ("--pretrained", opts.pretrained)) if value}
    outputs = {flag: Path(value) for flag, value in (("--metrics", opts.metrics),
                                                     ("--plot", plot_path),
                                                     ("--export", opts.export)) if value}
    for out_flag, out in outputs.items():
        for in_flag, given in inputs.items():
            if out.exists() and given.exists() and os.path.samefile(out, given):
                kind = "directory" if given.is_dir() else "file"
                raise ValueError(f"{out_flag} {out} is the {in_flag} {kind}: writing it would "
                                 f"overwrite your input; choose another {out_flag} path")
    # two outputs in one file: the picture written last over the metrics (not made yet, so
    # compared by path)
    if plot_path is not None and opts.metrics and \
            plot_path.absolute() == Path(opts.metrics).absolute():
        raise ValueError(f"--plot {plot_path} is the --metrics file: the picture would replace "
                         "the metrics; choose another --plot path")


def _check_export_dir(path: Path) -> None:
    """Raise now, not after the run, when ``--export`` cannot be written: a file there, or a
    directory (its nearest existing one) this process cannot write in (tried for real, a probe
    file made and removed at once: permission bits say nothing for root, a read-only mount or
    /proc). Without --save-dir the trained model exists only in the export."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--export {path} is a file: the export is a directory (config.json and "
                         "the weights, as from_pretrained loads); choose a directory path")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"--export {path}: {existing} is a file, so the directory cannot be "
                         "made; choose another path")
    try:
        write_probe(existing)
    except OSError as exc:
        raise PermissionError(f"--export {path}: cannot write in {existing} "
                              f"({exc.strerror or exc}); choose a writable path") from None


def _plot_path(opts: TrainOptions) -> Path | None:
    if opts.plot in ("off", "none"):
        return None
    if opts.plot:
        return check_plot_path(Path(opts.plot), example="run.png")
    if opts.metrics and plot_available():
        path = Path(opts.metrics).with_suffix(".png")
        if path == Path(opts.metrics):      # --metrics run.png: the picture beside it instead
            path = path.with_name(path.name + ".png")
        check_writable(path, "--plot (default: next to --metrics)", example="plot.png")
        return path
    return None


def _log_placement(kind: EngineKind, config: Any, states: int, swap_parents: list[str]) -> None:
    if kind == "torch":
        _log.info("torch baseline: all %s of model states in memory (ZeRO/offload settings are "
                  "not used)", format_bytes(states))
        return
    zero = config.zero
    budget = config.infinity.host_memory_budget
    ratio = f" = {states / budget:.1f}x the host budget {format_bytes(budget)}" if budget else ""
    _log.info("ZeRO stage %d, params on %s, optimizer on %s; model states %s%s%s",
              zero.stage, zero.offload_param.device, zero.offload_optimizer.device,
              format_bytes(states), ratio,
              f"; swap under {', '.join(swap_parents)}" if swap_parents else "")


class _PhaseTimers:
    """``wall_clock_breakdown``: forward / backward / step wall times, logged every N steps."""

    def __init__(self, enabled: bool, every: int) -> None:
        self.enabled = enabled
        self.every = max(1, every)
        self._sums: dict[str, float] = {}

    def phase(self, name: str) -> "_Phase":
        return _Phase(self, name)

    def add(self, name: str, seconds: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + seconds

    def log(self, step: int) -> None:
        if not self.enabled or step % self.every:
            return
        parts = ", ".join(f"{k} {v / self.every * 1e3:.1f} ms" for k, v in self._sums.items())
        _log.info("step %d: mean over the last %d steps: %s", step, self.every, parts)
        self._sums.clear()


class _Phase:
    def __init__(self, timers: _PhaseTimers, name: str) -> None:
        self.timers, self.name, self.start = timers, name, 0.0

    def __enter__(self) -> None:
        if self.timers.enabled:
            self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self.timers.enabled:
            self.timers.add(self.name, time.perf_counter() - self.start)

