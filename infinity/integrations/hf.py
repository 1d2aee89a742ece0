"""``transformers.Trainer`` on an infinity engine: change the import, keep the script.

```python
from infinity.integrations.hf import Trainer, TrainingArguments   # was: from transformers
args = TrainingArguments("out", deepspeed="ds_config.json", gradient_accumulation_steps=2, ...)
Trainer(model=model, args=args, train_dataset=..., eval_dataset=...).train()
```

``deepspeed=`` (the ds_config path or dict HF users already have, ``"auto"`` values and all)
is infinity's config here. The DeepSpeed package is not needed, but both names must come from
here: transformers' own ``TrainingArguments(deepspeed=...)`` needs it, and fails as it is built
(``PackageNotFoundError: deepspeed>=0.9.3``), before infinity sees it. transformers' own
arguments without it are rebuilt as infinity's (``as_infinity_args``); pass the config as
``Trainer(..., config=ds_config)``.

How it plugs in (the extension points transformers documents for subclasses, and the three
private hooks its DeepSpeed support also goes through, named here so a transformers upgrade
that moves them is caught at import):
- ``create_optimizer``: the Trainer's own optimizer (``args.optim``, its weight-decay groups:
  none on biases and norms) is built and handed to ``infinity.initialize``, which takes it over
  (engine/client_optimizer.py); a config with an ``"optimizer"`` section is used instead, with
  the same groups. The schedule is the config's ``"scheduler"``, else ``args.lr_scheduler_type``
  built on the engine's optimizer. The engine owns both, so its checkpoints hold them.
- ``training_step``: the Trainer's forward, loss scaling and ``loss.backward()`` (the engine
  sees that backward), then ``engine.step()`` at every micro-batch, as DeepSpeed's engine is
  stepped: it steps the optimizer and the schedule at the accumulation boundary, which is the
  Trainer's (``set_gradient_accumulation_boundary``: an epoch that is not a multiple of the
  accumulation ends with a shorter cycle, as with the plain Trainer). The Trainer's
  ``optimizer.step()`` and ``lr_scheduler.step()`` are then no-ops (as accelerate's DeepSpeed
  wrappers are), the logged ``learning_rate`` is the rate of the step just taken and
  ``grad_norm`` the engine's (``_get_grad_norm`` / ``_clip_grad_norm``: clipping is the config's
  ``gradient_clipping``, filled from ``max_grad_norm``).
- ``_wrap_model`` hands the engine out as the wrapped model (no DDP over it at several ranks:
  the engine reduces gradients itself); ``save_model`` writes through the safe path
  (``engine.save_pretrained``, or a PEFT model's adapter from its current weights); a
  Trainer checkpoint holds ``engine.save_checkpoint`` (``global_step<N>/`` and ``latest``, as
  with DeepSpeed), which ``_load_optimizer_and_scheduler`` loads on resume.

The engine lives as long as the Trainer: ``trainer.close()`` (or ``trainer.engine.close()``)
removes its swap files; evaluation and ``save_model`` after ``train()`` use it. A model larger
than host memory cannot be loaded by transformers first: build its engine with
``infinity.from_pretrained(dir, config=..., optimizer=...)`` and pass
``Trainer(model=engine.module, engine=engine, ...)``.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer

from infinity.base.interrupts import deferred_interrupts
from infinity.base.log import get_logger
from infinity.integrations.hf_resume import check_resumable, last_whole_checkpoint
from infinity.engine.model_methods import is_peft_model
from infinity.integrations.hf_config import fill_from_training_args, read_ds_config

log = get_logger("integrations")

# transformers' private hooks this module overrides: a version without them would silently run
# its own (grad norm 0, an optimizer.pt of nothing), so their absence stops the import
_PRIVATE_HOOKS = ("_get_grad_norm", "_clip_grad_norm", "_wrap_model",
                  "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
                  "_load_from_checkpoint")
_missing = [name for name in _PRIVATE_HOOKS if not hasattr(transformers.Trainer, name)]
if _missing:
    raise ImportError(f"infinity.integrations.hf needs transformers >= 5.0 (its Trainer has "
                      f"no {', '.join(_missing)}); this is transformers "
                      f"{transformers.__version__}")

__all__ = ["Trainer", "TrainingArguments", "as_infinity_args"]


def _floats(value: Any) -> tuple[float, ...]:
    """A setting (a number, or betas) as floats, to compare the engine's with the Trainer's."""
    return tuple(float(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' TrainingArguments, whose ``deepspeed`` (a ds_config path or dict) is
    infinity's config: it lands in ``infinity_config`` and transformers' DeepSpeed support
    stays off. The model is not moved to the device before the engine places it."""

    infinity_config: dict | str | None = dataclasses.field(
        default=None, metadata={"help": "The ds_config infinity trains with (deepspeed= "
                                        "is read as this)."})

    def __post_init__(self) -> None:
        if self.deepspeed is not None:
            if self.infinity_config is not None:
                raise ValueError("TrainingArguments got deepspeed= and infinity_config=: both "
                                 "name infinity's config, pass one")
            self.infinity_config, self.deepspeed = self.deepspeed, None
        super().__post_init__()

    @property
    def place_model_on_device(self) -> bool:
        """False: the engine places the model. transformers' Trainer reads this in its
        ``__init__``, so it is where a Trainer that is not infinity's (transformers.Trainer, or
        a subclass of it for a custom loss) is caught: it would ignore the ds_config and train
        without infinity, without a word."""
        if self.infinity_config is not None and not self.__dict__.get(_CLAIMED):
            raise ValueError(
                "infinity's TrainingArguments (with a ds_config in deepspeed= or "
                "infinity_config=) were given to a Trainer that is not infinity's "
                "(transformers.Trainer or a subclass of it): it would ignore the ds_config and "
                "train without infinity. Use infinity.integrations.hf.Trainer (subclass it for "
                "a custom compute_loss), or transformers' own TrainingArguments for a plain run")
        return False


METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")
"""transformers' schedule types stepped with an evaluation metric, not per optimizer step."""

_CLAIMED = "_infinity_trainer_claimed"
"""Set on TrainingArguments by infinity's Trainer before transformers' ``__init__`` reads them."""


def as_infinity_args(args: Any) -> Any:
    """transformers' own ``TrainingArguments`` (or a subclass of it: Seq2SeqTrainingArguments,
    TRL's configs) as infinity's, of a class that is both, every field's value kept and its
    ``deepspeed`` read as infinity's config; others as they are. Why: a script that swaps only
    the Trainer's import keeps transformers' arguments, which would move the model to the
    device before the engine places it and, with ``deepspeed=``, turn transformers' DeepSpeed
    support on. They are built again from their fields' values (as ``dataclasses.replace``
    does), so their checks run again; the object passed is left as it was, except that
    transformers' global DeepSpeed config, which its ``deepspeed=`` registered (where the
    DeepSpeed package is installed), is cleared: ``from_pretrained`` would read ZeRO-3 from it."""
    if args is None or isinstance(args, TrainingArguments) \
            or not isinstance(args, transformers.TrainingArguments):
        return args
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    if getattr(args, "hf_deepspeed_config", None) is not None:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return _infinity_class(type(args))(**values)


@functools.cache
def _infinity_class(cls: type) -> type:
    """infinity's TrainingArguments over ``cls`` (transformers' or a subclass of it)."""
    if cls is transformers.TrainingArguments:
        return TrainingArguments
    return dataclasses.dataclass(type(cls.__name__, (TrainingArguments, cls), {
        "__module__": __name__, "__doc__": f"{cls.__name__} with infinity's deepspeed= "
                                           "(infinity.integrations.hf.as_infinity_args)"}))


