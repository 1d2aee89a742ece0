"""The native library is built, loaded, and reports this machine's capabilities."""
from __future__ import annotations

import os

import pytest

import infinity


def test_native_info_reports_every_capability() -> None:
    info = infinity.native_info()
    for key in ("io_uring", "libaio", "avx2", "avx512f", "f16c", "neon", "io_backend", "adam_kernel"):
        assert key in info, f"native_info() lacks {key!r}: {info}"
    assert info["version"] == infinity.__version__
    assert os.path.isfile(info["library"])


def test_cpu_features_agree_with_proc_cpuinfo() -> None:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if not flags:
        pytest.skip("no x86 flags line in /proc/cpuinfo")
    words = set(flags.split(":", 1)[1].split())
    info = infinity.native_info()
    assert info["avx2"] == ("avx2" in words)
    assert info["f16c"] == ("f16c" in words)
    assert info["avx512f"] == ("avx512f" in words)


def test_ci_machine_has_the_fast_paths() -> None:
    """In CI (this x86-64 Linux box) io_uring and AVX2 must be there: no silent fallback."""
    if not os.environ.get("CI"):
        pytest.skip("only enforced in CI (CI=true)")
    info = infinity.native_info()
    assert info["io_uring"], f"io_uring unavailable in CI: {info}"
    assert info["avx2"], f"AVX2 unavailable in CI: {info}"
