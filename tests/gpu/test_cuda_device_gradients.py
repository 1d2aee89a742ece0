"""Gradients reduced on a GPU ([Note: gradients reduced on the device] in
optim/device_gradients.py) on one GPU, the two ranks' collectives computed in process on the
device (the other rank's gradient given): skipped visibly without CUDA, run by
tools/gpu_check.sh where a GPU is lent. The real two-rank NCCL reduce runs through the same path
in tests/gpu/test_cuda_ranks.py (needs 2 GPUs).

Checked: the collector takes the device path on CUDA (a real TierManager, CudaCopies); the own
shard that reaches the pinned host buffer is bit for bit what the host path on the CPU gives
(the same fp32 adds, and a mean of two that is exact on either device); only the shard is
copied; and with one kept buffer the next unit's reduce, queued on the compute stream right
behind a 256 MiB copy out, waits for that copy's event (its gradients fill the buffer's front
meanwhile; the first unit's shard is its own, not the second's). With the communication dtype bf16 (bf16 gradients): the buffer is bf16, the
shard crosses PCIe in bf16 into the back half of its pinned host buffer and is widened there at
the wait, and equals ``float(bf16(bf16(a + b) / 2))`` bit for bit (the rule of
tests/unit/test_device_gradients_dtype.py, computed on the CPU); the 128 MiB bf16 copy out is
waited for by the next unit's reduce as the fp32 one is."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from fakes import MemoryStore  # noqa: E402
from test_gradients import _Rig, _unit  # noqa: E402

from infinity.base.budget import MemoryBudget
from infinity.optim.gradients import GradientCollector
from infinity.optim.held_room import HeldRoom
from infinity.optim.records import OptimTimers, UnitOptimState
from infinity.storage.buffer_pool import BufferPool
from infinity.storage.manager import TierManager
from infinity.storage.transfers import CudaCopies

pytestmark = pytest.mark.gpu

F32 = torch.float32


class _TwoRanksOn:
    """Rank ``rank`` of two, the other rank's flat gradient given, on its device."""

    active = True
    world_size = 2

    def __init__(self, rank: int, other: torch.Tensor) -> None:
        self.rank, self.other = rank, other

    def reduce_scatter_mean(self, output, source, tag=None) -> None:
        n = output.numel()
        other = self.other.to(source.device)
        output.copy_(((source + other) / 2)[self.rank * n:(self.rank + 1) * n])

    def all_reduce_mean(self, tensor, tag=None) -> None:
        tensor.copy_((tensor + self.other.to(tensor.device)[:tensor.numel()]) / 2)

    def any_mask(self, mask):
        return mask | True


def _cuda_collector(units, comm, *, shards, buffers: int | None = None, dtype: str = "fp32"):
    manager = TierManager(host_budget=MemoryBudget("host", None),
                          device_budget=MemoryBudget("device", None),
                          device=torch.device("cuda"))
    assert isinstance(manager.copies, CudaCopies)
    states = [UnitOptimState(u, None, None, None, MemoryStore(max(1, s[1] - s[0]), name="grad"),
                             shard=s) for u, s in zip(units, shards)]
    largest = max(u.flat_numel for u in units)
    pool = BufferPool(manager, largest * 4, 2, "gradient")
    collector = GradientCollector(
        states, manager, early_step=False, holds_grads=False, grad_pool=pool,
        held_room=HeldRoom(0), timers=OptimTimers(), max_trainable=largest,
        steps_running=lambda: False, speculates=lambda state: False, comm=comm, scatter=True,
        device_buffers=buffers, device_dtype=dtype)
    return manager, states, collector


