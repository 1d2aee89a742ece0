"""A unit: a group of parameters fetched to the device together (usually one transformer block).

The unit owns a flat device buffer in the compute dtype; while the unit is fetched each of its
parameters is a view into it (``param.data = view``, the supported torch API; no attributes are
set on the Parameter). Releasing the unit leaves the flat buffer's storage with 0 bytes, so every
tensor autograd saved from the parameters holds no memory, and points each parameter at an
empty tensor of its dtype and device (as DeepSpeed does): a released parameter has 0 elements,
so whatever reads it outside a forward (``copy.deepcopy(model)``, ``p.numpy()``, a state dict)
sees an empty tensor instead of reading memory that is not there. Fetching gives the flat buffer
memory again, fills it from the unit's home tier (the memory itself is recycled by the device
cache, see storage/device_cache.py) and points the parameters back at it. A parameter's
identity, its name in ``named_parameters()`` and ``state_dict()``, and the autograd graph (its
saved views keep the flat buffer's storage) survive release.

[Note: flat layout]
Trainable parameters come first, grouped by optimizer param group; frozen parameters come last,
after the trainable range padded to a 4 KiB multiple of fp32 (``trainable_numel``: the range the
optimizer steps, so no frozen element may lie in it -- AdamW's decay would move it). Every
parameter starts on a 64-byte boundary (SIMD alignment for the Adam kernel); the total is padded
to a 4 KiB multiple (O_DIRECT). The optimizer steps contiguous runs of one param group (see
``AdamKernel.step_runs`` in optim/kernel.py); the gaps between parameters are zeros in params,
grads and moments alike, so stepping them is harmless and keeps runs contiguous. The arithmetic is
``infinity.planner.alignment.flat_layout`` (PARAM_ALIGN_BYTES there), which the engine's sizes
bound too.

[Note: shards]
With N data-parallel ranks at stage 1-3 the flat buffer is cut into N equal shards of
``shard_numel`` elements (``infinity.planner.alignment.shard_numel``: a multiple of 2048
elements, so each shard keeps the 4 KiB alignment; the last ones padded), and the device buffer
has ``flat_numel = N * shard_numel`` elements. Rank r owns elements [r * shard_numel, (r+1) *
shard_numel): its optimizer steps that range of the trainable part, and at stage 3 its param
home (HOST store, NVMe extent, device store) holds only that range. Fetching reads the own
shard from home into its place in the device buffer, then all-gathers the others
(``gather``). After a step changed the own shard, the device copy is stale until the next
gather; the coordinator keeps track (see [Note: collective order] in comm/collectives.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.comm.collectives import NO_COMM, Collectives
from infinity.planner.alignment import flat_layout, shard_numel
from infinity.storage.buffer_pool import wait_and_release
from infinity.storage.manager import FlatStore, TierManager
from infinity.storage.tiers import Residency, ResidencyState, Tier
from infinity.zero.protocols import UnitValues

log = get_logger("zero")


@dataclass(eq=False)
class ParamEntry:
    """One parameter of a unit: where it lives in the unit's flat buffer."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    offset: int
    numel: int
    group_index: int  # optimizer param group; -1 when frozen
    frozen_at_build: bool = False
    """``requires_grad`` was False when the unit was made: no optimizer state was made for it,
    so a later ``requires_grad_(True)`` cannot train it (``engine.guards.check_pass_start``)."""

    @property
    def trainable(self) -> bool:
        return self.group_index >= 0


def flat_nbytes(named_params: list[tuple[str, nn.Parameter, int]], dtype: torch.dtype,
                shards: int = 1) -> int:
    """``Unit(...).nbytes`` of these parameters (shapes only: meta ones do), before it is made."""
    order = sorted(named_params, key=lambda t: (t[2] < 0, t[2]))
    _, numel, _ = flat_layout([(p.numel(), group >= 0) for _, p, group in order], dtype.itemsize)
    return shards * shard_numel(numel, shards) * dtype.itemsize


