"""``engine.guards.unusable_swap_paths``: the existing swap paths a config names that the engine
would refuse at ``initialize`` (``infinity plan`` reports such a plan as not fitting), by
storage's one check (``storage.preflight.check_swap_path``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from infinity.config import InfinityConfig
from infinity.engine import guards


def _config(param: tuple[str, Path | None], opt: tuple[str, Path | None],
            backend: str = "auto") -> InfinityConfig:
    def section(device: str, path: Path | None) -> dict:
        return {"device": device, **({"nvme_path": str(path)} if path is not None else {})}
    return InfinityConfig.from_dict({
        "zero_optimization": {"stage": 3, "offload_param": section(*param),
                              "offload_optimizer": section(*opt)},
        "aio": {"backend": backend}})


def test_a_regular_file_is_refused_with_the_check_message(tmp_path) -> None:
    swapfile = tmp_path / "swapfile"
    swapfile.write_bytes(b"")
    problems = guards.unusable_swap_paths(_config(("nvme", swapfile), ("nvme", swapfile)))
    assert len(problems) == 1, problems                  # one path, checked once
    assert str(swapfile) in problems[0] and "is not a directory" in problems[0]


def test_a_missing_path_and_a_path_no_nvme_tier_uses_are_not_checked(tmp_path) -> None:
    swapfile = tmp_path / "swapfile"
    swapfile.write_bytes(b"")
    assert guards.unusable_swap_paths(
        _config(("nvme", tmp_path / "not-yet"), ("cpu", swapfile))) == ()


@pytest.mark.parametrize("backend, direct", [("auto", True), ("mmap", False)])
def test_o_direct_is_probed_unless_the_backend_is_mmap(tmp_path, monkeypatch, backend: str,
                                                      direct: bool) -> None:
    calls = []
    monkeypatch.setattr(guards, "check_swap_path",
                        lambda path, need, *, direct_io: calls.append((path, need, direct_io)))
    assert guards.unusable_swap_paths(_config(("cpu", None), ("nvme", tmp_path), backend)) == ()
    assert calls == [(str(tmp_path), 0, direct)]
