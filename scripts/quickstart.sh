#!/usr/bin/env bash
# Fresh Debian machine -> the batch job on the bundled tiny default (configs/tiny-cpu.yaml):
# installs packages, builds, writes the tiny random checkpoint, runs the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" --target clshard
[ -f .cache/models/llama3-tiny/model.safetensors ] ||
  ./build/clshard make-model --preset llama3-tiny --out .cache/models/llama3-tiny
./build/clshard run configs/tiny-cpu.yaml
