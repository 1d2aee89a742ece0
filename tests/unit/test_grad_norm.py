"""The clipping norm's sum of squares: float64 accuracy without a float64 copy of the input."""
from __future__ import annotations

import torch

from infinity.optim.partitioned import _sum_of_squares


def test_sum_of_squares_is_float64_accurate_across_chunk_edges() -> None:
    torch.manual_seed(0)
    values = torch.randn(3 * 1000 + 17) * 1e3 + 5.0    # a large mean: float32 sums drift
    expected = float((values.double() ** 2).sum())
    for chunk in (1000, 1 << 18):
        got = _sum_of_squares(values, chunk=chunk)
        assert abs(got - expected) <= 1e-12 * expected, (chunk, got, expected)
    assert _sum_of_squares(torch.empty(0)) == 0.0
