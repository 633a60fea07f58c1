// The model registry: every models/ folder registers its architectures, layout, plan and presets;
// draft families register the same way; lookups by architecture and preset.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "models/registry.h"

namespace clshard {
namespace {

TEST(ModelRegistry, EveryFolderRegistersItsFamilies) {
  const ModelRegistry& r = ModelRegistry::get();
  const ModelFamily* llama = r.find("LlamaForCausalLM");
  ASSERT_NE(llama, nullptr);
  EXPECT_EQ(llama->name, "Llama 3");
  EXPECT_EQ(r.find("GraniteForCausalLM"), llama);
  EXPECT_EQ(llama->layout, parallel::Layout::TensorParallelReplicas);
  const ModelFamily* ds = r.find("deepseek_v3");
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(r.find("DeepseekV3ForCausalLM"), ds);
  EXPECT_EQ(ds->layout, parallel::Layout::DataParallelAttentionExpertParallel);
  EXPECT_EQ(r.find("GPT2LMHeadModel"), nullptr);
  for (const ModelFamily& f : r.families()) {
    EXPECT_TRUE(f.load && f.plan && f.write_preset) << f.name;
    EXPECT_FALSE(f.presets.empty()) << f.name;
  }
  EXPECT_EQ(r.find_preset("llama3-tiny"), llama);
  EXPECT_EQ(r.find_preset("dsv3-tiny"), ds);
  EXPECT_EQ(r.find_preset("nope"), nullptr);
  const auto presets = model_presets();
  EXPECT_NE(std::find(presets.begin(), presets.end(), "dsv3-mini"), presets.end());
  EXPECT_NE(r.architectures().find("LlamaForCausalLM"), std::string::npos);
}

TEST(ModelRegistry, DraftFamiliesRegisterByMethod) {
  ModelRegistry r;
  DraftFamily d;
  d.name = "test draft";
  d.method = "test-method";
  d.target_architectures = {"TestForCausalLM"};
  d.load = [](const std::filesystem::path&, const std::optional<std::filesystem::path>&,
              const LoadOptions&) -> std::unique_ptr<DraftModel> { return nullptr; };
  r.add(std::move(d));
  ASSERT_NE(r.find_draft("test-method"), nullptr);
  EXPECT_EQ(r.find_draft("test-method")->name, "test draft");
  EXPECT_EQ(r.find_draft("mtp"), nullptr);
  EXPECT_EQ(r.find("TestForCausalLM"), nullptr);
  // The folders register the two methods of the seeds.
  const ModelRegistry& all = ModelRegistry::get();
  ASSERT_NE(all.find_draft("mtp"), nullptr);
  ASSERT_NE(all.find_draft("eagle3"), nullptr);
  EXPECT_EQ(all.find_draft("mtp")->target_architectures[0], "DeepseekV3ForCausalLM");
}

}  // namespace
}  // namespace clshard
