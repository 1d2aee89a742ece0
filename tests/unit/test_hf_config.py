"""The ds_config filled from the Trainer's arguments (infinity/integrations/hf_config.py): the
compute dtype follows the Trainer's precision where the config leaves it "auto"."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from infinity.integrations.hf_config import fill_from_training_args


def _args(**precision) -> SimpleNamespace:
    flags = {"fp16": False, "fp16_full_eval": False, "bf16": False, "bf16_full_eval": False}
    return SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1,
                           max_grad_norm=1.0, **{**flags, **precision})


@pytest.mark.parametrize("given, precision, want", [
    ({}, {}, "fp32"),                                   # bf16=False (the default): fp32
    ({"infinity": {"compute_dtype": "auto"}}, {}, "fp32"),
    ({"bf16": {"enabled": "auto"}}, {"bf16": True}, "bf16"),
    ({"infinity": {"compute_dtype": "bf16"}}, {"bf16": True}, "bf16"),
    ({"infinity": {"compute_dtype": "fp32"}}, {"bf16": True}, "fp32"),   # written: kept
    ({"fp16": {"enabled": "auto"}}, {"fp16": True}, None),              # "auto": fp16's own
    ({}, {"fp16": True}, "fp32"),          # no fp16 section: DeepSpeed trains fp32 (not bf16)
    ({}, {"bf16_full_eval": True}, "fp32"),                  # evaluation's flag, not training's
])
def test_an_auto_compute_dtype_takes_the_trainers_precision(given, precision, want) -> None:
    """``TrainingArguments(bf16=False)`` beside "auto" trained in bf16 on a CPU with native bf16
    (the plain Trainer in fp32): the Trainer's precision decides, as transformers' own does."""
    out = fill_from_training_args(given, _args(**precision), world_size=1, max_steps=4)
    got = out.get("infinity", {}).get("compute_dtype")
    assert (got == want) if want else got in (None, "auto"), got
