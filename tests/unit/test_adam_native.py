"""optim/_adam_native.py at unit level: the ctypes mirror of
native/include/inf_adam.h. Without these tests a misspelt symbol or a wrong argtype would pass
every test: cpu_adam falls back to the torch path and the kernel tests skip when the library
"lacks" a kernel. So: where the library is built, every function is declared as the header
declares it (transcribed here by hand from the header), the native kernels are found and used,
each wrapper's result and error text are checked, and a library without a symbol is refused
naming the component."""
from __future__ import annotations

import ctypes

import pytest
import torch

from infinity.base import native_library
from infinity.optim import _adam_native as N
from infinity.optim.cpu_adam import available_kernels


def _require_library() -> None:
    try:
        native_library.lib()
    except (ImportError, OSError, native_library.NativeLibraryError) as exc:
        pytest.skip(f"the native library is not available: {exc}")


# name -> (restype, argtypes) as native/include/inf_adam.h declares them
HEADER = {
    "inf_adam_step": (ctypes.c_int, [ctypes.POINTER(N.HParams), ctypes.POINTER(N.TensorRange),
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int]),
    "inf_adam_step_norm": (ctypes.c_int, [ctypes.POINTER(N.HParams),
                                          ctypes.POINTER(N.TensorRange), ctypes.c_int,
                                          ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_double)]),
    "inf_adam_step_zero": (ctypes.c_int, [ctypes.POINTER(N.HParams),
                                          ctypes.POINTER(N.TensorRange), ctypes.c_int,
                                          ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_double)]),
    "inf_adam_step_fold": (ctypes.c_int, [ctypes.POINTER(N.HParams),
                                          ctypes.POINTER(N.TensorRange), ctypes.c_int,
                                          ctypes.POINTER(N.Addend), ctypes.c_int, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_double)]),
    "inf_grad_sq_sum": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                       ctypes.c_int, ctypes.POINTER(ctypes.c_double)]),
    "inf_adam_kernel_supported": (ctypes.c_int, [ctypes.c_int]),
    "inf_adam_kernel_best": (ctypes.c_int, []),
    "inf_adam_kernel_name": (ctypes.c_char_p, [ctypes.c_int]),
    "inf_adam_rmw_bandwidth": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]),
}


def test_every_function_is_declared_as_the_header_declares_it() -> None:
    """A wrong argtype (a void pointer for a struct pointer) lets a call with the wrong struct
    through to C; a wrong restype reads the return as something else."""
    _require_library()
    lib = N.lib()
    for name, (restype, argtypes) in HEADER.items():
        fn = getattr(lib, name)
        assert fn.restype is restype, name
        assert list(fn.argtypes) == argtypes, name
    # the struct pointers are checked by ctypes: the ranges' struct where the hparams go fails
    with pytest.raises(ctypes.ArgumentError):
        lib.inf_adam_step(ctypes.byref(N.TensorRange()), None, 0, 0, -1, 0, 1)


def test_the_native_kernels_are_found_and_named() -> None:
    """Where the library is built the scalar kernel is always there (cpu_adam's fallback to
    torch must not be what the tests see), "auto" resolves to a real kernel, and every id has
    its name back."""
    _require_library()
    assert N.kernel_supported("scalar") is True
    assert "scalar" in available_kernels()
    assert N.best_kernel() in ("scalar", "avx2", "avx512", "neon")
    for name, kid in N.KERNELS.items():
        assert N.lib().inf_adam_kernel_name(kid).decode() == name
        assert N.KERNEL_NAMES[kid] == name


def _one_range(n: int = 5, grad: torch.Tensor | None = None):
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    g = torch.arange(1.0, n + 1) if grad is None else grad
    ranges = (N.TensorRange * 1)(N.TensorRange(p.data_ptr(), g.data_ptr(), m.data_ptr(),
                                               v.data_ptr(), None, n))
    hp = N.HParams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_scale=1.0,
                   step=1, adamw_mode=1, bias_correction=1)
    return hp, ranges, (p, g, m, v)


def test_a_step_and_a_step_with_the_norm_move_the_parameters() -> None:
    _require_library()
    hp, ranges, (p, g, m, v) = _one_range()
    N.step(hp, ranges, N.DTYPE_F32, N.DTYPE_NONE, N.KERNELS["scalar"], 1)
    assert bool((p < 0).all()) and torch.allclose(m, 0.1 * g)
    hp, ranges, (p, g, m, v) = _one_range()
    assert N.step_norm(hp, ranges, N.DTYPE_F32, N.DTYPE_NONE, N.KERNELS["scalar"], 1) == 55.0
    assert bool((p < 0).all())
    assert N.grad_sq_sum(g.data_ptr(), 5, N.DTYPE_F32, 1) == 55.0
    assert N.grad_sq_sum(g.data_ptr(), 3, N.DTYPE_F32, 2) == 14.0
    hp, ranges, (p, g, m, v) = _one_range()
    assert N.step_zero(hp, ranges, N.DTYPE_F32, N.DTYPE_NONE, N.KERNELS["scalar"], 1,
                       norm=True) == 55.0
    assert bool((p < 0).all()) and not bool(g.any())
    hp, ranges, (p, g, m, v) = _one_range()
    assert N.step_zero(hp, ranges, N.DTYPE_F32, N.DTYPE_NONE, N.KERNELS["scalar"], 1,
                       norm=False) == 0.0
    assert bool((p < 0).all()) and not bool(g.any())


def test_a_folded_addend_outside_its_range_is_refused_and_nothing_is_stepped() -> None:
    """``inf_adam_step_fold`` checks every addend before stepping: a range index, dtype or
    span outside the call is -EINVAL, the parameters untouched; one inside adds first."""
    _require_library()
    for bad in (dict(range=1), dict(dtype=7), dict(begin=3), dict(numel=-1)):
        hp, ranges, (p, g, m, v) = _one_range()
        extra = torch.ones(3)
        fields = dict(range=0, dtype=N.DTYPE_F32, begin=0, numel=3, values=extra.data_ptr())
        fields.update(bad)
        addends = (N.Addend * 1)(N.Addend(**fields))
        with pytest.raises(OSError, match="inf_adam_step_fold"):
            N.step_fold(hp, ranges, addends, N.DTYPE_NONE, N.KERNELS["scalar"], 1, norm=True)
        assert not bool(p.any()) and g.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0], bad
    hp, ranges, (p, g, m, v) = _one_range()
    extra = torch.ones(3)
    addends = (N.Addend * 1)(N.Addend(0, N.DTYPE_F32, 2, 3, extra.data_ptr()))
    assert N.step_fold(hp, ranges, addends, N.DTYPE_NONE, N.KERNELS["scalar"], 1,
                       norm=True) == 1 + 4 + 16 + 25 + 36     # 1, 2, 3+1, 4+1, 5+1
    assert bool((p < 0).all()) and not bool(g.any())


def test_native_errors_name_the_call_and_its_arguments() -> None:
    """-errno returns become OSErrors whose text names the function, the ranges, the kernel by
    name, the dtypes and the threads."""
    _require_library()
    unsupported = [k for k in ("neon", "avx512", "avx2") if k not in available_kernels()]
    if unsupported:
        hp, ranges, _ = _one_range()
        kernel = unsupported[0]
        with pytest.raises(OSError) as info:
            N.step(hp, ranges, N.DTYPE_F32, N.DTYPE_NONE, N.KERNELS[kernel], 3)
        assert str(info.value) == (f"[Errno 95] inf_adam_step(1 ranges, kernel {kernel}, grad "
                                   "dtype 0, half dtype -1, 3 threads): Operation not supported")
    hp, ranges, _ = _one_range()
    with pytest.raises(OSError) as info:
        N.step(hp, ranges, 7, N.DTYPE_BF16, N.KERNELS["scalar"], 2)
    assert str(info.value) == ("[Errno 22] inf_adam_step(1 ranges, kernel scalar, grad dtype 7, "
                               "half dtype 1, 2 threads): Invalid argument")
    with pytest.raises(OSError) as info:
        N.step_norm(hp, ranges, 7, N.DTYPE_NONE, N.KERNELS["auto"], 2)
    assert str(info.value) == ("[Errno 22] inf_adam_step_norm(1 ranges, kernel auto, grad dtype "
                               "7, 2 threads): Invalid argument")
    with pytest.raises(OSError) as info:
        N.grad_sq_sum(0, -1, N.DTYPE_F16, 4)
    assert str(info.value) == ("[Errno 22] inf_grad_sq_sum(-1 elements, grad dtype 2, 4 "
                               "threads): Invalid argument")
    with pytest.raises(OSError) as info:
        N.rmw_bandwidth(0, 0, 0, 0, -2, 1)
    assert str(info.value) == ("[Errno 22] inf_adam_rmw_bandwidth(-2 elements, 1 threads): "
                               "Invalid argument")


def test_the_bandwidth_reference_adds_b_to_a_c_and_d() -> None:
    _require_library()
    n = 1000
    a, b, c, d = torch.ones(n), torch.arange(float(n)), torch.full((n,), 2.0), torch.zeros(n)
    N.rmw_bandwidth(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), n, 2)
    assert torch.equal(a, 1 + b) and torch.equal(c, 2 + b) and torch.equal(d, b)
    assert torch.equal(b, torch.arange(float(n)))


def test_a_library_without_a_symbol_is_refused_naming_the_component(monkeypatch) -> None:
    """A library built before the CPU Adam component: NativeLibraryError saying which symbol is
    missing and which component needs it, not an AttributeError deep in a step."""

    class _OldLibrary:
        pass

    monkeypatch.setattr(native_library, "lib", lambda: _OldLibrary())
    monkeypatch.setattr(native_library, "_declared_components", set())
    monkeypatch.setattr(native_library, "library_path", lambda: "/x/libinfinity_native.so")
    with pytest.raises(native_library.NativeLibraryError) as info:
        N.lib()
    assert str(info.value) == (
        "/x/libinfinity_native.so has no inf_adam_step: it was built before the CPU Adam "
        "component; rebuild it (pip install -e . or bash tools/dev_build.sh)")
