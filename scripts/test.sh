#!/usr/bin/env bash
# Fresh Debian machine -> the passing test suite. This is exactly what .ci/run runs.
#   bash scripts/test.sh --sanitize   the suite under ASan + UBSan (build-asan/), then the tests that
#                                     use threads under TSan (build-tsan/); not part of CI (time)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = --sanitize ]; then
  launcher=()
  command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  supp="$PWD/tests/sanitizers"
  cmake --preset sanitize "${launcher[@]}" > /dev/null
  cmake --build build-asan -j"$(nproc)"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  # Every phase runs even when one before it failed (one test out of time under the sanitizers'
  # slowdown used to end the whole run after the suite's 40 minutes, before MPI and TSan); the
  # exit status says whether all passed, and the end names the phases that did not.
  failed=()
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=0 \
    ctest --test-dir build-asan --output-on-failure -j1 -E '^(mpi_|Mpi)' ||
    failed+=("ASan+UBSan suite")
  # The processes under mpirun: OpenMPI keeps allocations until exit in plugins it has unloaded by
  # then, so no suppression can name them; leaks are not checked there, memory errors still are.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=0 \
    ctest --test-dir build-asan --output-on-failure -j1 -R '^(mpi_|Mpi)' ||
    failed+=("ASan+UBSan MPI tests")
  # The threaded parts: collectives and signals between devices (CollectivesOn, the silent-peer
  # CollectiveFaults), data and tensor parallel replicas, the engine, the batch job, and the server
  # (its engine thread and connection threads: Server.*, and `clshard serve` itself under curl and
  # the openai client, server_*). Parameterised suites are named Setups/..., Devices/... by gtest.
  cmake --preset tsan "${launcher[@]}" > /dev/null
  cmake --build build-tsan -j"$(nproc)" --target clshard_tests clshard
  # Only clshard is instrumented: ignore_noninstrumented_modules=1 leaves out the memory accesses
  # that libc functions (memcpy, memcmp, ...) make for uninstrumented code (PoCL, its LLVM,
  # libstdc++, cpp-httplib), whose own synchronisation TSan cannot see (see tests/sanitizers/
  # tsan.supp); their locks still count. Every access in clshard's own compiled code is checked
  # (not those inside a libstdc++ function that is not inlined, such as std::string's append).
  TSAN_OPTIONS="suppressions=$supp/tsan.supp:halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1" \
    ctest --test-dir build-tsan --output-on-failure -j1 \
      -R '^(Collective|Setups/CollectivesOn|DataParallel|Devices/DataParallelLlama|TensorParallelLlama|Engine|BatchJob|BatchOutput|Server\.|ServeMetrics|server_)' ||
    failed+=("TSan threaded tests")
  if [ ${#failed[@]} -gt 0 ]; then
    printf 'test.sh --sanitize: failed: %s\n' "${failed[@]}" >&2
    exit 1
  fi
  exit 0
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
# Tests keep PoCL's compiled kernels and ours inside build/ (set by tests/test_util.cpp and
# perf/CMakeLists.txt), so a second run skips every kernel compile. One test per core: a cold run
# is mostly kernel compiles, one thread each (on the 2-core VM, 1017 tests took 864 s cold at -j2).
ctest --test-dir build --output-on-failure -j"$(nproc)"
# The parsers under ASan + UBSan (clang, build-fuzz/): every fuzz seed and kept crasher once through
# its libFuzzer target. A few minutes of CI; the full sanitizer run is --sanitize above.
bash scripts/fuzz.sh all 0