def test_the_shard_reduced_on_the_gpu_is_the_cpu_host_path_s_bit_for_bit() -> None:
    shapes = ((40, 50), (900,))
    gen = torch.Generator().manual_seed(3)
    other = torch.randn(4096, generator=gen)
    g0, g1, g1b = (torch.randn(*s, generator=gen) for s in ((40, 50), (900,), (900,)))
    host_comm = _TwoRanksOn(1, other)
    host = _Rig([_unit(0, shapes, comm=host_comm, shards=2)], home="disk", comm=host_comm,
                scatter=True, shards=[(2048, 3072)])
    state = host.states[0]
    for i, g in ((0, g0), (1, g1), (1, g1b)):
        host.grad(state, i, g)
    host.g.reduce(state)
    want = host.g.finish(state, write_home=False)

    unit = _unit(0, shapes, comm=host_comm, shards=2)
    manager, (dstate,), collector = _cuda_collector([unit], _TwoRanksOn(1, other.cuda()),
                                                    shards=[(2048, 3072)])
    assert collector.device_pool is not None
    for i, g in ((0, g0), (1, g1), (1, g1b)):
        collector.on_grad(unit, unit.trainable_entries()[i], g.cuda())
    assert dstate.grad.buffer is None and dstate.grad.device.tensor.is_cuda
    collector.reduce(dstate)
    assert len(dstate.grad.copies) == 1 and dstate.grad.buffer.numel() == 1024
    got = collector.finish(dstate, write_home=False)
    assert got.device.type == "cpu" and torch.equal(got.view(torch.int32), want.view(torch.int32))
    collector.close()
    manager.copies.drain()


def test_a_bf16_reduce_on_the_gpu_gives_the_rounded_sum_s_half() -> None:
    shapes = ((40, 50), (900,))
    gen = torch.Generator().manual_seed(3)
    bf16 = torch.bfloat16
    other = (torch.randn(4096, generator=gen) * 3).to(bf16)
    g0, g1, g1b = ((torch.randn(*s, generator=gen) * 3).to(bf16)
                   for s in ((40, 50), (900,), (900,)))
    comm = _TwoRanksOn(1, other.cuda())
    unit = _unit(0, shapes, comm=comm, shards=2)
    manager, (state,), collector = _cuda_collector([unit], comm, shards=[(2048, 3072)],
                                                   dtype="bf16")
    for i, g in ((0, g0), (1, g1), (1, g1b)):
        collector.on_grad(unit, unit.trainable_entries()[i], g.cuda())
    assert state.grad.device.tensor.dtype == bf16 and state.grad.device.tensor.is_cuda
    collector.reduce(state)
    assert state.grad.buffer.is_pinned()       # the staging is its back half: a real async copy
    got = collector.finish(state, write_home=False)
    mine = torch.zeros(4096, dtype=bf16)
    mine[0:2000] = g0.reshape(-1)
    mine[2000:2900] = (g1.float() + g1b.float()).to(bf16)
    want = ((mine.float() + other.float()).to(bf16).float() / 2).to(bf16).float()[2048:3072]
    assert got.dtype == F32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    collector.close()
    manager.copies.drain()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_device_buffer_is_written_again_only_after_its_copy_out(dtype: str) -> None:
    """One kept buffer and a 64M-element shard (256 MiB to copy out): the second unit's
    gradient and reduce are queued on the compute stream right after the first unit's copy
    began; the reduce, which writes the shard the copy reads, must wait for that copy's event,
    so the first unit's host shard holds its own mean (all 1.0), not the second's (all 5.0)."""
    numel = 128 << 20
    comm = _TwoRanksOn(0, torch.zeros(numel, device="cuda"))
    units = [_unit(i, ((numel - 4096,),), comm=comm, shards=2) for i in range(2)]
    flat = units[0].flat_numel
    shard = (0, flat // 2)
    grad_dtype = torch.bfloat16 if dtype == "bf16" else F32
    manager, (a, b), collector = _cuda_collector(units, _TwoRanksOn(0, torch.zeros(
        flat, device="cuda", dtype=grad_dtype)), shards=[shard, shard], buffers=1, dtype=dtype)
    entry = units[0].trainable_entries()[0]
    collector.on_grad(units[0], entry, torch.full(entry.shape, 2.0, device="cuda",
                                                  dtype=grad_dtype))
    collector.reduce(a)                       # copy out of a's shard queued on its stream
    collector.on_grad(units[1], units[1].trainable_entries()[0],
                      torch.full(entry.shape, 10.0, device="cuda", dtype=grad_dtype))
    collector.reduce(b)
    assert collector.device_pool.made == 1
    got_a = collector.finish(a, write_home=False)
    got_b = collector.finish(b, write_home=False)
    assert bool((got_a[:entry.numel] == 1.0).all()) and bool((got_b[:entry.numel] == 5.0).all())
    collector.close()
    manager.copies.drain()
