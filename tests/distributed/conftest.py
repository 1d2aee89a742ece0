"""The multi-rank tests (several gloo processes on localhost, started as torchrun would) and
their rank workers. They share the launcher and the model, config and reference helpers of
tests/integration (ranks.py, parity.py, hf_common.py): that directory is put on sys.path here for
the tests, and on each worker's PYTHONPATH by ranks.py."""
from __future__ import annotations

import sys
from pathlib import Path

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
if str(INTEGRATION) not in sys.path:
    sys.path.insert(0, str(INTEGRATION))
