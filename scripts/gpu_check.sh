#!/usr/bin/env bash
# The GPU checks of a built tree on a machine with a GPU: what the OpenCL driver reports, then
# the kernel and end-to-end benchmarks (llama3-1b and dsv3-mini bf16, batch 1 and 64; a
# deployment file greedy and at temperature 1; the model's greedy loop; the sampler alone; the
# GEMV lanes' A/B), then a tuning run saved to the kernel cache and the single-device tests on the
# GPU (its own kernel shape) last; TUNE_LIMIT and CTEST_LIMIT bound those two (300 and 600 s).
#   bash scripts/gpu_check.sh [OUT_DIR]     (default: gpu-check/; BUILD=build)
# Every step has a time limit and its log goes to OUT_DIR; nothing here is part of CI. Tests that
# need a CPU device (sub-devices, `type: cpu` deployments) or mpirun fail on a GPU-only machine,
# and so do the reference cases whose files ../shared lacks there: read ctest.log by name.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
build=${BUILD:-build}
mkdir -p "$out"
models=$(mktemp -d)
trap 'rm -rf "$models"' EXIT
t0=$(date +%s)
step() { echo "== $1 [+$(($(date +%s) - t0)) s]"; }

step "devices"
command -v clinfo > /dev/null && clinfo > "$out/clinfo.txt" 2>&1
"$build/clshard" devices 2>&1 | tee "$out/devices.txt"
grep -q "type: *gpu" "$out/devices.txt" || { echo "no GPU among the OpenCL devices"; exit 2; }

# The models are written while the tests run (CPU work beside GPU work).
("$build/clshard" make-model --preset llama3-1b --dtype bf16 --out "$models/llama3-1b" &&
 "$build/clshard" make-model --preset dsv3-mini --dtype bf16 --out "$models/dsv3-mini") \
  > "$out/make-model.log" 2>&1 &
make_models=$!

step "kernels (bench_kernels --quick, then the prefill GEMMs next to CLBlast)"
timeout 300 "$build/perf/bench_kernels" --quick > "$out/kernels.log" 2>&1
tail -30 "$out/kernels.log"

wait "$make_models" || { echo "make-model failed: $out/make-model.log"; exit 1; }
for m in llama3-1b dsv3-mini; do
  step "clshard bench $m"
  timeout 300 "$build/clshard" bench --model "$models/$m" --batch 1,64 --prompt-len 512 \
    --gen-len 32 --roofline --json "$out/bench-$m.json" 2>&1 | tail -4
done
# A deployment file's path (the pool from kv_cache.memory_fraction: NVIDIA's OpenCL on an H200
# refused 0.8 of its memory at first use, 0.5 ran), greedy and at temperature 1: the gap between
# the two is the sampler's share of a batch-1 step.
for t in 0.0 1.0; do
  step "clshard bench llama3-1b from a deployment file, temperature $t"
  printf 'model:\n  path: %s\ndevices:\n  type: gpu\nkv_cache:\n  memory_fraction: 0.5\nsampling:\n  temperature: %s\n' \
    "$models/llama3-1b" "$t" > "$models/deploy.yaml"
  timeout 120 "$build/clshard" bench "$models/deploy.yaml" --batch 1 --prompt-len 512 --gen-len 64 \
    2>&1 | tail -2
done
step "bench_llama llama3-1b (the model's greedy loop, no engine)"
timeout 180 "$build/perf/bench_llama" "$models/llama3-1b" --roofline-rounds 1 > "$out/bench-llama.log" 2>&1
tail -8 "$out/bench-llama.log"
step "sampler alone (bench_sampling, 1 and 32 rows)"
for rows in 1 32; do
  timeout 120 "$build/perf/bench_sampling" --quick --rows "$rows" > "$out/sampling-$rows.log" 2>&1
  grep -E 'sample_tokens|compute_logprobs top 20' "$out/sampling-$rows.log" | grep 128256
done
step "speculative acceptance (bench_acceptance: the GPU shape's accept_rows_wg)"
timeout 120 "$build/perf/bench_acceptance" --quick 2>&1 | tail -9
step "GEMV lanes: linear_vector 1 against the device's row"
timeout 120 "$build/perf/bench_kernel_shapes" --set linear_vector=1 2>&1 | grep '^linear M=' > "$out/vector1.log"
timeout 120 "$build/perf/bench_kernel_shapes" 2>&1 | grep '^linear M=' > "$out/vector-row.log"
paste -d'\n' "$out/vector1.log" "$out/vector-row.log"
step "decode breakdown llama3-1b, batch 1"
timeout 120 "$build/perf/bench_decode_breakdown" "$models/llama3-1b" --batch 1 --fused-only \
  --rounds 1 > "$out/decode-breakdown.log" 2>&1
tail -30 "$out/decode-breakdown.log"
step "tuning run (bench_kernel_shapes --tune --save; later runs read the saved entry)"
timeout "${TUNE_LIMIT:-300}" "$build/perf/bench_kernel_shapes" --tune --save > "$out/tune.log" 2>&1
tail -25 "$out/tune.log"

# Last, so that a short lease still gets the figures above: the limit is CTEST_LIMIT seconds.
step "single-device tests on the GPU (limit ${CTEST_LIMIT:-600} s)"
timeout "${CTEST_LIMIT:-600}" ctest --test-dir "$build" -j"${CTEST_JOBS:-8}" --timeout 120 \
  --output-on-failure -E '^(mpi_|server_|layers|perf_cli)' > "$out/ctest.log" 2>&1
grep -E 'tests passed|tests failed' "$out/ctest.log" || echo "ctest stopped at its limit"
step "done: $out"
