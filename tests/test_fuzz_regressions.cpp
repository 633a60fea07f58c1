// The regular suite's half of the fuzzing (tests/fuzz/): every hand-made seed, every crasher the
// fuzzers found (tests/fuzz/regressions/<target>/, kept after the fix) and the repository's real
// files go through the same entry points the libFuzzer drivers call. An entry aborts the process
// on a bug (tests/fuzz/fuzz_entries.h), so a regression fails this test by crashing it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_entries.h"

namespace clshard {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<uint8_t> with_prefix(uint8_t first, std::vector<uint8_t> rest) {
  rest.insert(rest.begin(), first);
  return rest;
}

// Every input of the target: committed seeds and crashers, then real files in its format.
std::vector<std::pair<std::string, std::vector<uint8_t>>> inputs_of(const std::string& target) {
  const fs::path root = CLSHARD_SOURCE_DIR;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> out;
  for (const char* kind : {"corpus", "regressions"}) {
    const fs::path dir = root / "tests/fuzz" / kind / target;
    if (!fs::is_directory(dir)) continue;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file()) out.emplace_back(e.path().string(), read_bytes(e.path()));
  }
  for (const auto& e : fs::recursive_directory_iterator(root / "configs")) {
    if (!e.is_regular_file()) continue;
    const auto& p = e.path();
    const std::string name = p.filename().string();
    if (target == "deploy_yaml" && p.extension() == ".yaml")
      out.emplace_back(p.string(), read_bytes(p));
    if (target == "job_lines" && p.extension() == ".jsonl")
      out.emplace_back(p.string(), read_bytes(p));
    if (target == "model_config" && name == "config.json")
      out.emplace_back(p.string(), with_prefix(1, read_bytes(p)));  // 1: DeepSeek-V3's reader
    if (target == "tokenizer" && name == "tokenizer.json") {
      auto bytes = read_bytes(p);
      const std::string text = std::string(1, '\0') + "The quick brown fox, 12 años.";
      bytes.insert(bytes.end(), text.begin(), text.end());
      out.emplace_back(p.string(), std::move(bytes));
    }
  }
  return out;
}

TEST(FuzzRegressions, EveryCorpusInputAndCrasherEndsClearly) {
  std::map<std::string, size_t> replayed;
  for (const auto& target : fuzz::targets()) {
    for (const auto& [name, bytes] : inputs_of(target.name)) {
      SCOPED_TRACE(name);
      target.run(bytes.data(), bytes.size());  // aborts on a bug
      ++replayed[target.name];
    }
  }
  // Each target has hand-made seeds, so an empty corpus means the files went missing.
  for (const auto& target : fuzz::targets())
    EXPECT_GE(replayed[target.name], 1u) << target.name << ": no corpus input found";
}

}  // namespace
}  // namespace clshard
