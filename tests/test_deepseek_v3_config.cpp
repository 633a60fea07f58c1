// DeepseekV3Config from config.json (every field, both rope_scaling spellings, YaRN numbers), the
// errors for what is not supported or inconsistent (config and checkpoint), the presets, and the
// memory/parameter plan from config.json alone (the real 671B DeepSeek-V3 included).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iostream>

#include "models/deepseek_v3/config.h"
#include "models/deepseek_v3/model.h"
#include "models/deepseek_v3/plan.h"
#include "models/deepseek_v3/presets.h"
#include "models/registry.h"
#include "runtime/engine/generation.h"
#include "runtime/model.h"
#include "runtime/ops_moe.h"
#include "runtime/safetensors.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using deepseek_v3::DeepseekV3Config;

std::filesystem::path ckpt(const std::string& name) {
  return test::reference_dir() / "ckpt" / name;
}
std::filesystem::path real_v3_config() {
  return std::filesystem::path(CLSHARD_SOURCE_DIR) / "configs/deepseek-v3-config.json";
}
nlohmann::json config_of(const std::string& name) { return read_json_file(ckpt(name) / "config.json"); }

// The error message of f(), or "" when it does not throw.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Expects cfg (a modified config.json) to be rejected with a message naming the field and saying
// what.
void expect_config_error(const nlohmann::json& cfg, const std::string& field,
                         const std::string& what) {
  const std::string msg = error_of([&] { DeepseekV3Config::from_json(cfg, "x/config.json"); });
  EXPECT_NE(msg.find("x/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'" + field + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(what), std::string::npos) << msg;
}

TEST(DeepseekV3Config, ReadsEveryFieldOfTheGroupedReference) {
  const auto c = DeepseekV3Config::from_dir(ckpt("deepseek-v3-tiny-grouped-fp8"));
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.q_lora_rank, 96);
  EXPECT_EQ(c.kv_lora_rank, 64);
  EXPECT_EQ(c.qk_nope_head_dim, 32);
  EXPECT_EQ(c.qk_rope_head_dim, 16);
  EXPECT_EQ(c.v_head_dim, 32);
  EXPECT_EQ(c.n_routed_experts, 16);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_TRUE(c.rope_interleave);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  ASSERT_TRUE(c.rope_scaling);  // "rope_type": "yarn"
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 40.0);
  EXPECT_EQ(c.rope_scaling->original_max_position, 4096);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->mscale_all_dim, 1.0);
  ASSERT_TRUE(c.quantization);
  EXPECT_EQ(c.quantization->block_n, 128);
  EXPECT_EQ(c.quantization->block_k, 128);
  EXPECT_EQ(c.cache_row_width(), 80);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_TRUE(c.is_moe_layer(2));

  // The other reference spells rope_scaling's type as "type" and has no dense layer.
  const auto t = DeepseekV3Config::from_dir(ckpt("deepseek-v3-tiny-f32"));
  ASSERT_TRUE(t.rope_scaling);
  EXPECT_DOUBLE_EQ(t.rope_scaling->factor, 40.0);
  EXPECT_EQ(t.n_group, 1);
  EXPECT_FALSE(t.quantization);
  EXPECT_TRUE(t.is_moe_layer(0));
}

TEST(DeepseekV3Config, RealV3SoftmaxScaleAndYarnFrequencies) {
  const auto c = DeepseekV3Config::from_json(read_json_file(real_v3_config()), "v3");
  EXPECT_EQ(c.cache_row_width(), 576);
  EXPECT_EQ(c.qk_head_dim(), 192);
  // MAX's figure: (1/sqrt(192)) * (0.1 ln 40 + 1)^2 = 0.0721688 * 1.368888^2 = 0.13523.
  EXPECT_NEAR(c.softmax_scale(), std::pow(0.1 * std::log(40.0) + 1.0, 2) / std::sqrt(192.0), 1e-7);
  EXPECT_NEAR(c.softmax_scale(), 0.135236, 5e-6);
  EXPECT_FLOAT_EQ(c.rope_attention_factor(), 1.0f);
  // dim 64: the correction range is [floor(10.47), ceil(22.51)] = [10, 23].
  const auto inv = c.rope_inv_freqs();
  ASSERT_EQ(inv.size(), 32u);
  for (int i : {0, 5, 10, 16, 23, 31}) {
    const double base = 1.0 / std::pow(10000.0, 2.0 * i / 64.0);
    const double ramp = std::clamp((i - 10.0) / 13.0, 0.0, 1.0);
    const double want = base / 40.0 * ramp + base * (1.0 - ramp);
    EXPECT_NEAR(inv[size_t(i)], want, 1e-6 * want) << "i " << i;
  }
  EXPECT_FLOAT_EQ(inv[0], 1.0f);  // highest frequency kept (extrapolated)
  EXPECT_NEAR(inv[31], 1.0 / std::pow(10000.0, 62.0 / 64.0) / 40.0, 1e-12);  // interpolated
}

