// Tokenizer speed: how long the Llama 3 tokenizer.json takes to load, and encode / decode
// throughput over the shared expected texts repeated into a larger corpus.
//
// usage: bench_tokenizer [tokenizer_dir] [corpus_megabytes]
//   tokenizer_dir defaults to $CLSHARD_SHARED_DIR/tokenizers/llama3 (or <source>/../shared/...).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "perf/bench_util.h"
#include "runtime/text/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::filesystem::path default_shared_dir() {
  if (const char* shared = std::getenv("CLSHARD_SHARED_DIR")) return shared;
#ifdef CLSHARD_SOURCE_DIR
  return std::filesystem::path(CLSHARD_SOURCE_DIR) / ".." / "shared";
#else
  return "../shared";
#endif
}

// The texts of every expected_*.jsonl next to the tokenizer directory, one per line.
std::string read_expected_texts(const std::filesystem::path& tokenizers_dir) {
  std::string texts;
  for (const char* file : {"expected_llama3.jsonl", "expected_deepseek_v3.jsonl"}) {
    std::ifstream in(tokenizers_dir / file);
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) texts += nlohmann::json::parse(line).at("text").get<std::string>() + "\n";
  }
  return texts;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tokenizer speed: the Llama 3 tokenizer.json's load time, encode and decode "
               "throughput over the shared expected texts repeated into a larger corpus",
               "bench_tokenizer"};
  std::string dir_arg = (default_shared_dir() / "tokenizers" / "llama3").string();
  double corpus_mb = 8.0;
  app.add_option("TOKENIZER_DIR", dir_arg, "directory with tokenizer.json")->capture_default_str();
  app.add_option("CORPUS_MEGABYTES", corpus_mb, "size of the encoded corpus")
      ->capture_default_str();
  clshard::bench::parse_args(app, argc, argv);
  const std::filesystem::path dir = dir_arg;

  try {
    // Load: the first load reads the file from disk (or page cache); report it and the median.
    std::vector<double> load_ms;
    for (int i = 0; i < 5; ++i) {
      const auto start = Clock::now();
      const clshard::Tokenizer tokenizer = clshard::Tokenizer::from_dir(dir);
      load_ms.push_back(ms_since(start));
    }
    const double first_load = load_ms.front();
    std::sort(load_ms.begin(), load_ms.end());
    std::printf("tokenizer: %s\n", dir.string().c_str());
    std::printf("load: first %.1f ms, median of %zu %.1f ms\n", first_load, load_ms.size(),
                load_ms[load_ms.size() / 2]);

    const std::string texts = read_expected_texts(dir.parent_path());
    if (texts.empty()) {
      std::fprintf(stderr, "no expected_*.jsonl texts found in %s\n",
                   dir.parent_path().string().c_str());
      return 1;
    }
    std::string corpus;
    while (corpus.size() < corpus_mb * 1e6) corpus += texts;

    const clshard::Tokenizer tokenizer = clshard::Tokenizer::from_dir(dir);
    // One pass over the distinct texts with an empty word cache: BPE runs for every word.
    auto start = Clock::now();
    const size_t cold_tokens = tokenizer.encode(texts).size();
    const double cold_ms = ms_since(start);
    std::printf("encode, cold cache: %.1f KB, %zu tokens, %.2f MB/s, %.0f tokens/s\n",
                texts.size() / 1e3, cold_tokens, texts.size() / 1e3 / cold_ms,
                cold_tokens / cold_ms * 1e3);

    std::vector<int32_t> ids;
    double best_ms = 1e300;
    for (int round = 0; round < 3; ++round) {
      start = Clock::now();
      ids = tokenizer.encode(corpus);
      best_ms = std::min(best_ms, ms_since(start));
    }
    std::printf(
        "encode, %.1f MB corpus (texts repeated), best of 3: %.1f ms, %.2f MB/s, %.0f tokens/s\n",
        corpus.size() / 1e6, best_ms, corpus.size() / 1e3 / best_ms, ids.size() / best_ms * 1e3);

    start = Clock::now();
    const std::string decoded = tokenizer.decode(ids);
    const double decode_ms = ms_since(start);
    std::printf("decode: %.1f ms, %.2f MB/s, %.0f tokens/s%s\n", decode_ms,
                decoded.size() / 1e3 / decode_ms, ids.size() / decode_ms * 1e3,
                decoded == corpus ? "" : "  (MISMATCH: decode != text)");

    start = Clock::now();
    clshard::StreamDecoder stream(tokenizer);
    size_t streamed_bytes = 0;
    for (const int32_t id : ids) streamed_bytes += stream.push(id).size();
    streamed_bytes += stream.flush().size();
    const double stream_ms = ms_since(start);
    std::printf("stream decode: %.1f ms, %.0f tokens/s%s\n", stream_ms,
                ids.size() / stream_ms * 1e3,
                streamed_bytes == corpus.size() ? "" : "  (MISMATCH: streamed size != text)");
    return decoded == corpus && streamed_bytes == corpus.size() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", e.what());
    return 1;
  }
}
