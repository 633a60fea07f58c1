// libFuzzer driver: scripts/fuzz.sh api_request [SECONDS]
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  clshard::fuzz::api_request(data, size);
  return 0;
}
