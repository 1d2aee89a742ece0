"""The stage-3 coordinator: hooks that fetch each unit just before it runs and release it after.

Forward: a pre-hook on each hooked module fetches its units (waiting for a prefetch in flight),
a post-hook releases them. Backward: a hook on the module's outputs fetches the units again
before the module's backward runs ("pre-backward"); each trainable parameter's
post-accumulate-grad hook hands its gradient to the gradient sink and, when the last one of a
unit has arrived, the unit's backward is done: the engine steps it early or stores its gradients,
and the unit is released. A hook on the module's inputs ("post-backward") tells when a unit
without trainable parameters is done. An end-of-backward callback finishes whatever is left
(unused parameters, units whose inputs needed no gradient) and releases everything.

[Note: release during backward]
A unit is released in backward only when no backward op can still need it: its trainable
parameters have their gradients (an op that saved one feeds its AccumulateGrad; one that saved it
detached does not: then the backward's end, zero/detached_reads.py) and, with frozen parameters
or saves the hooks did not see, the gradient w.r.t. its module's inputs exists. If a later op
needs it anyway (a unit used twice), the pre-backward hook fetches it again. During backward,
forward post-hooks (activation checkpointing recomputation) do not release.

The same holds for every other way a unit is let go in backward: once a pre-backward hook has
fetched a unit, nothing releases it before its backward is done. A unit whose deferred step ran
at its forward fetch is held until the step's writes land, and the poll that finds them landed
may come between the hook that fetched the unit again and the op that reads it (ALBERT's tied
decoder: the decoder's hook fetches the embeddings' unit, the prediction head's hook on the
same tensor polls the steps, and the decoder's backward then read an empty buffer, about once
in 40 runs on a loaded machine).

[Note: outputs passed through]
The pre-backward hook goes on the tensors a module produced, not on an input it hands back as
an output unchanged (T5's blocks pass on the position bias block 0 computed). Such a tensor's
gradient is complete only when its producer's backward has run, long after the passing module's
own backward: a hook on it fetched the passing unit again after its release, and held it beside
the units that were really running (a device budget that fits the backward failed in T5's
first one).

[Note: gathers at every use]
With parameters sharded over ranks (stage 3, several ranks) whether a unit is still fetched when
it is needed again depends on timing (a background step's writes landing frees it, a kept unit
is evicted when room runs short), and the ranks must gather in the same order (see [Note:
collective order] in comm/collectives.py). So the gather does not depend on it: every use that
no module call in progress covers (a module's forward, its backward's pre-hook, a pin) gathers,
whether the own shard was just read from home or is still in memory. A kept unit so saves its
disk read, not its gather. Replicated units (stages 1-2) gather only after their step.

Which units go when room runs short, and which are kept fetched for reuse: zero/device_room.py
([Note: keeping units for reuse]).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from infinity.base.log import get_logger
from infinity.storage.tiers import Residency
from infinity.zero.module_calls import (hook_for_backward, in_graph_task, keep_at, only_for,
                                        param_versions, tensors_in, unaliased, weak_grad_hook)
from infinity.zero.input_gradients import LATE_AFTER_INPUTS, marked_inputs
from infinity.zero.pass_state import (DOUBLE_BACKWARD, FORWARDS, PassPhase, UnitStatus,
                                      defer_to_recompute, drop_unused_inputs, next_trainable,
                                      take_recompute, upcoming_units)
from infinity.zero.detached_reads import DetachedReads
from infinity.zero.device_room import DeviceRoom
from infinity.zero.gather_ahead import AheadGathers
from infinity.zero.prefetch import PrefetchLimits, Trace, start_prefetches
from infinity.zero.protocols import NO_PASS_OWNER, NO_STEPPER, PassOwner, UnitStepper, Wait
from infinity.zero.steps_ahead import start_steps_ahead
from infinity.zero.working_set import check_backward_working_set, check_traced_working_set
from infinity.zero.unit import ParamEntry, Unit

log = get_logger("zero")

EXPECTED_AHEAD = 2   # units of the backward whose Adam states are read during the forward


class Coordinator:
    """Installs and runs the fetch/release hooks for a list of units."""

    def __init__(self, units: list[Unit], hooked: list[tuple[nn.Module, list[int]]], manager,
                 fetch_pool, limits: PrefetchLimits, stepper: UnitStepper = NO_STEPPER,
                 owner: PassOwner = NO_PASS_OWNER, overlap_comm: bool = False,
                 comm=None) -> None:
        self.units = units
        self.hooked = hooked
        self.manager = manager
        self.fetch_pool = fetch_pool
        self.limits = limits
        self.stepper = stepper   # the optimizer (see zero/protocols.py)
        self.owner = owner       # the engine
        # a backward the owner did not start (loss.backward() called directly) is announced
        # at its first gradient and closed at its end; the owner's own runs inside
        # ``tracked_backward``
        self._tracked = False
        self._untracked = False
        self.traces = {phase.value: Trace() for phase in PassPhase if phase.value is not None}
        self._handles: list = []
        self._status = [UnitStatus() for _ in units]   # by unit index
        self._phase = PassPhase.IDLE
        self._upcoming_all = lambda: upcoming_units(self._phase, self.traces)   # the rest of the run
        self._room = DeviceRoom(units, manager, limits, self._upcoming_all, self._drop_kept)
        # per hooked module, a stack (one entry per call in progress) of its inputs' tensor ids
        self._call_inputs: dict[int, list[tuple]] = {}
        self._outermost: dict[int, list[int]] = {}     # per module, pre-hooks kept ahead of ours
        check_backward_working_set(units, hooked, manager.device_budget)
        # ``overlap_comm``: see [Note: gathers issued ahead] in zero/gather_ahead.py
        self.ahead = AheadGathers.for_run(units, manager, comm, overlap_comm)
        self._ranks = comm.world_size if comm is not None else 1
        # the units the training forward in progress used with grad enabled, in order (a use
        # under no_grad has no backward), and the order last checked (``end_forward``)
        self._grad_uses: list[int] = []
        self._checked_order: list[int] = []
        self.fetch_stats = {"fetches": 0, "prefetch_hits": 0, "prefetched": 0, "nvme_fetches": 0,
                            "kept_for_reuse": 0, "prefetches_cancelled": 0, "steps_ahead": 0}
        # when a list: (kind, unit index) of "prefetch" (a read issued ahead), "fetch" (a use
        # found it not fetched), "keep", "cancel" (a prefetch dropped), "release", in order
        self.events: list[tuple[str, int]] | None = None
        self.detached_reads = DetachedReads(units, self._status)   # what the forward's hooks note

    # -- installation ----------------------------------------------------------------------
    @contextlib.contextmanager
    def tracked_backward(self) -> Iterator[None]:
        """``engine.backward`` runs inside (its gradients are not an untracked backward's); a
        forward it recomputes (reentrant checkpointing) has its detached reads noted."""
        self._tracked = True
        try:
            with self.detached_reads.hooks():
                yield
        finally:
            self._tracked = False

    @property
    def in_tracked_backward(self) -> bool:
        """The owner's backward is running (another engine's hooks may be reached by it)."""
        return self._tracked

    def install(self) -> None:
        for module, unit_ids in self.hooked:
            self.hook_module(module, unit_ids)
        for u, unit in enumerate(self.units):
            for k, entry in enumerate(unit.params):
                if entry.trainable:
                    self._handles.append(entry.param.register_post_accumulate_grad_hook(
                        weak_grad_hook(self._grad_ready, u, k)))   # held in C++: weakly
        self.reset_backward_state()

    def hook_module(self, module: nn.Module, unit_ids: list[int]) -> None:
        """Fetch ``unit_ids`` before ``module`` runs and release them after (its own unit, a
        tied parameter's, or one registered as external)."""
        ids = tuple(unit_ids)
        # The user's own hooks on the module see its parameters fetched: the fetch runs before
        # every other pre-hook (an old-style weight_norm pre-hook computes weight from g and v)
        # and the release after every other forward hook, also those registered after ours.
        def pre(m: nn.Module, args, kwargs):
            keep_at(m._forward_hooks, post.id, last=True)
            passed, args, kwargs = self._forward_pre(ids, args, kwargs)
            self._call_inputs.setdefault(id(m), []).append(passed)
            return args, kwargs   # see [Note: a call's inputs mark its backward]

        def after(m: nn.Module, args, output):
            keep_at(m._forward_pre_hooks, first.id, last=False)
            for outer in self._outermost.get(id(m), ()):
                keep_at(m._forward_pre_hooks, outer, last=False)
            calls = self._call_inputs.get(id(m))
            return self._forward_post(ids, output, calls.pop() if calls else (frozenset(), None))

        first = module.register_forward_pre_hook(only_for(module, pre), with_kwargs=True,
                                                 prepend=True)      # not a deepcopy's calls
        post = module.register_forward_hook(only_for(module, after))
        self._handles += [first, post]

    def keep_outermost(self, module: nn.Module, pre_hook_id: int) -> None:
        """Keep ``pre_hook_id`` ahead of the fetch hook on ``module`` (the engine's pass begins
        before a root that owns parameters fetches them)."""
        self._outermost.setdefault(id(module), []).append(pre_hook_id)
        keep_at(module._forward_pre_hooks, pre_hook_id, last=False)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def unfinished_backward(self) -> bool | None:
        """None, or whether a backward that raised (its end never came) delivered gradients."""
        if self._phase is not PassPhase.BACKWARD or in_graph_task():
            return None
        return self._untracked

    def reset_backward_state(self) -> None:
        for unit, status in zip(self.units, self._status):
            status.start_backward(len(unit.trainable_entries()))

    # -- forward ---------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Called by the engine before each forward pass (starts a trace pass)."""
        self.ahead.drop(self._status, self._release_or_keep)    # one a pass before left unused (it ended, or diverged)
        training = torch.is_grad_enabled()   # in eval mode too: [Note: a forward under grad trains]
        self._phase = PassPhase.TRAIN_FORWARD if training else PassPhase.EVAL_FORWARD
        self._grad_uses = []
        trace = self.traces[self._phase.value]
        trace.start_pass()
        self._prefetch(trace)
        if training:
            # the disk has little to do in the forward: read the Adam states of the units
            # whose backward comes first (see [Note: expected steps])
            for uid in next_trainable(self.units, self._status, self.traces["bwd"].order,
                                      EXPECTED_AHEAD):
                self.stepper.expect_backward(self.units[uid])

    def end_forward(self) -> None:
        """Called by the engine after a training forward returned: a newly recorded order is
        checked against the device budget before its backward runs (see
        ``check_traced_working_set``)."""
        order = self._grad_uses
        if order and order != self._checked_order:
            self._checked_order = list(order)
            check_traced_working_set(self.units, order, self.manager.device_budget)

    def _forward_pre(self, ids: tuple[int, ...], args, kwargs) -> tuple[tuple, Any, Any]:
        """Fetch the units; the ids of the call's inputs under grad ([Note: outputs passed
        through]) and its ``CallInputs``, and the arguments to call it with (``marked_inputs``)."""
        recompute = in_graph_task()
        if not recompute:
            self.owner.before_read()
        # a part called outside a pass of the model (a chunked loss: model.lm_head(h)) is in
        # no trace: an order recorded into one no pass starts grew by its calls for good
        trace = None if recompute or self._phase not in FORWARDS else self.traces[self._phase.value]
        for uid in ids:
            self._ensure(uid, trace)
            status = self._status[uid]
            if status.users == 0 and not recompute:
                status.versions = param_versions(self.units[uid])
            status.users += 1
        statuses = [self._status[uid] for uid in ids]
        if not torch.is_grad_enabled():
            if self._phase is PassPhase.TRAIN_FORWARD and not recompute:
                defer_to_recompute(statuses, tensors_in((args, kwargs)))
            return (frozenset(), None), args, kwargs
        watch = not recompute or take_recompute(statuses)
        args, kwargs, call = marked_inputs(
            args, kwargs, list(tensors_in((args, kwargs))),
            (lambda call: self._post_backward(ids, call)) if watch else None)
        for status in statuses if watch else ():
            status.note_call(call)
        if not recompute:
            self._grad_uses.extend(ids if trace is not None else ())
            self.detached_reads.note_call(ids)    # its saves hidden from the hooks: held longer
        # an input's id, and its base's (an output viewing the caller's tensor is passed on)
        return (frozenset(id(x) for t in tensors_in((args, kwargs)) for x in (t, t._base)
                          if x is not None), call), args, kwargs

    def _forward_post(self, ids: tuple[int, ...], output, record: tuple):
        recompute, (passed_through, call) = in_graph_task(), record
        replaced = None if recompute else unaliased(output, [self.units[u] for u in ids])
        output = output if replaced is None else replaced
        if call is not None and self._ranks > 1:     # an input the data let it skip
            drop_unused_inputs(call, output, [self._status[uid] for uid in ids])
        for uid in ids:
            status = self._status[uid]
            if status.users == 1 and not recompute:     # its last use (still held)
                unit = self.units[uid]
                before, status.versions = status.versions, None
                if unit.rebound():        # ``p.data = renorm(p.data)``, a max-norm layer
                    unit.take_rebound_values()
                    self.owner.modified_in_forward(unit)
                elif before is not None and before != param_versions(unit):
                    self.owner.modified_in_forward(unit)
            status.users -= 1
        if not recompute:
            for uid in ids:
                if self._status[uid].users == 0:
                    self._release_or_keep(uid)
            self._gather_after(ids[-1], self._phase if self._phase in FORWARDS
                               else PassPhase.EVAL_FORWARD)
        if torch.is_grad_enabled():     # see [Note: outputs passed through]
            hook_for_backward(output, passed_through, lambda grad: self._pre_backward(ids))
        return replaced

    # -- backward --------------------------------------------------------------------------
    def _pre_backward(self, ids: tuple[int, ...]) -> None:
        if torch.is_grad_enabled() and any(not self.units[uid].persistent for uid in ids):
            # grad mode is on inside a backward only with create_graph=True: the graph it builds
            # would need the units' parameters again after their release
            raise RuntimeError(DOUBLE_BACKWARD)
        if self._phase is not PassPhase.BACKWARD:
            self._phase = PassPhase.BACKWARD
            self.traces["bwd"].start_pass()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for uid in ids:
            self._ensure(uid, self.traces["bwd"])
            self._status[uid].fetched_for_backward()
        for uid in ids + tuple(next_trainable(
                self.units, self._status, self.traces["bwd"].upcoming(), 1)):
            if self.units[uid].has_trainable and not self._status[uid].backward_done:
                self.stepper.expect_backward(self.units[uid])

    def _post_backward(self, ids: tuple[int, ...], call: Any) -> None:
        for uid in ids:
            self._status[uid].reached_inputs(call)
            self._maybe_finish(self.units[uid])

    def _grad_ready(self, unit: Unit, entry: ParamEntry) -> None:
        grad = entry.param.grad
        if grad is None:
            return
        if not self._tracked and not self._untracked:
            try:
                self.owner.begin_untracked_backward()
            except BaseException:
                entry.param.grad = None       # the refused backward's: never added to the next
                self.abandon_pass()
                raise
            self._untracked = True
        entry.param.grad = None
        if self._status[unit.index].forced:   # reduced over the ranks without it
            raise RuntimeError(LATE_AFTER_INPUTS.format(param=entry.name, unit=unit.name))
        self.stepper.on_grad(unit, entry, grad)
        self._status[unit.index].grads_pending -= 1
        self._maybe_finish(unit)

    def _maybe_finish(self, unit: Unit) -> None:
        uid, status = unit.index, self._status[unit.index]
        if not status.may_finish(unit.has_trainable, unit.has_frozen, self._ranks):
            return
        if not self._finish(unit, status) and status.users == 0:
            self._release_or_keep(uid)   # kept: the next forward (and a deferred step) use it
        if self._phase is PassPhase.BACKWARD:   # after its reduce-scatter, on every rank
            self._gather_after(uid, PassPhase.BACKWARD)

    def _finish(self, unit: Unit, status: UnitStatus) -> bool:
        """Finish the unit's backward (its gradients reduced, its step begun); True: a step holds it."""
        status.finish_backward()
        if not unit.has_trainable or self.stepper.on_unit_backward_done(unit):   # reduces it
            return False
        status.stepping, status.stale = True, unit.shards > 1
        return True

    def _end_backward(self) -> None:
        """Runs once when autograd has finished the whole backward pass."""
        try:
            for unit, status in zip(self.units, self._status):
                if unit.has_trainable and status.unfinished_at_end(
                        len(unit.trainable_entries()), self._ranks):
                    self._finish(unit, status)
            self._phase = PassPhase.IDLE
            self.ahead.drop(self._status, self._release_or_keep)
            self.reap()
            for unit, status in zip(self.units, self._status):
                if status.users == 0 and not status.stepping:
                    self._release_or_keep(unit.index)
            if self._untracked:
                self.owner.end_untracked_backward()
        finally:
            self._phase = PassPhase.IDLE
            self._untracked = False
            self.reset_backward_state()

    def abandon_pass(self) -> None:
        """A forward or backward raised: its hooks will not finish the pass (post-hooks, the
        end-of-backward callback). Forget the pass, count no module as running, and release
        what no step or pin holds, so the next pass starts clean."""
        self._phase = PassPhase.IDLE
        self._untracked = False
        self._call_inputs.clear()
        for status in self._status:
            status.users = status.pins
        self.reset_backward_state()
        try:
            self.ahead.drop(self._status, self._release_or_keep)
        finally:    # a gather that failed to land: the pass is still let go
            self.reap()
            for unit, status in zip(self.units, self._status):
                if status.users == 0:
                    self._release_or_keep(unit.index)

    def reap(self, wait: Wait = Wait.NONE) -> None:
        """Release (or keep) the units whose background steps are over (see ``Wait``)."""
        self._release_stepped(self.stepper.reap(wait))

    def drain(self) -> None:
        """The run ends: every background step is seen out and its unit let go."""
        self._release_stepped(self.stepper.drain())

    def _release_stepped(self, units: list[Unit]) -> None:
        for unit in units:
            status = self._status[unit.index]
            status.stepping = False
            if status.users == 0:
                self._release_or_keep(unit.index)

    def discard(self, units: list[Unit]) -> None:
        """Drop the device copies of ``units`` (their values were rolled back, see [Note:
        speculative step] in optim/speculation.py): the next use fetches the current home. Their
        steps must be over. A pinned unit is fetched again at once."""
        for unit in units:
            uid = unit.index
            self._status[uid].stepping = False
            self._room.kept.discard(uid)
            if unit.persistent or unit.residency != Residency.FETCHED:
                continue
            if unit.gathered_ahead:
                unit.drop_gather()
            self._release(unit)
            if self._status[uid].users > 0:
                unit.finish_fetch(self.manager, self.fetch_pool)

    # -- releasing and keeping (see [Note: keeping units for reuse] in zero/device_room.py) -
    def _backward_may_read(self, uid: int) -> bool:
        """A backward op still to run may read the unit: a pre-backward hook of the backward
        in progress fetched it and its backward is not done (see [Note: release during
        backward])."""
        return self._phase is PassPhase.BACKWARD and self._status[uid].backward_may_read

    def _release_or_keep(self, uid: int) -> None:
        unit = self.units[uid]
        if unit.persistent or unit.residency != Residency.FETCHED or self._status[uid].stepping:
            return   # a unit being stepped is released when its step is over
        if unit.gathered_ahead:
            return   # held until its use waits on the gather (see [Note: gathers issued ahead])
        if self._backward_may_read(uid):
            return   # released when its backward is done, or at the backward's end
        if self._room.keep(uid, self._upcoming_all()):
            self.fetch_stats["kept_for_reuse"] += 1
            self._note("keep", uid)
            return
        self._release(unit)

    def _release(self, unit: Unit) -> None:
        if self.events is not None and unit.residency == Residency.FETCHED and not unit.persistent:
            self.events.append(("release", unit.index))
        unit.release(self.manager)

    def _note(self, kind: str, uid: int) -> None:
        if self.events is not None:
            self.events.append((kind, uid))

    def _drop_kept(self, uid: int) -> None:
        self._room.kept.discard(uid)
        if not self._status[uid].held:
            self._release(self.units[uid])

    # -- fetching --------------------------------------------------------------------------
    def _ensure(self, uid: int, trace: Trace | None) -> None:
        unit, status = self.units[uid], self._status[uid]
        ahead = unit.gathered_ahead
        self._make_current(uid, trace)
        # [Note: gathers at every use]: a unit with sharded parameters is gathered each time a
        # use begins that no module call in progress covers, unless issued ahead (waited on in
        # ``_make_current``); and again when a step changed its own shard since
        if status.stale or (not ahead and unit.params_sharded and status.users == 0):
            unit.gather()
            status.stale = False
        if trace is not None:   # the next unit's gather, where [Note: gathers issued ahead] says
            self.ahead.gather_next(uid, trace.upcoming(), self._status,
                                   self._phase is PassPhase.BACKWARD,
                                   lambda next_uid: self._make_current(next_uid, None))

    def _gather_after(self, uid: int, phase: PassPhase) -> None:
        """Unit ``uid``'s kernels are queued: an NVMe-homed unit's gather, where [Note: gathers
        issued ahead] says (its read waited for here, not before ``uid``'s compute)."""
        self.ahead.gather_after(uid, self.traces[phase.value].after(uid), self._status,
                                phase is PassPhase.BACKWARD,
                                lambda next_uid: self._make_current(next_uid, None))

    def _make_current(self, uid: int, trace: Trace | None) -> None:
        """Fetch unit ``uid`` with its own shard current (read from home or a prefetch, a
        waiting deferred step run on it); its other shards are gathered by the caller. A
        gather issued ahead is waited on here, before a step could write the own shard."""
        if self._any_stepping():
            self.reap()
        unit, status = self.units[uid], self._status[uid]
        if status.stepping:
            self.stepper.wait_stepped(unit)
        self._room.kept.discard(uid)   # in use again
        needs_memory = unit.flat.untyped_storage().nbytes() == 0   # not fetched or read into
        if needs_memory:
            self._make_room(unit.nbytes)
        budget, cache = self.manager.device_budget, self.manager.device_cache
        while needs_memory and self._any_stepping() and \
                budget.limit is not None and cache.in_use_bytes() + unit.nbytes > budget.limit:
            # backpressure: units held by background steps free the device when they finish
            # (a prefetch whose step ran ahead may then be cancelled, a unit kept evicted)
            self.reap(Wait.ONE)
            self._make_room(unit.nbytes)
        if trace is not None:
            trace.observe(uid)
        if unit.residency != Residency.FETCHED:
            prefetched = unit.residency == Residency.FETCHING
            hit = prefetched and unit.fetch_request is not None and unit.fetch_request.done()
            # the own shard only: a waiting step changes it before the others are gathered
            self._note("fetch", uid)
            unit.finish_fetch(self.manager, self.fetch_pool, gather=False)
            self.fetch_stats["fetches"] += 1
            if unit.param_store is not None and not unit.param_store.resident:
                self.fetch_stats["nvme_fetches"] += 1
                self.fetch_stats["prefetched"] += int(prefetched)   # issued ahead of its hook
                self.fetch_stats["prefetch_hits"] += int(hit)       # and already complete
        if trace is not None:
            self._prefetch(trace)
        unit.wait_gather()     # compute (and a step below) reads the buffer after the gather
        # a deferred step waiting for this unit runs on the copy just fetched (see [Note: the
        # deferred step lands at the next fetch]); the unit is held until its writes land
        # (marked stepping first: an interrupt while its step runs must not let the unit go)
        was_stepping, status.stepping = status.stepping, True
        if self.stepper.step_fetched(unit):
            status.stale = status.stale or unit.shards > 1
        else:
            status.stepping = was_stepping
        # on a GPU the next units' steps start now, beside this one's compute (see [Note: the
        # deferred step runs ahead of the forward] in zero/steps_ahead.py)
        self.fetch_stats["steps_ahead"] += start_steps_ahead(self.stepper, self._status,
                                                             self.manager.copies)

    def _make_room(self, nbytes: int) -> None:
        """Kept units, then prefetches into device memory, let go until ``nbytes`` fit."""
        self._room.evict_kept(nbytes)
        self._room.cancel_prefetches(nbytes, self.fetch_pool is not None, self._status,
                                     self._cancel_prefetch)

    def make_whole(self) -> None:
        """Gather the replicated units (parameters not sharded) whose copies are stale since
        their step, in unit order, before the model is read outside a pass (a checkpoint,
        ``state_dict``); every rank calls it at once. Units with sharded parameters are gathered
        by their next fetch."""
        stale = [u for u in self.units if self._status[u.index].stale and not u.params_sharded]
        if not stale:
            return
        self.stepper.wait_stepped()
        for unit in stale:
            unit.gather()
            self._status[unit.index].stale = False

    def forward_order(self) -> list[int]:
        """The units in the order the last training forward first used them."""
        return list(dict.fromkeys(self.traces["train_fwd"].order))

    def step_waiting_units(self, units: list[Unit]) -> None:
        """Fetch ``units`` so their waiting deferred steps run (units the forward did not use,
        or a flush); each is released when its writes have landed."""
        for unit in units:
            self.pin(unit)
            self.unpin(unit)

    def _prefetch(self, trace: Trace) -> None:
        upcoming = trace.upcoming()
        if trace is self.traces["train_fwd"] and len(upcoming) < self.limits.max_units_ahead:
            # the backward pass starts right after the forward: look into its trace too (never
            # from backward into the next forward: the optimizer step still writes those units)
            upcoming = upcoming + self.traces["bwd"].order[: self.limits.max_units_ahead]
        start_prefetches(self.units, upcoming, self.limits, self._room, self.manager,
                         self.fetch_pool, lambda uid: self._note("prefetch", uid))

    def _cancel_prefetch(self, uid: int) -> None:
        self._note("cancel", uid)
        self.units[uid].cancel_fetch(self.manager, self.fetch_pool)
        self.fetch_stats["prefetches_cancelled"] += 1

    def pin(self, unit: Unit) -> None:
        """Fetch ``unit`` and hold it (not released by hooks) until ``unpin``."""
        self._ensure(unit.index, None)
        status = self._status[unit.index]
        status.users += 1
        status.pins += 1

    def unpin(self, unit: Unit) -> None:
        status = self._status[unit.index]
        status.users -= 1
        status.pins -= 1
        if not status.held and self._phase is not PassPhase.BACKWARD:
            self._release(unit)

    def pinned_units(self) -> list[Unit]:
        """Units held by ``pin`` now (inside GatheredParameters)."""
        return [u for u in self.units if self._status[u.index].pins]

    def fetch_all(self) -> None:
        """Fetch every unit (for whole-model reads such as GatheredParameters on all params)."""
        self.ahead.drop(self._status, self._release_or_keep)
        for unit in self.units:
            # sharded ones gathered, fetched or not (see [Note: gathers at every use])
            unit.finish_fetch(self.manager, self.fetch_pool, gather=False)
            if unit.params_sharded:
                unit.gather()
                self._status[unit.index].stale = False
        self.make_whole()

    def release_all(self) -> None:
        """Release every fetched unit and drop unused prefetches."""
        self._room.kept.clear()
        self.ahead.drop(self._status, self._release_or_keep)
        for unit in self.units:
            if not self._status[unit.index].held:
                unit.cancel_fetch(self.manager, self.fetch_pool)
                self._release(unit)

    def _any_stepping(self) -> bool:
        return any(status.stepping for status in self._status)
