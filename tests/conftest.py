"""Shared test fixtures and the visible skip of GPU tests on machines without CUDA."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Tests use tiny models: one intra-op thread is as fast, and it stays fast when the machine
    # is shared (two OpenMP threads spinning against other processes on 2 cores are not).
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def disk_dir() -> Path:
    """A fresh directory on a real disk (not tmpfs), for tests that need O_DIRECT.

    Uses ``$INFINITY_TEST_DISK`` when set, else /var/tmp (a disk on most systems, unlike /tmp).
    Only the files a test creates are removed, then the directory itself.
    """
    base = os.environ.get("INFINITY_TEST_DISK", "/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="infinity-test-", dir=base))
    try:
        yield path
    finally:
        for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if child.is_dir() and not child.is_symlink():
                child.rmdir()
            else:
                child.unlink()
        path.rmdir()


@pytest.fixture
def infinity_log(caplog: pytest.LogCaptureFixture):
    """caplog that also sees the package logger (which does not propagate to the root logger)."""
    from infinity.base.log import get_logger

    # set up first: get_logger configures the logger (its level, its stderr handler) only
    # while it has no handler, so adding caplog's before left it at the root's WARNING
    logger = get_logger()
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def infinity_info_log(infinity_log: pytest.LogCaptureFixture):
    """``infinity_log`` with the package logger at INFO for the test (lines a test reads that
    a quieter default level would drop)."""
    import logging

    from infinity.base.log import get_logger

    logger = get_logger()
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield infinity_log
    finally:
        logger.setLevel(old)
