"""When the step stream lets the CPU Adam round a sub-group's new master straight into the unit's
device copy (see [Note: the kernel rounds into the device copy] in optim/device_copy.py): only
where every element of the sub-group is written by the kernel, so the device copy ends with the
same bits as through the temporary. Where the copy is not CPU memory (or copies overlap compute)
the same condition leaves the temporary unfilled: the kernel writes all of it."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from infinity.optim.records import StepRun
from infinity.optim.device_copy import (
    flat_rounded_by_kernel, host_temporary, kernel_writes_every_element)

UNIT = SimpleNamespace(flat=torch.zeros(100, dtype=torch.bfloat16))
GRAD = torch.zeros(100)


def test_runs_covering_the_sub_group_round_into_the_device_copy() -> None:
    runs = [StepRun(0, 0, 40, 3), StepRun(1, 40, 100, 3)]
    assert flat_rounded_by_kernel(UNIT, GRAD, runs, 0, 100)
    assert flat_rounded_by_kernel(UNIT, GRAD, runs, 30, 60)      # across two runs
    assert flat_rounded_by_kernel(UNIT, GRAD, [StepRun(0, 0, 100, 1)], 50, 70)


def test_a_parameter_not_stepped_keeps_the_temporary() -> None:
    gap = [StepRun(0, 0, 40, 3), StepRun(0, 50, 100, 3)]        # [40, 50) got no gradient
    assert not flat_rounded_by_kernel(UNIT, GRAD, gap, 0, 100)
    assert flat_rounded_by_kernel(UNIT, GRAD, gap, 50, 100)       # a sub-group past the gap
    assert not flat_rounded_by_kernel(UNIT, GRAD, [StepRun(0, 10, 100, 1)], 0, 100)
    assert not flat_rounded_by_kernel(UNIT, GRAD, [StepRun(0, 0, 90, 1)], 0, 100)
    assert not flat_rounded_by_kernel(UNIT, GRAD, [], 0, 100)


def test_held_gradients_or_a_device_copy_off_the_cpu_keep_the_temporary() -> None:
    runs = [StepRun(0, 0, 100, 1)]
    assert not flat_rounded_by_kernel(UNIT, {0: GRAD}, runs, 0, 100)   # gaps between parts
    meta = SimpleNamespace(flat=torch.zeros(100, dtype=torch.bfloat16, device="meta"))
    assert not flat_rounded_by_kernel(meta, GRAD, runs, 0, 100)


def test_a_device_copy_off_the_cpu_takes_an_unfilled_temporary_only_where_the_kernel_writes_all(
) -> None:
    """The temporary's fill (the master's rounding, for what the kernel skips) is left out only
    where the kernel writes every element: one flat gradient and runs covering the range."""
    runs = [StepRun(0, 0, 100, 1)]
    assert kernel_writes_every_element(GRAD, runs, 0, 100)
    assert not kernel_writes_every_element({0: GRAD}, runs, 0, 100)
    assert not kernel_writes_every_element(GRAD, [StepRun(0, 0, 90, 1)], 0, 100)
    master = torch.linspace(-1, 1, 100)
    filled = host_temporary(master, torch.bfloat16, pinned=False)
    assert filled.dtype == torch.bfloat16 and torch.equal(filled, master.to(torch.bfloat16))
    assert filled.data_ptr() != master.data_ptr()
    same_dtype = host_temporary(master, torch.float32, pinned=False)
    assert torch.equal(same_dtype, master) and same_dtype.data_ptr() != master.data_ptr()
    bare = host_temporary(master, torch.bfloat16, pinned=False, fill=False)
    assert bare.shape == master.shape and bare.dtype == torch.bfloat16
