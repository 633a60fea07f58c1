// Shared helpers for tests: where ../shared is, the reference index, a device to run on.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/device_manager.h"

namespace clshard {
class Device;
class Tokenizer;
}

namespace clshard::test {

std::filesystem::path shared_dir();      // $CLSHARD_SHARED_DIR or <source>/../shared
std::filesystem::path reference_dir();   // shared_dir()/reference
std::filesystem::path tokenizers_dir();  // shared_dir()/tokenizers
const nlohmann::json& reference_index(); // reference/index.json
std::filesystem::path temp_dir(const std::string& name);  // fresh empty dir under the build tree

// Raw little-endian float32 file.
std::vector<float> read_f32(const std::filesystem::path& p);

// The shipped Llama 3 and DeepSeek-V3 tokenizers, loaded once per process (several MB each).
const Tokenizer& llama3_tokenizer();
const Tokenizer& deepseek_v3_tokenizer();

// The CPU device(s), split as asked ("" for whole), or every CPU device with all = true.
DeviceSelection cpu_devices(const std::string& split, bool all = false);

// The first OpenCL device (PoCL's CPU device here), shared by the tests of one process.
Device& default_device();

// Runs the clshard executable with args; returns its exit code, stdout and stderr in out/err.
int run_clshard(const std::vector<std::string>& args, std::string* out = nullptr,
                std::string* err = nullptr);

}  // namespace clshard::test
