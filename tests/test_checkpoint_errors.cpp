// Bad input gets a clear error: missing files, truncated or corrupt safetensors, wrong shapes and
// dtypes, unknown architectures, config fields of the wrong type.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "models/llama3/config.h"
#include "models/registry.h"
#include "runtime/model.h"
#include "runtime/mapped_file_guard.h"
#include "runtime/safetensors.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

std::filesystem::path tiny_ref() { return test::reference_dir() / "ckpt" / "llama3-tiny-f32"; }

// A copy of the tiny reference checkpoint we may break.
std::filesystem::path copy_tiny(const std::string& name) {
  auto dir = test::temp_dir(name);
  for (const auto& e : std::filesystem::directory_iterator(tiny_ref()))
    std::filesystem::copy_file(e.path(), dir / e.path().filename());
  for (const auto& e : std::filesystem::directory_iterator(dir))
    std::filesystem::permissions(e.path(), std::filesystem::perms::owner_write,
                                 std::filesystem::perm_options::add);
  return dir;
}

std::string load_error(const std::filesystem::path& dir) {
  try {
    load_model(dir, LoadOptions{{&test::default_device()}, std::nullopt});
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

void write_text(const std::filesystem::path& p, const std::string& s) { std::ofstream(p) << s; }

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

TEST(CheckpointErrors, MissingDirectoryAndFiles) {
  EXPECT_HAS(load_error("/nonexistent/model"), "model directory not found");
  auto dir = copy_tiny("missing_cfg");
  std::filesystem::remove(dir / "config.json");
  EXPECT_HAS(load_error(dir), "config.json: cannot open");
  dir = copy_tiny("missing_weights");
  std::filesystem::remove(dir / "model.safetensors");
  EXPECT_HAS(load_error(dir), "no model.safetensors");
}

TEST(CheckpointErrors, TruncatedSafetensors) {
  auto dir = copy_tiny("truncated");
  std::filesystem::resize_file(dir / "model.safetensors", 100000);
  const std::string e = load_error(dir);
  EXPECT_HAS(e, "model.safetensors");
  EXPECT_HAS(e, "outside the data section");
  std::filesystem::resize_file(dir / "model.safetensors", 4);
  EXPECT_HAS(load_error(dir), "truncated");
}

TEST(CheckpointErrors, CorruptHeader) {
  auto dir = copy_tiny("corrupt");
  {
    std::fstream f(dir / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("#", 1);  // the header's opening brace
  }
  EXPECT_HAS(load_error(dir), "header is not valid JSON");
  {
    std::fstream f(dir / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t huge = 1ull << 40;
    f.write(reinterpret_cast<const char*>(&huge), 8);
  }
  EXPECT_HAS(load_error(dir), "header length");
}

TEST(CheckpointErrors, ValidationOfSpansAndDtypes) {
  auto dir = test::temp_dir("spans");
  auto write_header = [&](const std::string& header, size_t data_bytes) {
    std::ofstream out(dir / "x.safetensors", std::ios::binary);
    uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
  };
  auto error = [&]() -> std::string {
    try {
      SafetensorsFile f(dir / "x.safetensors");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  };
  write_header(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_HAS(error(), "unknown dtype 'F33'");
  write_header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  EXPECT_HAS(error(), "is 12 bytes but data_offsets span 8");
  write_header(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      12);
  EXPECT_HAS(error(), "overlap");
  write_header(R"({"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},
                   "__metadata__":{"format":"pt"}})", 8);
  // Found by fuzzing: 2^62 x 4 x 4 bytes wraps around 2^64 to 0, the span the tensor claims.
  write_header(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0);
  EXPECT_HAS(error(), "tensor 'a': shape [4611686018427387904, 4] x F32 is more than 2^64 bytes "
                      "but data_offsets span 0");
  write_header(R"([1, 2])", 0);
  EXPECT_HAS(error(), "header is not a JSON object");
  write_header(std::string(200, '[') + std::string(200, ']'), 0);
  EXPECT_HAS(error(), "header is not valid JSON: JSON nested deeper than 128 levels");
  write_header(R"({"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},
                   "__metadata__":{"format":"pt"}})", 8);
  SafetensorsFile ok(dir / "x.safetensors");
  EXPECT_EQ(ok.tensors().at("a").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(ok.metadata().at("format"), "pt");
}

TEST(CheckpointErrors, WrongShapeAndDtype) {
  // Rewrite the checkpoint with one tensor of the wrong shape, then of the wrong dtype.
  auto src = WeightStore(tiny_ref());
  auto rewrite = [&](const std::string& name, const std::string& which) {
    auto dir = copy_tiny(name);
    std::vector<TensorToWrite> ts;
    for (const auto& n : src.names()) {
      const TensorView& v = src.get(n);
      TensorToWrite t{n, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.bytes)};
      if (n == "model.layers.1.mlp.down_proj.weight") {
        if (which == "shape") {
          t.shape = {v.shape[1], v.shape[0]};
        } else {
          t.dtype = DType::I32;
        }
      }
      ts.push_back(std::move(t));
    }
    write_safetensors(dir / "model.safetensors", ts);
    return dir;
  };
  std::string e = load_error(rewrite("bad_shape", "shape"));
  EXPECT_HAS(e, "'model.layers.1.mlp.down_proj.weight' has shape [384, 128], expected [128, 384]");
  e = load_error(rewrite("bad_dtype", "dtype"));
  EXPECT_HAS(e, "'model.layers.1.mlp.down_proj.weight' has dtype I32, expected F32 or BF16 or F16");
}

// A checkpoint truncated while it is mapped: reading a weight past the new end is a SIGBUS, which
// ends the process with a message naming the file and exit status 3, not a bare "Bus error".
TEST(CheckpointErrorsDeathTest, FileTruncatedWhileMappedEndsWithItsName) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto dir = test::temp_dir("truncated_while_mapped");
  const auto file = dir / "model.safetensors";
  std::vector<uint8_t> bytes(1 << 20, 7);
  write_safetensors(file, {{"w", DType::U8, {int64_t(bytes.size())}, bytes}});
  EXPECT_EXIT(
      {
        SafetensorsFile f(file);
        const TensorView& w = f.tensors().at("w");
        std::filesystem::resize_file(file, 64);
        volatile uint8_t last = w.data[w.bytes - 1];  // the page is gone: SIGBUS
        (void)last;
        std::exit(0);
      },
      ::testing::ExitedWithCode(kExitCheckpointChanged),
      "clshard: checkpoint file .*model.safetensors changed while in use \\(truncated or "
      "replaced\\?\\); restore it and rerun");
}

TEST(CheckpointErrors, IndexNamesOnlyFilesBesideIt) {
  auto error = [](const char* index) -> std::string {
    try {
      safetensors_index_shards(nlohmann::json::parse(index), "ckpt/model.safetensors.index.json");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(error(R"({"weight_map": {"w": "../../etc/passwd"}})"),
            "ckpt/model.safetensors.index.json: weight_map['w'] names '../../etc/passwd', not a "
            "file name in the checkpoint's folder");
  EXPECT_EQ(error(R"({"weight_map": {"w": ".."}})"),
            "ckpt/model.safetensors.index.json: weight_map['w'] names '..', not a file name in "
            "the checkpoint's folder");
  EXPECT_EQ(error(R"([])"), "ckpt/model.safetensors.index.json: expected a weight_map object");
  EXPECT_EQ(safetensors_index_shards(
                nlohmann::json::parse(R"({"weight_map": {"a": "s2", "b": "s1", "c": "s2"}})"), "i"),
            (std::vector<std::string>{"s1", "s2"}));
}

TEST(CheckpointErrors, ShardedIndexAndMissingTensor) {
  // Split the tiny checkpoint into two shards with an index: same logits-ready store.
  WeightStore src(tiny_ref());
  auto dir = copy_tiny("sharded");
  std::filesystem::remove(dir / "model.safetensors");
  std::vector<TensorToWrite> a, b;
  nlohmann::json index;
  for (const auto& n : src.names()) {
    const TensorView& v = src.get(n);
    auto& part = (n < "model.layers.1") ? a : b;
    part.push_back({n, v.dtype, v.shape, std::vector<uint8_t>(v.data, v.data + v.bytes)});
    index["weight_map"][n] = (&part == &a) ? "model-00001-of-00002.safetensors"
                                           : "model-00002-of-00002.safetensors";
  }
  write_safetensors(dir / "model-00001-of-00002.safetensors", a);
  write_safetensors(dir / "model-00002-of-00002.safetensors", b);
  write_text(dir / "model.safetensors.index.json", index.dump());
  WeightStore sharded(dir);
  EXPECT_EQ(sharded.names(), src.names());
  EXPECT_EQ(load_error(dir), "(no error)");
  // Drop a tensor: the error names it.
  b.erase(std::remove_if(b.begin(), b.end(),
                         [](const auto& t) { return t.name == "model.norm.weight"; }),
          b.end());
  write_safetensors(dir / "model-00002-of-00002.safetensors", b);
  EXPECT_HAS(load_error(dir), "missing tensor 'model.norm.weight'");
  std::filesystem::remove(dir / "model-00002-of-00002.safetensors");
  EXPECT_HAS(load_error(dir), "names shard model-00002-of-00002.safetensors, which is missing");
}

TEST(ConfigErrors, UnknownArchitectureAndWrongTypes) {
  auto dir = copy_tiny("bad_arch");
  auto cfg = read_json_file(dir / "config.json");
  cfg["architectures"] = {"GPT2LMHeadModel"};
  write_text(dir / "config.json", cfg.dump());
  EXPECT_HAS(load_error(dir), "unknown architecture 'GPT2LMHeadModel'");

  cfg = read_json_file(tiny_ref() / "config.json");
  cfg["hidden_size"] = "128";
  EXPECT_THROW(
      {
        try {
          llama3::Llama3Config::from_json(cfg, "config.json");
        } catch (const std::runtime_error& e) {
          EXPECT_HAS(e.what(), "config.json: field 'hidden_size': expected an integer, got string");
          throw;
        }
      },
      std::runtime_error);
  // A float outside int64's range (found by fuzzing: converting it was undefined behaviour) and an
  // unsigned integer above INT64_MAX are refused, as a whole float in range is accepted.
  for (const auto& [value, message] : std::vector<std::pair<nlohmann::json, std::string>>{
           {5.9e21, "field 'hidden_size': expected an integer, got number 5.9e+21"},
           {uint64_t(1) << 63,
            "field 'hidden_size': expected an integer in the int64 range, got number "
            "9223372036854775808"}}) {
    cfg = read_json_file(tiny_ref() / "config.json");
    cfg["hidden_size"] = value;
    try {
      llama3::Llama3Config::from_json(cfg, "config.json");
      ADD_FAILURE() << "accepted hidden_size " << value.dump();
    } catch (const std::runtime_error& e) {
      EXPECT_HAS(e.what(), message);
    }
  }
  cfg = read_json_file(tiny_ref() / "config.json");
  const auto hidden = cfg["hidden_size"].get<int64_t>();
  cfg["hidden_size"] = double(hidden);
  EXPECT_EQ(llama3::Llama3Config::from_json(cfg, "config.json").hidden_size, uint32_t(hidden));
  cfg = read_json_file(tiny_ref() / "config.json");
  cfg["rope_scaling"]["factor"] = true;
  try {
    llama3::Llama3Config::from_json(cfg, "config.json");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_HAS(e.what(), "rope_scaling: field 'factor': expected a number, got boolean");
  }
  cfg = read_json_file(tiny_ref() / "config.json");
  cfg["rope_scaling"]["rope_type"] = "dynamic";
  try {
    llama3::Llama3Config::from_json(cfg, "config.json");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_HAS(e.what(), "'dynamic' is not supported");
  }
  cfg = read_json_file(tiny_ref() / "config.json");
  cfg["num_key_value_heads"] = 3;
  try {
    llama3::Llama3Config::from_json(cfg, "config.json");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_HAS(e.what(), "must divide num_attention_heads");
  }
}

TEST(Config, Llama3FieldsFromConfigJson) {
  auto c = llama3::Llama3Config::from_dir(tiny_ref());
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.num_key_value_heads, 2);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_FLOAT_EQ(c.attention_scale(), 1.0f / std::sqrt(32.0f));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2}));
  // Llama 3 scaling: high frequencies kept, low ones divided by the factor.
  auto inv = c.rope_inv_freqs();
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  EXPECT_NEAR(inv.back(), std::pow(500000.0, -30.0 / 32) / 8.0, 1e-12);
  // Granite multipliers and tied embeddings.
  auto j = read_json_file(tiny_ref() / "config.json");
  j["embedding_multiplier"] = 12.0;
  j["residual_multiplier"] = 0.22;
  j["logits_scaling"] = 8.0;
  j["attention_multiplier"] = 0.015625;
  j["clip_qkv"] = 8;
  auto g = llama3::Llama3Config::from_json(j, "config.json");
  EXPECT_DOUBLE_EQ(g.embedding_multiplier, 12.0);
  EXPECT_DOUBLE_EQ(g.residual_multiplier, 0.22);
  EXPECT_DOUBLE_EQ(g.logits_scaling, 8.0);
  EXPECT_FLOAT_EQ(g.attention_scale(), 0.015625f);
  EXPECT_DOUBLE_EQ(*g.clip_qkv, 8.0);
  WeightStore tied(test::reference_dir() / "ckpt" / "llama32-tiny-f32");
  auto t = llama3::Llama3Config::from_dir(tied.dir());
  t.finalize(tied);
  EXPECT_TRUE(t.tie_word_embeddings);
  EXPECT_FALSE(t.stacked_qkv);
}

}  // namespace
}  // namespace clshard
