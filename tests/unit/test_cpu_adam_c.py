"""Compiles and runs native/test/test_adam.c against the loaded native library: the scalar 16-bit
conversions against the hardware's (F16C) on every rounding boundary, each SIMD kernel against the
scalar reference over many sizes/offsets/dtypes with special values, thread-count independence,
multi-range calls, -errno returns, concurrent callers and a step after fork()."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from infinity.base import native_library

ROOT = Path(__file__).resolve().parents[2]


def test_native_adam_c_suite(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler on this machine to build native/test/test_adam.c")
    lib = native_library.library_path()
    exe = tmp_path / "test_adam"
    build = subprocess.run(
        [cc, "-O2", "-std=gnu11", "-pthread", f"-I{ROOT / 'native/include'}",
         f"-I{ROOT / 'native/src'}", str(ROOT / "native/test/test_adam.c"), str(lib),
         f"-Wl,-rpath,{lib.parent}", "-o", str(exe)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"compiling test_adam.c failed:\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, f"test_adam failed:\n{run.stdout}\n{run.stderr}"
    assert " 0 failed" in run.stdout