TEST(DeepseekV3Config, UnsupportedRoutingIsAClearError) {
  auto cfg = config_of("deepseek-v3-tiny-grouped-f32");
  auto c = cfg;
  c["scoring_func"] = "softmax";
  expect_config_error(c, "scoring_func", "'softmax' is not supported");
  c = cfg;
  c["topk_method"] = "group_limited_greedy";
  expect_config_error(c, "topk_method", "'group_limited_greedy' is not supported");
  c = cfg;
  c["n_group"] = 3;  // 16 experts do not split into 3 groups
  expect_config_error(c, "n_group", "must divide n_routed_experts");
  c = cfg;
  c["topk_group"] = 5;
  expect_config_error(c, "topk_group", "must be in [1, n_group = 4]");
  c = cfg;
  c["num_experts_per_tok"] = 9;  // 2 kept groups of 4 experts give 8 candidates
  expect_config_error(c, "num_experts_per_tok", "cannot be chosen");
  c = cfg;
  c["num_experts_per_tok"] = 17;
  expect_config_error(c, "num_experts_per_tok", "n_routed_experts = 16");
}

TEST(DeepseekV3Config, OtherUnsupportedFieldsAreClearErrors) {
  const auto cfg = config_of("deepseek-v3-tiny-grouped-fp8");
  auto c = cfg;
  c["rope_scaling"]["rope_type"] = "linear";
  expect_config_error(c, "rope_type", "'linear' is not supported for DeepSeek-V3 (yarn only)");
  c = cfg;
  c["quantization_config"]["weight_block_size"] = {64, 64};
  expect_config_error(c, "weight_block_size", "only [128, 128]");
  c = cfg;
  c["quantization_config"]["quant_method"] = "awq";
  expect_config_error(c, "quant_method", "'awq' is not supported");
  c = cfg;
  c["tie_word_embeddings"] = true;
  expect_config_error(c, "tie_word_embeddings", "separate lm_head");
  c = cfg;
  c["hidden_act"] = "gelu";
  expect_config_error(c, "hidden_act", "only silu");
  c = cfg;
  c.erase("kv_lora_rank");
  expect_config_error(c, "kv_lora_rank", "missing");
  c = cfg;
  c["qk_rope_head_dim"] = 15;
  expect_config_error(c, "qk_rope_head_dim", "must be even");
  c = cfg;
  c["architectures"] = {"DeepseekV2ForCausalLM"};
  expect_config_error(c, "architectures", "is not one of DeepseekV3ForCausalLM");
}

// A copy of a reference checkpoint with tensors dropped and config fields changed.
std::filesystem::path altered_checkpoint(const std::string& from, const std::string& name,
                                         const std::vector<std::string>& drop,
                                         const nlohmann::json& config_patch) {
  const auto dir = test::temp_dir("dsv3-" + name);
  WeightStore src(ckpt(from));
  std::vector<TensorToWrite> tensors;
  for (const auto& n : src.names()) {
    if (std::find(drop.begin(), drop.end(), n) != drop.end()) continue;
    const TensorView& v = src.get(n);
    tensors.push_back({n, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.bytes)});
  }
  write_safetensors(dir / "model.safetensors", tensors);
  auto cfg = config_of(from);
  if (config_patch.is_object()) cfg.merge_patch(config_patch);
  std::ofstream(dir / "config.json") << cfg.dump(2);
  return dir;
}

std::string load_error(const std::filesystem::path& dir) {
  return error_of([&] { load_model(dir, LoadOptions{{&test::default_device()}, std::nullopt}); });
}

TEST(DeepseekV3Weights, MissingFp8ScalesAreAClearError) {
  const std::string scale = "model.layers.1.mlp.experts.7.up_proj.weight_scale_inv";
  const auto dir = altered_checkpoint("deepseek-v3-tiny-grouped-fp8", "noscale", {scale}, {});
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("'model.layers.1.mlp.experts.7.up_proj.weight' is F8_E4M3"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("'" + scale + "' [1, 1] F32 are missing"), std::string::npos) << msg;
}

