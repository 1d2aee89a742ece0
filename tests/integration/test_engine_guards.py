"""What an engine refuses before it builds anything, or before it takes a step nobody asked for:
several ranks, parameters another live engine trains, a scheduler bound to another optimizer,
and another engine's backward reaching it under the early step (a GAN's generator loss)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import infinity
from infinity.zero.init import _live_engines


class Net(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(inputs, 32), nn.Linear(32, 32)])
        self.out = nn.Linear(32, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def _config(disk_dir, early_step: str = "auto") -> dict:
    disk_dir.mkdir(exist_ok=True)
    path = str(disk_dir)
    return {"train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "nvme", "nvme_path": path},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": path}},
            "infinity": {"early_step": early_step, "compute_dtype": "fp32"}}   # torch parity at 1e-5


def _weights(engine) -> torch.Tensor:
    params = list(engine.module.parameters())
    with infinity.zero.GatheredParameters(params):
        return torch.cat([p.detach().flatten().clone() for p in params])


def test_ranks_the_launcher_did_not_describe_are_refused_before_anything_is_built(
        disk_dir, monkeypatch) -> None:
    """WORLD_SIZE=2 without the rest of torchrun's environment: said, with what to do, before
    anything is built (multi-rank training itself: tests/distributed/test_zero_ranks.py)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    before = len(_live_engines)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT is "
                                           "not set: start the ranks with torchrun"):
        infinity.initialize(model=Net(4, 2), config=_config(disk_dir))
    assert len(_live_engines) == before and list(disk_dir.iterdir()) == []
    monkeypatch.setenv("WORLD_SIZE", "1")
    engine, *_ = infinity.initialize(model=Net(4, 2), config=_config(disk_dir))
    engine.close()


def test_a_parameter_another_live_engine_trains_is_refused(disk_dir) -> None:
    shared = nn.Linear(4, 4)
    first = nn.Sequential(shared, nn.Linear(4, 2))
    second = nn.Sequential(shared, nn.Linear(4, 3))
    engine, *_ = infinity.initialize(model=first, config=_config(disk_dir / "a"))
    try:
        with pytest.raises(ValueError, match=r"2 parameter\(s\) of this model \(e.g. '0.weight'\)"
                                             r".*live engine over another model \(Sequential\)"):
            infinity.initialize(model=second, config=_config(disk_dir / "b"))
    finally:
        engine.close()


