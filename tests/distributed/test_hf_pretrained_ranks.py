"""Hugging Face directories in and out at two gloo ranks (the single-process tests:
tests/integration/test_hf_pretrained.py): ``infinity.from_pretrained`` at stage 3 on NVMe, each
rank reading only its shards, trains like torch on the whole batch and saves what transformers
loads."""
from __future__ import annotations

import pytest
import torch

from hf_common import hf_load, hf_moe, hf_saved, logits_of, weights_in
from parity import VOCAB, loss_of
from ranks import check_ranks, launch, read_results

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_two_ranks_load_train_and_save_pretrained(disk_dir, tmp_path, family) -> None:
    """from_pretrained at 2 gloo ranks (stage 3, NVMe, each rank reading only its shards),
    3 clipped steps: the mean loss over the ranks equals torch AdamW on the whole batch;
    engine.save_pretrained, model.save_pretrained (all ranks calling, rank 0 writing) and
    infinity export of the 2-rank checkpoint load with transformers to the engine's logits;
    model.state_dict() is the same on both ranks; generate() with a length of its own on each
    rank gives transformers' tokens (a rank done first went on alone: a hang or a gloo abort,
    without synced_gpus); a bf16 engine's default (fp32) save gathers
    its masters: the file's values bit for bit.
    Mixtral: its experts fused at load on each rank (each keeping its shard of the fused
    tensors), the router's auxiliary loss in each rank's loss, and saved per expert again."""
    from safetensors.torch import load_file

    steps = 3
    src = hf_saved(disk_dir, "llama") if family == "llama" else hf_moe(disk_dir, "mixtral")
    check_ranks(launch(2, "hf_pretrained_ranks_worker.py",
                       [str(tmp_path), str(disk_dir), str(src), str(steps)], timeout=600))
    results = read_results(tmp_path, 2)
    reference = hf_load(src).train()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randint(0, VOCAB, (4, 12), generator=gen)
        halves = [loss_of(reference(input_ids=x[r * 2:(r + 1) * 2], labels=x[r * 2:(r + 1) * 2]))
                  for r in range(2)]
        (sum(halves) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        got = sum(r["losses"][step] for r in results) / 2
        want = sum(h.item() for h in halves) / 2
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    logits = load_file(str(tmp_path / "logits0.safetensors"))["logits"]
    assert torch.equal(logits, load_file(str(tmp_path / "logits1.safetensors"))["logits"])
    x = torch.arange(12).reshape(1, 12) % VOCAB
    from infinity.cli import main

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "exported")]) == 0
    for name in ("saved", "model_saved", "exported"):
        assert (logits_of(hf_load(tmp_path / name), x) - logits).abs().max().item() == 0.0, name
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    saved = hf_load(tmp_path / "saved")
    for rank, result in enumerate(results):     # generations of different lengths per rank
        want = saved.generate(torch.arange(rank, rank + 5).reshape(1, 5),
                              max_new_tokens=3 + 5 * rank, do_sample=False)
        assert result["generated"] == want.tolist(), (rank, result["generated"], want)
    assert results[0]["state"] == results[1]["state"]
    original = weights_in(src)
    masters = weights_in(tmp_path / "masters")
    assert set(masters) == set(original)
    for name, value in original.items():
        assert masters[name].dtype == torch.float32 and torch.equal(masters[name], value), name
    torch.testing.assert_close(logits, logits_of(reference.eval(), x), rtol=1e-4, atol=1e-5)