TEST(DeepseekV3Weights, WrongExpertCountsAreClearErrors) {
  // config says 8 experts, the checkpoint has 16
  auto dir = altered_checkpoint("deepseek-v3-tiny-grouped-bf16", "fewer",
                                {}, {{"n_routed_experts", 8}, {"num_experts_per_tok", 2}});
  std::string msg = load_error(dir);
  EXPECT_NE(msg.find("model.layers.1.mlp.experts.1"), std::string::npos) << msg;  // 10..15
  EXPECT_NE(msg.find("n_routed_experts = 8 (wrong expert count)"), std::string::npos) << msg;
  // config says 32 experts, the checkpoint has 16
  dir = altered_checkpoint("deepseek-v3-tiny-grouped-bf16", "more", {}, {{"n_routed_experts", 32}});
  msg = load_error(dir);
  EXPECT_NE(msg.find("layer 1 has 16 routed experts, but"), std::string::npos) << msg;
  EXPECT_NE(msg.find("n_routed_experts = 32 (wrong expert count)"), std::string::npos) << msg;
  // one expert of one layer missing
  std::vector<std::string> drop;
  for (const char* part : {"gate_proj", "up_proj", "down_proj"})
    drop.push_back(std::string("model.layers.2.mlp.experts.15.") + part + ".weight");
  dir = altered_checkpoint("deepseek-v3-tiny-grouped-bf16", "hole", drop, {});
  msg = load_error(dir);
  EXPECT_NE(msg.find("layer 2 has 15 routed experts"), std::string::npos) << msg;
  // a dense layer that holds experts
  dir = altered_checkpoint("deepseek-v3-tiny-grouped-bf16", "dense", {},
                           {{"first_k_dense_replace", 2}});
  msg = load_error(dir);
  EXPECT_NE(msg.find("layer 1 has routed experts, but"), std::string::npos) << msg;
}

TEST(DeepseekV3Weights, MtpLayerIsRecognisedButALayerBeyondItIsNot) {
  auto dir = altered_checkpoint("deepseek-v3-tiny-grouped-bf16", "nomtp", {},
                                {{"num_nextn_predict_layers", 0}});
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("belongs to layer 3, but"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_nextn_predict_layers = 0"), std::string::npos) << msg;
}

TEST(DeepseekV3Weights, WrongShapesAndDtypesNameTheTensor) {
  auto dir = altered_checkpoint("deepseek-v3-tiny-grouped-bf16", "rank", {},
                                {{"kv_lora_rank", 48}});
  std::string msg = load_error(dir);
  EXPECT_NE(msg.find("tensor 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight' has shape "
                     "[80, 128], expected [64, 128]"),
            std::string::npos)
      << msg;
}

// q_lora_rank null means a plain q_proj (DeepSeek-V2-Lite style). With unit input norms the normed
// stream has RMS 1, so an identity q_a_proj with a unit q_a_layernorm passes it through unchanged:
// q_b_proj after that equals q_proj = q_b_proj, and the two checkpoints must agree.
TEST(DeepseekV3Model, PlainQProjEqualsAnIdentityLowRankQuery) {
  const std::string from = "deepseek-v3-tiny-f32";
  WeightStore src(ckpt(from));
  const auto cfg = DeepseekV3Config::from_dir(ckpt(from));
  const int64_t H = cfg.hidden_size, q_out = cfg.num_attention_heads * cfg.qk_head_dim();
  auto f32_tensor = [](const std::string& name, std::vector<int64_t> shape,
                       const std::vector<float>& v) {
    TensorToWrite t{name, DType::F32, std::move(shape), std::vector<uint8_t>(v.size() * 4)};
    std::memcpy(t.data.data(), v.data(), t.data.size());
    return t;
  };
  std::vector<float> eye(size_t(H * H), 0.0f), ones(size_t(H), 1.0f), q_b(size_t(q_out * H));
  for (int64_t i = 0; i < H; ++i) eye[size_t(i * H + i)] = 1.0f;
  for (size_t i = 0; i < q_b.size(); ++i) q_b[i] = 0.2f * std::sin(0.37f * float(i));
  std::map<std::string, std::filesystem::path> dirs;
  for (const bool low_rank : {true, false}) {
    std::vector<TensorToWrite> tensors;
    for (const auto& n : src.names()) {
      if (n.find("self_attn.q_") != std::string::npos) continue;
      const TensorView& v = src.get(n);
      tensors.push_back({n, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.bytes)});
      if (n.find("input_layernorm") != std::string::npos) tensors.back() = f32_tensor(n, {H}, ones);
    }
    for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
      if (low_rank) {
        tensors.push_back(f32_tensor(p + "q_a_proj.weight", {H, H}, eye));
        tensors.push_back(f32_tensor(p + "q_a_layernorm.weight", {H}, ones));
        tensors.push_back(f32_tensor(p + "q_b_proj.weight", {q_out, H}, q_b));
      } else {
        tensors.push_back(f32_tensor(p + "q_proj.weight", {q_out, H}, q_b));
      }
    }
    const auto dir = test::temp_dir(low_rank ? "dsv3-q-lowrank" : "dsv3-q-plain");
    write_safetensors(dir / "model.safetensors", tensors);
    auto j = config_of(from);
    j["q_lora_rank"] = low_rank ? nlohmann::json(H) : nlohmann::json(nullptr);
    std::ofstream(dir / "config.json") << j.dump(2);
    dirs[low_rank ? "low" : "plain"] = dir;
  }
  const std::vector<std::vector<int32_t>> seqs = {{1, 15, 300, 42, 7, 99, 3, 250, 18, 64}, {9, 9}};
  std::map<std::string, std::vector<std::vector<float>>> logits;
  for (const auto& [k, dir] : dirs) {
    auto model = load_model(dir, LoadOptions{{&test::default_device()}, std::nullopt});
    logits[k] = all_position_logits(*model, seqs, 16);
  }
  EXPECT_EQ(DeepseekV3Config::from_dir(dirs["plain"]).q_lora_rank, 0);
  for (size_t b = 0; b < seqs.size(); ++b) {
    float d = 0, spread = 0;
    for (size_t i = 0; i < logits["low"][b].size(); ++i) {
      d = std::max(d, std::abs(logits["low"][b][i] - logits["plain"][b][i]));
      spread = std::max(spread, std::abs(logits["low"][b][i]));
    }
    EXPECT_GT(spread, 0.1f);
    EXPECT_LT(d, 2e-5f) << b;
  }
}

