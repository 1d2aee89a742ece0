#!/usr/bin/env bash
# One pass on a lent GPU machine (the device tool runs it in the repository root): install, build,
# run the CUDA tests and the out-of-core benchmark, print a short table. Budget: ~12 minutes.
#   bash tools/gpu_check.sh            # results also under $OUT (or /tmp/gpu_check)
set -uo pipefail
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# torch with CUDA: whatever the machine has, else the default wheel (pulls CUDA)
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || \
    python3 -m pip install -q torch 2>&1 | tail -2
python3 -m pip install -q --no-build-isolation -e ".[test]" 2>&1 | tail -2 || \
    python3 -m pip install -q -e ".[test]" 2>&1 | tail -2
python3 -c "import torch, infinity; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name()); print(infinity.native_info())" | tee "$OUT/versions.txt"
timeout 300 python3 -m pytest -q tests/gpu tests/unit/test_buffers.py -rA 2>&1 | tail -40 \
    | tee "$OUT/gpu_tests.txt"
# the stage-3 parity tests, now with a GPU present (the engine's device is the GPU)
timeout 240 python3 -m pytest -q -x tests/integration/test_stage3_parity.py 2>&1 | tail -5 \
    | tee "$OUT/parity.txt"
left=$(( 720 - ($(date +%s) - start) ))
if [ "$left" -gt 120 ]; then
    timeout $(( left - 30 )) python3 tools/bench/out_of_core.py --sizes 0.49B --steps 3 --warmup 1 \
        --schedules on,off --skip-deepspeed --out "$OUT/out_of_core.jsonl" 2>&1 | tail -20 \
        | tee "$OUT/bench.txt"
fi
echo "== summary ($(( $(date +%s) - start )) s)"
grep -E "passed|failed|error" "$OUT/gpu_tests.txt" "$OUT/parity.txt" | tail -4
