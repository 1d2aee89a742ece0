"""No growth of file descriptors or memory over 10,000 requests on any backend."""
from __future__ import annotations

import os

import pytest

from infinity.io import AioConfig, AioEngine, aligned_empty, backend_available, wait_all


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def churn(eng: AioEngine, path, nreq: int) -> None:
    """nreq small requests (writes and reads, 64 in flight), each file reopened every 1000."""
    buf = aligned_empty(64 * 4096)
    done = 0
    while done < nreq:
        with eng.open(path, "rw", create=True) as f:
            for _ in range(1000 // 64 + 1):
                n = min(64, nreq - done)
                if n <= 0:
                    break
                op = eng.write if (done // 64) % 2 == 0 else eng.read
                wait_all([op(buf[i * 4096:(i + 1) * 4096], f, i * 4096) for i in range(n)])
                done += n


@pytest.mark.parametrize("backend", ["io_uring", "libaio", "threads", "mmap"])
def test_ten_thousand_requests_leak_nothing(backend: str, disk_dir) -> None:
    if not backend_available(backend):
        pytest.skip(f"aio backend {backend} is not available on this machine")
    path = disk_dir / "churn.dat"
    # Warm up: the first engine/requests allocate lasting things (ctypes, torch, glibc arenas).
    with AioEngine(AioConfig(backend=backend, block_size=4096, queue_depth=16)) as eng:
        churn(eng, path, 1000)
    fds0, rss0 = open_fds(), rss_bytes()
    for _ in range(2):  # engines are created and closed too
        with AioEngine(AioConfig(backend=backend, block_size=4096, queue_depth=16)) as eng:
            churn(eng, path, 5000)
            assert eng.in_flight == 0
    assert open_fds() == fds0, "file descriptors leaked"
    grown = rss_bytes() - rss0
    assert grown < 1 << 20, f"resident memory grew by {grown} bytes over 10,000 requests"
