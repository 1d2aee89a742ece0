"""The clipping norm's sum of squares: float64 accuracy without a float64 copy of the input,
on the native path (one read pass) and the fallback (chunks through a float64 buffer)."""
from __future__ import annotations

import torch

from infinity.optim import _adam_native as N
from infinity.optim.grad_norm import sum_of_squares


def test_sum_of_squares_is_float64_accurate_across_chunk_edges() -> None:
    torch.manual_seed(0)
    values = torch.randn(3 * 1000 + 17) * 1e3 + 5.0    # a large mean: float32 sums drift
    expected = float((values.double() ** 2).sum())
    for chunk in (1000, 1 << 18):
        got = sum_of_squares(values, chunk=chunk)
        assert abs(got - expected) <= 1e-12 * expected, (chunk, got, expected)
    strided = values[::3]          # not contiguous: the float64-buffer fallback
    want = float((strided.double() ** 2).sum())
    assert abs(sum_of_squares(strided, chunk=100) - want) <= 1e-12 * want
    assert sum_of_squares(torch.empty(0)) == 0.0


def test_native_sum_of_squares_is_deterministic_for_every_dtype_and_thread_count() -> None:
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        values = torch.randn(1_000_003).to(dtype)
        want = float((values.double() ** 2).sum())
        code = {torch.float32: N.DTYPE_F32, torch.bfloat16: N.DTYPE_BF16,
                torch.float16: N.DTYPE_F16}[dtype]
        sums = {N.grad_sq_sum(values.data_ptr(), values.numel(), code, threads)
                for threads in (1, 2, 7)}
        assert len(sums) == 1, (dtype, sums)
        assert abs(sums.pop() - want) <= 1e-12 * want, dtype
        assert sum_of_squares(values) == N.grad_sq_sum(values.data_ptr(), values.numel(), code, 1)
