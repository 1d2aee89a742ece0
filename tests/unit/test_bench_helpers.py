"""The engine benchmarks' own arithmetic: model sizes, the I/O replay's byte accounting, the
worker protocol. A wrong helper would make every number in BENCHMARKS.md quietly wrong."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import _common as C  # noqa: E402
import out_of_core  # noqa: E402


def test_llama_params_matches_transformers():
    import torch
    import transformers

    shape = C.size_shape("tiny")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(C.llama_config(shape, 128))
    assert C.llama_params(shape) == sum(p.numel() for p in model.parameters())
    # the issue-6 sizes, as named
    assert round(C.llama_params(C.size_shape("0.49B")) / 1e9, 2) == 0.49
    assert round(C.llama_params(C.size_shape("1.04B")) / 1e9, 2) == 1.04


def test_size_shape_errors_name_the_size():
    assert C.size_shape("64x1x2x128x100") == (64, 1, 2, 128, 100)
    with pytest.raises(ValueError, match="'7B'"):
        C.size_shape("7B")


class _Req:
    def __init__(self, log, op):
        self.log, self.op = log, op

    def wait(self):
        self.log["inflight"][self.op] -= 1


class _FakeEngine:
    def __init__(self):
        self.log = {"r": [], "w": [], "inflight": {"r": 0, "w": 0}, "max": {"r": 0, "w": 0}}

    def _sub(self, op, off, n):
        if len(self.log["r"]) + len(self.log["w"]) > 1000:
            raise AssertionError("the replay does not stop")
        self.log[op].append((off, n))
        self.log["inflight"][op] += 1
        self.log["max"][op] = max(self.log["max"][op], self.log["inflight"][op])
        return _Req(self.log, op)

    def read(self, buf, f, off, n):
        return self._sub("r", off, n)

    def write(self, buf, f, off, n):
        return self._sub("w", off, n)


@pytest.mark.parametrize("reads,writes", [(10 << 20, 3 << 20), (0, 5 << 20), (7 << 20, 0),
                                          ((25 << 20) + 4096, (1 << 20) + 8192)])
def test_replay_moves_exactly_the_step_bytes_within_the_file(reads, writes):
    eng = _FakeEngine()
    chunk, file_bytes, depth = 1 << 20, 4 << 20, 2
    out_of_core._replay(eng, None, None, [None] * depth, reads, writes, chunk, file_bytes)
    log = eng.log
    assert sum(n for _, n in log["r"]) == reads
    assert sum(n for _, n in log["w"]) == writes
    for off, n in log["r"] + log["w"]:
        assert off % 4096 == 0 and 0 <= off and off + n <= file_bytes
    assert log["max"]["r"] <= depth and log["max"]["w"] <= depth
    assert log["inflight"] == {"r": 0, "w": 0}  # everything was waited for


def test_replay_with_the_real_engine(disk_dir):
    from infinity.io import AioConfig, AioEngine, aligned_empty

    chunk = 1 << 20
    path = disk_dir / "replay.swap"
    with AioEngine(AioConfig(queue_depth=4)) as eng:
        f = eng.open(path, "rw", create=True)
        wbuf = aligned_empty(chunk)
        for off in range(0, 4 * chunk, chunk):
            eng.write(wbuf, f, off).wait()
        s = out_of_core._replay(eng, f, wbuf, [aligned_empty(chunk) for _ in range(2)],
                                6 * chunk, 3 * chunk, chunk, 4 * chunk)
        f.close()
    assert s > 0
    path.unlink()


def test_run_worker_reads_the_json_line_and_survives_a_crash(tmp_path):
    ok = C.run_worker([sys.executable, "-c", "print('noise'); print(json.dumps({'ok': True, 'x': 1}))"
                       .replace("json.dumps", "__import__('json').dumps")],
                      log_path=tmp_path / "ok.log", timeout_s=60)
    assert ok["ok"] and ok["x"] == 1 and ok["returncode"] == 0
    bad = C.run_worker([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
                       log_path=tmp_path / "bad.log", timeout_s=60)
    assert not bad["ok"] and bad["returncode"] == 3 and "boom" in bad["log_tail"]
    assert "exited 3" in bad["error"]
    json.dumps(bad)  # what goes into the results file stays JSON


def _fake(tag: str, median: float, **extra) -> dict:
    return {"ok": True, "tag": tag, "median_step_s": median, **extra}


def test_paired_ratios_pair_each_round_with_its_own_compute_run():
    got = {"rounds": [
        {"ours": {"on": _fake("ours-on", 5.0)}, "compute": _fake("compute", 4.0)},
        {"ours": {"on": _fake("ours-on@2", 4.2)}, "compute": _fake("compute@2", 3.5)},
        # a failed compute run pairs with nothing
        {"ours": {"on": _fake("ours-on@3", 4.0)}, "compute": {"ok": False, "tag": "compute@3"}},
    ]}
    assert out_of_core.paired_ratios(got, "on") == [5.0 / 4.0, 4.2 / 3.5]
    assert out_of_core.paired_ratios(got, "off") == []
    assert [out_of_core.round_tag("compute", r) for r in range(3)] == \
        ["compute", "compute@2", "compute@3"]


def test_thread_cpu_counts_a_busy_thread_by_its_name():
    """No timing: the spinner spins until its own CPU clock (time.thread_time) has 0.3 s, says
    so, and waits; only then is the count read, however loaded the machine (it slept 0.5 s of
    wall time and hoped the spinner got 0.2 s of CPU in it)."""
    import threading
    import time

    start = C.thread_cpu()
    spun, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def spin():
        try:
            while time.thread_time() < 0.3:     # this thread's own CPU seconds
                pass
        except BaseException as exc:            # noqa: BLE001 - reported by the main thread
            failed.append(exc)
        finally:
            spun.set()
        done.wait()                             # stays alive (and listed) until measured

    t = threading.Thread(target=spin, name="bench-spinner")
    t.start()
    try:
        spun.wait()
        per_step = C.thread_cpu_since(start, steps=1)
    finally:
        done.set()
        t.join()
    assert not failed
    user, system = per_step["bench-spinner"]
    assert user + system >= 0.25, per_step
    assert "MainThread" not in per_step or sum(per_step["MainThread"]) < 0.25, per_step
