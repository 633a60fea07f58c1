// libFuzzer driver: scripts/fuzz.sh deploy_yaml [SECONDS]
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  clshard::fuzz::deploy_yaml(data, size);
  return 0;
}
