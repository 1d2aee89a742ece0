"""What a checkpoint load restores besides the tensors (checkpoint/restore.py), at unit level:
the counters read and checked,
the param-group settings kept or refused, the loss scaler's and the scheduler's states taken
or kept, and every refusal's message naming the checkpoint, the field and the value."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from infinity.checkpoint.restore import CONFIG_GROUP_KEYS, Restore, read_restore
from infinity.checkpoint.tensor_file import CheckpointError
from infinity.checkpoint.training_state import TrainingState
from infinity.config.precision import Fp16Config
from infinity.optim.loss_scaler import LossScaler

from fakes import RecordingRun

DIR = Path("/ckpt/global_step7")


def _group(**over: Any) -> dict[str, Any]:
    group = {"params": [], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
             "weight_decay": 0.0, "bias_correction": True, "adamw_mode": True, "step": 3,
             "name": "decay"}
    group.update(over)
    return group


def _state(groups: list[dict] | None = None, scheduler: Any = None, scaler: Any = None,
           gas: int = 4, speculation: bool | None = None) -> TrainingState:
    return TrainingState(
        module=torch.nn.Module(), units=[], unit_states=[],
        param_groups=[_group()] if groups is None else groups, lr_scheduler=scheduler,
        loss_scaler=scaler, global_steps=0, micro_steps=0, skipped_steps=0, stage=3,
        compute_dtype=torch.float32, gradient_accumulation_steps=gas,
        speculation_pays=speculation, backwards_since_step=0, manager=None, lendable_pools=[],
        run=RecordingRun())


def _read(state: TrainingState, manifest: dict, optimizer: bool = True,
          scheduler: bool = True) -> Restore:
    return read_restore(state, manifest, optimizer, scheduler, DIR)


def _refused(state: TrainingState, manifest: dict, optimizer: bool = True,
             scheduler: bool = True) -> str:
    with pytest.raises(CheckpointError) as info:
        _read(state, manifest, optimizer, scheduler)
    return str(info.value)


def _lambda_lr() -> torch.optim.lr_scheduler.LambdaLR:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


class _Schedule:
    """A schedule that says which states it takes (as optim/schedules.py's does)."""

    def __init__(self, takes: bool) -> None:
        self.takes = takes
        self.asked: list[Any] = []

    def accepts_state(self, state: Any) -> bool:
        self.asked.append(state)
        return self.takes

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": 5}


def test_counters_are_read_and_micro_steps_follow_the_loading_engines_accumulation() -> None:
    """micro_steps is global_steps times the LOADING engine's gradient_accumulation_steps;
    the saved one is reported apart; everything else taken with both flags on."""
    scaler_state = {"cur_scale": 8.0}
    sched = _lambda_lr()
    saved_sched = sched.state_dict()
    r = _read(_state(scheduler=sched, scaler=LossScaler(Fp16Config(enabled=True)), gas=4,
                     speculation=True),
              {"engine": {"global_steps": 5, "skipped_steps": 2,
                          "gradient_accumulation_steps": 3, "speculation_pays": 0},
               "param_groups": [_group(lr=0.5, betas=[0.9, 0.999])], "loss_scaler": scaler_state,
               "lr_scheduler": saved_sched})
    assert (r.global_steps, r.skipped_steps, r.micro_steps) == (5, 2, 20)
    assert r.saved_gradient_accumulation_steps == 3
    assert r.loss_scaler is scaler_state
    assert r.lr_scheduler == saved_sched     # decoded: an equal value
    assert r.speculation_pays is False and r.lr_from_scheduler is False
    assert r.param_groups == [{"lr": 0.5, "betas": (0.9, 0.999), "eps": 1e-8,
                               "weight_decay": 0.0, "bias_correction": True, "step": 3,
                               "name": "decay"}]


def test_a_manifest_without_counters_restores_zero_steps_and_the_engines_accumulation() -> None:
    r = _read(_state(gas=6), {"param_groups": []})
    assert (r.global_steps, r.skipped_steps, r.micro_steps) == (0, 0, 0)
    assert r.saved_gradient_accumulation_steps == 6
    assert r.param_groups == [] and r.loss_scaler is None and r.lr_scheduler is None
    assert r.speculation_pays is None


def test_speculation_is_restored_as_a_bool_only_when_saved_and_the_engine_speculates() -> None:
    """A saved 1 comes back True (not 1); not saved, or an engine that does not speculate
    (its speculation_pays None), or without optimizer states: None, the engine's kept."""
    on = _read(_state(speculation=False), {"engine": {"speculation_pays": 1}, "param_groups": []})
    assert on.speculation_pays is True
    assert _read(_state(speculation=None), {"engine": {"speculation_pays": True},
                                            "param_groups": []}).speculation_pays is None
    assert _read(_state(speculation=True), {"engine": {"speculation_pays": True}},
                 optimizer=False).speculation_pays is None


def test_without_optimizer_states_groups_scaler_and_speculation_are_kept() -> None:
    """load_optimizer_states=False: no group settings, no scaler state (even a damaged one,
    which is then not looked at), and the lr is set from the restored schedule."""
    sched = _lambda_lr()
    r = _read(_state(scheduler=sched, scaler=LossScaler(Fp16Config(enabled=True))),
              {"engine": {"global_steps": 1}, "param_groups": "damaged", "loss_scaler": [1],
               "lr_scheduler": sched.state_dict()}, optimizer=False)
    assert r.param_groups is None and r.loss_scaler is None and r.speculation_pays is None
    assert r.lr_from_scheduler is True
    assert r.lr_scheduler == sched.state_dict()


def test_without_scheduler_states_the_saved_schedule_is_neither_checked_nor_taken() -> None:
    """load_lr_scheduler_states=False: a scheduler state of another kind is not refused."""
    r = _read(_state(scheduler=_lambda_lr()), {"param_groups": [], "lr_scheduler": {"x": 1}},
              scheduler=False)
    assert r.lr_scheduler is None


def test_states_of_parts_the_engine_lacks_are_dropped() -> None:
    """A saved scaler state with no loss scaler (bf16 now), a saved schedule with no
    scheduler: nothing to restore them into."""
    r = _read(_state(scheduler=None, scaler=None),
              {"param_groups": [], "loss_scaler": {"cur_scale": 2.0},
               "lr_scheduler": {"last_epoch": 3}})
    assert r.loss_scaler is None and r.lr_scheduler is None


@pytest.mark.parametrize("key,value,kind", [
    ("global_steps", 2.0, "an integer"), ("global_steps", True, "an integer"),
    ("skipped_steps", "3", "an integer"), ("gradient_accumulation_steps", None, "an integer"),
    ("gradient_accumulation_steps", 2.5, "an integer")])
def test_a_counter_that_is_not_an_integer_is_refused_naming_it(key: str, value: Any,
                                                               kind: str) -> None:
    message = _refused(_state(), {"engine": {key: value}, "param_groups": []})
    assert message == (f"checkpoint {DIR}: its manifest.json has {key} = {value!r}, not {kind}: "
                       "the manifest was edited or damaged. Load another checkpoint")


def test_engine_counters_that_are_not_a_dict_are_refused() -> None:
    assert _refused(_state(), {"engine": [1, 2]}) == (
        f"checkpoint {DIR}: its manifest.json's engine counters are not a dict: the manifest "
        "was edited or damaged")


@pytest.mark.parametrize("counters", [{"global_steps": -1}, {"skipped_steps": -1},
                                      {"global_steps": 3, "skipped_steps": -2}])
def test_negative_step_counts_are_refused(counters: dict) -> None:
    g, s = counters.get("global_steps", 0), counters.get("skipped_steps", 0)
    assert _refused(_state(), {"engine": counters, "param_groups": []}) == (
        f"checkpoint {DIR}: its manifest.json has negative step counts ({g}, {s})")


def test_zero_counts_are_accepted() -> None:
    r = _read(_state(), {"engine": {"global_steps": 0, "skipped_steps": 0}, "param_groups": []})
    assert (r.global_steps, r.skipped_steps) == (0, 0)


@pytest.mark.parametrize("groups", [None, {"lr": 1}, [{"lr": 1}, [1]], "x"])
def test_param_groups_that_are_not_a_list_of_dicts_are_refused(groups: Any) -> None:
    manifest = {} if groups is None else {"param_groups": groups}
    assert _refused(_state(), manifest) == (
        f"checkpoint {DIR}: its manifest.json's param_groups is not a list of settings: the "
        "manifest was edited or damaged")


def test_group_settings_keep_config_keys_unknown_keys_and_params(infinity_log) -> None:
    """adamw_mode is the config's (a warning when the checkpoint's differs, none when the
    same); keys the group lacks and "params" are not restored; groups pair in order."""
    state = _state(groups=[_group(), _group(adamw_mode=False, lr=2.0)])
    r = _read(state, {"param_groups": [
        {"adamw_mode": True, "lr": 0.25, "params": [0, 1], "foo": 1},
        {"adamw_mode": True, "lr": 0.5}]})
    assert r.param_groups == [{"lr": 0.25}, {"lr": 0.5}]
    warnings = [rec.getMessage() for rec in infinity_log.records if rec.levelname == "WARNING"]
    assert warnings == [f"checkpoint {DIR} was saved with adamw_mode = True in param group 1; "
                        "the config's False is kept"]
    assert CONFIG_GROUP_KEYS == ("adamw_mode", "optimizer_moments", "optimizer_master")


def test_a_group_the_engine_lacks_the_key_of_is_not_warned_about(infinity_log) -> None:
    """A config key the engine's group does not have is skipped, compared with its absence:
    a saved value equal to the engine's (missing) one is silent."""
    r = _read(_state(groups=[{"params": [], "lr": 1.0}]),
              {"param_groups": [{"adamw_mode": None, "lr": 3}]})
    assert r.param_groups == [{"lr": 3}]
    assert not [rec for rec in infinity_log.records if rec.levelname == "WARNING"]


def test_betas_come_back_as_a_tuple_of_numbers() -> None:
    r = _read(_state(), {"param_groups": [{"betas": [0.8, 1]}]})
    assert r.param_groups == [{"betas": (0.8, 1)}]
    assert type(r.param_groups[0]["betas"]) is tuple


@pytest.mark.parametrize("betas", [(0.8, 0.9), [0.9], [0.8, 0.9, 0.99], 0.9])
def test_betas_that_are_not_two_numbers_are_refused(betas: Any) -> None:
    assert _refused(_state(), {"param_groups": [{"betas": betas}]}) == (
        f"checkpoint {DIR}: its manifest.json has param_groups[0].betas = {betas!r}, not two "
        "numbers: the manifest was edited or damaged")


@pytest.mark.parametrize("betas", [[0.9, "x"], [True, 0.9]])
def test_a_beta_that_is_not_a_number_is_refused(betas: list) -> None:
    bad = betas[1] if betas[1] == "x" else betas[0]
    assert _refused(_state(), {"param_groups": [{"betas": betas}]}) == (
        f"checkpoint {DIR}: its manifest.json has param_groups[0].betas = {bad!r}, not a "
        "number: the manifest was edited or damaged. Load another checkpoint")


@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_a_flag_must_stay_true_or_false(value: Any) -> None:
    state = _state(groups=[_group(), _group()])
    assert _refused(state, {"param_groups": [{}, {"bias_correction": value}]}) == (
        f"checkpoint {DIR}: its manifest.json has param_groups[1].bias_correction = "
        f"{value!r}, not true or false")


def test_a_flag_is_restored_as_saved() -> None:
    r = _read(_state(), {"param_groups": [{"bias_correction": False}]})
    assert r.param_groups == [{"bias_correction": False}]


@pytest.mark.parametrize("key,value", [("lr", "0.1"), ("lr", True), ("step", None),
                                       ("weight_decay", [0.1])])
def test_a_number_setting_must_stay_a_number(key: str, value: Any) -> None:
    assert _refused(_state(), {"param_groups": [{key: value}]}) == (
        f"checkpoint {DIR}: its manifest.json has param_groups[0].{key} = {value!r}, not a "
        "number: the manifest was edited or damaged. Load another checkpoint")


def test_a_number_setting_may_change_between_int_and_float() -> None:
    """A number is a number: an int step saved as a float, a float lr saved as an int."""
    r = _read(_state(), {"param_groups": [{"lr": 1, "step": 4.0}]})
    assert r.param_groups == [{"lr": 1, "step": 4.0}]


def test_other_settings_are_taken_as_saved() -> None:
    r = _read(_state(), {"param_groups": [{"name": ["any", "value"]}]})
    assert r.param_groups == [{"name": ["any", "value"]}]


def test_loss_scaler_state_that_is_not_a_dict_is_refused() -> None:
    assert _refused(_state(scaler=LossScaler(Fp16Config(enabled=True))),
                    {"param_groups": [], "loss_scaler": [8.0]}) == (
        f"checkpoint {DIR}: its manifest.json's loss_scaler is not a dict: the manifest was "
        "edited or damaged")


def test_a_scheduler_state_of_another_kind_is_refused_before_anything_loads() -> None:
    """A torch LambdaLR resumed from a ds_config schedule's state: the missing keys named."""
    sched = _lambda_lr()
    expected = sorted(sched.state_dict())
    missing = sorted(set(expected) - {"last_epoch"})
    message = _refused(_state(scheduler=sched),
                       {"param_groups": [], "lr_scheduler": {"last_epoch": 2, "other": 1}})
    assert message == (
        f"checkpoint {DIR}: its LR scheduler state (['last_epoch', 'other']) lacks what this "
        f"engine's LambdaLR keeps ({missing}): it was saved by another kind of scheduler. "
        "Pass load_lr_scheduler_states=False to keep this engine's schedule")


def test_a_scheduler_state_that_is_not_a_dict_lacks_every_key() -> None:
    sched = _lambda_lr()
    message = _refused(_state(scheduler=sched), {"param_groups": [], "lr_scheduler": [1, 2]})
    assert message.startswith(f"checkpoint {DIR}: its LR scheduler state (list) lacks what "
                              f"this engine's LambdaLR keeps ({sorted(sched.state_dict())})")


def test_a_scheduler_state_that_is_a_number_is_refused_as_damaged() -> None:
    """An edited manifest's ``"lr_scheduler": 5``: the CheckpointError naming its type, not a
    TypeError from looking into it (``isinstance(state, dict) or True`` would take
    set(state) of any state)."""
    sched = _lambda_lr()
    message = _refused(_state(scheduler=sched), {"param_groups": [], "lr_scheduler": 5})
    assert message.startswith(f"checkpoint {DIR}: its LR scheduler state (int) lacks what "
                              f"this engine's LambdaLR keeps ({sorted(sched.state_dict())})")


def test_a_schedule_that_says_what_it_takes_decides() -> None:
    """accepts_state True: taken even with keys its state_dict lacks; False: refused even
    with every key of its state_dict; no scheduler state saved: nothing asked."""
    yes = _Schedule(True)
    r = _read(_state(scheduler=yes), {"param_groups": [], "lr_scheduler": {"other": 1}})
    assert r.lr_scheduler == {"other": 1} and yes.asked == [{"other": 1}]
    no = _Schedule(False)
    message = _refused(_state(scheduler=no),
                       {"param_groups": [], "lr_scheduler": {"last_batch_iteration": 1}})
    assert message.startswith(f"checkpoint {DIR}: its LR scheduler state "
                              "(['last_batch_iteration']) lacks what this engine's _Schedule "
                              "keeps ([]): it was saved by another kind of scheduler")
    quiet = _Schedule(False)
    assert _read(_state(scheduler=quiet), {"param_groups": []}).lr_scheduler is None
    assert quiet.asked == []


def test_a_state_with_every_key_of_a_plain_scheduler_is_taken() -> None:
    sched = _lambda_lr()
    saved = dict(sched.state_dict(), extra=1)
    assert _read(_state(scheduler=sched), {"param_groups": [], "lr_scheduler": saved}
                 ).lr_scheduler == saved