// ---- plan ---------------------------------------------------------------------------------------

TEST(DeepseekV3Plan, RealDeepseekV3ParameterCountsAsPublished) {
  const auto c = DeepseekV3Config::from_json(read_json_file(real_v3_config()), "v3");
  const auto p = deepseek_v3::plan_memory(c);
  // DeepSeek: 671B main model + 14B MTP module = 685B on Hugging Face.
  EXPECT_NEAR(double(p.params.main), 671e9, 0.005 * 671e9) << p.params.main;
  EXPECT_NEAR(double(p.params.total()), 685e9, 0.005 * 685e9) << p.params.total();
  // README_WEIGHTS.md: the MTP module has 11.5B unique parameters besides its embedding and head
  // copies (0.9B each).
  EXPECT_NEAR(double(p.params.mtp_unique), 11.5e9, 0.01 * 11.5e9) << p.params.mtp_unique;
  EXPECT_EQ(p.params.embedding, 129280ull * 7168);
  EXPECT_EQ(p.params.routed_expert, 3ull * 7168 * 2048);
  // The cache: one 576-wide row per token per layer (f32 here), 128-token pages.
  EXPECT_EQ(p.kv_bytes_per_token, 61ull * 576 * 4);
  EXPECT_EQ(p.kv_bytes_per_page, 61ull * 576 * 4 * 128);
  // FP8 weights: about one byte per parameter.
  EXPECT_GT(p.weight_bytes_main, p.params.main);
  EXPECT_LT(p.weight_bytes_main, p.params.main * 103 / 100);
  EXPECT_LT(p.active_weight_bytes_per_token, p.weight_bytes_main / 15);
}

// The plan from config.json alone counts exactly the tensors the reference checkpoints hold, in
// every dtype (FP8 scales included), MTP layer included.
TEST(DeepseekV3Plan, MatchesTheReferenceCheckpointsExactly) {
  for (const auto& [name, info] : test::reference_index()["checkpoints"].items()) {
    if (info["model_type"] != "deepseek_v3" || info.contains("architectures")) continue;
    const auto dir = test::reference_dir() / info["dir"].get<std::string>();
    const auto p = deepseek_v3::plan_memory(DeepseekV3Config::from_dir(dir));
    EXPECT_EQ(p.params.total(), info["params"].get<uint64_t>()) << name;
    EXPECT_EQ(p.weight_bytes_main + p.weight_bytes_mtp, WeightStore(dir).total_bytes()) << name;
    const auto j = plan_checkpoint(dir);
    EXPECT_EQ(j["parameters"]["total"].get<uint64_t>(), info["params"].get<uint64_t>()) << name;
  }
}

