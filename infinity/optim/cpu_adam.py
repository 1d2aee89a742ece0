"""CPU Adam / AdamW over fp32 master weights: the native vectorized, multi-threaded kernel.

Why: the optimizer step of an offloaded model runs on the CPU and is memory-bandwidth bound
(28 B/param: read p, g, m, v; write p, m, v). The native kernel (native/src/adam*.c) does it in
one pass at memory speed and can write the 16-bit copy of the updated parameters in the same pass.

Three layers:
- ``adam_step_flat``: one flat range (the partitioned optimizer's sub-group); exact signature
  the integrator codes against.
- ``adam_step_tensors``: many tensors in ONE native call (no per-tensor overhead).
- ``CPUAdam``: a ``torch.optim.Optimizer`` whose state_dict uses torch's Adam layout
  (``exp_avg``, ``exp_avg_sq``, ``step``), so torch AdamW states load and vice versa.

``impl``: "native" (the kernel chosen at run time, or the one named by $INFINITY_ADAM_KERNEL),
a kernel name ("scalar", "avx2", "avx512", "neon") to force one, or "torch": the pure-torch path
(``_adam_torch``) with the same numbers, bit for bit. "native" falls back to "torch", with one
warning, only when the native library cannot be loaded.

[Note: Adam on the device]
With ``offload_optimizer.device: "none"`` on a GPU the master weights, moments and gradients
stay in device memory and the same step runs there (the first H100 pass refused it at the first
step: the checks took CPU tensors only, and nothing else is needed). The native kernel reads
host memory, so tensors on another device take the pure-torch path of ``_adam_torch``: the
kernel's operations one torch op at a time, each a device kernel queued on the calling
thread's current stream, where the gradient was written (no copy, no host sync but the
``grad_sq_sum`` read). Its numbers are the native kernel's up to the device's own rounding of
sqrt and division. ``impl`` names a host kernel and is not consulted there; ``in_use`` says
"torch on cuda". The gradient may be on the host (the engine's gradient home is host memory
or NVMe, never the device, today): it is carried to the device for the step, 4 bytes a
parameter more over PCIe a step, and left at zero on the host with ``zero_grad``; a device
gradient home would save that copy and the one that brought it there.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from infinity.base.log import get_logger
from infinity.base.native_info import record_in_use
from infinity.optim import _adam_native as N
from infinity.optim._adam_torch import adam_constants, step_torch
from infinity.storage.host_adds import add_widened

__all__ = ["CPUAdam", "adam_step_flat", "adam_step_tensors", "available_kernels"]

log = get_logger("optim.cpu_adam")

KERNEL_ENV = "INFINITY_ADAM_KERNEL"
IMPLS = ("native", "torch", "scalar", "avx2", "avx512", "neon")
_GRAD_DTYPES = {torch.float32: N.DTYPE_F32, torch.bfloat16: N.DTYPE_BF16, torch.float16: N.DTYPE_F16}
_HALF_DTYPES = {torch.bfloat16: N.DTYPE_BF16, torch.float16: N.DTYPE_F16}
_fallback_warned = False


def available_kernels() -> list[str]:
    """The native kernels this CPU and build can run (empty when the library is unavailable)."""
    try:
        return [k for k in ("scalar", "avx2", "avx512", "neon") if N.kernel_supported(k)]
    except (ImportError, AttributeError, OSError):
        return []


def _native_or_none() -> str | None:
    """None when the native library is usable, else why not (warned once)."""
    global _fallback_warned
    try:
        N.lib()
        return None
    except (ImportError, AttributeError, OSError) as exc:
        if not _fallback_warned:
            _fallback_warned = True
            msg = (f"infinity CPU Adam: native library unavailable ({exc}); using the pure-torch "
                   "path (same numbers, several times slower). Build the package to fix this.")
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
        return str(exc)


def _resolve(impl: str) -> tuple[str, int]:
    """(name used, native kernel id or -1 for the torch path) for an ``impl`` argument."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch", -1
    if impl == "native":
        forced = os.environ.get(KERNEL_ENV, "").strip().lower()
        if forced in ("", "auto"):
            if _native_or_none() is not None:
                return "torch", -1
            name = N.best_kernel()
            return name, N.KERNELS[name]
        if forced not in N.KERNELS or forced == "auto":
            raise ValueError(f"{KERNEL_ENV}={forced!r} is not a kernel; use one of "
                             "scalar, avx2, avx512, neon (or unset it)")
        impl = forced
    N.lib()  # a forced kernel needs the library: no silent fallback
    if not N.kernel_supported(impl):
        raise RuntimeError(f"Adam kernel {impl!r} cannot run on this CPU/build; available: "
                           f"{available_kernels()}")
    return impl, N.KERNELS[impl]


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_hyperparameters(hyper: dict) -> None:
    """One param group's values (``AdamKernel.hyper``) as the kernel checks them at a step."""
    _check_hparams(1, float(hyper["lr"]), hyper["beta1"], hyper["beta2"], hyper["eps"],
                   hyper["weight_decay"], hyper["bias_correction"], 1.0)


