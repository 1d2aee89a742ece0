"""``infinity train --pretrained DIR --data FILE --export OUT``: the main job fine-tunes a local
transformers model (its tokenizer when the directory has one, bytes otherwise) with its
progress, summary and plot, and exports a directory from_pretrained loads (the tokenizer
with it). The engine's run is the torch baseline's run of the same options."""
from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch

from infinity.train.loop import TrainOptions, run_training
from infinity.train.run_config import demo_config

transformers = pytest.importorskip("transformers")

TEXT = ("In the beginning was the word, and the word was with the model, and the model was "
        "trained out of core. ") * 40


def _pretrained(directory: Path, vocab_size: int, tokenizer: bool) -> Path:
    """A tiny Llama saved as a transformers directory, with a byte-level BPE tokenizer trained on
    the text (no download) when ``tokenizer``."""
    warnings.filterwarnings("ignore")
    if tokenizer:
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator([TEXT], vocab_size=vocab_size, min_frequency=1,
                                special_tokens=["</s>"])
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer,
                                                    eos_token="</s>")
        fast.save_pretrained(directory)
        vocab_size = max(vocab_size, len(fast))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _run(pretrained: Path, data: Path, disk_dir: Path, out: Path, engine: str = "infinity",
         **extra):
    # the demo config in fp32: "auto" is bf16 on a CPU with native bf16, the losses below are
    # compared with the fp32 torch baseline's
    config = demo_config()
    config["infinity"]["compute_dtype"] = "fp32"
    (out / "fp32.json").write_text(json.dumps(config))
    extra.setdefault("config", str(out / "fp32.json"))
    opts = TrainOptions(engine=engine, pretrained=str(pretrained), data=str(data), steps=6,
                        seq_len=32, nvme_path=str(disk_dir), metrics=str(out / "run.jsonl"),
                        export=str(out / "export"), progress_every=2, lr=3e-3, **extra)
    summary = io.StringIO()
    result = run_training(opts, stream=io.StringIO(), out=summary)
    return result, summary.getvalue()


def test_a_pretrained_model_with_its_tokenizer_is_fine_tuned_and_exported(disk_dir, tmp_path,
                                                                         infinity_log) -> None:
    pretrained = _pretrained(tmp_path / "model", 300, tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    ours_dir, torch_dir = tmp_path / "ours", tmp_path / "torch"
    ours_dir.mkdir()
    torch_dir.mkdir()
    ours, summary = _run(pretrained, data, disk_dir, ours_dir)
    theirs, _ = _run(pretrained, data, disk_dir, torch_dir, engine="torch", plot="off")
    assert f"fine-tune of {pretrained}" in summary
    losses = [r.loss for r in ours.records]
    assert losses == pytest.approx([r.loss for r in theirs.records], rel=1e-5)
    assert losses[-1] < losses[0]
    rows = [json.loads(line) for line in (ours_dir / "run.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == pytest.approx(losses)
    assert ours.plot is not None and Path(ours.plot).stat().st_size > 0
    # the corpus was read with the directory's tokenizer, not as bytes
    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    logged = [r.getMessage() for r in infinity_log.records]
    assert f"tokens: the tokenizer of {pretrained}" in logged
    count = len(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    assert count < len(TEXT) // 2
    assert any(m.startswith(f"data: {data} ({count:,} tokens") for m in logged), logged

    exported = ours_dir / "export"
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    baseline = transformers.AutoModelForCausalLM.from_pretrained(torch_dir / "export")
    for (name, p), (_, q) in zip(model.named_parameters(), baseline.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    again = transformers.AutoTokenizer.from_pretrained(exported)
    assert again(TEXT[:60])["input_ids"] == tokenizer(TEXT[:60])["input_ids"]
    # the torch baseline's export carries the same tokenizer files (it had none)
    carried = sorted(f.name for f in pretrained.iterdir() if "token" in f.name)
    assert carried and all((torch_dir / "export" / name).read_bytes() ==
                           (pretrained / name).read_bytes() for name in carried), carried
    original = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    assert not torch.equal(original.lm_head.weight, model.lm_head.weight)   # it trained


def test_without_a_tokenizer_the_run_reads_bytes(disk_dir, tmp_path) -> None:
    pretrained = _pretrained(tmp_path / "model", 260, tokenizer=False)
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    out = tmp_path / "out"
    out.mkdir()
    result, _ = _run(pretrained, data, disk_dir, out, plot="off")
    assert len(result.records) == 6
    assert transformers.AutoModelForCausalLM.from_pretrained(out / "export").config.vocab_size \
        == 260
    small = _pretrained(tmp_path / "small", 200, tokenizer=False)
    with pytest.raises(ValueError, match=r"vocab_size = 200 cannot hold the byte ids"):
        _run(small, data, disk_dir, out, plot="off")
    with pytest.raises(ValueError, match=r"--export .* is the --pretrained directory"):
        run_training(TrainOptions(pretrained=str(pretrained), data=str(data), steps=1,
                                  seq_len=32, nvme_path=str(disk_dir), export=str(pretrained)),
                     stream=io.StringIO(), out=io.StringIO())
