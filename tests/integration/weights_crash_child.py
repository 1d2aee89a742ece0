"""One save of a weights directory, to be killed (weights_crash.run_kills, tools/crash_test.py
--exports): ``export`` from checkpoint B, or ``save_pretrained`` / ``save_16bit_model`` of an
engine that loaded it (the state the references were saved at). Prints ``saving`` just before
the save starts (the parent's random delay counts from there). With ``trap_at`` > 0 the child
SIGKILLs itself at that file operation of the save (weights_crash.trap).

    python weights_crash_child.py KIND CHECKPOINT DIRECTORY MAX_SHARD_SIZE SWAP TRAP_AT
"""
from __future__ import annotations

import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from weights_crash import trap  # noqa: E402


def main() -> None:
    kind, checkpoint, directory = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    max_shard_size, swap, trap_at = int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
    kill = (trap(trap_at, on_fire=lambda: os.kill(os.getpid(), signal.SIGKILL)) if trap_at
            else nullcontext())
    if kind == "export":
        from infinity.checkpoint.pretrained_write import export_pretrained

        print("saving", flush=True)
        with kill:
            export_pretrained(checkpoint, directory, max_shard_size=max_shard_size)
        return
    from weights_crash import engine_config

    import infinity
    from parity import make_model

    engine, *_ = infinity.initialize(model=make_model("llama", layers=2),
                                     config=engine_config(swap))
    engine.load_checkpoint(checkpoint.parent, tag=checkpoint.name)
    print("saving", flush=True)
    with kill:
        if kind == "save_pretrained":
            engine.save_pretrained(directory, max_shard_size=max_shard_size)
        else:
            engine.save_16bit_model(directory)
    engine.close()


if __name__ == "__main__":
    main()
