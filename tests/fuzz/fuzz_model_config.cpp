// libFuzzer driver: scripts/fuzz.sh model_config [SECONDS]
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  clshard::fuzz::model_config(data, size);
  return 0;
}
