"""Loads the native library (``native/`` built by the package build) with ctypes.

Why ctypes and not an extension module: the library has no Python or torch headers, so one build
serves every Python and torch version; ctypes releases the GIL for the duration of every call, so
waiting on I/O or running the Adam kernel never blocks other Python threads.

The library is found, in order, at ``$INFINITY_NATIVE_LIB`` (a developer's fresh cmake build), then
through importlib as ``infinity.libinfinity_native`` (works for wheels and for editable installs,
whose finder maps the installed file). There is no fallback: a missing library is an error that
says how to build it.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from pathlib import Path
from typing import Callable

LIBRARY_MODULE = "infinity.libinfinity_native"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class NativeLibraryError(ImportError):
    """The native library could not be found or loaded."""


def library_path() -> Path:
    """Where the native library is loaded from (raises NativeLibraryError when it is missing)."""
    override = os.environ.get("INFINITY_NATIVE_LIB")
    if override:
        path = Path(override)
        if not path.is_file():
            raise NativeLibraryError(
                f"INFINITY_NATIVE_LIB={override!r} does not name a file; unset it or point it at a "
                "built libinfinity_native.so")
        return path
    spec = None
    try:
        spec = importlib.util.find_spec(LIBRARY_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and Path(spec.origin).is_file():
        return Path(spec.origin)
    beside = Path(__file__).parent.parent / "libinfinity_native.so"     # in the infinity package
    if beside.is_file():
        return beside
    raise NativeLibraryError(
        "the infinity native library (libinfinity_native.so) is not built; install the package "
        "with `pip install .` (or `pip install -e .`), which compiles native/ with CMake, or set "
        "INFINITY_NATIVE_LIB to a library built with `cmake -S . -B build && cmake --build build`")


def lib() -> ctypes.CDLL:
    """The loaded native library (loaded once per process)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                path = library_path()
                try:
                    _lib = ctypes.CDLL(str(path))
                except OSError as exc:
                    raise NativeLibraryError(f"loading {path} failed: {exc}") from exc
                _declare_info(_lib)
    return _lib


_declared_components: set[str] = set()


def declare(component: str,
            signatures: Callable[[], dict[str, tuple[object, list[object]]]]) -> ctypes.CDLL:
    """The library with ``component``'s C signatures declared once; ``signatures()`` returns
    name -> (restype, argtypes) and is called only the first time (lib() is on hot paths).

    A symbol missing from the loaded library means it was built before the component existed:
    that is a NativeLibraryError saying to rebuild, not an AttributeError deep in a call.
    """
    library = lib()
    if component in _declared_components:
        return library
    with _lock:
        if component not in _declared_components:
            for name, (restype, argtypes) in signatures().items():
                try:
                    fn = getattr(library, name)
                except AttributeError as exc:
                    raise NativeLibraryError(
                        f"{library_path()} has no {name}: it was built before the {component} "
                        "component; rebuild it (pip install -e . or bash tools/dev_build.sh)") from exc
                fn.restype = restype
                fn.argtypes = argtypes
            _declared_components.add(component)
    return library


def _declare_info(library: ctypes.CDLL) -> None:
    library.inf_version.restype = ctypes.c_char_p
    library.inf_version.argtypes = []
    library.inf_cpu_features.restype = ctypes.c_uint
    library.inf_cpu_features.argtypes = []
    library.inf_probe_io_uring.restype = ctypes.c_int
    library.inf_probe_io_uring.argtypes = []
    library.inf_probe_libaio.restype = ctypes.c_int
    library.inf_probe_libaio.argtypes = []


def check(ret: int, what: str) -> int:
    """Turn a native ``-errno`` return into an OSError that names ``what``."""
    if ret < 0:
        err = -ret
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret
