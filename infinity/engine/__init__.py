"""The engine: the facade users touch (``infinity.initialize`` returns one), wired from one config.

``engine.py`` builds the parts and runs the training calls; the other modules are its helpers:
``entry`` (``initialize``), ``wiring`` (where each state lives, the units in their home tiers, the
tier manager), ``sizing`` (the sizes it asks the planner for and checks), ``param_groups``,
``passes`` (forward/backward hooks), ``guards``, ``model_methods`` and ``module_state`` (the
model's methods routed through the engine), ``deepspeed_api`` (DeepSpeed's accessors),
``step_stats``, ``checkpointing``, ``pass_owner``.

[Note: the life of a byte]
One weight of a block, stage 3, offload_param and offload_optimizer on NVMe, one rank (a fetch is a
copy, no gather). CPU: fp32 compute, so the master IS the parameter (planner/placement.py ``state_homes``:
master_separate False) and the disk reads into device memory ("direct fetch" on any CPU device,
engine.py: no fetch pool). GPU: a 16-bit copy in the unit's params extent, the fp32 master in an
extent of its own, and pinned host slots (the "fetch" ``BufferPool``) between disk and device.
Start (training thread). engine.py ``Engine._build`` -> wiring.py ``build_units`` -> zero/unit.py
  ``Unit.__init__`` gives the byte its offset in the unit's flat buffer ([Note: flat layout]);
  ``Unit.adopt`` copies it in (FETCHED, DEVICE) and ``TierManager.create`` (storage/manager.py)
  makes the ``FlatStore``: storage/swap.py ``SwapSpace.allocate`` -> storage/extents.py
  ``ExtentAllocator.allocate`` (best fit, 4 KiB aligned): the byte's home is an extent in a swap
  file. ``Unit.write_home`` swaps it out (``FlatStore.store_async`` -> ``SwapSpace.write`` ->
  io/aio.py ``AioEngine.write``; GPU via slots) and ``Unit.release`` leaves it RELEASED, home NVME,
  the parameter a 0-element tensor. optim/partitioned.py ``PartitionedOptimizer.__init__`` makes
  the exp_avg, exp_avg_sq (and GPU: master, seeded by ``_init_master``) extents; Adam's first
  read of m, v finds zeros because a fresh preallocated swap file reads as zeros.
Forward (training thread, module hooks). engine/passes.py ``PassHooks`` -> ``Engine._begin_pass``
  -> zero/coordinator.py ``Coordinator.begin_forward`` starts the trace pass; each module's
  pre-hook ``_forward_pre`` -> ``_ensure``, then ``_prefetch`` -> zero/prefetch.py
  ``choose_prefetch`` picks the next units within the bucket and live budgets -> unit.py
  ``Unit.start_fetch`` (FETCHING). CPU: storage/device_cache.py ``DeviceMemoryCache.try_attach``
  gives the flat buffer memory and ``_read_into_device`` swaps in straight to DEVICE; GPU:
  storage/buffer_pool.py ``BufferPool.try_acquire`` and ``_read_into_slot`` read into a HOST slot.
  The read: ``FlatStore.load_async`` -> ``SwapSpace.read`` (``_submit``) -> ``AioEngine.read`` ->
  native/src/aio_core.c ``inf_aio_submit`` queues it; native lane threads (aio_uring.c,
  aio_libaio.c or aio_threads.c) take its pieces (``aio_take``), read with O_DIRECT and mark it
  done (``aio_complete``); see [Note: aio lanes and pieces] (native/src/aio_internal.h),
  [Note: request lifetime] (io/aio.py), [Note: store buffer lifetimes] (storage/manager.py).
  At the unit's use ``_ensure`` -> ``Unit.finish_fetch`` -> ``TierManager.wait`` ->
  ``IORequest.wait``, which first checks the read's page fingerprints (``SwapSpace._verify``,
  [Note: swap-space integrity check] in storage/integrity.py). GPU: ``_allocate_device`` (the
  CUDA allocator), ``flat.copy_(slot)`` HOST -> DEVICE, the slot goes back; CPU: nothing to copy.
  ``_point_params`` (param.data = view): FETCHED. A deferred step waiting for the unit runs now
  (``step_fetched``, [Note: the deferred step lands at the next fetch]). The module's forward
  reads the view; its post-hook ``_forward_post`` -> ``_release_or_keep`` (or kept, [Note:
  keeping units for reuse]) -> ``Unit.release``: no write-back, the extent is current; CPU:
  ``DeviceMemoryCache.detach`` keeps the memory ([Note: moving memory between storages]); GPU:
  the storage is resized to 0.
Backward (autograd). A hook on the module's outputs, ``_pre_backward`` -> ``_ensure``: the fetch
  again, in the backward trace, and (early step) ``expect_backward`` -> optim/step_stream.py
  ``StepStream.expect`` starts reading the unit's Adam states ([Note: expected steps]). Each
  AccumulateGrad -> ``Coordinator._grad_ready`` -> optim/gradients.py ``GradientCollector.on_grad``:
  early step on CPU, autograd's tensor is held ([Note: held gradients]); GPU, copied DEVICE -> HOST
  into a "gradient" slot in fp32; deferred, summed into the grad store (HOST, or a buffer that
  ``finish`` swaps out); each copy through storage/transfers.py ``to_host`` (GPU: on the
  device-to-host stream), its event waited before the unit's gradient is first read (early
  step: by the step stream, not the training thread; [Note: gradients leave the device]).
  The last one -> ``_maybe_finish`` -> ``on_unit_backward_done`` (optim/partitioned.py):
  early, ``_submit_ready`` makes the job READY and the unit stays FETCHED ([Note: background
  early step]); deferred, the unit is released and ``step()`` queues the job to land at the
  next fetch.
Step (the "infinity-step-stream" thread; [Note: the life of a step job], [Note: one stream of
  sub-groups]). ``StepStream._read_next`` swaps in a sub-group's m, v (GPU: and master; deferred:
  and gradient) into "optimizer" slots (``FlatStore.load_async``, as above); ``_step`` waits for
  them -> optim/kernel.py ``AdamKernel.run`` -> optim/cpu_adam.py ``adam_step_flat`` ->
  native/src/adam.c ``inf_adam_step`` or ``inf_adam_step_norm`` (the kernel of adam_avx512.c,
  adam_avx2.c, adam_neon.c or adam_scalar.c chosen at run time, on adam_pool.c's threads). CPU:
  the parameter stepped is ``unit.flat`` itself, in DEVICE memory; GPU: the master in its slot,
  the kernel writing the 16-bit copy (``half_out``), then copied into ``unit.flat``. Swap-out:
  ``_store`` -> ``FlatStore.store_async`` of m, v (GPU: master) from their slots;
  ``_write_params``: CPU straight from the page-aligned ``unit.flat``, GPU from the host values
  the device copy was made from (``_write_values``); ``SwapSpace.write`` records fingerprints
  (shadow extents: [Note: speculative step] in optim/speculation.py). ``_retire`` waits and
  frees the slots; the job has LANDED. Training thread: ``Engine.step`` -> ``PartitionedOptimizer.step`` waits for every early
  job's kernels (or queues the deferred jobs); ``Coordinator.reap`` -> optim/pending_steps.py
  ``PendingSteps.reap`` hands the landed units back to be released, their last writes landing
  behind the next forward ([Note: writes behind the step]).
"""
from infinity.engine.engine import Engine

__all__ = ["Engine"]