class Unit:
    """Parameters fetched and released together, with their flat buffers and states."""

    def __init__(self, index: int, name: str, module: nn.Module,
                 named_params: list[tuple[str, nn.Parameter, int]], dtype: torch.dtype,
                 device: torch.device, *, comm: Collectives = NO_COMM, shards: int = 1,
                 params_sharded: bool = False) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.dtype = dtype
        self.device = device
        order = sorted(named_params, key=lambda t: (t[2] < 0, t[2]))
        offsets, self.numel, self.trainable_numel = flat_layout(
            [(param.numel(), group >= 0) for _, param, group in order], dtype.itemsize)
        self.params: list[ParamEntry] = [
            ParamEntry(name_, param, param.shape, offset, param.numel(), group,
                       frozen_at_build=not param.requires_grad)
            for (name_, param, group), offset in zip(order, offsets)]
        # see [Note: shards]: ``shards`` is the world size when states are sharded (stage >= 1)
        self.comm = comm
        self.shards = shards
        self.rank = comm.rank if shards > 1 else 0
        self.shard_numel = shard_numel(self.numel, shards)
        self.flat_numel = shards * self.shard_numel
        self.shard_start = self.rank * self.shard_numel
        self.params_sharded = params_sharded and shards > 1
        self.residency = ResidencyState(f"unit {name}")
        self.persistent = False
        self.param_home = Tier.DEVICE
        self.param_store: FlatStore | None = None
        self.flat = torch.empty(0, dtype=dtype, device=device)
        self._released_data = torch.empty(0, dtype=dtype, device=device)
        self.fetch_request = None
        self.fetch_slot = None
        # a prefetch already copied to the device from its slot or host home: the copy's
        # event (``advance_fetch``, ``_copy_home``; see [Note: copy events] in
        # storage/transfers.py)
        self.copy_event = None
        # an all-gather issued ahead of use and not yet waited on by compute (``gather_ahead``;
        # see [Note: gathers issued ahead] in zero/gather_ahead.py): the unit is held until then
        self.gather_event = None
        # the copy that filled the device buffer at the last fetch (``wait_fetched``)
        self.fetch_event = None
        # the same copy, kept until the buffer is let go: a step's write into the buffer is
        # ordered after it (see [Note: the step's writes do not queue behind fetches] in
        # storage/transfers.py); set once at the copy's issue, so the step stream's thread
        # reads it while the training thread moves ``copy_event`` to ``fetch_event``
        self.fill_event = None
        self.fetch_count = 0
        self.prefetch_hits = 0

    # -- properties ----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the device buffer (all shards, with their padding)."""
        return self.flat_numel * self.flat.element_size()

    @property
    def home_numel(self) -> int:
        """Elements the param home holds: the own shard, or the whole buffer."""
        return self.shard_numel if self.params_sharded else self.numel

    @property
    def home_start(self) -> int:
        """Where the param home's first element lies in the flat buffer."""
        return self.shard_start if self.params_sharded else 0

    @property
    def own_flat(self) -> torch.Tensor:
        """The part of the device buffer the param home holds."""
        return self.flat[self.home_start:self.home_start + self.home_numel]

    def gather(self) -> None:
        """Fill the other ranks' shards of the device buffer from them (its own shard is
        current); a no-op with one rank. Every rank calls it at the same point (see [Note:
        collective order] in comm/collectives.py)."""
        if self.shards > 1:
            self.comm.all_gather(self.flat, tag=self.index)

    def gather_ahead(self) -> None:
        """``gather`` issued now and left in flight (``overlap_comm``): the unit must be fetched
        with its own shard current, and stays so until ``wait_gather`` (or ``drop_gather``);
        every rank issues it at the same point (see [Note: gathers issued ahead] in
        zero/gather_ahead.py)."""
        if self.gather_event is not None or self.residency != Residency.FETCHED:
            raise RuntimeError(f"unit {self.name}: an all-gather issued ahead needs a fetched "
                               f"unit with none in flight (residency {self.residency.value.name}, "
                               f"one in flight: {self.gather_event is not None})")
        if self.params_sharded:
            self.gather_event = self.comm.all_gather_async(self.flat, tag=self.index)

    @property
    def gathered_ahead(self) -> bool:
        """An all-gather issued ahead is in flight or not yet waited on by compute."""
        return self.gather_event is not None

    def wait_gather(self) -> None:
        """Compute that reads the parameters runs after the gather issued ahead (on a GPU the
        compute stream waits on its event; on a CPU the thread waits)."""
        event, self.gather_event = self.gather_event, None
        if event is not None:
            self.comm.compute_waits(event)

    def drop_gather(self) -> None:
        """A gather issued ahead that no use will wait on (the pass ended first): wait for it
        (its bytes are written into the buffer), so that the unit may be released."""
        event, self.gather_event = self.gather_event, None
        if event is not None:
            event.wait()

    @property
    def has_trainable(self) -> bool:
        return self.trainable_numel > 0

    @property
    def has_frozen(self) -> bool:
        return any(not p.trainable for p in self.params)

    def trainable_entries(self) -> list[ParamEntry]:
        return [p for p in self.params if p.trainable]

    # -- building ------------------------------------------------------------------------
    def adopt(self, manager: TierManager, param_home: Tier, persistent: bool, staging=None,
              doubled: bool = False, values: UnitValues | None = None,
              write_behind: bool = False, from_rank0: bool = False) -> Callable[[], None] | None:
        """Take the parameters' current values into the flat buffer and point them at it.

        With a HOST/NVME param home the values go to the home tier and the unit ends RELEASED
        (unless persistent); with a DEVICE home the unit stays FETCHED for good. ``values``:
        the parameters it provides are read from it instead (a pretrained checkpoint), only
        the range the home holds when the unit is released after (its own shard at stage 3).
        ``write_behind``: an NVMe home written straight from page-aligned host memory is left
        in flight, and a callable is returned that waits for the write and releases the unit
        (the caller fills the next unit meanwhile; until it is called this unit stays FETCHED
        and holds its device memory); None when nothing was left in flight. ``from_rank0``:
        the parameters' values are each rank's own (a model built outside ``zero.Init``, or
        values drawn by each rank's generator beside loaded ones): the unit takes rank 0's, as
        DDP and DeepSpeed make the ranks start from one model (each rank kept its own: stage 0
        trained a model per rank, stages 1-3 mixed the ranks').
        """
        # sharded at stage 3, a DEVICE home holds the own shard (see [Note: shards])
        self.persistent = persistent or (param_home is Tier.DEVICE and not self.params_sharded)
        # A persistent unit's device copy is its only home (no second copy on host or NVMe).
        self.param_home = Tier.DEVICE if self.persistent else param_home
        self._allocate_device(manager)
        with torch.no_grad():
            if values is None:
                self.flat.zero_()
                for entry in self.params:
                    self.flat[entry.offset:entry.offset + entry.numel].copy_(
                        entry.param.detach().reshape(-1))
                if from_rank0 and self.comm is not None:
                    self.comm.broadcast(self.flat, 0)
            else:
                lo, hi = (0, self.flat_numel) if self.persistent else \
                    (self.home_start, self.home_start + self.home_numel)
                self.fill_range(values, lo, hi, self.flat[lo:hi])
                if from_rank0 and self.comm is not None and not self.params_sharded:
                    self.comm.broadcast(self.flat, 0)     # the values drawn beside the loaded
        self.residency.to(Residency.FETCHED)
        self._point_params()
        if not self.persistent:
            # doubled: the speculative step writes parameters to a shadow extent
            self.param_store = manager.create(f"{self.name}.params", self.home_numel, self.dtype,
                                              self.param_home, doubled=doubled)
            if write_behind and staging is None and self.flat_on_aligned_host and \
                    not self.param_store.resident:
                requests = self._write_direct(manager)

                def finish() -> None:
                    try:
                        manager.wait(*requests)
                    finally:
                        self.release(manager)
                return finish
            self.write_home(manager, staging)
            self.release(manager)
        return None

    def fill_range(self, values: UnitValues, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` = elements [lo, hi) of the flat buffer's layout: the parameters ``values``
        provides read from it, the others' current values, zeros between them."""
        cursor = lo
        pieces = []
        for entry in sorted(self.params, key=lambda e: e.offset):
            x, y = max(lo, entry.offset), min(hi, entry.offset + entry.numel)
            if x >= y:
                continue
            if cursor < x:
                out[cursor - lo:x - lo].zero_()
            piece = out[x - lo:y - lo]
            if values.provides(entry.name):
                pieces.append((entry.name, x - entry.offset, piece))
            else:
                piece.copy_(entry.param.detach().reshape(-1)[x - entry.offset:y - entry.offset])
            cursor = y
        if cursor < hi:
            out[cursor - lo:].zero_()
        if pieces:
            values.fill(pieces)

    def _point_params(self) -> None:
        for entry in self.params:
            entry.param.data = self.flat[entry.offset:entry.offset + entry.numel].view(entry.shape)

    def rebound(self) -> bool:
        """Whether a fetched parameter's ``.data`` was rebound (it no longer views the flat
        buffer), see ``take_rebound_values``."""
        base, size = self.flat.data_ptr(), self.flat.element_size()
        return any(e.numel and e.param.data_ptr() != base + e.offset * size for e in self.params)

    def take_rebound_values(self) -> dict[ParamEntry, torch.Tensor]:
        """A fetched unit's parameters were changed by rebinding ``param.data`` (not in place,
        e.g. ``p.data = torch.zeros_like(p)``): copy the new values into the flat buffer and
        point the parameters back at it. A new shape cannot be taken (the layout is fixed).
        Returns the rebound values finer than the flat buffer's dtype (an fp32 tensor given
        to a bf16 unit), which a separate fp32 master takes as they are ([Note: a change by
        hand reaches the master] in optim/master_seed.py)."""
        finer: dict[ParamEntry, torch.Tensor] = {}
        for entry in self.params:
            data = entry.param.data
            view = self.flat[entry.offset:entry.offset + entry.numel]
            if data.data_ptr() == view.data_ptr() and data.shape == entry.shape:
                continue
            if data.shape != entry.shape:
                raise ValueError(
                    f"parameter {entry.name} of unit {self.name} was given shape "
                    f"{tuple(data.shape)} (it has {tuple(entry.shape)}): stage 3 keeps each "
                    "parameter's shape for the engine's life; resize the model (e.g. "
                    "resize_token_embeddings) before infinity.initialize")
            finer_values = data.is_floating_point() and data.dtype.itemsize > view.dtype.itemsize
            before = view.float() if finer_values else None
            with torch.no_grad():
                view.copy_(data.reshape(-1))
            if before is not None:
                # NaN where the values are the copy's own (``w.data = w.data.float()``, the
                # rows an edit left): the master keeps what it holds below the copy's precision
                values = data.detach().reshape(-1).float().clone()
                values[values == before] = float("nan")
                finer[entry] = values
        self._point_params()
        return finer

    def _unpoint_params(self) -> None:
        """Released: every parameter has 0 elements (see the module docstring)."""
        for entry in self.params:
            entry.param.data = self._released_data

    def _shape_flat(self) -> None:
        """The device buffer has the unit's size, with no memory (it comes from the device
        cache)."""
        if self.flat.numel() != self.flat_numel:
            self.flat = torch.empty(self.flat_numel, dtype=self.dtype, device=self.device)
            self.flat.untyped_storage().resize_(0)

    def _allocate_device(self, manager: TierManager) -> None:
        self._shape_flat()
        manager.device_cache.attach(self.flat.untyped_storage(), self.nbytes, f"unit {self.name}")

    def _try_allocate_device(self, manager: TierManager) -> bool:
        """``_allocate_device`` where the device cache has room now; False (nothing held)
        where it has not: a copy ahead of use waits for no room."""
        self._shape_flat()
        return manager.device_cache.try_attach(self.flat.untyped_storage(), self.nbytes,
                                               f"unit {self.name}")

    # -- fetch / release -----------------------------------------------------------------
    def start_fetch(self, manager: TierManager, pool) -> bool:
        """Begin a fetch ahead of use (prefetch): the swap-in of an NVMe-homed unit into a host
        slot of ``pool``, or with no pool straight into the unit's device memory (see
        ``_read_into_device``); the copy of a host-homed unit to the device (``_copy_home``).

        Returns False when no slot or device memory is free now, or the unit is not fetched
        ahead (the fetch then happens synchronously at need).
        """
        if self.residency != Residency.RELEASED:
            return False
        if self.param_home is Tier.HOST:
            return self._copy_home(manager)
        if self.param_home is not Tier.NVME:
            return False
        if pool is None:
            if not manager.device_cache.try_attach(self.flat.untyped_storage(), self.nbytes,
                                                   f"unit {self.name}"):
                return False
        else:
            slot = pool.try_acquire()
            if slot is None:
                return False
            self.fetch_slot = slot
        try:
            self.fetch_request = (self._read_into_device() if pool is None
                                  else self._read_into_slot(self.fetch_slot))
        except BaseException:
            self._drop_fetch(manager, pool)     # the read was not issued: give back the room
            raise
        self.residency.to(Residency.FETCHING)
        return True

    def _copy_home(self, manager: TierManager) -> bool:
        """Issue the copy of a host-homed unit from its home to the device now, ahead of use,
        where the device has room: its home is its host slot, always filled, so the copy goes
        at once and overlaps the compute of the units before it (the use waits on its event,
        ``finish_fetch``). Only where copies run beside compute (``overlaps_compute``: a GPU's
        stream); a CPU device's immediate copies still copy at the fetch, as before (a copy
        ahead would hide nothing and hold device memory sooner). Whether it goes is local:
        no collective depends on it (see [Note: gathers issued ahead] in zero/gather_ahead.py)."""
        copies = manager.copies       # see [Note: copy events] in storage/transfers.py
        if not copies.overlaps_compute or self.param_store is None:
            return False
        if not self._try_allocate_device(manager):
            return False
        try:
            self.copy_event = self.fill_event = copies.to_device(
                self.own_flat, self.param_store.tensor[: self.home_numel])
        except BaseException:
            manager.device_cache.detach(self.flat.untyped_storage())
            raise
        self.residency.to(Residency.FETCHING)
        return True

    def _read_into_slot(self, slot):
        """The NVMe read of the parameters into a host slot (copied to the device at finish)."""
        self.fetch_slot = slot
        return self.param_store.load_async(slot.view(self.dtype, self.home_numel))

    @property
    def flat_on_aligned_host(self) -> bool:
        """The device buffer is page-aligned host memory (a CPU device): the disk can read and
        write it directly, without a slot."""
        return self.flat.device.type == "cpu" and self.flat.data_ptr() % 4096 == 0

    def _read_into_device(self):
        """The NVMe read of the parameters straight into the (attached) device buffer."""
        if not self.flat_on_aligned_host:
            raise RuntimeError(f"unit {self.name}: direct reads need page-aligned host memory "
                               f"for the device buffer, got {self.flat.device} at "
                               f"{self.flat.data_ptr():#x}; fetch through a slot pool instead")
        return self.param_store.load_async(self.own_flat)

    def advance_fetch(self, manager: TierManager, pool) -> bool:
        """A prefetch read into a host slot that is over starts its copy to the device now,
        ahead of use (where the device has room), so that the copy overlaps the compute of the
        units before it; the slot goes back once the copy's event fired. Returns whether a copy
        was started."""
        if self.residency != Residency.FETCHING or self.fetch_slot is None or \
                self.copy_event is not None or not self.fetch_request.done():
            return False
        if not self._try_allocate_device(manager):
            return False
        try:
            manager.wait(self.fetch_request)      # over: raises what the read raised
        except BaseException:
            self._drop_fetch(manager, pool)
            raise
        self.fetch_request = None
        self.copy_event = self._copy_slot(manager, pool)
        return True

    def _copy_slot(self, manager: TierManager, pool):
        """Copy the fetch slot to the device; the slot goes back after the copy's event."""
        copies = manager.copies        # see [Note: copy events] in storage/transfers.py
        slot, self.fetch_slot = self.fetch_slot, None
        event = self.fill_event = copies.to_device(self.own_flat,
                                                   slot.view(self.dtype, self.home_numel))
        copies.release_after(event, lambda: pool.release(slot))
        return event

    def finish_fetch(self, manager: TierManager, pool, gather: bool = True) -> None:
        """Make the unit's parameters valid on the device (waits for a prefetch in flight).
        With sharded parameters the own shard is read and, with ``gather``, the others are
        gathered; without, the caller gathers (after a step of the own shard)."""
        if self.residency == Residency.FETCHED:
            return
        self.fetch_count += 1
        direct = pool is None and self.param_home is Tier.NVME
        if self.copy_event is not None:   # copied ahead (advance_fetch, _copy_home)
            self.prefetch_hits += 1
            event, self.copy_event = self.copy_event, None
        else:
            try:
                if self.residency == Residency.FETCHING:
                    if self.fetch_request.done():
                        self.prefetch_hits += 1
                elif direct:
                    self._allocate_device(manager)
                    self.fetch_request = self._read_into_device()
                elif self.param_home is Tier.NVME:
                    self.fetch_request = self._read_into_slot(pool.acquire(timeout=60.0))
                manager.wait(self.fetch_request)
            except BaseException:
                self._drop_fetch(manager, pool)     # issued or not, nothing of it stays held
                raise
            self.fetch_request = None
            event = None
            if not direct:
                self._allocate_device(manager)
                if self.param_home is Tier.NVME:
                    event = self._copy_slot(manager, pool)
                else:
                    event = self.fill_event = manager.copies.to_device(
                        self.own_flat, self.param_store.tensor[: self.home_numel])
        if event is not None:
            manager.copies.compute_waits(event)
            self.fetch_event = event
        manager.counters.host_to_device_bytes += self.home_numel * self.flat.element_size()
        self._point_params()
        self.residency.to(Residency.FETCHED)
        if gather and self.params_sharded:
            self.gather()

    def wait_fetched(self) -> None:
        """Block the calling thread until the copy that filled the device buffer at the last
        fetch is over. Compute is ordered after it on its stream (``compute_waits``); a thread
        that writes the buffer itself -- the deferred step run at the fetch, from the step
        stream's thread, on that thread's own CUDA stream -- is not, and waits here first."""
        event, self.fetch_event = self.fetch_event, None
        if event is not None:
            event.wait()

    def _drop_fetch(self, manager: TierManager, pool) -> None:
        """A fetch failed or was cancelled (its read is over): give back what it held."""
        if self.copy_event is not None:
            self.copy_event.wait()          # the copy writes the memory given back below
            self.copy_event = None
        self.fetch_request = None
        if self.fetch_slot is not None:
            pool.release(self.fetch_slot)
            self.fetch_slot = None
        self.fill_event = None
        manager.device_cache.detach(self.flat.untyped_storage())
        if self.residency == Residency.FETCHING:
            self.residency.to(Residency.RELEASED)

    def cancel_fetch(self, manager: TierManager, pool) -> None:
        """Drop a prefetch that was not used (waits for its read, frees its slot or memory).

        Its bytes are dropped unread, so a read that failed (an I/O error, or garbage the swap
        integrity check found) is only logged: a fetch that uses those bytes reads them again
        and raises then, and ``close()`` after such an error no longer raises it a second time."""
        if self.residency != Residency.FETCHING:
            return
        try:
            manager.wait(self.fetch_request)
        except OSError as exc:
            log.warning("a prefetch of unit %s that was not used failed (%s); its bytes were "
                        "dropped", self.name, exc)
        finally:
            self._drop_fetch(manager, pool)

    def release(self, manager: TierManager) -> None:
        """Free the device copy (no write-back: the home tier holds the current values)."""
        if self.persistent or self.residency != Residency.FETCHED:
            return
        if self.gather_event is not None:
            # the gather still writes the buffer (or its bytes would be lost): the holder of
            # the unit waits (``wait_gather`` / ``drop_gather``) before letting it go
            raise RuntimeError(f"unit {self.name} released while its all-gather issued ahead "
                               f"(unit index {self.index}, {self.nbytes} bytes) has not been "
                               "waited on: it must stay held from the gather to its use (see "
                               "[Note: gathers issued ahead] in zero/gather_ahead.py)")
        self.fetch_event = self.fill_event = None
        self._unpoint_params()
        manager.device_cache.detach(self.flat.untyped_storage())
        self.residency.to(Residency.RELEASED)

    def _write_direct(self, manager: TierManager, count: bool = True) -> list:
        """Start the writes of the own range of a page-aligned host device buffer to the NVMe
        param home (both extents of a doubled store); the requests."""
        store, own = self.param_store, self.own_flat
        if count:
            manager.counters.device_to_host_bytes += self.home_numel * own.element_size()
        shadows = (False, True) if store.doubled else (False,)
        return [store.store_async(own, shadow=s) for s in shadows]

    def write_home(self, manager: TierManager, staging=None) -> None:
        """Write the device copy back to the param home (after it was modified), to both of a
        doubled store's extents (the frozen part is written nowhere else).

        For NVMe the copy goes through ``staging`` slots in slot-sized chunks, two in flight
        (without a pool, through one temporary aligned buffer).
        """
        store = self.param_store
        if store is None:
            return
        own, n = self.own_flat, self.home_numel
        if store.resident:
            store.tensor[:n].copy_(own)
            return
        manager.counters.device_to_host_bytes += n * own.element_size()

        def write(buf: torch.Tensor, start: int = 0, count: int | None = None) -> list:
            shadows = (False, True) if store.doubled else (False,)
            return [store.store_async(buf, start, count, shadow=s) for s in shadows]

        if staging is None and self.flat_on_aligned_host:
            manager.wait(*self._write_direct(manager, count=False))   # page-aligned: as it is
            return
        if staging is None:
            buf = manager.host_empty(store.padded, self.dtype, what=f"{self.name} staging")
            buf[:n].copy_(own)
            manager.wait(*write(buf))
            return
        chunk = staging.slot_bytes // self.flat.element_size()
        in_flight: list = []
        try:
            for start in range(0, n, chunk):
                count = min(chunk, n - start)
                if len(in_flight) == 2:
                    wait_and_release([in_flight.pop(0)], manager.wait, staging.release)
                slot = staging.acquire(timeout=600.0)
                buf = slot.view(self.dtype, count)
                buf.copy_(own[start:start + count])
                in_flight.append((write(buf, start, count), slot))
        finally:
            wait_and_release(in_flight, manager.wait, staging.release)