def test_a_scheduler_bound_to_another_optimizer_is_refused(disk_dir) -> None:
    model = Net(4, 2)
    foreign = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    with pytest.raises(ValueError, match="StepLR built on a SGD.*lr_scheduler=lambda opt"):
        infinity.initialize(model=model, config=_config(disk_dir), lr_scheduler=foreign)
    assert not any(e.module is model for e in _live_engines)
    engine, _, _, scheduler = infinity.initialize(
        model=model, config=_config(disk_dir),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    try:
        assert scheduler.optimizer is engine.optimizer
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_an_initialize_that_fails_late_leaves_the_model_free(disk_dir, stage) -> None:
    """A scheduler factory that raises fails initialize after the model was hooked: the model
    stayed hooked to an engine nobody could close (a step-stream thread running, a retry told
    to "close() the first engine", a forward failing on a missing attribute). Now the failure
    closes what was built: at stage 2 the model trains again as it was; at stage 3 a retry
    says its weights are gone (released into the failed engine's tiers), as documented."""
    import threading

    model = Net(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    config = _config(disk_dir)
    config["zero_optimization"]["stage"] = stage
    if stage == 2:
        del config["zero_optimization"]["offload_param"]

    calls = []

    def failing(opt):
        # the first call builds it on a stand-in before anything moves (what fails there is
        # refused early: test_lr_schedules.py); this one fails at the real build, late
        calls.append(opt)
        if len(calls) > 1:
            raise RuntimeError("the user's scheduler factory failed")
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    with pytest.raises(RuntimeError, match="scheduler factory failed"):
        infinity.initialize(model=model, config=config, lr_scheduler=failing)
    assert len(calls) == 2
    assert not any(e.module is model for e in _live_engines)
    assert not [t for t in threading.enumerate() if t.name == "infinity-step-stream"]
    if stage == 3:      # its values are gone: what is left on it says so
        with pytest.raises(RuntimeError, match="whose initialize failed part-way"):
            model(torch.randn(8, 4))
        with pytest.raises(ValueError, match="are empty: an engine released them"):
            infinity.initialize(model=model, config=config)
        return
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    engine, *_ = infinity.initialize(model=model, config=config)
    engine.close()


def test_a_scheduler_on_groups_the_engine_drops_is_refused_before_the_weights_move(
        disk_dir) -> None:
    """The scheduler's groups cannot be driven one for one (an empty group is dropped): a pure
    argument check, refused before anything is built (at stage 3 the refusal came after the
    weights moved into the engine, leaving the model without them)."""
    model = Net(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": []}], lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    config = _config(disk_dir)
    del config["optimizer"]
    with pytest.raises(ValueError, match="2 param groups became 1 in the engine"):
        infinity.initialize(model=model, optimizer=opt, lr_scheduler=schedule, config=config)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_another_engines_backward_never_early_steps_this_one(disk_dir) -> None:
    """The generator's backward goes through the discriminator's engine: under the early step
    the discriminator would step then; it refuses instead, before stepping anything, and the
    generator's engine trains on once the discriminator is kept out of its loss."""
    torch.manual_seed(0)
    gen_model, disc_model = Net(4, 8), Net(8, 1)
    gen, *_ = infinity.initialize(model=gen_model, config=_config(disk_dir / "g"))
    disc, *_ = infinity.initialize(model=disc_model, config=_config(disk_dir / "d"))
    try:
        assert disc.optimizer.early_step
        before = _weights(disc)
        z = torch.randn(8, 4)
        with pytest.raises(RuntimeError, match="backward of another engine.*nothing was stepped"
                                               r".*early_step \"off\""):
            gen.backward(disc(gen(z)).mean())
        assert torch.equal(_weights(disc), before)
        for p in disc_model.parameters():
            p.requires_grad_(False)
        gen.backward(disc(gen(z)).mean())
        gen.step()
        assert gen.global_steps == 1 and torch.equal(_weights(disc), before)
    finally:
        gen.close()
        disc.close()


def test_a_deferred_engine_keeps_another_engines_gradients_as_torch_does(disk_dir) -> None:
    """With early_step "off" the discriminator keeps what the generator's backward gave it until
    its own zero_grad() (a GAN loop), and trains as torch does."""
    torch.manual_seed(0)
    gen_model, disc_model = Net(4, 8), Net(8, 1)
    ref_gen, ref_disc = copy.deepcopy(gen_model), copy.deepcopy(disc_model)
    opt_g = torch.optim.Adam(ref_gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(ref_disc.parameters(), lr=1e-2)
    gen, *_ = infinity.initialize(model=gen_model, config=_config(disk_dir / "g"))
    disc, *_ = infinity.initialize(model=disc_model, config=_config(disk_dir / "d", "off"))
    data = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            z, real = torch.randn(8, 4, generator=data), torch.randn(8, 8, generator=data)
            # discriminator step
            disc.zero_grad()
            loss_d = disc(real).mean() - disc(gen(z).detach()).mean()
            disc.backward(loss_d)
            disc.step()
            opt_d.zero_grad()
            ref_loss_d = ref_disc(real).mean() - ref_disc(ref_gen(z).detach()).mean()
            ref_loss_d.backward()
            opt_d.step()
            # generator step: its backward leaves gradients in the discriminator
            loss_g = disc(gen(z)).mean()
            gen.backward(loss_g)
            gen.step()
            opt_g.zero_grad()
            ref_loss_g = ref_disc(ref_gen(z)).mean()
            ref_loss_g.backward()
            opt_g.step()
            torch.testing.assert_close(loss_d, ref_loss_d, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loss_g, ref_loss_g, rtol=1e-5, atol=1e-6)
        assert disc.global_steps == gen.global_steps == 3
    finally:
        gen.close()
        disc.close()


def test_a_ctrl_c_in_a_backward_that_steps_units_waits_for_its_end(disk_dir) -> None:
    """Ctrl-C (a real SIGINT) inside a backward under the early step, which steps each unit as
    it completes: the backward finishes and is recorded, then KeyboardInterrupt is raised, so
    the state is a backward before its step(): a save refuses it, step() completes it, and
    training goes on equal to a run never interrupted. Before, the interrupt stopped the
    backward halfway (the later units stepped, the earlier not) and a save took that state as
    the step before."""
    import os
    import signal

    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def train(interrupt_at: int | None) -> torch.Tensor:
        torch.manual_seed(0)
        model = Net(16, 4)
        armed = {"on": False}

        def ctrl_c(module, grad_output):
            if armed["on"]:
                armed["on"] = False
                os.kill(os.getpid(), signal.SIGINT)    # delivered to this, the main thread
        model.blocks[1].register_full_backward_pre_hook(ctrl_c)
        engine, *_ = infinity.initialize(model=model, config=_config(disk_dir / f"{interrupt_at}",
                                                                     "on"))
        try:
            for i, x in enumerate(batches):
                armed["on"] = i == interrupt_at
                loss = engine(x).pow(2).mean()
                if i != interrupt_at:
                    engine.backward(loss)
                else:
                    with pytest.raises(KeyboardInterrupt):
                        engine.backward(loss)
                    with pytest.raises(RuntimeError, match="between backward\\(\\) and step"):
                        engine.save_checkpoint(disk_dir / "ckpt")
                engine.step()
            return _weights(engine)
        finally:
            engine.close()

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    assert torch.equal(train(1), train(None))


def test_a_backward_of_a_graph_recorded_before_close_is_refused_plainly(disk_dir) -> None:
    """The backward's hooks fetched a unit after close(): a new swap directory was made under
    the user's nvme_path, and the error was an unallocated extent's read. Now the closed swap
    space says so, and nothing new is made on the disk."""
    torch.manual_seed(0)
    engine, *_ = infinity.initialize(model=Net(8, 4), config=_config(disk_dir))
    loss = engine(torch.randn(8, 8)).pow(2).mean()
    engine.close()
    before = sorted(p.name for p in disk_dir.iterdir())
    with pytest.raises(RuntimeError, match="swap space was closed with the engine"):
        loss.backward()
    assert sorted(p.name for p in disk_dir.iterdir()) == before
