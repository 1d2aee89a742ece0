"""Faults across ranks (gloo, processes on localhost): a rank killed with SIGKILL during a step,
or raising in its forward, makes the other rank exit non-zero within the collective timeout +
30 s with an error naming the lost rank, never a hang; ranks started with different configs or
model structures are refused at initialize on every rank, naming the first difference.

The workers call ``infinity.init_distributed()`` first (the default timeout of 30 minutes): the
config's short ``infinity.collective_timeout`` must apply to that group anyway.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from ranks import launch, start

pytestmark = pytest.mark.distributed

TIMEOUT_S = 10.0      # infinity.collective_timeout of these runs
BAR_S = TIMEOUT_S + 30


def _run(tmp_path, mode: str, victim: int = 1, world: int = 2, timeout_s: float = TIMEOUT_S):
    out, nvme = tmp_path / "out", tmp_path / "nvme"
    out.mkdir()
    nvme.mkdir()
    procs = start(world, "rank_faults_worker.py", [mode, str(out), str(nvme), str(timeout_s),
                                                   str(victim)])
    return procs, out


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """Wait for ``proc`` (killing it past ``timeout``): its exit status, stderr, exit time."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        err += f"\n[killed: still running after {timeout:.0f}s]"
    return proc.returncode, err, time.time()


