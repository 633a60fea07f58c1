#include "runtime/cli/commands.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/generation.h"
#include "runtime/model.h"

namespace clshard::cli {

namespace {

// "1,2,3" -> {1, 2, 3}, with an error naming the bad item.
std::vector<int32_t> parse_ids(const std::string& s, const std::string& flag) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used != item.size() || v < 0 || v > INT32_MAX)
      throw std::runtime_error(flag + ": '" + item + "' is not a token id (expected e.g. 1,2,3)");
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) throw std::runtime_error(flag + ": no token ids given");
  return ids;
}

struct ModelFlags {
  std::string model_dir;
  std::string device_type = "any";
  std::string platform;
  int device_id = 0;
  void add(CLI::App* app) {
    app->add_option("--model", model_dir, "Hugging Face checkpoint directory")->required();
    app->add_option("--device-type", device_type, "cpu | gpu | accelerator | any")
        ->capture_default_str();
    app->add_option("--platform", platform, "substring of the OpenCL platform name");
    app->add_option("--device", device_id, "index among the matching devices")
        ->capture_default_str();
  }
  DeviceSelection selection() const {
    DeviceSelection sel;
    sel.platform = platform;
    sel.type = device_type;
    sel.ids = {device_id};
    return sel;
  }
};

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"clshard: LLM inference on OpenCL devices, one or many"};
  app.require_subcommand(1);

  auto* devices = app.add_subcommand("devices", "List every OpenCL platform and device");
  devices->callback([] { std::cout << format_device_listing(list_devices()); });

  // make-model
  auto* mk = app.add_subcommand("make-model",
                                "Write a random checkpoint of a preset in Hugging Face layout");
  std::string preset, mk_out;
  MakeModelOptions mk_opts;
  mk->add_option("--preset", preset, "preset name")->required();
  mk->add_option("--out", mk_out, "output directory")->required();
  mk->add_option("--dtype", mk_opts.dtype, "f32 | bf16 | fp8")->capture_default_str();
  mk->add_option("--seed", mk_opts.seed, "random seed")->capture_default_str();
  mk->callback([&] {
    auto t0 = std::chrono::steady_clock::now();
    make_model(preset, mk_out, mk_opts);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cerr << "wrote " << preset << " (" << mk_opts.dtype << ", seed " << mk_opts.seed
              << ") to " << mk_out << " in " << s << " s\n";
  });

  // logits
  auto* lg = app.add_subcommand(
      "logits", "Run token sequences as one ragged batch and write every position's logits");
  ModelFlags lg_model;
  lg_model.add(lg);
  std::vector<std::string> lg_tokens;
  std::string lg_out;
  uint32_t lg_page = 128;
  lg->add_option("--tokens", lg_tokens, "comma-separated token ids; repeat for more sequences")
      ->required();
  lg->add_option("--out", lg_out, "output directory")->required();
  lg->add_option("--page-size", lg_page, "KV cache page size")->capture_default_str();
  lg->callback([&] {
    std::vector<std::vector<int32_t>> seqs;
    for (const auto& t : lg_tokens) seqs.push_back(parse_ids(t, "--tokens"));
    DeviceManager mgr(lg_model.selection());
    auto model = load_model(lg_model.model_dir, LoadOptions{mgr.devices(), std::nullopt});
    auto logits = all_position_logits(*model, seqs, lg_page);
    std::filesystem::create_directories(lg_out);
    nlohmann::ordered_json manifest;
    manifest["model"] = lg_model.model_dir;
    manifest["architecture"] = model->info().architecture;
    manifest["vocab_size"] = model->info().vocab_size;
    manifest["dtype"] = "float32";
    manifest["layout"] = "row t = logits for the token after position t";
    manifest["devices"] = nlohmann::json::array();
    for (Device* d : model->devices())
      manifest["devices"].push_back(d->info().name + " (" + d->info().platform + ")");
    manifest["sequences"] = nlohmann::json::array();
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::string file = "seq" + std::to_string(i) + ".logits.f32";
      std::ofstream out(std::filesystem::path(lg_out) / file, std::ios::binary);
      out.write(reinterpret_cast<const char*>(logits[i].data()),
                std::streamsize(logits[i].size() * sizeof(float)));
      manifest["sequences"].push_back(
          {{"tokens", seqs[i]},
           {"file", file},
           {"shape", {seqs[i].size(), model->info().vocab_size}}});
    }
    std::ofstream(std::filesystem::path(lg_out) / "manifest.json") << manifest.dump(2) << "\n";
    std::cerr << "wrote logits of " << seqs.size() << " sequence(s) to " << lg_out << "\n";
  });

  // generate (token ids; the YAML form with a text prompt comes with the tokenizer)
  auto* gen = app.add_subcommand("generate", "Greedy continuation of token ids");
  ModelFlags gen_model;
  gen_model.add(gen);
  std::vector<std::string> gen_tokens;
  uint32_t gen_max = 16;
  gen->add_option("--tokens", gen_tokens, "comma-separated prompt token ids; repeat for a batch")
      ->required();
  gen->add_option("--max-new-tokens", gen_max, "tokens to generate")->capture_default_str();
  gen->callback([&] {
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& t : gen_tokens) prompts.push_back(parse_ids(t, "--tokens"));
    DeviceManager mgr(gen_model.selection());
    auto model = load_model(gen_model.model_dir, LoadOptions{mgr.devices(), std::nullopt});
    auto t0 = std::chrono::steady_clock::now();
    auto out = greedy_generate(*model, prompts, gen_max);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const auto& o : out) std::cout << join_ids(o) << "\n";
    std::cerr << prompts.size() * gen_max << " tokens in " << s << " s\n";
  });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "clshard: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace clshard::cli
