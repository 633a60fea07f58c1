// `clshard plan` for a checkpoint: parameter counts, weight bytes, KV bytes per token and per page,
// and an activation estimate, from config.json alone (no weights needed).
#pragma once

#include <filesystem>

#include <nlohmann/json.hpp>

namespace clshard {

// `dir_or_config_json`: a checkpoint directory (its config.json is read) or a config.json file.
// Defined in models/registry.cpp; throws naming the file for unknown architectures or bad fields.
nlohmann::json plan_checkpoint(const std::filesystem::path& dir_or_config_json);

}  // namespace clshard
