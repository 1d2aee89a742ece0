"""One rank of the two-rank PEFT test (started by tests/integration/ranks.py ``launch``): a
LoRA model with ``modules_to_save`` at stage 3, two steps on this rank's rows, then
``model.save_pretrained`` on every rank (rank 0 writes) and ``merge_and_unload()``, which must be
refused. PEFT's save reads the copied head's ``state_dict()`` for its keys on rank 0 alone: a
gather there was a collective rank 1 never joined.

argv: out_dir nvme_dir
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import peft
import torch

import infinity
from parity import VOCAB, make_model, zero_config

GLOBAL_ROWS = 4


def main() -> None:
    out, nvme = Path(sys.argv[1]), sys.argv[2]
    warnings.filterwarnings("ignore")
    info = infinity.init_distributed()
    rank, rows = info.rank, GLOBAL_ROWS // info.world_size
    model = peft.get_peft_model(make_model("llama", layers=2, width=32, seed=0), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
        task_type="CAUSAL_LM"))
    ds = zero_config(3, "nvme", "nvme", nvme, collective_timeout=120)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds.update(optimizer={"type": "AdamW", "params": {"lr": 1e-2}},
              train_micro_batch_size_per_gpu=rows)
    engine, *_ = infinity.initialize(model=model, config=ds)
    gen = torch.Generator().manual_seed(3)
    try:
        for _ in range(2):
            x = torch.randint(0, VOCAB, (GLOBAL_ROWS, 12), generator=gen)[rank * rows:(rank + 1) * rows]
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        model.save_pretrained(out / "adapter")
        try:
            model.merge_and_unload()
            merge = "not refused"
        except RuntimeError as exc:
            merge = str(exc)
        head = {k: float(v.double().sum()) for k, v in model.state_dict().items()
                if "modules_to_save" in k}
    finally:
        engine.close()
    # a prompt-tuning adapter: PEFT's save computes its tensor by the prompt encoder's forward,
    # which gathers at stage 3 (on rank 0 alone: a hang or a gloo abort)
    prompt = peft.get_peft_model(make_model("llama", layers=2, width=32, seed=0),
                                 peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                         num_virtual_tokens=5))
    engine, *_ = infinity.initialize(model=prompt, config=ds)
    try:
        x = torch.randint(0, VOCAB, (rows, 12), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        engine.save_pretrained(out / "prompt")
        embedding = float(prompt.get_prompt_embedding_to_save("default").double().sum())
    finally:
        engine.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"merge": merge, "head": head,
                                                      "prompt": embedding}))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
