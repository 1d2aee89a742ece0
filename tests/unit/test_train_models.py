"""infinity.train.models: byte-level presets, --hf-config of any causal LM, bad configs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infinity.train import models
from infinity.train.data import VOCAB_SIZE


def test_demo_preset_is_85m_with_the_byte_vocabulary() -> None:
    config = models.preset_config(models.DEFAULT_PRESET, seq_len=128)
    assert config.vocab_size == VOCAB_SIZE
    assert config.tie_word_embeddings is False and config.use_cache is False
    n = models.count_parameters(config)
    # 12 layers x (4 h^2 + 3 h i + 2 h) + 2 x vocab x h + h, with h = 768, i = 2048.
    assert n == 12 * (4 * 768**2 + 3 * 768 * 2048 + 2 * 768) + 2 * VOCAB_SIZE * 768 + 768
    assert 84e6 < n < 86e6
    assert "85.35M params" in models.describe(config, n)


def test_planner_sizes_get_the_byte_vocabulary() -> None:
    config = models.preset_config("1B", seq_len=4096)
    assert config.vocab_size == VOCAB_SIZE and config.hidden_size == 2048
    assert config.max_position_embeddings >= 4096


def test_long_sequences_widen_the_position_table() -> None:
    assert models.preset_config("tiny", seq_len=10_000).max_position_embeddings == 10_000


def test_unknown_preset_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="'3Q' is not a preset; choose one of .*tiny.*85M"):
        models.preset_config("3Q", seq_len=128)


def test_tiny_preset_builds_and_runs_a_byte_batch() -> None:
    torch.manual_seed(0)
    model = models.build_model(models.model_config("tiny", None, seq_len=32))
    x = torch.randint(0, VOCAB_SIZE, (2, 32))
    out = model(input_ids=x, labels=x)
    assert out.logits.shape == (2, 32, VOCAB_SIZE) and torch.isfinite(out.loss)


def _gpt2_config(tmp_path: Path, **overrides) -> Path:
    config = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
              "vocab_size": 300}
    config.update(overrides)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_hf_config_of_another_architecture(tmp_path: Path) -> None:
    path = _gpt2_config(tmp_path)
    for source in (path, tmp_path):  # the file or its directory
        config = models.model_config(None, source, seq_len=64)
        assert config.model_type == "gpt2" and config.vocab_size == 300
    model = models.build_model(config)
    x = torch.randint(0, VOCAB_SIZE, (1, 64))
    assert torch.isfinite(model(input_ids=x, labels=x).loss)
    assert "gpt2, 2 layers, hidden 32" in models.describe(config, models.count_parameters(config))


def test_hf_config_must_hold_the_byte_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"vocab_size = 100 .* set vocab_size >= {VOCAB_SIZE}"):
        models.hf_config(_gpt2_config(tmp_path, vocab_size=100), seq_len=64)


def test_hf_config_must_hold_the_sequence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at most 64 positions but --seq-len is 65"):
        models.hf_config(_gpt2_config(tmp_path), seq_len=65)


def test_hf_config_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.hf_config(tmp_path / "missing.json", seq_len=8)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON at line 1"):
        models.hf_config(bad, seq_len=8)
    bad.write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="model_type"):
        models.hf_config(bad, seq_len=8)
    bad.write_text('{"model_type": "no-such-arch"}')
    with pytest.raises(ValueError, match="transformers cannot read it"):
        models.hf_config(bad, seq_len=8)


def test_model_size_and_hf_config_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pass one of them"):
        models.model_config("tiny", _gpt2_config(tmp_path), seq_len=8)
