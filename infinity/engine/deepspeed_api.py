"""The accessors DeepSpeed's engine offers and training scripts (and Hugging Face's Trainer and
accelerate) call on it: batch sizes, precision flags, the last gradient norm, whether a step was
applied, and attribute access falling through to the model (``engine.generate(...)``). Kept out
of ``engine.py``, which holds the training logic; ``Engine`` inherits them."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from infinity.engine.guards import (BOUNDARY_UNSET_AFTER_LAST_BACKWARD,
                                    NOT_A_BOUNDARY_UNDER_EARLY_STEP, every_rank_call)


class DeepSpeedEngineAccessors:
    """Mixed into ``Engine``; reads ``self.config``, ``self.optimizer``, ``self.module``,
    ``self.compute_dtype``, and the engine's counts of micro-steps and backwards."""

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), the
        numbers DeepSpeed's docstring promises (its code returns the bound methods)."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def fp16_enabled(self) -> bool:
        """Whether the engine computes in fp16 (an fp16 section on a CPU-only machine computes
        in fp32: callers read it to cast their inputs, as ``bfloat16_enabled``)."""
        return self.compute_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        """Whether the engine computes in bf16 (as the config asks, or as "auto" chose for a CPU
        that multiplies it natively: callers read it to cast their inputs)."""
        return self.compute_dtype == torch.bfloat16

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (inf after an overflow; None
        before the first step). Under the early step no step needs it: the Adam kernel sums
        each unit's gradient squares as it steps the unit."""
        return self.optimizer.last_grad_norm

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-step in progress ends the accumulation cycle (its ``step()``
        steps the optimizer): the value ``set_gradient_accumulation_boundary`` set, else every
        ``gradient_accumulation_steps``-th micro-step."""
        if self._boundary_set is not None:
            return self._boundary_set
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's call: the next backwards end the cycle (True) or not (False) whatever
        the count says, until set again; ``None`` goes back to counting. Why: a data loader
        whose epoch is not a multiple of the accumulation ends it with a shorter cycle (as
        Hugging Face's Trainer and accelerate do, which call this before each micro-batch).
        Set it before the micro-batch's forward: its backward reduces and norms the gradients
        only when it knows it is the last. DeepSpeed's other style, backwards with False and
        one ``step()`` after the last, set True before its forward, works too. A cycle that
        ends early counts as a whole one (``micro_steps`` moves on to the next multiple of the
        accumulation), so checkpoints, which are taken at boundaries, and the counting after
        ``None`` start a fresh cycle. False under the early step is refused: every backward
        steps the weights there ([Note: a boundary under the early step] in guards.py)."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary({is_boundary!r}): pass True, "
                            "False or None (count gradient_accumulation_steps again)")
        if is_boundary is False and self.optimizer.early_step:
            raise RuntimeError(NOT_A_BOUNDARY_UNDER_EARLY_STEP)
        previous = self._boundary_set
        self._boundary_set = is_boundary
        if self._backwards_since_step and self._backward_was_boundary and \
                not self.is_gradient_accumulation_boundary():
            self._boundary_set = previous
            raise RuntimeError(BOUNDARY_UNSET_AFTER_LAST_BACKWARD.format(value=is_boundary))

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped: its gradients were not finite
        (fp16's, or any under the deferred schedule; the early step has already stepped)."""
        return not self.optimizer.overflow

    def get_mom(self) -> list[tuple[float, float]]:
        """Each param group's Adam betas."""
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]

    @property
    def global_samples(self) -> int:
        return self.global_steps * self.config.train_batch_size

    # the data-parallel ranks (see infinity/comm)
    @property
    def local_rank(self) -> int:
        return self.ranks.local_rank

    @property
    def global_rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def dp_world_size(self) -> int:
        return self.ranks.world_size

    def to(self, *args: Any, **kwargs: Any) -> "DeepSpeedEngineAccessors":
        """The engine places its states itself: ``engine.to(device)`` returns the engine, as
        DeepSpeed's does (not the model, which ``__getattr__`` would hand back), after
        checking that the device is the engine's."""
        import torch

        wanted = next((a for a in (*args, *kwargs.values())
                       if isinstance(a, (str, torch.device))), None)
        if wanted is not None and torch.device(wanted).type != self.device.type:
            raise ValueError(f"engine.to({wanted!r}): the engine trains on {self.device}; it "
                             "moves states between its tiers itself. Build the model on the "
                             "device you want before initialize")
        return self

    @every_rank_call("state_dict()")
    def module_state_dict(self, destination: dict | None = None, prefix: str = "",
                          keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The model's full state dict (DeepSpeed's name), read unit by unit under
        ``GatheredParameters``: current values, every parameter a copy (a plain
        ``module.state_dict()`` at stage 3 shows released parameters empty, and a unit still
        fetched may lag a deferred step). Holds the whole model in host memory; to save it,
        ``save_16bit_model`` streams instead. ``keep_vars`` applies to buffers only."""
        from infinity.checkpoint.layout import aliases
        from infinity.zero.init import GatheredParameters
        from infinity.zero.persistent_buffers import all_persistent_buffers

        from infinity.engine.module_state import check_whole_model_fits

        self._check_open("module_state_dict")      # closed: released parameters read as empty
        check_whole_model_fits(self, "model.state_dict() / engine.module_state_dict()",
                               frozen_too=not exclude_frozen_parameters)
        state = {} if destination is None else destination
        for unit in self.units:
            with GatheredParameters([e.param for e in unit.params]):
                for entry in unit.params:
                    if entry.param.requires_grad or not exclude_frozen_parameters:
                        state[prefix + entry.name] = entry.param.detach().clone()
        for alias, name in aliases(self.module, self.units).items():
            if prefix + name in state:        # a tied parameter's other names share it
                state[prefix + alias] = state[prefix + name]
        for name, buf in all_persistent_buffers(self.module):
            state[prefix + name] = buf if keep_vars else buf.detach()
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, Any]:
        """What accelerate's ``get_state_dict`` and DeepSpeed's own 16-bit save call at stage
        3: the whole model in the compute dtype, on every rank (each must call it);
        ``module_state_dict``'s values."""
        return self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)

    def zero_optimization(self) -> bool:
        return self.config.zero.stage > 0

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero.stage >= 3

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.config.zero.stage >= 3 and self.config.zero.offload_param.device != "none"

    def zero_cpu_offload(self) -> bool:
        return self.config.zero.offload_optimizer.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    def empty_partition_cache(self) -> None:
        """DeepSpeed's call to free the parameters stage 3 keeps gathered between uses: this
        engine keeps none (a unit is released after its use, or kept by the planner as
        persistent within the budget it sized), so there is nothing to free."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for scripts written for DDP, and a no-op at any world size: every backward
        reduces its gradients over the ranks as they come (ZeRO shards them; DeepSpeed refuses
        no_sync at stages 2-3). A DDP loop accumulating under it still trains as torch would
        where backwards may add up before step() (the deferred schedule); accumulate with
        gradient_accumulation_steps instead, which skips nothing."""
        yield

    def get_data_parallel_world_size(self) -> int:
        return self.ranks.world_size

    def optimizer_name(self) -> str | None:
        """The config's optimizer type ("Adam", "AdamW"), or the class name of the optimizer
        passed to ``initialize``."""
        if self.config.optimizer is not None:
            return self.config.optimizer.type
        return type(self._client_optimizer).__name__ if self._client_optimizer is not None \
            else None

    def scheduler_name(self) -> str | None:
        """The config's scheduler type, or None (DeepSpeed's)."""
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16 loss scaling is dynamic (``fp16.loss_scale`` 0)."""
        return self.config.fp16.enabled and not self.config.fp16.loss_scale

    def destroy(self) -> None:
        """DeepSpeed's name for ``close()``."""
        self.close()

    def save_fp16_model(self, save_dir: Any, save_filename: str = "model.safetensors",
                        exclude_frozen_parameters: bool = False) -> Any:
        """DeepSpeed's older name for ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine does not have come from the model, as with DeepSpeed's engine
        (``engine.generate(...)``, ``engine.config`` is the engine's own); one neither has
        names the engine (the model's error named the model, as if the script had a typo)."""
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"the infinity engine has no attribute {name!r}, nor has its model "
                f"({type(module).__name__}); DeepSpeed engine methods it lacks (such as "
                "set_train_batch_size) are not supported") from None

