#!/usr/bin/env bash
# Fresh Debian machine -> the default batch job (configs/dsv3-mtp-cpu.yaml): installs packages,
# builds, and runs the bundled trained DeepSeek-V3-style checkpoint with MTP speculative decoding
# over English prompts; completions land in .cache/out/english-completions.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" --target clshard
./build/clshard run configs/dsv3-mtp-cpu.yaml
