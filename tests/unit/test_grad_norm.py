"""The gradient norm's sum of squares (optim/grad_norm.py): float64 accuracy without a float64
copy of the input, on the native path (one read pass, on the calling thread's count of threads)
and the fallback (chunks through a float64 buffer kept per thread)."""
from __future__ import annotations

import threading

import pytest
import torch

from infinity.optim import _adam_native as N
from infinity.optim import grad_norm
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_is_the_float64_sum(dtype) -> None:
    values = (torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    want = float((values.double() ** 2).sum())
    assert sum_of_squares(values) == pytest.approx(want, rel=1e-12)
    strided = values[::3]          # not contiguous: the chunked path
    assert sum_of_squares(strided, chunk=64) == pytest.approx(
        float((strided.double() ** 2).sum()), rel=1e-12)


def test_sum_of_squares_keeps_what_float32_would_round_away() -> None:
    """4096**2 = 2**24: in float32 each following 1 is lost; both paths sum in float64."""
    values = torch.ones(1001)
    values[0] = 4096.0
    assert sum_of_squares(values) == 16777216.0 + 1000
    assert sum_of_squares(values[::1].as_strided((1001,), (1,)).clone().double()) == \
        16777216.0 + 1000
    assert sum_of_squares(torch.ones(0)) == 0.0


def test_sum_of_squares_calls_the_native_kernel_once_on_the_calling_thread(monkeypatch) -> None:
    calls = []
    real = N.grad_sq_sum

    def recording(ptr, numel, dtype, threads):
        calls.append((ptr, numel, dtype, threads))
        return real(ptr, numel, dtype, threads)
    monkeypatch.setattr(N, "grad_sq_sum", recording)
    for dtype, code in ((torch.float32, N.DTYPE_F32), (torch.bfloat16, N.DTYPE_BF16),
                        (torch.float16, N.DTYPE_F16)):
        values = torch.full((300,), 2.0, dtype=dtype)
        assert sum_of_squares(values) == 1200.0
        assert calls[-1] == (values.data_ptr(), 300, code, 1)
    calls.clear()
    assert sum_of_squares(torch.full((40,), 2.0, dtype=torch.float64)) == 160.0
    assert sum_of_squares(torch.full((80,), 2.0)[::2]) == 160.0
    assert calls == []        # float64, or not contiguous: no native call


@pytest.mark.parametrize("error", [ImportError, AttributeError, OSError])
def test_sum_of_squares_without_the_native_library_sums_in_chunks(monkeypatch, error) -> None:
    def missing(*args):
        raise error("no library")
    monkeypatch.setattr(N, "grad_sq_sum", missing)
    monkeypatch.delattr(grad_norm._norm_scratch, "buffer", raising=False)
    values = torch.arange(10, dtype=torch.float32)
    assert sum_of_squares(values, chunk=4) == 285.0       # chunks of 4, 4 and 2
    first = grad_norm._norm_scratch.buffer
    assert first.dtype == torch.float64 and first.numel() == 4
    assert sum_of_squares(values, chunk=4) == 285.0
    assert grad_norm._norm_scratch.buffer is first         # kept: no allocation per call
    assert sum_of_squares(values, chunk=16) == 285.0      # a larger chunk gets a larger one
    assert grad_norm._norm_scratch.buffer.numel() == 16
    assert sum_of_squares(values, chunk=4) == 285.0       # and a smaller one reuses it
    assert grad_norm._norm_scratch.buffer.numel() == 16


def test_sum_of_squares_scratch_is_per_thread(monkeypatch) -> None:
    monkeypatch.setattr(N, "grad_sq_sum", lambda *a: (_ for _ in ()).throw(OSError("none")))
    sum_of_squares(torch.ones(8), chunk=8)
    mine = grad_norm._norm_scratch.buffer
    seen = []
    thread = threading.Thread(target=lambda: seen.append(
        (sum_of_squares(torch.ones(8), chunk=8), grad_norm._norm_scratch.buffer)))
    thread.start()
    thread.join(60)
    assert seen[0][0] == 8.0 and seen[0][1] is not mine
