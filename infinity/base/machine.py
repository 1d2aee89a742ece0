"""Which machine this process runs on: its boot id and a name for the machine.

Why here: the swap directories' owners (storage/swap_dir.py) and the planner's count of ranks
sharing a machine's memory (planner/inputs.py) both ask it, and the planner sits below storage.
"""
from __future__ import annotations

import socket
from pathlib import Path

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id(path: str = BOOT_ID_PATH) -> str:
    """This boot's id (changes at every reboot), or "" when the kernel does not expose it."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def machine_id() -> str:
    """The host name and boot id: the same for every process on one running machine, and
    different between two machines even where their host names are alike ("localhost" in
    containers)."""
    return f"{socket.gethostname()}/{boot_id()}"
