"""Small stand-ins shared by the unit tests (imported as ``fakes``: pytest puts tests/unit on
sys.path): a tier manager that only records the host buffers asked of it, a wrapper that makes
the n-th call of a function fail, a TrainingState whose callbacks log, a textbook Adam in
float64 to check the kernels against, a flat store on a pretend disk with the manager that
waits for its requests, and two machines the planner tests describe (``CPU_BOX``, ``GPU_BOX``)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from infinity.checkpoint.training_state import TrainingState
from infinity.planner.inputs import Hardware
from infinity.storage.transfers import ImmediateCopies

GiB = 2**30
CPU_BOX = Hardware(cpu_cores=2, host_total_bytes=24 * GiB, host_available_bytes=16 * GiB,
                   nvme_path="/swap", disk_free_bytes=100 * GiB)
"""A CPU-only machine of this project's kind: 2 cores, 24 GiB, a swap path with 100 GiB free."""
GPU_BOX = Hardware(cpu_cores=32, host_total_bytes=256 * GiB, host_available_bytes=200 * GiB,
                   gpu_name="test GPU", gpu_total_bytes=80 * GiB, gpu_free_bytes=78 * GiB,
                   nvme_path="/swap", disk_free_bytes=4096 * GiB)
"""A GPU server: one 80 GiB GPU, 32 cores, 256 GiB, 4 TiB of NVMe."""


class RecordingManager:
    """What a buffer pool asks the tier manager for (host buffers), recorded; zero-filled CPU
    tensors given back; a CPU device's copies (``copies``)."""

    device = torch.device("cpu")    # the device a TierManager's units compute on

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.dtype, str]] = []
        self.copies = ImmediateCopies()

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


class RecordingRun:
    """A run at rest (checkpoint's ``RunAtRest``) that appends each call it gets to ``log``:
    ("open", what), ("flush",), ("release",), ("gathered", unit name); ``check_open`` raises
    what ``closed(what)`` returns, when given; a unit is held by GatheredParameters when
    ``pinned``."""

    def __init__(self, log: list | None = None,
                 closed: Callable[[str], BaseException | None] | None = None,
                 pinned: bool = False) -> None:
        self.log = [] if log is None else log
        self.closed = closed
        self.pinned = pinned

    def check_open(self, what: str) -> None:
        self.log.append(("open", what))
        error = self.closed(what) if self.closed is not None else None
        if error is not None:
            raise error

    def any_pinned(self) -> bool:
        return self.pinned

    def flush(self) -> None:
        self.log.append(("flush",))

    def release_units(self) -> None:
        self.log.append(("release",))

    @contextlib.contextmanager
    def gathered(self, unit):
        self.log.append(("gathered", unit.name))
        yield


def recording_training_state(model: Any, units: list, dtype: torch.dtype, comm: Any, log: list,
                             **over: Any) -> TrainingState:
    """A TrainingState of ``units`` at step 2 (4 micro-steps of 2, stage 3, no optimizer states)
    whose run (``RecordingRun``) appends what it was called with to ``log``; ``over`` gives the
    ``manager`` and replaces any other field."""
    fields = dict(
        module=model, units=units, unit_states=[], param_groups=[], lr_scheduler=None,
        loss_scaler=None, global_steps=2, micro_steps=4, skipped_steps=0, stage=3,
        compute_dtype=dtype, gradient_accumulation_steps=2, speculation_pays=None,
        backwards_since_step=0, lendable_pools=[], run=RecordingRun(log), comm=comm)
    fields.update(over)
    return TrainingState(**fields)


def reference_adam_f64(p: torch.Tensor, gs: list[torch.Tensor], *, lr: float, beta1: float,
                       beta2: float, eps: float, weight_decay: float, adamw_mode: bool,
                       bias_correction: bool, grad_scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Textbook Adam/AdamW in float64, independent of the code under test: (p, m, v) after one
    step per gradient of ``gs``."""
    p = p.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for k, g in enumerate(gs, start=1):
        g = g.double() / grad_scale
        if not adamw_mode:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bc1 = 1 - beta1 ** k if bias_correction else 1.0
        bc2 = 1 - beta2 ** k if bias_correction else 1.0
        if adamw_mode:
            p = p * (1 - lr * weight_decay)
        p = p - lr / bc1 * m / ((v / bc2).sqrt() + eps)
    return p, m, v


class MemoryRequest:
    """An I/O request of ``MemoryStore``: its bytes move when it is waited for (once), as an
    asynchronous read or write moves them while in flight."""

    def __init__(self, move: Callable[[], Any]) -> None:
        self._move = move
        self.waited = False

    def wait(self, timeout: float | None = None) -> int:
        if not self.waited:
            self._move()
            self.waited = True
        return 0


class MemoryStore:
    """A FlatStore on a pretend disk (not resident): ``data`` holds its float32 elements,
    ``shadow`` its second extent when ``doubled``; a request is bound to its extent when issued
    (``flip`` later does not move it), and a range must start on a 4 KiB boundary as for
    O_DIRECT."""

    resident = False

    def __init__(self, numel: int, doubled: bool = False, name: str = "store") -> None:
        self.name = name
        self.data = torch.zeros(numel)
        self.shadow = torch.zeros(numel) if doubled else None
        self.flips = 0

    @property
    def doubled(self) -> bool:
        return self.shadow is not None

    def flip(self) -> None:
        self.data, self.shadow = self.shadow, self.data
        self.flips += 1

    def _extent(self, start: int, count: int | None, shadow: bool) -> tuple[torch.Tensor, int]:
        extent = self.shadow if shadow else self.data
        if extent is None:
            raise RuntimeError(f"{self.name}: no shadow extent")
        count = extent.numel() - start if count is None else count
        if start % 1024 or start < 0 or start + count > extent.numel():
            raise ValueError(f"{self.name}: range [{start}, {start + count}) is not aligned "
                             f"or not within {extent.numel()} elements")
        return extent, count

    def load_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                   shadow: bool = False) -> MemoryRequest:
        extent, count = self._extent(start, count, shadow)
        return MemoryRequest(lambda: buf[:count].copy_(extent[start:start + count]))

    def store_async(self, buf: torch.Tensor, start: int = 0, count: int | None = None,
                    shadow: bool = False) -> MemoryRequest:
        extent, count = self._extent(start, count, shadow)
        return MemoryRequest(lambda: extent[start:start + count].copy_(buf[:count]))


class WaitingManager(RecordingManager):
    """A RecordingManager that also waits for requests (``wait``), recording each call's."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple] = []

    def wait(self, *requests: Any) -> None:
        self.waits.append(requests)
        for request in requests:
            if request is not None:
                request.wait()


def least_budget_with_two_gradient_buffers(plan: Callable[[int], Any], high: int = 1 << 30) -> int:
    """The least device budget (bytes, by bisection up to ``high``) at which ``plan(budget)``
    keeps two device gradient buffers: the planner's one-or-two choice is monotone in the
    budget, so a byte under it keeps one."""
    low = 0
    while low < high:
        mid = (low + high) // 2
        if plan(mid).derived.device_grad_buffers == 2:
            high = mid
        else:
            low = mid + 1
    return low

