"""The planner's step time and peak host memory for the 85M main job (``infinity train``'s demo
config: ZeRO-3, parameters and optimizer on NVMe, 512 MiB host budget, clipping, so the deferred
speculative step), calibrated the way tools/bench/plan_calibration.py calibrates the out-of-core
bench: the inputs measured here, in this test (the block's matrix products, timed again before
every step; the disk; the CPU Adam; a block's resident bytes; the process's runtime), the
constants fitted on a smaller model of the same family (the 85M shape with 4 blocks, its own run
and its forward + backward alone) and checked on the main job held out (12 blocks); the emulated
device pool's peak from the dry run, which equals the tier manager's (asserted too).

Memory is asserted with the bench's bar, max(10%, 64 MiB). Time is asserted within a wide band
(1/3x to 3x): on a shared 2-core CI machine other jobs take the cores between the fit run and the
held-out one (this VM's 0.49B step measured 3.2-18 s within minutes), the matrix-product probe
before each step catches only part of that, and at 4 blocks the fit is dominated by per-step
costs the model does not name (fitted overlaps of 1.3-2.4 here, against ~1 at 0.49B), so the
held-out prediction came out 0.68-0.73x of the measured step; the bench checks the 25% bar.
When the probe's rate swings more than 2x within the test (the load changed between the fit and
the held-out run: a failure of this test under a benchmark beside it), the time is not checked
and a warning says so; the memory always is.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from infinity.commands.dry_run import DryRunRates, DryRunSetup, dry_run, meta_llama
from infinity.planner.calibration import MachineRates, fit_constants, predict_run, run_sizes
from infinity.planner.run_plan import plan_run
from infinity.planner.inputs import detect_hardware, llama_stats
from infinity.planner.shape import shape_from_llama_kwargs
from infinity.train import calibrate
from infinity.train.models import preset_kwargs
from infinity.train.run_config import Overrides, build_ds_config, demo_config

pytest.importorskip("transformers")

SEQ, MBS = 128, 2      # infinity train's defaults (DEFAULT_SEQ_LEN, DEFAULT_MICRO_BATCH)
FIT_LAYERS = 4
RSS_SHARE, RSS_FLOOR = 0.10, 64 << 20
TIME_BAND = (1 / 3, 3.0)
# the time check needs a machine whose load held still during the test: the probe before each
# step sees the load; past this swing between its fastest and slowest, the fit and the held-out
# run did not run on the same machine in effect, and a time ratio would test the neighbours
PROBE_SWING_LIMIT = 2.0


def worker(kind: str, spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "infinity.train.calibrate", kind],
                          input=json.dumps(spec).encode(), capture_output=True, timeout=300)
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("{")]
    assert lines, proc.stderr.decode()[-3000:]
    res = json.loads(lines[-1])
    assert res.get("ok"), res.get("error")
    return res


def test_85m_main_job_prediction_fitted_on_a_smaller_one(disk_dir) -> None:
    path = str(disk_dir)
    main = preset_kwargs("85M", SEQ)
    small = dict(main, num_hidden_layers=FIT_LAYERS)
    ds, cfg = build_ds_config(demo_config(), Overrides(nvme_path=path, steps=10))
    hw = detect_hardware(path)
    lay, _, _ = run_sizes(cfg, llama_stats(main), hw)
    probe = dict(hidden=main["hidden_size"], intermediate=main["intermediate_size"],
                 tokens=SEQ * MBS, dtype=lay.compute_dtype, min_s=0.05)

    disk = calibrate.measure_disk(path, size=128 << 20, repeats=1)
    adam = calibrate.measure_adam(1 << 24, 1 << 22, reps=2)
    layer = worker("layer_memory", dict(model_kwargs=main, seq=SEQ, micro_batch=MBS,
                                        dtype=lay.compute_dtype))
    nvme_config = json.loads(json.dumps(ds).replace(path, "@NVME@"))

    def run(model: dict) -> dict:
        return worker("engine", dict(model_kwargs=model, ds_config=nvme_config, seq=SEQ,
                                     micro_batch=MBS, steps=2, warmup=1, scratch=path,
                                     probe=probe))

    def predicted(model: dict, measured: dict, constants=None):
        stats = llama_stats(model)
        lay, sizes, speculative = run_sizes(cfg, stats, hw)
        if "engine_sizes" in measured:      # the planner's sizes are the engine's
            assert measured["engine_sizes"]["device_budget"] == sizes.device_budget
            assert measured["engine_sizes"]["host_budget"] == sizes.host_budget
        rates = MachineRates(compute_flops_per_s=measured["median_probe_flops_per_s"],
                             nvme_read_GBps=disk["read_GBps"], nvme_write_GBps=disk["write_GBps"],
                             adam_params_per_s=adam["params_per_s"],
                             runtime_rss_bytes=measured.get("runtime_rss_bytes", 0),
                             layer_rss_bytes=layer["layer_rss_bytes"])
        report = dry_run(meta_llama(model), DryRunSetup(plan=plan_run(cfg, hw, stats=stats)),
            DryRunRates(compute_flops_per_s=rates.compute_flops_per_s,
                        nvme_read_GBps=disk["read_GBps"], nvme_write_GBps=disk["write_GBps"],
                        adam_params_per_s=adam["params_per_s"]), seq_len=SEQ, micro_batch=MBS,
            steps=2)
        if "tier_peak_bytes" in measured:   # the dry run's peaks are the tier manager's
            assert report.peak["host"] == pytest.approx(measured["tier_peak_bytes"]["host"],
                                                        rel=0.05)
            assert report.peak["device"] == pytest.approx(measured["tier_peak_bytes"]["device"],
                                                          rel=0.05)
        kwargs = {} if constants is None else {"constants": constants}
        return predict_run(cfg, stats, shape_from_llama_kwargs(model), hw, seq_len=SEQ,
                           micro_batch=MBS, rates=rates, speculative=speculative,
                           device_pool_bytes=report.peak["device"], **kwargs)

    fit_run = run(small)
    alone = worker("compute_alone", dict(model_kwargs=small, seq=SEQ, micro_batch=MBS, steps=2,
                                         warmup=1, probe=probe, dtype=lay.compute_dtype))
    fit_prediction = predicted(small, fit_run)
    constants = fit_constants(
        [(fit_prediction, fit_run["median_step_s"], fit_run["vm_hwm_bytes"])],
        [(predicted(small, alone), alone["median_step_s"])])

    held_out = run(main)
    p = predicted(main, held_out, constants)
    measured_rss = held_out["vm_hwm_bytes"]
    tolerance = max(RSS_SHARE * measured_rss, RSS_FLOOR)
    assert abs(p.peak_rss_bytes - measured_rss) <= tolerance, (
        f"predicted {p.peak_rss_bytes >> 20} MiB ({ {k: v >> 20 for k, v in p.rss_parts.items()} }),"
        f" measured {measured_rss >> 20} MiB; constants {constants}")
    print(f"85M: RSS predicted {p.peak_rss_bytes >> 20} MiB, measured {measured_rss >> 20} MiB; "
          f"step predicted {p.predicted_s:.2f} s, measured {held_out['median_step_s']:.2f} s; {constants}")
    probes = [f for r in (fit_run, alone, held_out) for f in r["probe_flops_per_s"]]
    swing = max(probes) / min(probes)
    if swing > PROBE_SWING_LIMIT:
        warnings.warn(f"step time not checked: the block's matmul rate, timed before every step, "
                      f"ranged {min(probes) / 1e9:.0f}-{max(probes) / 1e9:.0f} GFLOP/s "
                      f"({swing:.1f}x) during the test: the machine's load changed between the "
                      f"fit and the held-out run (the memory was checked)")
        return
    ratio = p.predicted_s / held_out["median_step_s"]
    assert TIME_BAND[0] <= ratio <= TIME_BAND[1], (
        f"predicted {p.predicted_s:.2f} s, measured {held_out['median_step_s']:.2f} s; "
        f"constants {constants}")
