"""optim/master_seed.py ``_merge``: the fp32 master takes what a change by hand changed in the
16-bit compute copy, and a state dict's exact fp32 values only where the copy holds them (at
several ranks the copy is the source rank's, broadcast; a rank's own dict may differ: it set
that rank's master to its own values, out of step with the weights every rank computes with)."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from infinity.optim.master_seed import _merge


@dataclass(frozen=True)
class _Entry:
    offset: int
    numel: int


def test_changed_elements_and_agreeing_exact_values_reach_the_master() -> None:
    master = torch.tensor([1.0001, 2.0001, 3.0001, 4.0001, 5.0001, 6.0001])
    current = master.to(torch.bfloat16)                 # the step's rounding: unchanged
    current[1] = 7.0                                    # changed by hand
    entry = _Entry(offset=3, numel=3)          # loaded from a state dict
    exact = torch.tensor([4.00390625 + 1e-4, 9.1234, 6.0001])
    current[3] = exact[0].to(torch.bfloat16)            # what this rank's load wrote
    current[4] = 8.0                                    # the source rank's value, not this dict's
    before = master.clone()
    _merge(master, current, SimpleNamespace(), 0, {entry: exact})
    assert master[0] == before[0] and master[2] == before[2] and master[5] == before[5]
    assert master[1] == 7.0                             # the change, taken
    assert master[3] == exact[0]                        # exact where the copy holds it
    assert master[4] == 8.0                             # the copy's, not this rank's dict