TEST(DeepseekV3Plan, PlanCheckpointTakesConfigFilesAndLlama) {
  const auto j = plan_checkpoint(real_v3_config());
  EXPECT_EQ(j["architecture"], "DeepseekV3ForCausalLM");
  EXPECT_EQ(j["kv_cache"]["bytes_per_token"].get<uint64_t>(), 61ull * 576 * 4);
  EXPECT_GT(j["activations"]["bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["weights"]["linear_dtype"], "F8_E4M3+scales");
  for (const char* llama : {"llama3-tiny-bf16", "llama32-tiny-bf16"}) {
    const auto l = plan_checkpoint(ckpt(llama));
    const auto& info = test::reference_index()["checkpoints"][llama];
    EXPECT_EQ(l["parameters"]["total"].get<uint64_t>(), info["params"].get<uint64_t>()) << llama;
    EXPECT_EQ(l["weights"]["bytes_total"].get<uint64_t>(), WeightStore(ckpt(llama)).total_bytes())
        << llama;
  }
  const std::string msg = error_of([&] {
    const auto dir = test::temp_dir("plan-unknown");
    std::ofstream(dir / "config.json") << R"({"architectures": ["GPT2LMHeadModel"]})";
    plan_checkpoint(dir);
  });
  EXPECT_NE(msg.find("unknown architecture 'GPT2LMHeadModel'"), std::string::npos) << msg;
}

// ---- presets ------------------------------------------------------------------------------------

TEST(DeepseekV3Presets, MiniHasTheSharedBenchmarkShape) {
  for (const char* name : {"dsv3-mini", "dsv3-mini-mtp"}) {
    const auto c = DeepseekV3Config::from_json(deepseek_v3::preset_config(name, "bf16"), name);
    EXPECT_EQ(c.hidden_size, 2048);
    EXPECT_EQ(c.num_hidden_layers, 6);
    EXPECT_EQ(c.first_k_dense_replace, 1);
    EXPECT_EQ(c.intermediate_size, 4608);
    EXPECT_EQ(c.num_attention_heads, 16);
    EXPECT_EQ(c.q_lora_rank, 768);
    EXPECT_EQ(c.kv_lora_rank, 512);
    EXPECT_EQ(c.qk_nope_head_dim, 128);
    EXPECT_EQ(c.qk_rope_head_dim, 64);
    EXPECT_EQ(c.v_head_dim, 128);
    EXPECT_EQ(c.n_routed_experts, 64);
    EXPECT_EQ(c.moe_intermediate_size, 512);
    EXPECT_EQ(c.num_experts_per_tok, 8);
    EXPECT_EQ(c.n_group, 8);
    EXPECT_EQ(c.topk_group, 4);
    EXPECT_EQ(c.n_shared_experts, 1);
    EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
    EXPECT_EQ(c.vocab_size, 32000);
    ASSERT_TRUE(c.rope_scaling);
    EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 40.0);
    EXPECT_EQ(c.num_nextn_predict_layers, std::string(name) == "dsv3-mini-mtp" ? 1 : 0);
  }
  const auto fp8 = DeepseekV3Config::from_json(deepseek_v3::preset_config("dsv3-mini", "fp8"), "x");
  ASSERT_TRUE(fp8.quantization);
  EXPECT_NE(error_of([] { deepseek_v3::preset_config("dsv3-mini", "int4"); }).find("int4"),
            std::string::npos);
}

TEST(DeepseekV3Presets, E4m3EncodingRoundsToNearestEven) {
  for (int code = 0; code <= 0x7E; ++code) {
    const float v = reference::e4m3_to_f32(uint8_t(code));
    EXPECT_EQ(deepseek_v3::f32_to_e4m3(v), code) << v;
    EXPECT_EQ(deepseek_v3::f32_to_e4m3(-v), code == 0 ? 0x80 : (code | 0x80)) << -v;
  }
  EXPECT_EQ(deepseek_v3::f32_to_e4m3(1.0625f), 0x38);  // halfway 1 / 1.125: to even (1.0)
  EXPECT_EQ(deepseek_v3::f32_to_e4m3(1.1875f), 0x3A);  // halfway 1.125 / 1.25: to even (1.25)
  EXPECT_EQ(deepseek_v3::f32_to_e4m3(0x1p-10f), 0x00);  // half the smallest subnormal: to 0
  EXPECT_EQ(deepseek_v3::f32_to_e4m3(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(deepseek_v3::f32_to_e4m3(1000.0f), 0x7E);  // saturates at 448
}

// dsv3-tiny in all three dtypes from one seed: the same model up to rounding, checkpoints the plan
// counts exactly, FP8 weights within e4m3 precision of the f32 ones, and logits that agree.
TEST(DeepseekV3Presets, TinyPresetsLoadAndAgreeAcrossDtypes) {
  std::map<std::string, std::filesystem::path> dirs;
  for (const char* dt : {"f32", "bf16", "fp8"}) {
    dirs[dt] = test::temp_dir(std::string("dsv3-tiny-") + dt);
    make_model("dsv3-tiny", dirs[dt], MakeModelOptions{dt, 7});
    const auto p = deepseek_v3::plan_memory(DeepseekV3Config::from_dir(dirs[dt]));
    EXPECT_EQ(p.weight_bytes_main + p.weight_bytes_mtp, WeightStore(dirs[dt]).total_bytes()) << dt;
    EXPECT_TRUE(std::filesystem::exists(dirs[dt] / "tokenizer.json"));
  }
  {
    WeightStore f32(dirs["f32"]), fp8(dirs["fp8"]);
    const std::string n = "model.layers.1.self_attn.kv_b_proj.weight";
    const TensorView& w = f32.get(n);
    const TensorView& q = fp8.get(n);
    const TensorView& s = fp8.get("model.layers.1.self_attn.kv_b_proj.weight_scale_inv");
    ASSERT_EQ(q.dtype, DType::F8_E4M3);
    std::vector<float> deq(size_t(q.numel()));
    reference::dequantize_fp8(q.data, reinterpret_cast<const float*>(s.data), uint32_t(q.dim(0)),
                              uint32_t(q.dim(1)), deq.data());
    const float* ref = reinterpret_cast<const float*>(w.data);
    const float* scales = reinterpret_cast<const float*>(s.data);
    for (size_t i = 0; i < deq.size(); ++i) {
      const size_t r = i / size_t(q.dim(1)), c = i % size_t(q.dim(1));
      const float block_scale = scales[(r / 128) * size_t(s.dim(1)) + c / 128];
      // half an e4m3 ulp: 2^-4 relative for normals, 2^-10 x scale for subnormals
      ASSERT_LE(std::abs(deq[i] - ref[i]), std::abs(ref[i]) / 16 + block_scale * 0x1p-10f) << i;
    }
  }
  const std::vector<std::vector<int32_t>> seqs = {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {42, 7, 300}};
  std::map<std::string, std::vector<std::vector<float>>> logits;
  for (const auto& [dt, dir] : dirs) {
    auto model = load_model(dir, LoadOptions{{&test::default_device()}, std::nullopt});
    EXPECT_EQ(model->info().vocab_size, 512u);
    logits[dt] = all_position_logits(*model, seqs, 16);
    for (const auto& row : logits[dt])
      for (float v : row) ASSERT_TRUE(std::isfinite(v)) << dt;
  }
  for (size_t b = 0; b < seqs.size(); ++b) {
    float d_bf16 = 0, d_fp8 = 0, spread = 0;
    for (size_t i = 0; i < logits["f32"][b].size(); ++i) {
      d_bf16 = std::max(d_bf16, std::abs(logits["bf16"][b][i] - logits["f32"][b][i]));
      d_fp8 = std::max(d_fp8, std::abs(logits["fp8"][b][i] - logits["f32"][b][i]));
      spread = std::max(spread, std::abs(logits["f32"][b][i]));
    }
    // Weight rounding moves logits a little (seed 7: bf16 0.3%, fp8 0.6% of the largest logit;
    // the embedding and lm_head, which dominate these logits, are BF16 in both).
    std::cout << "[ dsv3-tiny vs f32 ] seq " << b << ": bf16 " << d_bf16 << ", fp8 " << d_fp8
              << " (largest |logit| " << spread << ")\n";
    EXPECT_LT(d_bf16, 0.01f * spread) << b;
    EXPECT_LT(d_fp8, 0.02f * spread) << b;
    EXPECT_GT(d_fp8, d_bf16) << b;  // e4m3 (3 mantissa bits) rounds more than bf16 (7)
  }
}

}  // namespace
}  // namespace clshard
