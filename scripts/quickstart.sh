#!/usr/bin/env bash
# Fresh Debian machine -> the default batch job (configs/dsv3-mtp-cpu.yaml): installs packages,
# builds, and runs the trained DeepSeek-V3-style checkpoint of ../shared with MTP speculative decoding
# over English prompts; completions land in .cache/out/english-completions.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" --target clshard
# The default job's model: ../shared's trained checkpoint with its f32 tensors rounded to bf16,
# made once (2 s) and kept out of git.
model=configs/models/dsv3-mtp-trained
[ -f "$model/model.safetensors" ] ||
  python3 scripts/bf16_checkpoint.py "${CLSHARD_SHARED_DIR:-../shared}/models/dsv3-mtp-trained" "$model"
./build/clshard run configs/dsv3-mtp-cpu.yaml
