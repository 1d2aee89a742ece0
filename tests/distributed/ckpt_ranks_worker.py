"""One rank of the checkpoint-across-ranks test (started by tests/integration/ranks.py
``launch``): for each case, either trains steps [0, first) and saves, or loads that checkpoint
and trains steps [first, last); the global batch (all ranks' rows) is the same at every world
size, so a run saved at N ranks and resumed at M must continue as one never interrupted.

argv: out_dir nvme_dir ckpt_root cases_json mode(save|resume|resume-damaged) first last

Resuming, each rank records the checkpoint files it hashed (the ranks divide the checking);
"resume-damaged" expects the load to fail on every rank and records the error.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import infinity
import infinity.checkpoint.pinned as pinned
from parity import make_model
from parity_ranks_worker import case_config, global_batches

GLOBAL_ROWS = 4


def main() -> None:
    out, nvme, root = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    cases, mode = json.loads(sys.argv[4]), sys.argv[5]
    first, last = int(sys.argv[6]), int(sys.argv[7])
    info = infinity.init_distributed()
    rank, world = info.rank, info.world_size
    rows = GLOBAL_ROWS // world
    results = {}
    hashed: list[str] = []
    verify = pinned.PinnedSave.verify

    def counted_verify(save, needed, checksums, share=(0, 1), hash_fd=pinned.sha256_of_fd):
        names = {fd: name for name, fd in save._fds.items()}

        def counted_hash(fd):
            hashed.append(names[fd])
            return hash_fd(fd)
        save.open_all(needed)
        names.update({fd: name for name, fd in save._fds.items()})
        return verify(save, needed, checksums, share, counted_hash)

    pinned.PinnedSave.verify = counted_verify
    for case in cases:
        ds = case_config(case, nvme, world)
        ds["train_micro_batch_size_per_gpu"] = rows
        engine, *_ = infinity.initialize(model=make_model("torch", seed=0, layers=3, width=32),
                                         config=ds)
        accumulation = engine.gradient_accumulation_steps()
        # global_batches draws MICRO(2) * world rows per micro-batch; 2 * 2 = GLOBAL_ROWS
        batches = global_batches(case.get("seed", 1), last, accumulation, 2)
        ckpt = root / case["name"]
        try:
            steps = range(0, first) if mode == "save" else range(first, last)
            hashed.clear()
            if mode == "resume-damaged":
                try:
                    engine.load_checkpoint(ckpt)
                except infinity.checkpoint.CheckpointError as exc:
                    results[case["name"]] = {"error": str(exc), "hashed": list(hashed)}
                    continue
                raise AssertionError(f"rank {rank}: a damaged checkpoint loaded")
            if mode == "resume":
                path, client = engine.load_checkpoint(ckpt)
                assert path is not None and client == {"by": "test"}, (path, client)
            losses = []
            for step in steps:
                total = 0.0
                for x in batches[step]:
                    mine = x[rank * rows:(rank + 1) * rows]
                    loss = engine(input_ids=mine, labels=mine)
                    engine.backward(loss)
                    engine.step()
                    total += loss.item()
                losses.append(total / accumulation)
            if mode == "save":
                engine.save_checkpoint(ckpt, client_state={"by": "test"})
            results[case["name"]] = {"losses": losses, "global_steps": engine.global_steps,
                                     "hashed": list(hashed)}
        finally:
            engine.close()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