def _wait_for(path, procs, limit: float = 120.0) -> float:
    deadline = time.time() + limit
    while not path.exists():
        if time.time() > deadline or all(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            errs = [p.communicate()[1][-3000:] for p in procs]
            pytest.fail(f"the fault was never injected ({path.name} missing): {errs}")
        time.sleep(0.1)
    time.sleep(0.05)     # written, not necessarily flushed
    return float(path.read_text())


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-store-host"])
def test_a_rank_killed_during_a_step_is_named_by_the_others(tmp_path, victim):
    procs, out = _run(tmp_path, "kill", victim=victim)
    killed_at = _wait_for(out / "killed_at", procs)
    survivor = 1 - victim
    rc, err, ended = _finish(procs[survivor], BAR_S + 30)
    procs[victim].communicate()
    assert rc != 0, err[-3000:]
    assert ended - killed_at < BAR_S, (ended - killed_at, err[-3000:])
    assert "LostRankError" in err and f"rank {victim}" in err, err[-3000:]
    if victim == 1:
        assert "rank 1 (" in err and "stopped: its heartbeat stopped" in err, err[-3000:]
    else:       # rank 0 hosted the store: it went with it
        assert "rank 0 (which hosts it) has stopped" in err, err[-3000:]


def test_a_rank_raising_in_its_forward_is_named_with_its_error(tmp_path):
    procs, _ = _run(tmp_path, "raise")
    rc1, err1, ended1 = _finish(procs[1], BAR_S + 60)
    rc0, err0, ended0 = _finish(procs[0], BAR_S + 30)
    assert rc1 != 0 and "injected failure in rank 1's forward" in err1, err1[-3000:]
    assert rc0 != 0, err0[-3000:]
    assert ended0 - ended1 < BAR_S, (ended0 - ended1, err0[-3000:])
    assert "rank 1 (" in err0 and \
        "failed: RuntimeError: injected failure in rank 1's forward (in forward)" in err0, \
        err0[-3000:]


def test_a_rank_that_raised_and_hangs_is_named_after_the_timeout(tmp_path):
    """The victim catches its error and stays alive outside any collective: the survivor's
    collective fails after the config's timeout (not the group's 30 minutes), naming it."""
    procs, out = _run(tmp_path, "raise-and-hang")
    raised_at = _wait_for(out / "raised_at", procs)
    rc0, err0, ended0 = _finish(procs[0], BAR_S + 30)
    procs[1].kill()
    procs[1].communicate()
    assert rc0 != 0, err0[-3000:]
    assert TIMEOUT_S - 1 <= ended0 - raised_at < BAR_S, (ended0 - raised_at, err0[-3000:])
    assert "rank 1 (" in err0 and "failed: RuntimeError: injected failure" in err0, err0[-3000:]


def test_a_save_called_on_rank_0_only_is_refused_naming_it_on_every_rank(tmp_path):
    """``if rank == 0: engine.save_checkpoint(...)``: rank 0's first gather would pair with rank
    1's next training collective (gloo aborts both, or they wait out the timeout). Rank 0
    refuses as soon as rank 1 has gone past the call (not after the timeout, which is long
    here), before writing anything; rank 1's collective then fails naming rank 0's error."""
    procs, out = _run(tmp_path, "alone", victim=0, timeout_s=600.0)
    rc0, err0, _ = _finish(procs[0], 300)
    rc1, err1, _ = _finish(procs[1], 120)
    # each rank names its call and the other's (the forward agrees too, at stage 3)
    want0 = ("rank 0 called save_checkpoint() where rank 1 called a training forward",
             "save_checkpoint() must be called on every rank")
    want1 = ("rank 1 called a training forward where rank 0 called save_checkpoint()",)
    assert rc0 != 0 and all(w in err0 for w in want0), err0[-3000:]
    assert "CallNotMadeError" in err0 and "[killed" not in err0, err0[-3000:]
    assert rc1 != 0 and all(w in err1 for w in want1), err1[-3000:]
    saved = out / "ckpt"
    assert not saved.exists() or not any(saved.iterdir()), list(saved.iterdir())


@pytest.mark.parametrize("mode, call", [("skip-step", "step()"),
                                        ("lone-gather", "GatheredParameters()"),
                                        ("lone-eval", "an evaluation forward (no_grad)"),
                                        ("lr-apart", None)])
def test_a_rank_that_parts_from_the_others_is_refused_naming_it(tmp_path, mode, call):
    """Rank 1 skips step() once, or reads a weight under GatheredParameters alone: its next
    collective paired with another kind on rank 0 (gloo aborted the process, or rank 1 read
    another unit's values under the weight's name without a word). Now the call is agreed
    first, as a save is: refused as soon as one rank went past it (not after the timeout,
    long here), the other's collective naming that error. An lr set on one rank only stepped
    each rank's shard at its own rate: the step refuses on both ranks."""
    procs, out = _run(tmp_path, mode, victim=1, timeout_s=600.0)
    results = [_finish(proc, 180) for proc in procs]
    for rank, (rc, err, _) in enumerate(results):
        assert rc != 0 and "[killed" not in err and "Received data size" not in err, \
            (rank, err[-3000:])
        if call is None:
            assert "the ranks step with different settings at optimizer step 3" in err, \
                (rank, err[-3000:])
            continue
        assert f"called {call} where rank {1 - rank} called a training forward" in err or \
            f"called a training forward where rank {1 - rank} called {call}" in err, \
            (rank, err[-3000:])


def test_ranks_started_with_different_configs_or_models_are_refused(tmp_path):
    procs, out = _run(tmp_path, "differ")
    for rank, proc in enumerate(procs):
        rc, err, _ = _finish(proc, 120)
        assert rc == 0, (rank, err[-3000:])
    for rank in range(2):
        refusals = json.loads((out / f"rank{rank}.json").read_text())
        assert refusals["alike"] is None, refusals
        assert "rank 1 was started differently from rank 0" in refusals["config"], refusals
        assert "config key optimizer.params.lr is 0.001 on rank 0 and 0.002 there" in \
            refusals["config"], refusals
        assert "rank 1 was started differently from rank 0" in refusals["model"], refusals
        assert "model parameter embed.weight of shape (256, 32), torch.float32 on rank 0, " \
            "embed.weight of shape (256, 48), torch.float32 there" in refusals["model"], refusals
        assert "model buffer stats of shape (2,), torch.float32 on rank 0, stats of shape (3,), " \
            "torch.float32 there" in refusals["buffer"], refusals


def test_a_config_one_rank_refuses_is_named_on_the_others():
    """Rank 1 alone refusing its config at initialize: rank 0 said "its heartbeat stopped
    (killed, or it exited without reporting an error)", the error unnamed."""
    results = launch(2, "config_rank_worker.py", [], timeout=120)
    said = {r.stdout.split(" ", 1)[0]: r.stdout for r in results if r.stdout}
    assert said["1"].startswith("1 ConfigError: zero_optimization.offload_param.device"), said
    assert "rank 1" in said["0"] and "needs ZeRO stage 3" in said["0"] and \
        "(in initialize)" in said["0"], said
