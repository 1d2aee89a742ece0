#!/usr/bin/env python3
"""The dry run's prediction for a GPU machine described by its rates: ``infinity plan --dry-run``
on that machine as a target, for one of tools/bench/gpu_profile.py's setups. gpu_profile.py
runs it beside each measured setup (rates measured in the same run) and alone with
``--predict RATES`` (no GPU needed): what the next GPU pass is compared with."""
from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def gpu_preset(name: str) -> str | None:
    """``infinity plan``'s GPU preset a device name matches ("NVIDIA H200" -> "H200"; an A100
    matches the first A100 preset: the card's own memory is passed beside it), else None."""
    from infinity.planner.target import GPU_PRESETS

    return next((key for key in GPU_PRESETS if name and key.split("-")[0] in name), None)


def plan_command(res: dict[str, Any], rates: dict[str, Any], hf_config: Path, ds_config: Path,
                 scratch: str) -> list[str]:
    """``infinity plan`` for the setup's config on this machine described as a target: one GPU
    of the preset its name matches (else its memory), the rates measured in this run."""
    preset = gpu_preset(rates.get("gpu_name", ""))
    cmd = ["plan", "--hf-config", str(hf_config), "--config", str(ds_config), "--dry-run",
           "--json", "--nvme-path", scratch,
           "--seq-len", str(res["seq"]), "--micro-batch", str(res["mbs"]),
           "--grad-accum", str(res.get("accumulate", 1)),
           "--gpus", "1", "--gpu-tflops", f"{rates['matmul_tflops']:.1f}",
           "--pcie-GBps", f"{rates['h2d_GBps']:.2f}",
           "--host-memory", str(rates["host_total_bytes"]),
           "--cpu-cores", str(rates["cpu_cores"]),
           "--host-memory-GBps", f"{rates['host_memory_GBps']:.1f}"]
    # the preset's peak and links, the card's own memory (an A100 40GB matches "A100-80G")
    cmd += (["--gpu", preset] if preset else []) + ["--gpu-memory", str(rates["gpu_total_bytes"])]
    if "nvme_read_GBps" in rates:
        cmd += ["--nvme", str(rates["disk_free_bytes"]),
                "--nvme-read-GBps", f"{rates['nvme_read_GBps']:.2f}",
                "--nvme-write-GBps", f"{rates['nvme_write_GBps']:.2f}"]
    return cmd


def predict(res: dict[str, Any], rates: dict[str, Any], size: str,
            scratch: str) -> dict[str, Any]:
    """The dry run's step for the setup's config on this machine (``plan_command``); none on a
    CPU-only machine (tools/bench/plan_calibration.py checks the dry run there)."""
    from infinity import cli

    if "matmul_tflops" not in rates:
        return {"error": "no GPU: the CPU's prediction is plan_calibration.py's"}
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "config.json"
        C.llama_config(C.size_shape(size), res["seq"]).to_json_file(str(hf))
        ds = Path(tmp) / "ds.json"
        ds.write_text(json.dumps(res["ds_config"]))
        cmd = plan_command(res, rates, hf, ds, scratch)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                rc = cli.main(cmd)
        except (Exception, SystemExit) as exc:      # noqa: BLE001 - reported, not raised
            return {"error": f"{type(exc).__name__}: {exc}", "command": cmd}
    if rc != 0:
        return {"error": f"infinity plan exited {rc}", "command": cmd}
    text = printed.getvalue()
    data = json.loads(text[text.index("{"):])
    dry = data.get("dry_run") or {}
    return {"simulated_step_s": dry.get("simulated_step_s"),
            "analytical_step_s": dry.get("analytical_step_s"), "busy_s": dry.get("busy_s"),
            "hidden_behind_compute": dry.get("hidden_behind_compute") or {},
            "command": "infinity " + " ".join(cmd)}


PREDICT_KEYS = ("gpu_name", "matmul_tflops", "h2d_GBps", "host_total_bytes", "cpu_cores",
                "host_memory_GBps", "gpu_total_bytes")
"""The rates ``predict`` needs (``measure_rates`` measures them); the "bench" setup also needs
``nvme_read_GBps``, ``nvme_write_GBps`` and ``disk_free_bytes``."""


def read_rates(source: str) -> dict[str, Any]:
    """The machine ``--predict`` describes: a JSON object, or a run's profile.json (its
    "rates"); an error that names the keys missing."""
    try:
        text = source if source.lstrip().startswith("{") else Path(source).read_text()
        data = json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--predict {source!r}: expected a JSON object of rates or a readable "
                         f"profile.json ({type(exc).__name__}: {exc})")
    rates = data.get("rates", data) if isinstance(data, dict) else None
    missing = [k for k in PREDICT_KEYS if not isinstance(rates, dict) or k not in rates]
    if missing:
        raise SystemExit(f"--predict: the rates lack {missing} (a profile.json's \"rates\", or "
                         f"an object with {list(PREDICT_KEYS)})")
    return rates
