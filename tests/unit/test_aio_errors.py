"""Every AioEngine error is raised (never asserted) before any I/O where it can be, with the values."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from infinity.io import AioConfig, AioEngine, aligned_empty, backend_available, open_direct


@pytest.fixture(params=["io_uring", "libaio", "threads"])
def engine(request):
    if not backend_available(request.param):
        pytest.skip(f"aio backend {request.param} is not available on this machine")
    eng = AioEngine(AioConfig(backend=request.param, block_size=64 << 10, queue_depth=4))
    yield eng
    eng.close()


def test_missing_file_names_the_path(engine: AioEngine, disk_dir) -> None:
    path = disk_dir / "nope.dat"
    with pytest.raises(FileNotFoundError) as info:
        engine.open(path, "r")
    assert str(path) in str(info.value)


def test_writing_a_file_opened_read_only(engine: AioEngine, disk_dir) -> None:
    path = disk_dir / "ro.dat"
    path.write_bytes(bytes(8192))
    buf = aligned_empty(4096)
    with engine.open(path, "r") as f:
        with pytest.raises(OSError, match="read-only") as info:
            engine.write(buf, f, 0)
        assert info.value.errno == errno.EBADF and str(path) in str(info.value)
    with engine.open(path, "w") as f:
        with pytest.raises(OSError, match="opened with mode 'w'"):
            engine.read(buf, f, 0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permission bits")
def test_opening_a_read_only_file_for_writing(engine: AioEngine, disk_dir) -> None:
    path = disk_dir / "perm.dat"
    path.write_bytes(bytes(4096))
    path.chmod(0o444)
    with pytest.raises(PermissionError) as info:
        engine.open(path, "w")
    assert str(path) in str(info.value)


def test_misaligned_buffer_and_offset_are_refused_before_io(engine: AioEngine, disk_dir) -> None:
    path = disk_dir / "align.dat"
    path.write_bytes(b"x" * 8192)
    buf = aligned_empty(8192)
    with engine.open(path, "rw") as f:
        with pytest.raises(ValueError, match="not 512-byte aligned"):
            engine.write(buf[1:4097], f, 0)
        with pytest.raises(ValueError, match="offset 100 is not a multiple"):
            engine.read(buf, f, 100, nbytes=4096)
        with pytest.raises(ValueError, match=r"nbytes=9000 must be an int in \[0, 8192\]"):
            engine.read(buf, f, 0, nbytes=9000)
        with pytest.raises(ValueError, match="offset must be a non-negative"):
            engine.read(buf, f, -4096)
        with pytest.raises(ValueError, match="not contiguous"):
            engine.write(buf.view(2, 4096)[:, :2048], f, 0)
    assert path.read_bytes() == b"x" * 8192, "a refused request must not have touched the file"


def test_kernel_errors_carry_errno_path_and_offset(engine: AioEngine, disk_dir) -> None:
    path = disk_dir / "big.dat"
    buf = aligned_empty(4096)
    offset = 1 << 62  # beyond any filesystem's largest file
    with engine.open(path, "rw", create=True) as f:
        with pytest.raises(OSError) as info:
            engine.write(buf, f, offset).wait()
    assert info.value.errno in (errno.EFBIG, errno.EINVAL)
    msg = str(info.value)
    assert str(path) in msg and str(offset) in msg and "4096 bytes" in msg


def test_io_on_a_closed_file(engine: AioEngine, disk_dir) -> None:
    f = engine.open(disk_dir / "closed.dat", "rw", create=True)
    f.close()
    with pytest.raises(ValueError, match="closed file"):
        engine.write(aligned_empty(4096), f, 0)


def test_read_into_a_read_only_buffer(engine: AioEngine, disk_dir) -> None:
    with engine.open(disk_dir / "rob.dat", "rw", create=True) as f:
        with pytest.raises(ValueError, match="read-only buffer"):
            engine.read(bytes(4096), f, 0)


def test_o_direct_refused_names_path_filesystem_and_remedy() -> None:
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    path = os.path.join(shm, f"infinity-odirect-{os.getpid()}.dat")
    try:
        try:
            f = open_direct(path, "w", create=True)
        except OSError as exc:
            assert exc.errno == errno.EINVAL
            assert path in str(exc) and "tmpfs" in str(exc) and '"mmap"' in str(exc)
        else:
            f.close()
            pytest.skip("/dev/shm accepts O_DIRECT on this kernel")
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_unavailable_or_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"aio\.queue_depth"):
        AioConfig(queue_depth=0)
    with pytest.raises(ValueError, match=r"aio\.backend"):
        AioConfig(backend="spdk")  # type: ignore[arg-type]


def test_gpu_tensor_is_refused(engine: AioEngine, disk_dir) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: no GPU on this machine")
    with engine.open(disk_dir / "gpu.dat", "rw", create=True) as f:
        with pytest.raises(ValueError, match="host memory"):
            engine.write(torch.empty(4096, dtype=torch.uint8, device="cuda"), f, 0)


def test_o_direct_refusal_message(monkeypatch, disk_dir) -> None:
    """Where a filesystem refuses O_DIRECT (EINVAL at open), the error says what to do.

    Kernels >= 6.6 accept O_DIRECT on tmpfs, so the refusal is simulated at os.open."""
    import infinity.io.files as files

    real_open = os.open

    def refusing_open(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(files.os, "open", refusing_open)
    path = disk_dir / "refused.dat"
    with pytest.raises(OSError) as info:
        open_direct(path, "w", create=True)
    msg = str(info.value)
    assert info.value.errno == errno.EINVAL
    assert str(path) in msg and files.filesystem_of(str(disk_dir)) in msg and '"mmap"' in msg
