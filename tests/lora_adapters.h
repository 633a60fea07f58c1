// PEFT LoRA adapters that the LoRA tests write for their tiny checkpoints (random A and B), and the
// model loaded with them: what test_lora.cpp (Llama 3) and test_lora_deepseek_v3.cpp share.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "runtime/safetensors.h"
#include "tests/test_util.h"

namespace clshard::test {

// A LoRA target's shape: x [.., in] -> y [.., out].
struct LoraShape {
  int64_t in, out;
};

struct TestAdapter {
  int rank = 4;
  double alpha = 8;
  // By module path: A [rank, in], B [out, rank].
  std::map<std::string, std::pair<std::vector<float>, std::vector<float>>> weights;
};

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Writes a PEFT adapter directory: adapter_config.json (r, lora_alpha, target_modules and the base
// model's name) and, for each (module path, shape) in turn, A and B drawn uniformly from
// (-0.15, 0.15) by a generator seeded with `seed`.
inline TestAdapter write_peft_adapter(
    const std::filesystem::path& dir, int rank, double alpha,
    const std::vector<std::string>& modules,
    const std::vector<std::pair<std::string, LoraShape>>& paths, uint32_t seed,
    const std::string& base_model) {
  TestAdapter a;
  a.rank = rank;
  a.alpha = alpha;
  std::filesystem::create_directories(dir);
  nlohmann::json cfg = {{"r", rank},
                        {"lora_alpha", alpha},
                        {"target_modules", modules},
                        {"peft_type", "LORA"},
                        {"base_model_name_or_path", base_model}};
  std::ofstream(dir / "adapter_config.json") << cfg.dump(2);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-0.15f, 0.15f);
  std::vector<TensorToWrite> tensors;
  for (const auto& [path, s] : paths) {
    std::vector<float> A(size_t(rank * s.in)), B(size_t(s.out * rank));
    for (float& x : A) x = u(rng);
    for (float& x : B) x = u(rng);
    const std::string name = "base_model.model." + path;
    tensors.push_back({name + ".lora_A.weight", DType::F32, {rank, s.in}, f32_bytes(A)});
    tensors.push_back({name + ".lora_B.weight", DType::F32, {s.out, rank}, f32_bytes(B)});
    a.weights[path] = {A, B};
  }
  write_safetensors(dir / "adapter_model.safetensors", tensors);
  return a;
}

// The checkpoint at `dir` on the test device with the named adapters loaded.
inline std::unique_ptr<CausalLM> load_with_adapters(
    const std::filesystem::path& dir,
    const std::vector<std::pair<std::string, std::filesystem::path>>& adapters,
    uint32_t max_rank = 16, uint32_t max_loaded = 8) {
  LoadOptions o{{&default_device()}, std::nullopt};
  for (const auto& [n, d] : adapters) o.lora_adapters.push_back({n, d});
  o.lora_max_rank = max_rank;
  o.lora_max_loaded = max_loaded;
  return load_model(dir, o);
}

}  // namespace clshard::test
