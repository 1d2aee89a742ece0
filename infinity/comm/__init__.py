"""Data-parallel ranks: the process group (group.py) and the collectives on flat buffers
(collectives.py). Sits below zero and optim, which issue the collectives, and above storage."""
from infinity.comm.collectives import NO_COMM, Collectives, CommCounters, LostRankError
from infinity.comm.group import RankInfo, current_ranks, init_distributed

__all__ = ["NO_COMM", "Collectives", "CommCounters", "LostRankError", "RankInfo",
           "current_ranks", "init_distributed"]
