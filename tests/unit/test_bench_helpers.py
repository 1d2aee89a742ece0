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
import gpu_predict  # noqa: E402
import gpu_profile  # noqa: E402
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


def _trace(*events: tuple[str, str, float, float, int]) -> dict:
    """A torch.profiler Chrome trace of (category, name, start µs, duration µs, stream)."""
    return {"traceEvents": [{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                             "args": {"stream": stream}} for cat, name, ts, dur, stream in events]
            + [{"ph": "M", "name": "process_name", "args": {"name": "GPU 0"}}]}


H2D, D2H = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"


def test_copy_time_hidden_behind_compute_is_the_part_a_kernel_covers():
    """gpu_check.sh's "h2d hidden" figure (issue 36's bar: >= 80%): of each copy direction's
    busy time, the part during which a kernel of the compute stream (the one with the most
    kernel time) runs. Overlapping kernels count once; an NCCL kernel, or a conversion kernel
    on a copy's stream, is not compute; a copy beside another copy but no kernel is not hidden;
    a copy on the compute stream is counted apart (it can never be hidden)."""
    trace = _trace(
        ("kernel", "ampere_bf16_gemm", 0, 10, 7), ("kernel", "elementwise", 5, 10, 7),  # 0..15
        ("kernel", "ncclDevKernel_AllGather", 30, 40, 9),                         # not compute
        ("kernel", "copy_kernel (bf16 -> fp32)", 40, 5, 21),                      # side: 40..45
        ("gpu_memcpy", H2D, 10, 10, 20),        # 10..20: 5 of 10 hidden
        ("gpu_memcpy", H2D, 12, 4, 20),         # inside the one above
        ("gpu_memcpy", H2D, 40, 10, 20),        # 40..50: beside NCCL and a side kernel only
        ("gpu_memcpy", H2D, 60, 5, 7),          # on the compute stream
        ("gpu_memcpy", D2H, 2, 4, 21),          # wholly hidden
        ("cpu_op", "aten::mm", 0, 100, 0))      # host side: not the device
    got = gpu_profile.overlap_figures(trace)
    assert got["compute_us"] == 15 and got["nccl_us"] == 40 and got["side_us"] == 5
    assert got["h2d_us"] == 25 and got["h2d_hidden_share"] == pytest.approx(5 / 25)
    assert got["h2d_on_compute_stream_share"] == pytest.approx(5 / 25)
    assert got["d2h_us"] == 4 and got["d2h_hidden_share"] == 1.0
    assert got["d2h_on_compute_stream_share"] == 0.0
    assert got["window_us"] == 70 and got["compute_gap_us"] == 70 - 15   # NCCL ends last
    assert got["events"] == {"compute": 2, "side": 1, "nccl": 1, "h2d": 4, "d2h": 1}
    assert got["streams"] == {"compute": [7], "side": [21], "nccl": [9], "h2d": [7, 20],
                              "d2h": [21]}
    # a trace without copies (a CPU device) has no share, not a share of 0 or 1
    none = gpu_profile.overlap_figures(_trace(("kernel", "gemm", 0, 5, 7)))
    assert none["h2d_hidden_share"] is None and none["d2h_on_compute_stream_share"] is None
    assert none["compute_gap_us"] == 0
    assert gpu_profile.overlap_figures(_trace(("gpu_memcpy", H2D, 0, 5, 20)))["compute_gap_us"] \
        is None
    # between two kernels, not only at an end: the longest such span
    gap = gpu_profile.overlap_figures(_trace(("kernel", "a", 0, 5, 7), ("kernel", "b", 30, 5, 7),
                                             ("kernel", "c", 40, 5, 7),
                                             ("gpu_memcpy", H2D, 44, 10, 20)))
    assert gap["compute_gap_us"] == 25


