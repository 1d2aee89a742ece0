"""One rank of test_train_ranks.py's mismatched-run test: ``infinity train`` with a --seed that
depends on the rank (a launcher wrapper passing each node its own), as the CLI's main. argv:
the nvme path."""
from __future__ import annotations

import os
import sys

from infinity.cli import main

if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    sys.exit(main(["train", "--model-size", "tiny", "--steps", "1", "--seq-len", "32",
                   "--nvme-path", sys.argv[1], "--seed", str(rank), "--plot", "off"]))
