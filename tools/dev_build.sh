#!/usr/bin/env bash
# Fast developer rebuild of native/ without reinstalling the package.
#   bash tools/dev_build.sh [BUILD_DIR]      (default build/dev)
#   export INFINITY_NATIVE_LIB=$PWD/BUILD_DIR/libinfinity_native.so   # then python/pytest use it
# Also builds the small C tests in native/test (run them from BUILD_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/dev}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DINFINITY_NATIVE_TESTS=ON >/dev/null
cmake --build "$build" -- -j2 >&2
echo "$PWD/$build/libinfinity_native.so"
