"""infinity.optim"""
from infinity.optim.cpu_adam import CPUAdam, adam_step_flat, adam_step_tensors

__all__ = ["CPUAdam", "adam_step_flat", "adam_step_tensors"]
