"""compute_dtype "auto" follows the CPU: the bf16 flags, the timed probe, the environment's
override, and the planner's choice on both kinds of CPU (hand-made Hardware)."""
from __future__ import annotations

import dataclasses
import time

import pytest

import infinity
from infinity.base import cpu_bf16
from infinity.base.cpu_bf16 import ENV, bf16_flags, detect_cpu_bf16, probe_matmul
from infinity.config import InfinityConfig
from infinity.planner.inputs import Hardware, ModelStats, detect_hardware
from infinity.planner.placement import choose_compute_dtype, compute_dtype_choice, place
from infinity.planner.plan import plan_memory
from infinity.planner.sizes import derive_sizes
from infinity.planner.tiers import Tier

GiB = 2**30
OLD_CPU = Hardware(cpu_cores=2, host_total_bytes=24 * GiB, host_available_bytes=16 * GiB,
                   nvme_path="/swap", disk_free_bytes=100 * GiB)
BF16_CPU = dataclasses.replace(OLD_CPU, cpu_bf16=True, cpu_bf16_reason="flags avx512_bf16; probed")
GPU_BOX = Hardware(cpu_cores=32, host_total_bytes=256 * GiB, host_available_bytes=200 * GiB,
                   gpu_name="test GPU", gpu_total_bytes=80 * GiB, gpu_free_bytes=78 * GiB,
                   cpu_bf16=True)
STATS = ModelStats.from_counts(10_000_000, 1_000_000, 10, 10_000_000)

X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\nbogomips\t: 1\n"
X86_OLD = "processor\t: 0\nflags\t\t: fpu sse avx2 fma avx512f avx512bw\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"


@pytest.fixture
def fresh_probe(monkeypatch: pytest.MonkeyPatch):
    """No override in the environment, and the per-process answer forgotten before and after."""
    monkeypatch.delenv(ENV, raising=False)
    cpu_bf16._measured.cache_clear()
    yield
    cpu_bf16._measured.cache_clear()


def config(*, auto: str = "auto", stage: int = 3, **extra: object) -> InfinityConfig:
    zero = {"stage": stage, "offload_param": {"device": "nvme", "nvme_path": "/swap"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}}
    return InfinityConfig.from_dict({"zero_optimization": zero,
                                     "infinity": {"compute_dtype": auto, "host_memory_budget": "1GiB"},
                                     **extra})


# ---- flags ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, flags", [(X86_BF16, ("avx512_bf16",)), (X86_OLD, ()),
                                         (ARM_BF16, ("bf16",)), ("", ())])
def test_flags_from_cpuinfo(text: str, flags: tuple[str, ...]) -> None:
    assert bf16_flags(text) == flags


def test_flags_of_this_machine_agree_with_proc_cpuinfo() -> None:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert ("avx512_bf16" in bf16_flags()) == (" avx512_bf16" in text)


# ---- the probe and its cache -----------------------------------------------------------------
def test_probe_is_sub_second() -> None:
    start = time.perf_counter()
    t16, t32 = probe_matmul()
    # sub-second on either kind of CPU (bf16 emulated: ~45x fp32's 2 ms); loose for a busy box
    assert 0 < t16 < 1.0 and 0 < t32 < 1.0
    assert time.perf_counter() - start < 5.0


def test_no_flag_means_no_probe(fresh_probe, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_bf16, "bf16_flags", lambda: ())
    monkeypatch.setattr(cpu_bf16, "probe_matmul", lambda: pytest.fail("probed without a flag"))
    answer = detect_cpu_bf16()
    assert not answer.native and answer.bf16_ms is None and "no bf16 flag" in answer.reason


@pytest.mark.parametrize("times, native", [((1.0e-3, 3.0e-3), True),     # native: ~3x faster
                                           ((45e-3, 1.0e-3), False),     # emulated: ~45x slower
                                           ((1.0e-3, 1.1e-3), False)])   # flag, but no gain here
