#!/usr/bin/env bash
# Fuzzes clshard's parsers with libFuzzer under ASan + UBSan (clang; the regular build does not
# need it). One target per input surface (tests/fuzz/fuzz_entries.h).
#   bash scripts/fuzz.sh [TARGET|all] [SECONDS per target, default 120] [LIBFUZZER FLAGS...]
#   bash scripts/fuzz.sh json_schema 7200 -runs=1000000 -timeout=600 -report_slow_units=1
#                                  flags after SECONDS come last, so they win over the defaults
#                                  below. A long run on a machine where it may be paused (SIGSTOP)
#                                  needs a larger -timeout, since a pause reads as a hang; then run
#                                  the target binary with -timeout=1 on the slow-unit-* files that
#                                  -report_slow_units=1 keeps in the artifacts folder
#   bash scripts/fuzz.sh all 0     replay only: every seed and kept crasher once through each target
#                                  under ASan + UBSan, no fuzzing (scripts/test.sh runs this in CI)
# Crashes, hangs (> 1 s per input), leaks and sanitizer reports land in build-fuzz/artifacts/TARGET/;
# keep each as tests/fuzz/regressions/TARGET/NAME (the suite replays them) once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-all}"
seconds="${2:-120}"
extra=("${@:3}")
all=(safetensors model_config tokenizer chat_template deploy_yaml job_lines api_request json_schema)
if [ "$target" = all ]; then targets=("${all[@]}"); else targets=("$target"); fi
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target '$t' (one of: ${all[*]})" >&2; exit 2; }
done
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake --preset fuzz "${launcher[@]}" > /dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_all
seeds=build-fuzz/seeds
rm -rf "$seeds" && bash tests/fuzz/seeds.sh "$seeds"
declare -A dict=([safetensors]=json [model_config]=json [tokenizer]=json [chat_template]=jinja
                 [deploy_yaml]=yaml [job_lines]=json [api_request]=schema [json_schema]=schema)
status=0
for t in "${targets[@]}"; do
  corpus="build-fuzz/corpus/$t" artifacts="build-fuzz/artifacts/$t/"
  mkdir -p "$corpus" "$artifacts"
  [ "$seconds" = 0 ] && echo "== $t: replay" >&2 || echo "== $t: ${seconds}s" >&2
  log="build-fuzz/fuzz-$t.log"
  # -timeout=1: an input that takes over a second is a hang; -rss_limit_mb: a memory blow-up.
  # SECONDS 0: -runs=0 executes the inputs of the corpus folders once and stops.
  if [ "$seconds" = 0 ]; then budget=(-runs=0); else budget=(-max_total_time="$seconds"); fi
  if ! "build-fuzz/tests/fuzz/fuzz_$t" "$corpus" "$seeds/$t" "${budget[@]}" \
      -timeout=1 -rss_limit_mb=2048 -max_len=65536 -dict="tests/fuzz/dict/${dict[$t]}.dict" \
      -artifact_prefix="$artifacts" -print_final_stats=1 "${extra[@]}" > "$log" 2>&1; then
    status=1
    echo "$t: FAILED, see $log and $artifacts" >&2
  fi
  execs=$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')
  cov=$(grep -E '^#[0-9]+' "$log" | tail -1 | sed -nE 's/.*cov: ([0-9]+).*/\1/p')
  echo "$t: ${execs:-?} executions, ${cov:-?} edges covered, corpus $(ls "$corpus" | wc -l) inputs"
done
exit $status
