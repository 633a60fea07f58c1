// libFuzzer driver: scripts/fuzz.sh json_schema [SECONDS]
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  clshard::fuzz::json_schema(data, size);
  return 0;
}