def test_the_probe_confirms_the_flag(fresh_probe, monkeypatch: pytest.MonkeyPatch,
                                     times: tuple[float, float], native: bool) -> None:
    calls = []
    monkeypatch.setattr(cpu_bf16, "bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setattr(cpu_bf16, "probe_matmul", lambda: calls.append(1) or times)
    answer = detect_cpu_bf16()
    assert answer.native is native and answer.flags == ("avx512_bf16",)
    assert answer.bf16_ms == pytest.approx(times[0] * 1e3) and "avx512_bf16" in answer.reason
    assert detect_cpu_bf16() is answer and len(calls) == 1     # measured once per process


@pytest.mark.parametrize("value, native", [("0", False), ("off", False), ("1", True), ("on", True)])
def test_the_environment_forces_the_answer(monkeypatch: pytest.MonkeyPatch, value: str,
                                           native: bool) -> None:
    monkeypatch.setenv(ENV, value)
    monkeypatch.setattr(cpu_bf16, "probe_matmul", lambda: pytest.fail("probed though forced"))
    answer = detect_cpu_bf16()
    assert answer.native is native and ENV in answer.reason


def test_detect_hardware_reports_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the CPU's bf16 is not asked")
    for value, native in (("0", False), ("1", True)):
        monkeypatch.setenv(ENV, value)
        hw = detect_hardware()
        assert hw.cpu_bf16 is native and ENV in hw.cpu_bf16_reason


def test_native_info_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    info = infinity.native_info()["cpu_bf16"]
    assert info["native"] is False and ENV in info["reason"] and isinstance(info["flags"], list)


# ---- the choice --------------------------------------------------------------------------------
@pytest.mark.parametrize("hw, extra, dtype", [
    (OLD_CPU, {}, "fp32"),
    (OLD_CPU, {"bf16": {"enabled": True}}, "fp32"),
    (BF16_CPU, {}, "bf16"),
    (BF16_CPU, {"bf16": {"enabled": True}}, "bf16"),
    (BF16_CPU, {"fp16": {"enabled": True}}, "fp32"),     # fp16 on a CPU: far slower than fp32
    # a DeepSpeed config's explicit false is fp32, as DeepSpeed trains it (it was bf16)
    (BF16_CPU, {"bf16": {"enabled": False}}, "fp32"),
    (GPU_BOX, {"bf16": {"enabled": False}}, "fp32"),
    (GPU_BOX, {}, "fp32"),                                # GPUs follow bf16/fp16.enabled, as before
    (GPU_BOX, {"bf16": {"enabled": True}}, "bf16"),
    (GPU_BOX, {"fp16": {"enabled": True}}, "fp16"),
])
def test_auto_follows_the_cpu(hw: Hardware, extra: dict, dtype: str) -> None:
    chosen, why = compute_dtype_choice(config(**extra), hw)
    assert chosen == dtype == choose_compute_dtype(config(**extra), hw)
    assert why.startswith("auto: ")


@pytest.mark.parametrize("hw", [OLD_CPU, BF16_CPU, GPU_BOX])
@pytest.mark.parametrize("asked", ["fp32", "bf16"])
def test_an_explicit_compute_dtype_always_wins(hw: Hardware, asked: str) -> None:
    chosen, why = compute_dtype_choice(config(auto=asked), hw)
    assert chosen == asked and repr(asked) in why
    assert derive_sizes(config(auto=asked), STATS, hw).compute_dtype == asked


def test_the_reason_names_the_cpu_answer() -> None:
    assert "flags avx512_bf16; probed" in compute_dtype_choice(config(), BF16_CPU)[1]
    notes = plan_memory(config(), STATS, BF16_CPU).notes
    assert any(n.startswith("compute dtype bf16: auto: CPU-only") for n in notes), notes


def test_bf16_on_a_cpu_keeps_a_separate_master() -> None:
    """16-bit compute: the fp32 master is separate, as on GPUs; parameters move as bf16."""
    bf16, fp32 = place(config(), STATS, BF16_CPU), place(config(), STATS, OLD_CPU)
    assert (bf16.compute_dtype, bf16.c, bf16.single_copy) == ("bf16", 2, False)
    assert (fp32.compute_dtype, fp32.c, fp32.single_copy) == ("fp32", 4, True)
    assert bf16.param_tier is Tier.NVME and bf16.master_tier is Tier.NVME
