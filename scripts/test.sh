#!/usr/bin/env bash
# Fresh Debian machine -> the passing test suite. This is exactly what .ci/run runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
# Tests keep PoCL's compiled kernels and ours inside build/ (set by tests/CMakeLists.txt), so a
# second run skips every kernel compile.
ctest --test-dir build --output-on-failure -j1
