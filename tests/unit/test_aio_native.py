"""Builds and runs the C test of the aio engine (native/test/test_aio.c) against the loaded library."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from infinity.base import native_library

ROOT = Path(__file__).resolve().parents[2]


def test_native_aio_c_program(tmp_path, disk_dir) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build native/test/test_aio.c")
    lib = native_library.library_path()
    exe = tmp_path / "test_aio"
    subprocess.run([cc, "-O1", "-Wall", "-Werror", "-I", str(ROOT / "native/include"),
                    str(ROOT / "native/test/test_aio.c"), str(lib), f"-Wl,-rpath,{lib.parent}",
                    "-o", str(exe)], check=True)
    run = subprocess.run([str(exe), str(disk_dir)], capture_output=True, text=True, timeout=120)
    if run.returncode == 77:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout
