"""One rank of the two-rank pretrained test (started by tests/integration/ranks.py ``launch``):
``infinity.from_pretrained`` at stage 3 with parameters and optimizer on NVMe, a few clipped
steps on this rank's rows of each global batch, then ``engine.save_pretrained`` and
``model.save_pretrained`` (every rank calls them; rank 0 writes), and the eval logits of a
fixed batch; then a bf16 engine's fp32 save of what it loaded.

argv: out_dir nvme_dir src_dir steps
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

import infinity
from parity import VOCAB, zero_config

GLOBAL_ROWS = 4


def main() -> None:
    out, nvme, src, steps = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    warnings.filterwarnings("ignore")
    info = infinity.init_distributed()
    rank, world = info.rank, info.world_size
    rows = GLOBAL_ROWS // world
    ds = zero_config(3, "nvme", "nvme", nvme)
    ds.update(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              train_micro_batch_size_per_gpu=rows, gradient_clipping=0.05)
    engine, *_ = infinity.from_pretrained(src, config=ds)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (GLOBAL_ROWS, 12), generator=gen) for _ in range(steps)]
    losses = []
    try:
        engine.train()
        for x in batches:
            mine = x[rank * rows:(rank + 1) * rows]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.save_pretrained(out / "saved", max_shard_size="40KB")
        engine.save_checkpoint(out / "ckpt")        # slices per rank, for infinity export
        engine.module.save_pretrained(out / "model_saved")
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=torch.arange(12).reshape(1, 12) % VOCAB).logits
            # each rank its own prompt and length: rank 0 is done first (synced_gpus on by
            # default at stage 3, as transformers sets it under DeepSpeed ZeRO-3)
            generated = engine.module.generate(
                torch.arange(rank, rank + 5).reshape(1, 5), max_new_tokens=3 + 5 * rank,
                do_sample=False)
        state = engine.module.state_dict()
    finally:
        engine.close()
    # a bf16 engine saves fp32 by default at stage 3 (no 16-bit gather): its masters, each
    # rank's shard of them gathered, which hold the file's fp32 values bit for bit
    ds.update(bf16={"enabled": True}, infinity={"compute_dtype": "bf16"})
    engine, *_ = infinity.from_pretrained(src, config=ds)
    try:
        engine.save_pretrained(out / "masters")
    finally:
        engine.close()
    save_file({"logits": logits.contiguous()}, str(out / f"logits{rank}.safetensors"))
    digest = {name: float(value.double().sum()) for name, value in state.items()}
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "state": digest,
                                                      "generated": generated.tolist()}))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