def test_the_dry_run_of_an_accumulating_setup_runs_every_micro_batch(tmp_path):
    """The "accumulate" setup's prediction: the dry run runs each of a step's micro-batches
    (forward and backward) before its one optimizer step: compute is k times one
    micro-batch's, the parameters are copied to the device for every micro-batch (more than
    twice a step of one: which units stay fetched between micro-batches, and which stay held by
    the steps of the last backward, differs), and the CPU Adam runs once: memory-bound at 50
    GB/s, over 34 bytes a parameter from the gradient home (read, then written back at zero:
    planner/step_time.py ``adam_bytes_per_param``) against the early step's 30."""
    rates = {"matmul_tflops": 700.0, "h2d_GBps": 40.0, "host_total_bytes": 128 * C.GiB,
             "cpu_cores": 16, "gpu_name": "NVIDIA H200", "gpu_total_bytes": 140 * C.GiB,
             "host_memory_GBps": 50.0}
    busy = {}
    for k in (1, 4):
        setup = {**gpu_profile.SETUPS["accumulate"], "accumulate": k}
        res = {**setup, "ds_config": gpu_profile._config(setup, str(tmp_path), "bf16")}
        got = gpu_predict.predict(res, rates, "tiny", str(tmp_path))
        assert "error" not in got and f"--grad-accum {k} " in got["command"] + " ", got
        busy[k] = got["busy_s"]
    assert busy[4]["compute"] == pytest.approx(4 * busy[1]["compute"], rel=1e-9)
    assert busy[4]["H2D"] > 2 * busy[1]["H2D"] > 0
    assert busy[4]["CPU Adam"] == pytest.approx(busy[1]["CPU Adam"] * 34 / 30, rel=1e-9)


def test_predict_gives_the_dry_runs_step_and_shares_for_described_rates(tmp_path, capsys):
    """``--predict``: no GPU and no run, the dry run's figures for each setup on a machine
    described by a JSON object or a profile.json's rates; rates lacking a key are refused,
    naming it."""
    rates = {"matmul_tflops": 700.0, "h2d_GBps": 40.0, "host_total_bytes": 128 * C.GiB,
             "cpu_cores": 16, "gpu_name": "NVIDIA H200", "gpu_total_bytes": 140 * C.GiB,
             "host_memory_GBps": 50.0}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"rates": rates}))
    args = ["--setups", "overlap", "--size", "tiny", "--scratch", str(tmp_path)]
    for source in (json.dumps(rates), str(profile)):
        assert gpu_profile.main(["--predict", source, *args]) == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith("dry run [overlap] tiny mbs 4 x 1 seq 1024: predicted "), line
        step = float(line.split("predicted ")[1].split(" s")[0])
        h2d = float(line.split("h2d ")[1].split(",")[0])
        assert step > 0 and 0.0 <= h2d <= 1.0, line
    del rates["h2d_GBps"]
    with pytest.raises(SystemExit, match="h2d_GBps"):
        gpu_profile.main(["--predict", json.dumps(rates), *args])
    with pytest.raises(SystemExit, match="readable profile.json"):
        gpu_profile.main(["--predict", str(tmp_path / "missing.json"), *args])


def test_a_copy_stalls_compute_only_where_the_next_kernel_waited_for_it():
    """The "stalling" share: copy time the compute stream sat idle for, its next kernel
    starting within ``WAIT_SLACK_US`` of the copy's end. A copy beside idle compute whose next
    kernel comes much later (compute waiting on the host) stalls nothing; one ending while a
    kernel runs stalls nothing; one the next kernel starts right after stalls from the last
    kernel's end (or its own start, if later) to its end."""
    slack = gpu_profile.WAIT_SLACK_US
    compute = [(0.0, 10.0), (10.0, 20.0), (100.0, 110.0), (300.0, 310.0), (400.0, 410.0)]
    copies = [(5.0, 15.0),                    # ends inside a kernel
              (30.0, 100.0 - slack / 2),      # the kernel at 100 waited: 30..(100 - slack/2)
              (120.0, 200.0),                 # the next kernel comes 100 us later: not waited
              (380.0, 400.0)]                 # waited, from its own start: 20
    got = gpu_profile.stalled(copies, compute)
    assert got == [(30.0, 100.0 - slack / 2), (380.0, 400.0)]
    # the same copy started before the last kernel ended: the stall starts at that end
    assert gpu_profile.stalled([(305.0, 400.0)], compute) == [(310.0, 400.0)]
    assert gpu_profile.stalled(copies, []) == []
    figures = gpu_profile.overlap_figures(_trace(
        ("kernel", "gemm", 0, 10, 7), ("kernel", "gemm", 50, 10, 7),
        ("gpu_memcpy", H2D, 20, 30, 20),     # 20..50, the kernel at 50 waited: 30 stalled
        ("gpu_memcpy", H2D, 70, 30, 20)))    # 70..100, nothing after it
    assert figures["h2d_stalling_share"] == pytest.approx(30 / 60)


