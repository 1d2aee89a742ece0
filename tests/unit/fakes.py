"""Small stand-ins shared by the unit tests (imported as ``fakes``: pytest puts tests/unit on
sys.path): a tier manager that only records the host buffers asked of it, and a wrapper that
makes the n-th call of a function fail."""
from __future__ import annotations

from typing import Any, Callable

import torch


class RecordingManager:
    """What a buffer pool asks the tier manager for (host buffers), recorded; zero-filled CPU
    tensors given back."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.dtype, str]] = []

    def host_empty(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        self.calls.append((numel, dtype, what))
        return torch.zeros(numel, dtype=dtype)


def failing_on_call(real: Callable[..., Any], n: int,
                    error: BaseException) -> tuple[Callable[..., Any], list[int]]:
    """``real`` that raises ``error`` at its ``n``-th call (1-based) and runs as itself at the
    others; with the list of calls so far (one entry each)."""
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)
    return wrapped, calls