class _EngineOptimizer(AcceleratedOptimizer):
    """What the Trainer holds as its optimizer: the engine's, whose ``step()`` the engine took
    at the last micro-batch (so here it is a no-op, as accelerate's DeepSpeed wrapper's is)."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self._is_accelerate_prepared = True      # accelerate's prepare() keeps it as it is

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        return None

    @property
    def step_was_skipped(self) -> bool:
        return not self.engine.was_step_applied()


class _EngineSchedule:
    """What the Trainer holds as its LR scheduler: the engine steps the real one (its
    ``lr_scheduler``) after each optimizer step; ``get_last_lr()`` is the rates of the step
    just taken, which is what the plain Trainer logs."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.step_lrs: list[float] | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.step_lrs) if self.step_lrs is not None else self.engine.get_lr()

    def state_dict(self) -> dict:
        raise RuntimeError("the Trainer's schedule lives in the infinity engine: it is saved "
                           "and loaded with its checkpoints (engine.save_checkpoint)")

    def load_state_dict(self, state: dict) -> None:
        self.state_dict()


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` training through an infinity engine (see the module docstring).
    ``config``: the ds_config, when ``args`` is transformers' own TrainingArguments.
    ``engine``: an engine already holding ``model`` (``infinity.from_pretrained``, for a model
    larger than host memory), trained as it is: its config's batch sizes must be the
    arguments', its optimizer is its own, and ``args.lr_scheduler_type`` drives it unless its
    config has a schedule."""

    def __init__(self, *args: Any, config: Any = None, engine: Any = None,
                 **kwargs: Any) -> None:
        # transformers' own TrainingArguments become infinity's (as_infinity_args)
        if len(args) > 1:
            args = (args[0], as_infinity_args(args[1]), *args[2:])
        elif "args" in kwargs:
            kwargs["args"] = as_infinity_args(kwargs["args"])
        given = args[1] if len(args) > 1 else kwargs.get("args")
        if isinstance(given, TrainingArguments):
            object.__setattr__(given, _CLAIMED, True)       # see place_model_on_device
        super().__init__(*args, **kwargs)
        from_args = getattr(self.args, "infinity_config", None)
        if config is not None and from_args is not None:
            raise ValueError("Trainer got config= and TrainingArguments(deepspeed=...): both "
                             "name infinity's config, pass one")
        self.infinity_config = config if config is not None else from_args
        self._held = engine
        if engine is not None:
            if self.model_init is not None:
                raise ValueError("Trainer got engine= and model_init=: the engine trains the "
                                 "model it holds, and model_init would make another each "
                                 "train(); pass one of them")
            if self.infinity_config is not None:
                raise ValueError("Trainer got engine= and a ds_config: the engine has its "
                                 "config already, pass one of them")
            if engine.module is not self.model:
                raise ValueError("Trainer(engine=...) trains the engine's model: pass "
                                 "model=engine.module")
        elif self.infinity_config is None:
            raise ValueError(
                "infinity's Trainer needs a ds_config: import Trainer and TrainingArguments from "
                "infinity.integrations.hf and pass TrainingArguments(deepspeed="
                "\"ds_config.json\") (transformers' own TrainingArguments(deepspeed=...) needs "
                "the DeepSpeed package), or pass Trainer(config=\"ds_config.json\")")
        if self.is_deepspeed_enabled:
            raise ValueError(
                "transformers' DeepSpeed support is on (ACCELERATE_USE_DEEPSPEED=true in the "
                "environment: accelerate launch with a DeepSpeed config?): infinity's Trainer "
                "trains without DeepSpeed. Launch with torchrun (or accelerate without "
                "DeepSpeed), with Trainer and TrainingArguments imported from "
                "infinity.integrations.hf")
        if self.args.torch_compile:
            log.warning("TrainingArguments(torch_compile=True) is not applied: infinity's engine "
                        "runs the model uncompiled (it fetches and releases each unit's "
                        "parameters around its forward); training goes on uncompiled")
        if self.args.load_best_model_at_end and self.args.save_only_model:
            # transformers refuses this pair under DeepSpeed and FSDP too
            raise ValueError(
                "TrainingArguments(load_best_model_at_end=True, save_only_model=True): the "
                "checkpoints would hold the model's weights but no engine state, which this "
                "Trainer loads the best model from (the last step's weights would stay, "
                "silently). Drop save_only_model (checkpoints then hold the engine's state), "
                "or keep it and load the best checkpoint's weights yourself after training "
                "(infinity.from_pretrained(trainer.state.best_model_checkpoint))")
        self.engine = None
        # where the engine's schedule came from: "args" (built here from the TrainingArguments),
        # "config" (the ds_config's), "user" (the Trainer's or the engine's own)
        self._schedule_origin = "user"

    # -- building the engine -----------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The engine, built once, with the Trainer's optimizer taken over (or the config's,
        with the Trainer's weight-decay groups) and its schedule."""
        if self.engine is not None:
            if self.engine.module is self.model:
                return self.optimizer
            # train() again with model_init (hyperparameter_search, a fresh model each run):
            # the last run's engine holds the last model; the new one gets its own
            self.engine.close()
            self.engine, self._schedule_origin = None, "user"
        import infinity

        max_steps = self.state.max_steps or self.args.max_steps
        if not max_steps or max_steps < 0:
            raise ValueError("infinity's Trainer builds its engine when training starts "
                             "(trainer.train()), which knows the number of steps")
        if self._held is not None:
            self._check_device(self._held.device)
            return self._adopt(self._held, max_steps)
        from infinity.engine.model_methods import model_device

        self._check_device(model_device(self.model))
        ds = fill_from_training_args(read_ds_config(self.infinity_config), self.args,
                                     world_size=self.args.world_size, max_steps=max_steps)
        kwargs: dict[str, Any] = {}
        user_schedule = self.lr_scheduler          # Trainer(optimizers=(opt, schedule))
        if "optimizer" in ds:
            if self.optimizer is not None:
                raise ValueError("the ds_config has an \"optimizer\" section and the Trainer "
                                 "was given an optimizer: remove one")
            kwargs["model_parameters"] = self._decay_groups()
        else:
            kwargs["optimizer"] = super().create_optimizer(model)
            if not isinstance(kwargs["optimizer"], torch.optim.Adam):    # AdamW is one too
                optim = getattr(self.args.optim, "value", self.args.optim)
                raise ValueError(
                    f"TrainingArguments(optim={optim!r}) builds a "
                    f"{type(kwargs['optimizer']).__name__}: the engine steps Adam/AdamW only "
                    "(its CPU Adam over the offloaded states). Use optim=\"adamw_torch\" "
                    "(the default) or \"adamw_torch_fused\", or give the ds_config an "
                    "\"optimizer\" section")
        kind = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        if "scheduler" not in ds and user_schedule is None and kind in METRIC_SCHEDULES:
            raise ValueError(
                f"TrainingArguments(lr_scheduler_type={kind!r}) moves the rate from the "
                "evaluation's metric, which the engine's schedule never sees (it steps its "
                "schedule with each optimizer step): use a step schedule (\"linear\", "
                "\"cosine\", ...) or a ds_config \"scheduler\" section")
        if "scheduler" not in ds:
            kwargs["lr_scheduler"] = user_schedule if user_schedule is not None else \
                self._schedule_factory(max_steps)
            self._schedule_origin = "user" if user_schedule is not None else "args"
        elif user_schedule is not None:
            raise ValueError("the ds_config has a \"scheduler\" section and the Trainer was "
                             "given a scheduler: remove one")
        else:
            self._schedule_origin = "config"
        engine, *_ = infinity.initialize(model=self.model, config=ds, **kwargs)
        self.engine = engine
        self.optimizer = _EngineOptimizer(engine)
        self._set_schedule()
        return self.optimizer

    def _set_schedule(self) -> None:
        """The Trainer's view of the engine's schedule. A schedule made for this run (from the
        TrainingArguments or the ds_config's "auto" steps) is marked as the Trainer's own, so
        that a second ``train()`` drops it, as transformers' Trainer drops the one it made, and
        ``create_scheduler`` makes the next run's (before, the engine kept the spent one: a
        second train() ran at the end of its decay, lr 0, the logs looking normal)."""
        self.lr_scheduler = _EngineSchedule(self.engine)
        self._created_lr_scheduler = self._schedule_origin in ("args", "config")

    def _check_device(self, device: torch.device) -> None:
        """The engine trains on its model's device; the Trainer sends the batches to
        ``args.device``: they must be one kind (a CPU model on a GPU machine would train on
        the CPU, or fail at the first batch)."""
        if device.type != self.args.device.type:
            raise ValueError(
                f"the model is on {device} but the Trainer runs on {self.args.device}: the "
                "engine trains on its model's device. Put the model there first (model.to(...) "
                "when it fits; else infinity.from_pretrained(dir, config=...) builds it there, "
                "then Trainer(model=engine.module, engine=engine)), or pass use_cpu=True")

    def _adopt(self, engine: Any, max_steps: int) -> torch.optim.Optimizer:
        """Train with an engine built before the Trainer (``Trainer(engine=...)``)."""
        if self.optimizer is not None:
            raise ValueError("Trainer(engine=...) got an optimizer too: the engine's is used")
        world = self.args.world_size
        wanted = {"train_micro_batch_size_per_gpu": self.args.per_device_train_batch_size,
                  "gradient_accumulation_steps": self.args.gradient_accumulation_steps}
        differ = [f"{k} = {getattr(engine.config, k)} but the Trainer's is {v}"
                  for k, v in wanted.items() if getattr(engine.config, k) != v]
        clip = float(self.args.max_grad_norm or 0.0)
        if engine.config.gradient_clipping != clip:
            differ.append(f"gradient_clipping = {engine.config.gradient_clipping} but the "
                          f"Trainer's max_grad_norm is {clip}")
        if engine.world_size != world:
            differ.append(f"the engine has {engine.world_size} ranks, the Trainer {world}")
        # the optimizer's settings, as transformers' DeepSpeed integration matches them
        # (learning_rate and weight_decay were ignored without a word)
        own = engine.optimizer_defaults
        for key, theirs, name in (
                ("lr", self.args.learning_rate, "learning_rate"),
                ("weight_decay", self.args.weight_decay, "weight_decay"),
                ("eps", self.args.adam_epsilon, "adam_epsilon"),
                ("betas", (self.args.adam_beta1, self.args.adam_beta2), "adam_beta1/2")):
            mine = own.get(key)
            if mine is not None and _floats(mine) != _floats(theirs):
                differ.append(f"the optimizer's {key} = {mine} but the Trainer's {name} is "
                              f"{theirs}")
        if differ:
            raise ValueError("the engine's config and the TrainingArguments disagree:\n- "
                             + "\n- ".join(differ) + "\nthe engine trains with its own: set "
                             "the TrainingArguments to its values (or build the engine with "
                             "the Trainer's)")
        if engine.lr_scheduler is None:
            if self.lr_scheduler is not None:
                raise ValueError("Trainer(engine=...) got a scheduler: give it to the engine "
                                 "(lr_scheduler=lambda opt: ...) instead")
            engine.lr_scheduler = self._schedule_factory(max_steps)(engine.optimizer)
            self._schedule_origin = "args"
        self.engine = engine
        self.optimizer = _EngineOptimizer(engine)
        self._set_schedule()
        return self.optimizer

    def _decay_groups(self) -> list[dict]:
        """The Trainer's param groups (decay on all but biases and norms) for a config's
        optimizer: the no-decay group overrides the config's weight_decay with 0."""
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay]},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def _schedule_factory(self, max_steps: int):
        args = self.args

        def build(optimizer: torch.optim.Optimizer):
            return transformers.get_scheduler(
                args.lr_scheduler_type, optimizer=optimizer,
                num_warmup_steps=args.get_warmup_steps(max_steps), num_training_steps=max_steps,
                scheduler_specific_kwargs=args.lr_scheduler_kwargs)

        return build

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The engine holds the schedule (built with it in ``create_optimizer``); a later
        ``train()`` that dropped the one made for the last run gets a new one for its steps
        (see ``_set_schedule``)."""
        if self.engine is None:
            self.create_optimizer()
        elif self.lr_scheduler is None:
            if self._schedule_origin == "config":
                raise ValueError(
                    "trainer.train() again with the ds_config's \"scheduler\": that schedule "
                    f"was made for the last run's steps and is spent (the engine is at step "
                    f"{self.engine.global_steps}), and infinity does not rebuild a ds_config "
                    "schedule. Build a new Trainer (resume_from_checkpoint= continues the run), "
                    "or leave the scheduler to the TrainingArguments (lr_scheduler_type), which "
                    "a second train() starts again as transformers' Trainer does")
            self.engine.lr_scheduler = self._schedule_factory(num_training_steps)(
                self.engine.optimizer)
            self._set_schedule()
        return self.lr_scheduler

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: Any = None, **gen_kwargs: Any) -> Any:
        """``Seq2SeqTrainer``'s generation (``class S(Trainer, Seq2SeqTrainer)``) with
        ``synced_gpus`` on at stage 3 over several ranks: it passes False itself where it sees
        no DeepSpeed ZeRO-3 (a rank done first went on alone: a gloo abort). Its
        ``_gen_kwargs`` are merged in, which it drops when any keyword is given."""
        engine = self.engine
        if getattr(self.args, "predict_with_generate", False) and engine is not None and \
                isinstance(self, transformers.Seq2SeqTrainer) and \
                engine.world_size > 1 and engine.zero_optimization_stage() == 3:
            gen_kwargs = {**getattr(self, "_gen_kwargs", {}), **gen_kwargs}
            gen_kwargs.setdefault("synced_gpus", True)
        return super().prediction_step(model, inputs, prediction_loss_only,
                                       ignore_keys=ignore_keys, **gen_kwargs)

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if self.engine is not None and self.engine.module is self.model:
            return self.engine
        if not training and any(p.is_meta for p in model.parameters()):
            # evaluate()/predict() before train(): the engine is built when training starts,
            # and a model built under zero.Init has no values outside it (accelerate's
            # model.to(device) failed on "Cannot copy out of meta tensor")
            raise ValueError(
                "evaluate()/predict() before train() on a model built under "
                "infinity.zero.Init: its weights live in the engine, which infinity's Trainer "
                "builds when training starts. Evaluate at the start of training "
                "(TrainingArguments(eval_on_start=True)), or build the engine first "
                "(infinity.initialize or infinity.from_pretrained) and pass "
                "Trainer(model=engine.module, engine=engine, ...)")
        return super()._wrap_model(model, training, dataloader)

    # -- training ----------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's forward and backward, then the engine's step (every micro-batch). The
        Trainer decides where a cycle ends (``accelerator.sync_gradients``): every
        ``gradient_accumulation_steps`` micro-batches, and at the last micro-batch of an epoch
        whose micro-batches are not a multiple of them, a shorter cycle whose loss the Trainer
        scales by its own count (``num_items_in_batch``). The engine is told so before the
        forward (``set_gradient_accumulation_boundary``, as accelerate tells DeepSpeed's), then
        goes back to its own count, which that early step realigned."""
        engine = self.engine
        boundary = self.accelerator.sync_gradients
        engine.set_gradient_accumulation_boundary(boundary)
        lrs = engine.get_lr() if boundary else None
        # the Trainer's backward is a plain loss.backward(), which may step units (the early
        # step; the cycle's last backward): a Ctrl-C waits for the micro-batch's step, as in
        # engine.backward() and engine.step() (see infinity/base/interrupts.py)
        with deferred_interrupts("the micro-batch's backward and step"):
            loss = super().training_step(model, inputs, num_items_in_batch)
            engine.record_loss(loss)   # its backward was loss.backward(): the monitors' loss
            engine.step()
            engine.set_gradient_accumulation_boundary(None)
            if lrs is not None:
                self.lr_scheduler.step_lrs = lrs
        return loss

    def _clip_grad_norm(self, model: Any) -> float | None:
        return self.engine.get_global_grad_norm()     # the engine clipped (gradient_clipping)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        return self.engine.get_global_grad_norm()

    # -- saving and resuming -----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model's current weights, through the engine (every rank takes part; rank 0
        writes): a transformers directory (``engine.save_pretrained``), or a PEFT model's
        adapter; then the tokenizer (processing class) and the arguments as JSON."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.save_pretrained(output_dir)       # a PEFT model's: its adapter
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            (Path(output_dir) / "training_args.json").write_text(self.args.to_json_string())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (model, Adam states, schedule, counters) in the Trainer's
        checkpoint directory; a PEFT model's frozen base is left out (it does not change)."""
        self.engine.save_checkpoint(output_dir,
                                    exclude_frozen_parameters=is_peft_model(self.model))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path, _ = self.engine.load_checkpoint(checkpoint)
        if path is None:
            raise FileNotFoundError(f"resume_from_checkpoint={checkpoint!r}: no infinity "
                                    "checkpoint there (no 'latest' file)")

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """transformers' ``train``; ``resume_from_checkpoint=True`` takes the newest checkpoint
        whose save finished (transformers takes the newest directory, and a run killed while
        saving one left it without the engine's state: the resume failed, blaming
        save_only_model)."""
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = last_whole_checkpoint(self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Called before the engine exists on resume: the engine's checkpoint is loaded once
        it is built (``_load_optimizer_and_scheduler``); here it is only checked for."""
        if self.engine is not None:
            self.engine.load_checkpoint(resume_from_checkpoint, load_module_only=True)
            return
        check_resumable(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        log.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        path, _ = self.engine.load_checkpoint(best, load_module_only=True)
        if path is None:
            raise FileNotFoundError(f"load_best_model_at_end: the best checkpoint {best!r} holds "
                                    "no infinity checkpoint ('latest'), so the best model "
                                    "cannot be loaded; the model keeps the last step's weights")

    def close(self) -> None:
        """Close the engine (its swap files are removed); the model is released with it."""
        if self.engine is not None:
            self.engine.close()
