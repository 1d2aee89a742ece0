#!/usr/bin/env bash
# One pass on a lent GPU machine, the first thing to run on one (the device tool runs it in the
# repository root):
#   bash tools/gpu_check.sh            # results under $OUT (or /tmp/gpu_check)
#
# [Note: one pass on a lent GPU]
# A lent machine is bare, offline and short: about 15 minutes of device time a task, its start
# included, and at most 600 s a command. So the pass ends within ~480 s: each phase runs under
# `timeout` (install 180 s, tests 240 s, the profile what is left of 470 s), the most needed
# first, its results written under $OUT as it ends (a command killed at its limit still returns
# them), at most 8 files there (what comes back).
# - Install without the network: the image has torch with CUDA, pytest, transformers,
#   scikit-build-core, cmake and ninja, but not every test extra (import-linter is not there),
#   so `pip install -e ".[test]"` would try the network and fail, and nothing would import.
#   Here: no deps, no build isolation; the native library is built with the image's cmake.
# - tests/gpu: stage-3 parity with torch on the GPU (every tier, both schedules, fp32/bf16/
#   fp16), copies on their streams, device gradients, activation swap, checkpoints GPU -> CPU
#   -> GPU, NCCL with one rank (two where two GPUs are lent), the overlap seen in a profile,
#   an Init-built model's buffers, `infinity train` (README's main job).
# - tools/bench/gpu_profile.py: the 0.49B model with torch.profiler: measured step, MFU, the
#   share of host-to-device copy time hidden behind compute, beside the dry run's prediction
#   for this machine (rates measured in the same run), and PyTorch FSDP2 with CPU offload on
#   the same model and batch (tools/bench/fsdp2_offload.py) beside it.
# Files: env.txt, install.txt, gpu_tests.txt, profile.txt, profile.json, trace.json.gz,
# trace-accumulate.json.gz (the accumulating setup's profiled step),
# summary.txt.
set -uo pipefail
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
start=$(date +%s)
export PYTHONUNBUFFERED=1
elapsed() { echo $(( $(date +%s) - start )); }

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    lscpu | grep -E "^(Model name|CPU\(s\)):"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())"
} > "$OUT/env.txt" 2>&1

# -- install (offline; see the Note) -----------------------------------------------------------
timeout 180 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    > "$OUT/install.txt" 2>&1
rc=$?
echo "install rc=$rc at $(elapsed) s" >> "$OUT/install.txt"
if [ "$rc" -ne 0 ]; then
    # the tests import infinity from the checkout (pytest puts the root first on sys.path); the
    # native library built straight with cmake and named by INFINITY_NATIVE_LIB
    lib=$(timeout 120 bash tools/dev_build.sh build/gpu-check 2>> "$OUT/install.txt")
    export INFINITY_NATIVE_LIB="$lib"
    echo "fallback: cmake build, INFINITY_NATIVE_LIB=$lib at $(elapsed) s" >> "$OUT/install.txt"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import infinity; print(infinity.native_info())" >> "$OUT/env.txt" 2>&1
# the host slots are pinned by cudaHostRegister (io/buffers.py); where the runtime refuses it,
# every non_blocking copy is a synchronous one and nothing overlaps: say so first
python3 -c "from infinity.io import aligned_empty; b = aligned_empty(1 << 20); \
print('host slots pinned:', b.is_pinned())" >> "$OUT/env.txt" 2>&1

# -- CUDA tests ---------------------------------------------------------------------------------
# SIGINT at the limit: pytest stops as at a Ctrl-C and still prints its summary; the main job
# first (a file named before its directory is collected once, in that order)
timeout -s INT -k 20 240 python3 -m pytest -q tests/gpu/test_cuda_train.py tests/gpu -rfEs \
    --durations=10 -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "tests ended at $(elapsed) s" >> "$OUT/gpu_tests.txt"

# -- the 0.49B model profiled, beside the dry run ----------------------------------------------
left=$(( 470 - $(elapsed) ))
if [ "$left" -gt 60 ]; then
    # shellcheck disable=SC2086 # GPU_CHECK_PROFILE_ARGS: extra flags, e.g. a smoke run's
    timeout "$left" python3 tools/bench/gpu_profile.py --out "$OUT" ${GPU_CHECK_PROFILE_ARGS:-} \
        2>&1 | tail -120 \
        > "$OUT/profile.txt"
else
    echo "skipped: $left s left of the pass" > "$OUT/profile.txt"
fi

{
    echo "== gpu_check summary ($(elapsed) s)"
    grep -v "^\[infinity" "$OUT/env.txt"
    tail -1 "$OUT/install.txt"
    grep -E "passed|failed|error|skipped in" "$OUT/gpu_tests.txt" | tail -3
    grep -E "^(rates|step|mfu|h2d|d2h|dry run|ratio|fsdp2)" "$OUT/profile.txt" | awk '!seen[$0]++'
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
