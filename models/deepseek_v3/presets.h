// Random DeepSeek-V3 checkpoints in exact Hugging Face layout (config.json, model.safetensors with
// the real tensor names, tokenizer) for tests, demos and benchmarks. The shapes are fixed:
// benchmarks elsewhere use the same ones.
//   dsv3-tiny      hidden 128, 3 layers (first dense), 16 experts top-4 in 4 groups / top-2,
//                  the reference's "tiny-grouped" shape without its MTP layer
//   dsv3-mini      hidden 2048, 6 layers with the first dense (FFN 4608), 16 heads, q_lora_rank
//                  768, kv_lora_rank 512, nope 128 / rope 64 / v 128, 64 routed experts (FFN 512)
//                  top-8 in 8 groups / top-4 groups, 1 shared expert, routed scale 2.5,
//                  vocab 32000, YaRN factor 40
//   dsv3-mini-mtp  dsv3-mini plus one MTP layer (model.layers.6.*)
// --dtype f32 | bf16 | fp8; fp8 is the released format: decoder-layer linear weights F8_E4M3 with
// F32 `weight_scale_inv` per 128x128 block and quantization_config in config.json; embedding,
// lm_head, norms, router gate and eh_proj BF16; the correction bias F32.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/registry.h"

namespace clshard::deepseek_v3 {

std::vector<std::string> preset_names();
bool has_preset(const std::string& name);
void write_preset(const std::string& name, const std::filesystem::path& out,
                  const MakeModelOptions& opts);
// The config.json write_preset writes (checks and plans of a preset without its weights).
nlohmann::ordered_json preset_config(const std::string& name, const std::string& dtype);

// f32 -> e4m3fn, round to nearest even, saturating at +-448 (as DeepSeek's quantizer, which scales
// each block so that its largest magnitude maps to 448).
uint8_t f32_to_e4m3(float x);

// v [rows, cols] as an FP8 checkpoint holds it: each 128 x 128 block scaled so that its largest
// magnitude maps to 448 (scales [ceil(rows / 128), ceil(cols / 128)], 1 for an all-zero block) and
// rounded to e4m3 (codes [rows, cols]).
void quantize_fp8_blocks(const float* v, int64_t rows, int64_t cols, uint8_t* codes,
                         float* scales);

}  // namespace clshard::deepseek_v3
