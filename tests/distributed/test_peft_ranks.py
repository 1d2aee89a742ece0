"""PEFT at two gloo ranks, stage 3 (the single-process tests: tests/integration/test_hf_lora.py)."""
from __future__ import annotations

import pytest

from ranks import check_ranks, launch, read_results

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
pytest.importorskip("peft")


def test_a_modules_to_save_adapter_saves_at_two_ranks_and_a_merge_is_refused(
        disk_dir, tmp_path) -> None:
    """``model.save_pretrained`` of a LoRA model with ``modules_to_save=["lm_head"]``: rank 0's
    PEFT save read the head's state dict for its keys, which gathered it on rank 0 alone (a
    gloo abort, or a refusal blaming the user's calls). Now saved, the head whole and equal to
    the engine's; ``merge_and_unload()`` is refused (it merged into released, empty weights and
    lost the adapter without a word). A prompt-tuning adapter saves too: PEFT computes its
    tensor by a forward, which gathered on rank 0 alone (a hang or a gloo abort)."""
    from safetensors.torch import load_file

    check_ranks(launch(2, "peft_ranks_worker.py", [str(tmp_path), str(disk_dir)], timeout=300))
    results = read_results(tmp_path, 2)
    assert results[0]["head"] == results[1]["head"]
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    head = [k for k in saved if "lm_head" in k]
    assert len(head) == 1 and saved[head[0]].numel() > 0
    assert float(saved[head[0]].double().sum()) == pytest.approx(
        next(v for k, v in results[0]["head"].items() if k.endswith("weight")), rel=1e-12)
    prompt = load_file(str(tmp_path / "prompt" / "adapter_model.safetensors"))
    assert float(prompt["prompt_embeddings"].double().sum()) == pytest.approx(
        results[0]["prompt"], rel=1e-6) and results[0]["prompt"] == results[1]["prompt"]
    for r in results:
        assert "merge_and_unload() on a PEFT model an infinity engine holds at ZeRO stage 3" \
            in r["merge"] and "save_pretrained(dir, merged=True)" in r["merge"], r["merge"]
