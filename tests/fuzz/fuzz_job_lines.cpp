// libFuzzer driver: scripts/fuzz.sh job_lines [SECONDS]
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  clshard::fuzz::job_lines(data, size);
  return 0;
}