def _check_hparams(step: int, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, bias_correction: bool, grad_scale: float) -> None:
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr}")
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b}")
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")
    if not (math.isfinite(grad_scale) and grad_scale > 0.0):
        raise ValueError(f"grad_scale must be a finite number > 0, got {grad_scale}")
    if bias_correction and step < 1:
        raise ValueError(f"step must be >= 1 with bias correction (the step being taken, counted "
                         f"from 1), got {step}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_group(names: Sequence[str], tensors: Sequence[torch.Tensor | None], flat: bool) -> None:
    """ValueError naming the argument for any device/layout/dtype/size/overlap mismatch."""
    param = tensors[0]
    for name, t in zip(names, tensors):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != param.device and not (t is tensors[1] and t.device.type == "cpu"):
            raise ValueError(f"{name} is on {t.device} but {names[0]} on {param.device}: all "
                             "must be on one device")
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense strided tensor, got layout {t.layout}")
        if flat and t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()}); pass "
                             f"{name}.contiguous() and copy back, or a flat buffer")
        if t.numel() != param.numel():
            raise ValueError(f"{name} has {t.numel()} elements but {names[0]} has "
                             f"{param.numel()}: all must be equal")
    for name in (names[0], names[2], names[3]):
        t = tensors[names.index(name)]
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if tensors[1].dtype not in _GRAD_DTYPES:
        raise ValueError(f"{names[1]} must be float32, bfloat16 or float16, got {tensors[1].dtype}")
    half = tensors[4]
    if half is not None and half.dtype not in _HALF_DTYPES:
        raise ValueError(f"{names[4]} must be bfloat16 or float16, got {half.dtype}")
    if param.numel() == 0:
        return
    spans = [(n, _span(t)) for n, t in zip(names, tensors) if t is not None]
    for i, (na, (a0, a1)) in enumerate(spans):
        for nb, (b0, b1) in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{na} and {nb} overlap in memory ([{a0:#x}, {a1:#x}) and "
                                 f"[{b0:#x}, {b1:#x})): each must be its own buffer")


_FLAT_NAMES = ("param", "grad", "exp_avg", "exp_avg_sq", "half_out")


def adam_step_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, adamw_mode: bool = True,
                   bias_correction: bool = True, grad_scale: float = 1.0,
                   half_out: torch.Tensor | None = None, threads: int | None = None,
                   impl: str = "native", grad_sq_sum: bool = False,
                   zero_grad: bool = False,
                   addends: Sequence[tuple[int, torch.Tensor]] = ()) -> float | None:
    """One Adam/AdamW step of a flat range, in place.

    All tensors are 1-D contiguous tensors of equal numel on one device (the host, or a
    GPU: [Note: Adam on the device]): param, exp_avg, exp_avg_sq fp32;
    grad fp32, bf16 or fp16 (divided by ``grad_scale``); ``half_out`` (optional) bf16 or fp16
    receives the updated param rounded as ``param.to(half_out.dtype)`` would. ``step`` is the
    step being taken, from 1. ``threads``: default the CPUs this process may use. ``impl``: see
    the module docstring. ``grad_sq_sum``: also return sum(grad**2) in float64, of the gradient
    as given (summed in the same pass, while each chunk is in cache). ``zero_grad``: leave
    ``grad`` at zero, each chunk zeroed right after its update while it is in cache (a gradient
    accumulated in place, which the next backward adds into again: no pass of its own over it).
    ``addends``: parts of the gradient still apart from it, (offset in the range, 1-D values of
    any float dtype), added into ``grad`` (fp32) in the order given before the step, each chunk
    while in cache (the adds' bits, then the step's; the norm is of the completed gradient);
    only with ``zero_grad``. Raises ValueError naming the argument on any mismatch.
    """
    _check_group(_FLAT_NAMES, (param, grad, exp_avg, exp_avg_sq, half_out), flat=True)
    if addends:
        _check_addends(grad, addends, zero_grad)
    return _step_many([(param, grad, exp_avg, exp_avg_sq, half_out)], step=int(step),
                      lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                      weight_decay=float(weight_decay), adamw_mode=bool(adamw_mode),
                      bias_correction=bool(bias_correction), grad_scale=float(grad_scale),
                      threads=threads, impl=impl, grad_sq_sum=grad_sq_sum, zero_grad=zero_grad,
                      addends=tuple(addends))


def _check_addends(grad: torch.Tensor, addends: Sequence[tuple[int, torch.Tensor]],
                   zero_grad: bool) -> None:
    if not zero_grad:
        raise ValueError("addends are folded into a gradient the step leaves at zero: pass "
                         "zero_grad=True with them")
    if grad.dtype != torch.float32:
        raise ValueError(f"addends need a float32 grad to add into, got {grad.dtype}")
    for i, (offset, values) in enumerate(addends):
        if values.dtype not in _GRAD_DTYPES or values.device != grad.device or \
                values.dim() != 1 or not values.is_contiguous():
            raise ValueError(f"addends[{i}]: expected a contiguous 1-D tensor of float32, "
                             f"bfloat16 or float16 on the grad's {grad.device}, got "
                             f"{values.dtype} {tuple(values.shape)} on {values.device}")
        if offset < 0 or offset + values.numel() > grad.numel():
            raise ValueError(f"addends[{i}]: elements [{offset}, {offset + values.numel()}) lie "
                             f"outside the range's {grad.numel()}")


def adam_step_tensors(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                      step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True,
                      grad_scale: float = 1.0,
                      half_outs: Sequence[torch.Tensor | None] | None = None,
                      threads: int | None = None, impl: str = "native") -> None:
    """Like ``adam_step_flat`` for many contiguous tensors (any shapes) in ONE native call: the
    threads share the work of all of them, so small tensors cost no per-call overhead. All grads
    must share one dtype, and all half_outs one dtype (or all be None)."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(f"params, grads, exp_avgs, exp_avg_sqs must have equal lengths, got "
                         f"{n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}")
    if half_outs is not None and len(half_outs) != n:
        raise ValueError(f"half_outs has {len(half_outs)} entries but params has {n}")
    rows = []
    for i in range(n):
        h = None if half_outs is None else half_outs[i]
        row = (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], h)
        _check_group(tuple(f"{k}[{i}]" for k in ("params", "grads", "exp_avgs", "exp_avg_sqs",
                                                 "half_outs")), row, flat=False)
        rows.append(row)
    _step_many(rows, step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2),
               eps=float(eps), weight_decay=float(weight_decay), adamw_mode=bool(adamw_mode),
               bias_correction=bool(bias_correction), grad_scale=float(grad_scale),
               threads=threads, impl=impl)


def _step_many(rows: list[tuple], *, step: int, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, adamw_mode: bool, bias_correction: bool,
               grad_scale: float, threads: int | None, impl: str,
               grad_sq_sum: bool = False, zero_grad: bool = False,
               addends: tuple[tuple[int, torch.Tensor], ...] = ()) -> float | None:
    """Rows of (param, grad, exp_avg, exp_avg_sq, half_out or None), already checked; with
    ``grad_sq_sum``, returns the sum of the gradients' squares; with ``zero_grad`` the grads are
    left at zero."""
    _check_hparams(step, lr, beta1, beta2, eps, weight_decay, bias_correction, grad_scale)
    if threads is None:
        threads = _default_threads()
    elif int(threads) < 1:
        raise ValueError(f"threads must be >= 1 (or None for the CPUs this process may use), "
                         f"got {threads}")
    rows = [r for r in rows if r[0].numel() > 0]
    gdts = {r[1].dtype for r in rows}
    hdts = {None if r[4] is None else r[4].dtype for r in rows}
    if len(gdts) > 1:
        raise ValueError(f"all grads of one call must share a dtype, got {sorted(map(str, gdts))}")
    if len(hdts) > 1:
        raise ValueError(f"all half_outs of one call must share a dtype (or all be None), got "
                         f"{sorted(map(str, hdts))}")
    devices = {r[0].device for r in rows}
    if len(devices) > 1:
        raise ValueError(f"all tensors of one call must be on one device, got "
                         f"{sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu":
        name, kernel = _resolve(impl)
    else:           # see [Note: Adam on the device]
        name, kernel = f"torch on {device.type}", -1
    record_in_use("adam_kernel", name)
    if not rows:
        return 0.0 if grad_sq_sum else None
    if kernel < 0:
        c = adam_constants(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, adamw_mode=adamw_mode,
                           bias_correction=bias_correction, grad_scale=grad_scale)
        total = 0.0
        for p, g, m, v, h in rows:
            for offset, values in addends:      # one row where there are any (flat)
                add_widened(g[offset:offset + values.numel()], values)
            if grad_sq_sum:
                wide = g.reshape(-1).double()
                total += float(torch.dot(wide, wide))
            step_torch(p.view(-1), g.view(-1).to(p.device), m.view(-1), v.view(-1),
                       None if h is None else h.view(-1), c)
            if zero_grad:
                g.zero_()
        return total if grad_sq_sum else None
    hp = N.HParams(lr, beta1, beta2, eps, weight_decay, grad_scale, step, int(adamw_mode),
                   int(bias_correction))
    ranges = (N.TensorRange * len(rows))()
    for i, (p, g, m, v, h) in enumerate(rows):
        r = ranges[i]
        r.param, r.grad, r.exp_avg, r.exp_avg_sq = (p.data_ptr(), g.data_ptr(), m.data_ptr(),
                                                    v.data_ptr())
        r.half_out = None if h is None else h.data_ptr()
        r.numel = p.numel()
    hdt = hdts.pop()
    gdt, hdt = _GRAD_DTYPES[gdts.pop()], N.DTYPE_NONE if hdt is None else _HALF_DTYPES[hdt]
    if addends:
        folded = (N.Addend * len(addends))(*[
            N.Addend(0, _GRAD_DTYPES[values.dtype], offset, values.numel(), values.data_ptr())
            for offset, values in addends])
        total = N.step_fold(hp, ranges, folded, hdt, kernel, int(threads), grad_sq_sum)
        return total if grad_sq_sum else None
    if zero_grad:
        total = N.step_zero(hp, ranges, gdt, hdt, kernel, int(threads), grad_sq_sum)
        return total if grad_sq_sum else None
    run = N.step_norm if grad_sq_sum else N.step
    return run(hp, ranges, gdt, hdt, kernel, int(threads))


def _scalar(x: float | torch.Tensor, what: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{what} must be a number or a 1-element tensor, got shape "
                             f"{tuple(x.shape)}")
        return float(x.item())
    return float(x)


class CPUAdam(torch.optim.Optimizer):
    """Adam (``adamw_mode=False``: L2 weight decay added to the gradient, like torch.optim.Adam) or
    AdamW (default: decoupled weight decay, like torch.optim.AdamW) over fp32 CPU parameters.

    Each param group is stepped in one native call (all its tensors share the threads). State per
    parameter is torch's: ``step`` (0-dim float32 tensor), ``exp_avg``, ``exp_avg_sq``. ``lr`` may
    be a float or a 0-dim tensor; LR schedulers work as with torch optimizers. ``threads``: the
    CPUs this process may use by default. ``impl``: "native" (default), a kernel name, or "torch".
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                 bias_correction: bool = True, *, threads: int | None = None,
                 impl: str = "native") -> None:
        lr_f = _scalar(lr, "lr")
        if not (math.isfinite(lr_f) and lr_f >= 0.0):
            raise ValueError(f"Invalid learning rate: {lr_f} (must be finite and >= 0)")
        if not (0.0 <= float(betas[0]) < 1.0 and 0.0 <= float(betas[1]) < 1.0):
            raise ValueError(f"Invalid betas: {tuple(betas)} (each must be in [0, 1))")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if threads is not None and int(threads) < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self.threads = threads
        self.impl = impl
        # decoupled_weight_decay mirrors adamw_mode so that torch's Adam/AdamW loading this
        # optimizer's state_dict keeps the same weight-decay form (torch defaults it to False).
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        adamw_mode=bool(adamw_mode), bias_correction=bool(bias_correction),
                        decoupled_weight_decay=bool(adamw_mode), amsgrad=False, maximize=False)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            _adopt_group(group, self.defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this class's or torch Adam/AdamW's state_dict (same layout). A torch group's
        ``decoupled_weight_decay`` decides the mode when it has no ``adamw_mode``; amsgrad and
        maximize are not supported and are refused."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            _adopt_group(group, self.defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        by_step: dict[int, list[tuple]] = {}
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (strided home, contiguous work)
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError("CPUAdam does not support sparse gradients (got a "
                                   f"{g.layout} grad for a parameter of shape {tuple(p.shape)}); use "
                                   "torch.optim.SparseAdam for embeddings with sparse=True")
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise TypeError(f"CPUAdam steps float32 CPU parameters (fp32 masters); got "
                                f"{p.dtype} on {p.device} for a parameter of shape "
                                f"{tuple(p.shape)}")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if not torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            state["step"] += 1
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if not g.is_contiguous():
                g = g.contiguous()
            pw, mw, vw = p.detach(), m, v
            if not (p.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
                # e.g. a transposed parameter, or a loaded state with other strides: step
                # contiguous copies and copy the results back
                pw, mw, vw = (t.detach().contiguous() for t in (p, m, v))
                copy_back += [(p, pw), (m, mw), (v, vw)]
            by_step.setdefault(int(state["step"].item()), []).append((pw, g, mw, vw))
        beta1, beta2 = (_scalar(b, "betas") for b in group["betas"])
        for step, rows in by_step.items():
            ps, gs, ms, vs = (list(col) for col in zip(*rows))
            adam_step_tensors(ps, gs, ms, vs, step=step, lr=_scalar(group["lr"], "lr"),
                              beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                              weight_decay=float(group["weight_decay"]),
                              adamw_mode=group["adamw_mode"],
                              bias_correction=group["bias_correction"],
                              threads=self.threads, impl=self.impl)
        for home, work in copy_back:
            if home.data_ptr() != work.data_ptr():
                home.copy_(work)


def _adopt_group(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Fill a (possibly torch-made) param group with this optimizer's keys, or refuse it."""
    for key in ("amsgrad", "maximize"):
        if group.get(key):
            raise ValueError(f"CPUAdam does not support {key}=True (found in a loaded param group)")
    if "adamw_mode" not in group:
        group["adamw_mode"] = bool(group.get("decoupled_weight_decay", defaults["adamw_mode"]))
    group.setdefault("bias_correction", True)
    group["decoupled_weight_decay"] = bool(group["adamw_mode"])
    group.setdefault("amsgrad", False)
    group.setdefault("maximize", False)
