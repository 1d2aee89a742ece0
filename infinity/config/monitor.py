"""The monitor sections: ``"tensorboard"``, ``"csv_monitor"``, ``"wandb"`` (DeepSpeed's keys and
defaults). The engine writes DeepSpeed's events to each one enabled (engine/monitor.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infinity.config.values import ConfigError, check_bool


def _check_text(path: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise ConfigError(f"{path} = {value!r}: expected a string")


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    """``"tensorboard"``: event files for TensorBoard (needs the ``tensorboard`` package)."""

    enabled: bool = False
    """Write events."""
    output_path: str = ""
    """Directory of the run directories; "" = ``~/tensorboard`` (DeepSpeed's)."""
    job_name: str = "DeepSpeedJobName"
    """This run's directory under ``output_path``."""

    def __post_init__(self) -> None:
        check_bool("tensorboard.enabled", self.enabled)
        _check_text("tensorboard.output_path", self.output_path)
        _check_text("tensorboard.job_name", self.job_name)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "output_path": self.output_path,
                "job_name": self.job_name}


@dataclass(frozen=True, kw_only=True)
class CsvMonitorConfig:
    """``"csv_monitor"``: one CSV file per event (``step,<name>`` rows), as DeepSpeed's."""

    enabled: bool = False
    """Write events."""
    output_path: str = ""
    """Directory of the run directories; "" = ``./csv_monitor``."""
    job_name: str = "DeepSpeedJobName"
    """This run's directory under ``output_path``."""

    def __post_init__(self) -> None:
        check_bool("csv_monitor.enabled", self.enabled)
        _check_text("csv_monitor.output_path", self.output_path)
        _check_text("csv_monitor.job_name", self.job_name)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "output_path": self.output_path,
                "job_name": self.job_name}


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """``"wandb"``: a Weights & Biases run (needs the ``wandb`` package, logged in)."""

    enabled: bool = False
    """Log events."""
    group: str | None = None
    """The run's group."""
    team: str | None = None
    """The entity (team or user) the run belongs to."""
    project: str = "deepspeed"
    """The project (DeepSpeed's default name)."""

    def __post_init__(self) -> None:
        check_bool("wandb.enabled", self.enabled)
        _check_text("wandb.group", self.group, optional=True)
        _check_text("wandb.team", self.team, optional=True)
        _check_text("wandb.project", self.project)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "group": self.group, "team": self.team,
                "project": self.project}
