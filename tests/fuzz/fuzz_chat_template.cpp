// libFuzzer driver: scripts/fuzz.sh chat_template [SECONDS]
#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  clshard::fuzz::chat_template(data, size);
  return 0;
}
