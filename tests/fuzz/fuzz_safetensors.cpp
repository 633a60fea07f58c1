// libFuzzer driver: scripts/fuzz.sh safetensors [SECONDS]
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  clshard::fuzz::safetensors(data, size);
  return 0;
}