@pytest.mark.parametrize("seed", range(5))
def test_covered_equals_a_fine_grid_count(seed):
    """``covered`` against counting unit cells of a grid, on random integer intervals."""
    import random

    rng = random.Random(seed)

    def spans():
        return [(s, s + rng.randint(0, 9)) for s in (rng.randint(0, 60) for _ in range(8))]

    a, b = spans(), spans()
    cells = lambda xs: {t for s, e in xs for t in range(s, e)}  # noqa: E731
    assert gpu_profile.covered(a, b) == len(cells(a) & cells(b))
    assert gpu_profile.length(a) == len(cells(a))


def test_model_flops_count_the_multiplying_parameters_and_attention():
    h, layers, _, _, vocab = shape = C.size_shape("0.49B")
    per_token = 6 * (C.llama_params(shape) - vocab * h) + 12 * layers * h * 128
    assert gpu_profile.model_flops_per_step(shape, 128, 2) == per_token * 256


def test_the_gpu_profile_asks_the_dry_run_for_the_machine_it_measured(tmp_path):
    """gpu_check.sh sets the measured GPU step beside this prediction (issue 36's bar: within
    30%): the plan must be the dry run of the setup's own config for one GPU of the measured
    rates, not the datasheet's or this CPU's."""
    rates = {"matmul_tflops": 700.0, "h2d_GBps": 40.0, "host_total_bytes": 128 * C.GiB,
             "cpu_cores": 16, "gpu_name": "NVIDIA H200", "gpu_total_bytes": 140 * C.GiB,
             "nvme_read_GBps": 3.0, "nvme_write_GBps": 2.0, "disk_free_bytes": 60 * C.GiB,
             "host_memory_GBps": 50.0}
    setup = dict(gpu_profile.SETUPS["bench"])
    res = {**setup, "ds_config": gpu_profile._config(setup, str(tmp_path), "bf16")}
    got = gpu_predict.predict(res, rates, "tiny", str(tmp_path))
    assert "error" not in got, got
    for flag in ("--gpus 1 ", "--gpu H200 ", f"--gpu-memory {140 * C.GiB} ",
                 "--gpu-tflops 700.0 ", "--pcie-GBps 40.00 ", "--nvme-read-GBps 3.00",
                 "--seq-len 128 ", "--micro-batch 1 ", "--host-memory-GBps 50.0 "):
        assert flag in got["command"] + " ", (flag, got["command"])
    # the simulated step is at least the busiest resource's time; NVMe-bound at these rates
    assert got["simulated_step_s"] >= max(got["busy_s"].values()) - 1e-9 > 0
    assert got["busy_s"]["NVMe"] > 10 * got["busy_s"]["compute"]
    # the measured memory bandwidth reaches the dry run's CPU Adam (memory-bound at 0.5 GB/s:
    # 30 B a parameter against 16 cores' 14.4 G parameters/s), not only the analytical step
    slow = gpu_predict.predict(res, {**rates, "host_memory_GBps": 0.5}, "tiny", str(tmp_path))
    assert slow["busy_s"]["CPU Adam"] > 10 * got["busy_s"]["CPU Adam"] > 0
    # no GPU measured: no prediction, said so
    assert "error" in gpu_predict.predict(res, {"cpu_cores": 2}, "tiny", str(tmp_path))


def test_the_fsdp2_line_gives_the_ratio_or_the_error():
    """gpu_check.sh's summary line for the FSDP2 reference: the engine's "overlap" step over
    FSDP2's (lower is faster), or why there is none, never a ratio of nothing."""
    ours = {"median_step_s": 0.3}
    ref = {"median_step_s": 0.6, "timed_steps": 3, "device": "cuda:0", "offload": "cpu",
           "peak_device_bytes": 3 * C.GiB}
    line = gpu_profile.fsdp2_line(ref, ours)
    assert line.startswith("fsdp2 [overlap] median 0.600 s") and "infinity / fsdp2 0.50" in line
    assert "peak device 3.00 GiB" in line
    cpu = gpu_profile.fsdp2_line({**ref, "peak_device_bytes": None}, ours)
    assert "peak device - GiB" in cpu
    failed = gpu_profile.fsdp2_line({"error": "exited 1: no NCCL"}, ours)
    assert failed == "fsdp2 [overlap] failed: exited 1: no NCCL"
