"""tools/bench/adam_formats_agreement.py (issue 38 c) runs end to end on a tiny range and writes
every format's figures, and its cosine tells a wrong update from a right one (a cosine that
always said 1 would make every number in docs/optimizer-formats.md quietly wrong)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import adam_formats_agreement as A


def test_cosine_tells_a_wrong_update() -> None:
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(10000, generator=gen)
    assert A.cosine(u, u.clone()) > 0.999999
    wrong = u.clone()
    wrong[::2] *= -1                                  # half the signs flipped
    assert A.cosine(wrong, u) < 0.99
    assert A.cosine(u + 0.5 * torch.randn(10000, generator=gen), u) < 0.99
    assert A.cosine(-u, u) < -0.999999
    assert A.rel_err(wrong, u) > 0.5


def test_tool_runs_and_writes_every_format(tmp_path: Path) -> None:
    out = tmp_path / "agree.json"
    assert A.main(["--steps", "5", "--numel", "20000", "--hidden", "256", "--log-every", "0",
                   "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == set(A.FORMATS)
    for name, f in doc["summary"].items():
        for kind in ("same_all", "fresh_all", "traj_all"):
            assert -1.0 <= f[kind]["cos_min"] <= f[kind]["cos_mean"] <= 1.0, (name, kind)
        assert -1.0 <= f["final"]["cum_update_cos"] <= 1.0
        assert len(doc["series"][name]["traj_cos_all"]) == 5
        if f["master"] == "fp32":      # the kernels step from the dequantized moments exactly
            assert f["same_state_exact_max_abs_diff"] == 0.0, name
