"""DeepSpeed's ``communication_data_type`` (config/precision.py ``check_communication_dtype``):
read, no longer ignored, written back only when given, and refused with the key, the value and
the choices where it is no dtype or makes no sense beside the compute dtype."""
from __future__ import annotations

import pytest

from infinity.config import InfinityConfig
from infinity.config.infinity_config import IGNORED_KEYS
from infinity.config.values import ConfigError


def test_it_is_read_not_ignored() -> None:
    assert "communication_data_type" not in IGNORED_KEYS[""]
    assert InfinityConfig.from_dict({}).communication_data_type is None
    cfg = InfinityConfig.from_dict({"communication_data_type": "bf16"})
    assert cfg.communication_data_type == "bf16"
    assert InfinityConfig.from_dict(cfg.to_dict()) == cfg
    assert "communication_data_type" not in InfinityConfig.from_dict({}).to_dict()


@pytest.mark.parametrize("given, compute", [
    ({"communication_data_type": "fp32"}, {}),
    ({"communication_data_type": "fp32", "bf16": {"enabled": True}}, {}),
    ({"communication_data_type": "bf16"}, {}),                         # fp32 compute: half
    ({"communication_data_type": "bf16", "bf16": {"enabled": True}}, {}),
    ({"communication_data_type": "fp16", "fp16": {"enabled": True}}, {}),
    ({"communication_data_type": "bf16"}, {"compute_dtype": "bf16"}),
])
def test_the_choices_that_make_sense(given: dict, compute: dict) -> None:
    cfg = InfinityConfig.from_dict({**given, "infinity": compute})
    assert cfg.communication_data_type == given["communication_data_type"]


@pytest.mark.parametrize("given, match", [
    ({"communication_data_type": "float32"},
     r"communication_data_type = 'float32': expected one of 'fp32', 'bf16', 'fp16'"),
    ({"communication_data_type": 16}, r"communication_data_type = 16: expected one of"),
    ({"communication_data_type": "fp16", "bf16": {"enabled": True}},
     r"'fp16' with bf16 compute: .*65504.*\"bf16\".*\"fp32\""),
    ({"communication_data_type": "fp16"}, r"'fp16' with fp32 compute"),
    ({"communication_data_type": "fp16", "infinity": {"compute_dtype": "bf16"}},
     r"'fp16' with bf16 compute"),
    ({"communication_data_type": "bf16", "fp16": {"enabled": True}},
     r"'bf16' with fp16 compute: .*three fewer mantissa bits"),
])
def test_the_refusals_name_the_key_the_value_and_the_fix(given: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        InfinityConfig.from_dict(given)
