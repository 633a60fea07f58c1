// Random Llama 3 checkpoints in exact Hugging Face layout, for the default job, tests and
// benchmarks. The shapes are fixed: benchmarks elsewhere use the same ones.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "models/registry.h"

namespace clshard::llama3 {

std::vector<std::string> preset_names();  // llama3-tiny, llama-100m, llama3-1b
bool has_preset(const std::string& name);
void write_preset(const std::string& name, const std::filesystem::path& out,
                  const MakeModelOptions& opts);

}  // namespace clshard::llama3
