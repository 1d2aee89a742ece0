"""A parameter read ``.detach()``ed in the forward (saved for backward without its gradient) is
not let go before that read ran (see [Note: parameters read without a gradient] in
zero/detached_reads.py): trained as plain torch with the step early, with micro-batches (the
unit released between its gradients and the read), with activations offloaded, and with the
blocks recomputed in the backward (checkpointing, reentrant or not). Each run has a process of its own:
before the fix, some died of a segmentation fault."""
from __future__ import annotations

import json
import os
import subprocess
import weakref
import sys
from types import SimpleNamespace

import pytest
import torch

from infinity.zero.detached_reads import DetachedReads
from infinity.zero.pass_state import UnitStatus
from parity import TinyLM, run_parity, zero_config
from ranks import script_path, worker_pythonpath

CASES = {
    "stage3-cpu-early-step": {"stage": 3, "tier": "cpu", "accumulation": 1},
    "stage3-cpu-micro-batches": {"stage": 3, "tier": "cpu", "accumulation": 2},
    "stage3-nvme-micro-batches": {"stage": 3, "tier": "nvme", "accumulation": 2},
    "stage3-nvme-activations-offloaded": {"stage": 3, "tier": "nvme", "accumulation": 2,
                                          "infinity": {"offload_activations": "nvme",
                                                       "activation_min_bytes": 1}},
    "stage3-cpu-checkpointed": {"stage": 3, "tier": "cpu", "accumulation": 2,
                                "checkpointed": "reentrant"},
    # inside the region the checkpoint's hooks hide the saves: the unit waits for its inputs
    "stage3-cpu-non-reentrant": {"stage": 3, "tier": "cpu", "accumulation": 2,
                                 "checkpointed": "non-reentrant"},
    "stage3-nvme-non-reentrant-early": {"stage": 3, "tier": "nvme", "accumulation": 1,
                                        "checkpointed": "non-reentrant"},
    "stage2-cpu-early-step": {"stage": 2, "tier": "cpu", "accumulation": 1},
    "stage3-cpu-two-forwards-then-backwards": {"stage": 3, "tier": "cpu", "accumulation": 2,
                                               "interleaved": True},
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_detached_read_of_a_weight_trains_as_torch(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(script_path("detached_reads_worker.py")), json.dumps(CASES[name]),
         str(tmp_path)], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": worker_pythonpath()})
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # fp32 compute on both sides, the same order of operations: the runs agree to rounding
    # (~1e-7 here on every CPU's Adam kernel); a read of stepped weights at lr 0.02 was off by
    # ~6e-3, a read of a released buffer crashed
    for step, (mine, ref) in enumerate(zip(out["losses"], out["reference"])):
        assert abs(mine - ref) <= 1e-5 * abs(ref), (step, out)


def _unit(index: int, trainable: int, frozen: int):
    """What DetachedReads reads of a unit: a flat buffer, its trainable range first (one
    parameter each)."""
    flat = torch.zeros(trainable + frozen)
    params = [SimpleNamespace(name=f"w{i}", offset=start, numel=n,
                              param=torch.nn.Parameter(torch.zeros(n), requires_grad=i == 0))
              for i, (start, n) in enumerate(((0, trainable), (trainable, frozen))) if n]
    return SimpleNamespace(index=index, name=f"u{index}", flat=flat, has_trainable=trainable > 0,
                           trainable_numel=trainable, params=params)


def test_only_a_gradless_read_of_the_trainable_range_holds_its_unit():
    units = [_unit(0, 8, 8), _unit(1, 0, 8)]
    statuses = [UnitStatus() for _ in units]
    reads = DetachedReads(units, statuses)
    reads.begin()
    trainable, frozen = units[0].flat[:8], units[0].flat[8:]
    reads.note(frozen.view(2, 4))                  # a frozen parameter's values
    reads.note(units[1].flat)                      # a unit without trainable parameters
    reads.note(torch.zeros(8))                     # another storage
    reads.note(trainable.clone().requires_grad_()) # a copy: another storage
    assert [s.read_detached for s in statuses] == [False, False]
    reads.note(units[0].flat[6:12])                # straddles into the trainable range
    assert [s.read_detached for s in statuses] == [True, False]
    statuses[0].start_backward(1)     # stays set: a forward whose backward is to come set it
    assert statuses[0].read_detached


def test_a_parameter_frozen_after_initialize_holds_its_unit_without_a_detach_warning(
        infinity_log):
    """``requires_grad_(False)`` on a weight the unit trained at initialize: its saved values
    read the trainable range without a gradient, so the unit is held to the backward's end
    (its gradient never comes), but the warning said "a .detach()ed use" nobody made."""
    units = [_unit(0, 8, 0)]
    units[0].params[0].param.requires_grad_(False)
    statuses = [UnitStatus()]
    reads = DetachedReads(units, statuses)
    reads.begin()
    reads.note(units[0].flat[:8])
    assert statuses[0].read_detached
    said = [r.getMessage() for r in infinity_log.records]
    assert not [m for m in said if ".detach()ed use" in m], said


def test_a_saved_tensor_modified_in_place_still_raises():
    """The hooks keep autograd's check that a saved tensor was not modified before its read."""
    reads = DetachedReads([_unit(0, 8, 0)], [UnitStatus()])
    reads.begin()
    x = torch.randn(4, requires_grad=True)
    with reads.hooks():
        y = x.exp()                  # saves its result
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_graph_dropped_without_a_backward_is_freed():
    """The hooks keep saved tensors detached: an output kept as it is points back at its own
    ``grad_fn``, a cycle through autograd's C++ that the collector cannot free."""
    reads = DetachedReads([_unit(0, 8, 0)], [UnitStatus()])
    reads.begin()
    x = torch.randn(4, requires_grad=True)
    with reads.hooks():
        y = x.exp()                  # saves its result
        loss = (y * 2).sum()
    alive = weakref.ref(y)
    del y, loss
    assert alive() is None


class _FuncBlock(torch.nn.Module):
    """A block whose forward takes a gradient with torch.func (which refuses saved-tensor
    hooks)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slope = torch.func.grad(lambda z: (z.tanh() ** 2).sum())(x.detach())
        return x + torch.tanh(self.up(x)) * (1 + slope)


def _func_model() -> torch.nn.Module:
    torch.manual_seed(0)
    lm = TinyLM(width=32, depth=2)
    lm.blocks = torch.nn.ModuleList(_FuncBlock(32) for _ in range(2))
    return lm


def test_torch_func_in_the_forward_names_the_switch_and_trains_with_it_off(tmp_path):
    """Under the engine's hooks torch.func refuses with a message naming no cause the user set:
    the error carries a note naming ``detached_reads: "off"``; with it, training is torch's."""
    with pytest.raises(RuntimeError, match="torch.func") as refused:
        run_parity(_func_model(), zero_config(3, "cpu", "cpu", str(tmp_path)), steps=1)
    notes = " ".join(getattr(refused.value, "__notes__", []))
    assert '"detached_reads": "off"' in notes and "EXTERNAL" not in notes.upper(), notes
    result = run_parity(_func_model(), zero_config(3, "cpu", "cpu", str(tmp_path),
                                                   detached_reads="off"), steps=3)
    for mine, ref in zip(result.losses, result.ref_losses):
        assert abs(mine - ref) <= 1e-5 * abs(ref), (result.losses, result.ref_losses)


def test_the_callers_own_saved_tensor_hooks_keep_the_saves(tmp_path):
    """A forward the caller runs under hooks of its own (torch's save_on_cpu, say) keeps them on
    top: the engine's would take the saves over (none reached the caller's), so it adds none,
    and counts the saves as unseen (units wait for their inputs' gradient); training is torch's."""
    from parity import engine_and_reference, make_model, reference_step

    seen = []

    def pack(tensor):
        seen.append(1)
        return tensor.detach()

    ds = zero_config(3, "cpu", "cpu", str(tmp_path))
    ds["train_micro_batch_size_per_gpu"] = 2
    engine, reference, ref_opt = engine_and_reference(
        make_model("torch", seed=0, layers=2, width=32), ds, lr=0.02)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 256, (2, 16), generator=gen)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = engine(input_ids=x, labels=x)
            engine.backward(loss)
            engine.step()
            ref_loss = reference_step(reference, ref_opt, x, clip=0.0)
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    finally:
        engine.close()
    assert seen, "the caller's pack hook saw none of the forward's saves"
