"""What of ``torch.optim.Optimizer``'s API the partitioned optimizer refuses, and why.

The partitioned optimizer is a torch Optimizer so that LR schedulers, step hooks and
``param_groups`` work as users expect. Two parts of that API cannot be honoured: a state dict
(the Adam states live unit by unit in their tiers, possibly larger than memory, and torch's
empty dict would restore as a silent reset of Adam) and a param group added after the states
were laid out (it would never be stepped). Both raise, saying what to do instead.
"""
from __future__ import annotations

__all__ = ["RefusesTorchStateDict", "STATE_DICT_REFUSED"]

STATE_DICT_REFUSED = (
    "{call}: the Adam states of an infinity engine live in their tiers (host memory or the "
    "NVMe swap space), unit by unit, and may not fit in memory as one dict. Save and restore "
    "them with engine.save_checkpoint(dir) / engine.load_checkpoint(dir) (also the model, "
    "scheduler and counters), as with DeepSpeed")


class RefusesTorchStateDict:
    """A mixin before ``torch.optim.Optimizer``: ``state_dict`` and ``load_state_dict`` refused,
    ``add_param_group`` refused once the subclass sets ``_groups_fixed``."""

    def state_dict(self):  # noqa: D401 - torch API
        """Refused: the Adam states live in their tiers (NVMe, host), possibly larger than
        memory; torch's empty dict would restore as a silent reset of Adam."""
        raise RuntimeError(STATE_DICT_REFUSED.format(call="optimizer.state_dict()"))

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError(STATE_DICT_REFUSED.format(call="optimizer.load_state_dict()"))

    def add_param_group(self, param_group: dict) -> None:
        """Only while the optimizer is built: each parameter's states, sub-groups and unit are
        laid out at ``initialize``, so a group added later would never be stepped."""
        if getattr(self, "_groups_fixed", False):
            raise ValueError(
                "optimizer.add_param_group() after infinity.initialize: the engine lays out the "
                "optimizer states of every parameter it trains at initialize, so the new group "
                "would never be stepped. Give every group to infinity.initialize "
                "(model_parameters=[...]); to start training more of the model later, "
                "save_checkpoint, build a new engine with the new groups and load_checkpoint "
                "with load_optimizer_states=False")
        super().add_param_group(param_group)
