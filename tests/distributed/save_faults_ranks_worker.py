"""A rank of tests/distributed/test_save_faults_ranks.py: weights saves (``save_pretrained``,
``save_16bit_model``) that fail on rank 0 alone, before writing or partway, each followed by
the next; prints one JSON line of what each save raised and the files' bytes after it."""
from __future__ import annotations

import errno
import hashlib
import json
import sys
from pathlib import Path

import torch

import infinity
from infinity.checkpoint import tensor_file
from parity import VOCAB, make_model


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


class FailingAppends:
    """Rank 0's tensor files fail with a full disk at their ``after``-th append."""

    def __init__(self, after: int) -> None:
        self.after, self.count = after, 0
        self.original = tensor_file.TensorFileWriter.append

    def __enter__(self) -> None:
        def append(writer, name, values):
            self.count += 1
            if self.count >= self.after:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return self.original(writer, name, values)
        tensor_file.TensorFileWriter.append = append

    def __exit__(self, *exc) -> None:
        tensor_file.TensorFileWriter.append = self.original


def main() -> None:
    out, nvme = Path(sys.argv[1]), sys.argv[2]
    rank = infinity.init_distributed().rank
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
                                                            "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                              "nvme_path": nvme},
                                "offload_optimizer": {"device": "cpu"}},
          "infinity": {"collective_timeout": 60, "compute_dtype": "fp32"}}
    engine, *_ = infinity.initialize(model=make_model("llama", seed=0, layers=2, width=32),
                                     config=ds)

    def train() -> None:
        x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()

    def attempt(save, target: Path, fail_after: int = 0) -> str:
        try:
            if rank == 0 and fail_after:
                with FailingAppends(fail_after):
                    save(target)
            else:
                save(target)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    train()
    good, single = out / "good", out / "single"
    results = {"first": attempt(engine.save_pretrained, good),
               "first_16bit": attempt(engine.save_16bit_model, single / "model.safetensors")}
    before = {"good": digest(good), "single": digest(single)}
    blocked = out / "a_file"
    if rank == 0:
        blocked.write_text("the user's file\n")
    train()
    results["into_a_file"] = attempt(engine.save_pretrained, blocked)
    results["16bit_into_a_file"] = attempt(engine.save_16bit_model, blocked / "model.safetensors")
    results["partway"] = attempt(engine.save_pretrained, good, fail_after=2)
    results["16bit_partway"] = attempt(engine.save_16bit_model, single / "model.safetensors",
                                       fail_after=2)
    after_failures = {"good": digest(good), "single": digest(single)}
    train()
    results["after"] = attempt(engine.save_pretrained, out / "after")
    results["again"] = attempt(engine.save_pretrained, good)    # its lock was released
    engine.close()
    print(json.dumps({"rank": rank, "results": results, "unchanged": before == after_failures,
                      "user_file": blocked.read_text() if rank == 0 else None}), flush=True)


if __name__ == "__main__":
    main()
