#include "runtime/cli/commands.h"
#include "runtime/cli/serve_command.h"

#include <CLI/CLI.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "models/registry.h"
#include "parallel/deployment_plan.h"
#include "parallel/mpi_transport.h"
#include "runtime/cli/bench_command.h"
#include "runtime/cli/tune_command.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/engine/batch_job.h"
#include "runtime/engine/deployment.h"
#include "runtime/engine/generation.h"
#include "runtime/engine/mpi_steps.h"
#include "runtime/engine/progress.h"
#include "runtime/model.h"
#include "runtime/ops_lora.h"
#include "runtime/text/tokenizer.h"

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

// A model named either by a deployment file (positional) or by --model DIR plus device flags.
struct ModelFlags {
  std::string deploy;
  std::string model_dir;
  std::string device_type = "any";
  std::string platform;
  int device_id = 0;
  bool mpi = false;
  void add(CLI::App* app) {
    app->add_flag("--mpi", mpi,
                  "one rank per process over MPI (run under mpirun -np N): data = expert "
                  "parallel = N, each process on its --device");
    app->add_option("deploy", deploy, "deployment YAML (instead of --model)");
    app->add_option("--model", model_dir, "Hugging Face checkpoint directory");
    app->add_option("--device-type", device_type, "cpu | gpu | accelerator | any")
        ->capture_default_str();
    app->add_option("--platform", platform, "substring of the OpenCL platform name");
    app->add_option("--device", device_id, "index among the matching devices")
        ->capture_default_str();
  }
  // The deployment: the YAML file, or one made of the flags.
  DeployConfig config() const {
    if (deploy.empty() == model_dir.empty())
      throw std::runtime_error("name the model with a deployment file or with --model DIR (one of "
                               "the two)");
    if (!deploy.empty()) return load_deploy_config(deploy);
    DeployConfig cfg;
    cfg.source = "--model";
    cfg.model.path = model_dir;
    cfg.devices.platform = platform;
    cfg.devices.type = device_type;
    cfg.devices.ids = {device_id};
    if (mpi) {
#ifdef CLSHARD_HAVE_MPI
      parallel::mpi_init(nullptr, nullptr);
      cfg.cluster.transport = ClusterTransport::Mpi;
      cfg.parallel.data = cfg.parallel.expert = parallel::mpi_world_size();
#else
      throw std::runtime_error("--mpi: this build has no MPI transport (OpenMPI not found at "
                               "build time)");
#endif
    }
    return cfg;
  }
};

// Over MPI, the ranks other than 0 serve rank 0's steps (mpi_steps.h) and return true; rank 0's
// model becomes a StepLeader, and `stop` ends the others' service once rank 0 is done.
struct MpiSteps {
  Deployment& d;
  bool follow() {
    if (d.mpi_ranks == 0) return false;
    if (d.mpi_rank != 0) {
      serve_steps(*d.model);
      return true;
    }
    d.model = std::make_unique<StepLeader>(std::move(d.model));
    return false;
  }
  void stop() {
    if (d.mpi_ranks > 0) stop_followers();
  }
};

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace

LoadProgress stderr_load_progress() {
  return load_progress_printer(std::cerr, Progress::stderr_is_terminal());
}

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
    // Redrawn in place on a terminal; a line per layer in logs.
    const bool tty = Progress::stderr_is_terminal();
    mk_opts.on_layer = [&, tty](int64_t done, int64_t total) {
      std::cerr << (tty ? "\r" : "") << "make-model " << preset << ": layer " << done << "/"
                << total << (done == total ? ", writing files" : "")
                << (tty && done < total ? "" : "\n") << std::flush;
    };
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
  std::string lg_out, lg_tokens_file;
  uint32_t lg_page = 128;
  std::string lg_head = "target", lg_draft;
  lg->add_option("--tokens", lg_tokens, "comma-separated token ids; repeat for more sequences")
  ;
  lg->add_option("--head", lg_head,
                 "target | mtp (the checkpoint's NextN layer) | eagle3 (--draft-model)")
      ->check(CLI::IsMember({"target", "mtp", "eagle3"}))
      ->capture_default_str();
  lg->add_option("--draft-model", lg_draft, "the draft checkpoint for --head eagle3 (or a "
                                            "standalone NextN checkpoint for --head mtp)");
  lg->add_option("--tokens-file", lg_tokens_file, "a file of token-id lines (one sequence each)");
  lg->add_option("--out", lg_out, "output directory")->required();
  lg->add_option("--page-size", lg_page, "KV cache page size")->capture_default_str();
  lg->callback([&] {
    std::vector<std::vector<int32_t>> seqs;
    for (const auto& t : lg_tokens) seqs.push_back(parse_ids(t, "--tokens"));
    if (!lg_tokens_file.empty()) {
      std::ifstream in(lg_tokens_file);
      if (!in) throw std::runtime_error(lg_tokens_file + ": cannot open");
      std::string line;
      while (std::getline(in, line))
        if (!line.empty()) seqs.push_back(parse_ids(line, lg_tokens_file));
    }
    if (seqs.empty()) throw std::runtime_error("logits: give --tokens or --tokens-file");
    DeployConfig cfg = lg_model.config();
    if (lg->count("--page-size")) cfg.kv_cache.page_size = int(lg_page);
    cfg.kv_cache.pages = 1;  // all_position_logits lays out its own pages
    const bool draft_head = lg_head != "target";
    if (lg_head == "eagle3" && lg_draft.empty())
      throw std::runtime_error("logits: --head eagle3 needs --draft-model DIR");
    if (!draft_head && !lg_draft.empty())
      throw std::runtime_error("logits: --draft-model is for --head mtp | eagle3");
    if (draft_head) {
      cfg.speculative.method = lg_head == "mtp" ? SpeculativeMethod::Mtp : SpeculativeMethod::Eagle3;
      cfg.speculative.num_speculative_tokens = 1;
      cfg.speculative.draft_model = lg_draft;
    }
    Deployment d = Deployment::open(cfg, stderr_load_progress());
    auto& model = d.model;
    // Over MPI every process runs the same steps (the same sequences, read from the same
    // arguments); rank 0 holds the gathered logits and writes them.
    auto logits = draft_head ? all_position_draft_logits(*model, *d.draft, seqs,
                                                         uint32_t(cfg.kv_cache.page_size))
                             : all_position_logits(*model, seqs, uint32_t(cfg.kv_cache.page_size));
    if (d.mpi_rank != 0) return;
    std::filesystem::create_directories(lg_out);
    nlohmann::ordered_json manifest;
    manifest["model"] = cfg.model.path.string();
    manifest["architecture"] = model->info().architecture;
    manifest["vocab_size"] = model->info().vocab_size;
    manifest["dtype"] = "float32";
    manifest["head"] = lg_head;
    manifest["layout"] = draft_head ? "row i = the draft's logits for token i + 2, from token i + 1 "
                                      "and the target's hidden state at position i"
                                    : "row t = logits for the token after position t";
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
           {"shape", {logits[i].size() / model->info().vocab_size, model->info().vocab_size}}});
    }
    std::ofstream(std::filesystem::path(lg_out) / "manifest.json") << manifest.dump(2) << "\n";
    std::cerr << "wrote logits of " << seqs.size() << " sequence(s) to " << lg_out << "\n";
  });

  // generate: a text prompt streamed to stdout with the deployment's sampling, or greedy
  // continuation of token ids (usable before any tokenizer exists).
  auto* gen = app.add_subcommand("generate", "Stream one completion (or greedy token ids)");
  ModelFlags gen_model;
  gen_model.add(gen);
  std::vector<std::string> gen_tokens;
  std::string gen_prompt;
  uint32_t gen_max = 0;
  bool gen_stats = false;
  gen->add_option("--prompt", gen_prompt, "prompt text, streamed completion to stdout");
  gen->add_flag("--stats", gen_stats,
                "print the engine's figures (steps, device/host time, speculative acceptance)");
  gen->add_option("--tokens", gen_tokens,
                  "comma-separated prompt token ids; repeat for a batch (greedy)");
  gen->add_option("--max-new-tokens", gen_max, "tokens to generate (default: sampling.max_tokens)");
  gen->callback([&] {
    DeployConfig cfg = gen_model.config();
    if (gen_tokens.empty() == gen_prompt.empty())
      throw std::runtime_error("generate: give --prompt TEXT or --tokens IDS (one of the two)");
    const uint32_t max_new = gen_max ? gen_max : uint32_t(cfg.sampling.max_tokens);
    if (!gen_tokens.empty()) {
      std::vector<std::vector<int32_t>> prompts;
      for (const auto& t : gen_tokens) prompts.push_back(parse_ids(t, "--tokens"));
      cfg.kv_cache.pages = 1;  // greedy_generate lays out its own pages
      Deployment d = Deployment::open(cfg, stderr_load_progress());
      MpiSteps mpi{d};
      if (mpi.follow()) return;
      auto t0 = std::chrono::steady_clock::now();
      auto out = greedy_generate(*d.model, prompts, max_new, uint32_t(cfg.kv_cache.page_size));
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      mpi.stop();
      for (const auto& o : out) std::cout << join_ids(o) << "\n";
      std::cerr << prompts.size() * max_new << " tokens in " << s << " s\n";
      return;
    }
    Deployment d = Deployment::open(cfg, stderr_load_progress());
    MpiSteps mpi{d};
    if (mpi.follow()) return;
    auto engine = d.make_engine();
    GenerationRequest req;
    req.prompt = d.prompt_ids(gen_prompt, std::nullopt, std::nullopt);
    req.sampling = Deployment::sampling_params(cfg.sampling);
    req.max_tokens = max_new;
    req.stop = cfg.sampling.stop;
    req.stop_token_ids = cfg.sampling.stop_token_ids;
    engine->on_token([](uint64_t, int32_t, const std::string& text) {
      std::cout << text << std::flush;
    });
    engine->submit(std::move(req));
    auto t0 = std::chrono::steady_clock::now();
    std::vector<GenerationResult> done;
    while (engine->has_work())
      for (auto& r : engine->step()) done.push_back(std::move(r));
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    mpi.stop();
    std::cout << "\n";
    if (!done.empty() && done[0].reason == EndReason::Error)
      throw std::runtime_error(done[0].error);
    const size_t n = done.empty() ? 0 : done[0].token_ids.size();
    std::cerr << n << " tokens in " << s << " s (" << (s > 0 ? n / s : 0) << " tokens/s), finish: "
              << (done.empty() ? "?" : end_reason_name(done[0].reason)) << "\n";
    if (gen_stats) {
      const EngineStats& st = engine->stats();
      std::cerr << "engine: " << st.steps << " steps, device " << st.device_s << " s, host "
                << st.host_s << " s\n";
      if (d.draft) std::cerr << "speculative: " << st.speculative.describe() << "\n";
    }
  });

  // run: the batch job of a deployment file.
  auto* runc = app.add_subcommand("run", "Run the batch job of a deployment file");
  std::string run_deploy;
  runc->add_option("deploy", run_deploy, "deployment YAML")->required();
  runc->callback([&] {
    Deployment d = Deployment::open(load_deploy_config(run_deploy), stderr_load_progress());
    // Over MPI rank 0 runs the job and hands each step to the other ranks (mpi_steps.h).
    MpiSteps mpi{d};
    if (mpi.follow()) return;
    run_batch_job(d, std::cerr);
    mpi.stop();
  });

  // serve: the OpenAI-compatible HTTP server (runtime/cli/serve_command.cpp).
  add_serve_command(app);

  // plan: what a deployment will take on each device, from config.json alone.
  auto* pl = app.add_subcommand("plan", "Memory plan per device, without loading the weights");
  std::string pl_deploy, pl_model, pl_config;
  double pl_mem_gib = 0;
  size_t pl_devices = 0;
  bool pl_json = false;
  pl->add_option("deploy", pl_deploy, "deployment YAML");
  pl->add_option("--model", pl_model, "checkpoint directory (instead of a deployment)");
  pl->add_option("--config", pl_config, "config.json to plan (default: the model's)");
  pl->add_option("--device-memory", pl_mem_gib, "GiB per device (default: what the devices report)");
  pl->add_option("--devices", pl_devices, "device count (default: data x tensor)");
  pl->add_flag("--json", pl_json, "print JSON");
  pl->callback([&] {
    DeployConfig cfg;
    if (!pl_deploy.empty()) cfg = load_deploy_config(pl_deploy);
    else if (!pl_model.empty()) cfg.model.path = pl_model;
    else if (pl_config.empty())
      throw std::runtime_error("plan: give a deployment file, --model DIR or --config FILE");
    const std::filesystem::path what =
        pl_config.empty() ? cfg.model.path : std::filesystem::path(pl_config);
    nlohmann::json ck = plan_checkpoint(what, cfg.kv_cache.dtype);
    // Expert blocks as loading would make them before any speed is measured: even.
    const parallel::ParallelDegrees degrees{size_t(cfg.parallel.data), size_t(cfg.parallel.tensor),
                                            size_t(cfg.parallel.expert), false};
    size_t devices = pl_devices ? pl_devices : degrees.data * degrees.tensor;
    // Over MPI the devices are those of every process (on any number of nodes).
    const bool mpi = cfg.cluster.transport == ClusterTransport::Mpi;
    parallel::DeploymentShape shape;
    shape.memory_fraction = cfg.kv_cache.memory_fraction;
    shape.page_size = uint32_t(cfg.kv_cache.page_size);
    shape.max_batch_input_tokens = uint32_t(cfg.batch.max_batch_input_tokens);
    if (pl_mem_gib > 0) {
      shape.device_memory_bytes = uint64_t(pl_mem_gib * double(1ull << 30));
    } else {
      try {
        DeviceManager mgr(cfg.devices);
        shape.device_memory_bytes = UINT64_MAX;
        for (Device* d : mgr.devices())
          shape.device_memory_bytes = std::min(shape.device_memory_bytes, d->info().global_mem);
        if (!pl_devices && !mpi) devices = mgr.size();
      } catch (const std::exception& e) {
        throw std::runtime_error(std::string("plan: cannot open the deployment's devices here (") +
                                 e.what() + "); give --device-memory GIB (and --devices N)");
      }
    }
    nlohmann::json draft;
    const SpeculativeSection& sp = cfg.speculative;
    if (sp.method != SpeculativeMethod::None) {
      draft = plan_draft(to_string(sp.method), cfg.model.path,
                         sp.draft_model.empty() ? std::nullopt
                                                : std::optional<std::filesystem::path>(sp.draft_model));
      shape.draft_weight_bytes = draft["weight_bytes"].get<uint64_t>();
      shape.draft_routed_expert_bytes = draft["routed_expert_bytes"].get<uint64_t>();
      shape.draft_kv_bytes_per_token = draft["kv_bytes_per_token"].get<uint64_t>();
    }
    if (!cfg.lora.adapters.empty()) {
      std::vector<std::filesystem::path> dirs;
      for (const auto& [name, dir] : cfg.lora.adapters) dirs.push_back(dir);
      try {
        // Which modules a model supports is checked when it loads: here any module counts.
        shape.lora_bytes = lora_stack_bytes(dirs, uint32_t(cfg.lora.max_rank),
                                            uint32_t(cfg.lora.max_loaded), {});
      } catch (const std::exception& e) {
        throw std::runtime_error(cfg.where("lora.adapters") + ": " + e.what());
      }
    }
    const parallel::Topology topology = checkpoint_topology(what, degrees, devices);
    auto rows = parallel::plan_devices(ck, topology, shape);
    if (pl_json) {
      nlohmann::ordered_json j;
      j["checkpoint"] = ck;
      if (!draft.is_null()) j["draft"] = draft;
      j["devices"] = nlohmann::json::array();
      for (const auto& r : rows)
        j["devices"].push_back({{"device", r.device}, {"replica", r.replica},
                                {"experts", r.experts}, {"weights", r.weights},
                                {"draft_weights", r.draft_weights}, {"lora", r.lora},
                                {"activations", r.activations}, {"ep_buffers", r.ep_buffers},
                                {"signal_buffers", r.signal_buffers}, {"kv_pages", r.kv_pages},
                                {"kv_bytes", r.kv_bytes}, {"fits", r.fits}});
      std::cout << j.dump(2) << "\n";
      return;
    }
    const auto& p = ck["parameters"];
    std::cout << ck["architecture"].get<std::string>() << " (" << ck["config"].get<std::string>()
              << ")\n";
    std::cout << "parameters: " << p["total"].get<uint64_t>() / 1e9 << " B";
    if (p.contains("main"))
      std::cout << " (main " << p["main"].get<uint64_t>() / 1e9 << " B + MTP "
                << p["mtp"].get<uint64_t>() / 1e9 << " B)";
    std::cout << ", active per token " << p["active_per_token"].get<uint64_t>() / 1e9 << " B\n";
    std::cout << "weights: " << ck["weights"]["bytes_total"].get<uint64_t>() / 1e9
              << " GB; KV cache: " << ck["kv_cache"]["bytes_per_token"].get<uint64_t>()
              << " bytes per token, " << ck["kv_cache"]["bytes_per_token"].get<uint64_t>() *
                                            shape.page_size
              << " per page of " << shape.page_size << "\n";
    // Over MPI each process drives one device, or all the sub-devices of a numeric split.
    size_t per_rank = 1;
    if (mpi && !cfg.devices.split.empty() &&
        cfg.devices.split.find_first_not_of("0123456789") == std::string::npos)
      per_rank = std::stoul(cfg.devices.split);
    std::string layout = " device(s)";
    if (mpi && per_rank == 1)
      layout = " MPI rank(s) of one device each (`mpirun -np " + std::to_string(devices) +
               "`; device i below is rank i)";
    else if (mpi)
      layout = " devices over " + std::to_string(devices / per_rank) + " MPI rank(s) of " +
               std::to_string(per_rank) + " sub-devices each (`mpirun -np " +
               std::to_string(devices / per_rank) + "`; device i below is rank i / " +
               std::to_string(per_rank) + "'s sub-device i % " + std::to_string(per_rank) + ")";
    std::cout << "layout: " << devices << layout
              << ", data " << degrees.data << ", tensor " << degrees.tensor << ", expert "
              << degrees.expert << "\n";
    if (!draft.is_null())
      std::cout << "speculative: " << to_string(sp.method) << " draft, "
                << (shape.draft_weight_bytes + shape.draft_routed_expert_bytes) / 1e9
                << " GB of weights (" << shape.draft_routed_expert_bytes / 1e9
                << " GB routed experts, split like the target's), "
                << shape.draft_kv_bytes_per_token << " cache bytes per token; both in the "
                << "figures below\n";
    if (shape.lora_bytes > 0)
      std::cout << "lora: " << cfg.lora.adapters.size() << " adapter(s), at most "
                << std::min<size_t>(cfg.lora.adapters.size(), size_t(cfg.lora.max_loaded))
                << " resident (lora.max_loaded), " << shape.lora_bytes
                << " bytes on every device (in the weights below)\n";
    std::cout << parallel::format_device_plan(rows, shape);
  });

  // tokenize / detokenize: the stable way to check the tokenizer from outside.
  auto* tk = app.add_subcommand("tokenize", "Print token ids of a text file (JSON array)");
  std::string tk_dir, tk_file, tk_jsonl;
  bool tk_special = false;
  tk->add_option("--tokenizer", tk_dir, "directory with tokenizer.json")->required();
  tk->add_option("--text-file", tk_file, "text file, encoded byte for byte");
  tk->add_option("--jsonl", tk_jsonl, "one {\"text\": ...} object per line");
  tk->add_flag("--add-special-tokens", tk_special, "add BOS etc. as the tokenizer asks");
  tk->callback([&] {
    Tokenizer tok = Tokenizer::from_dir(tk_dir);
    auto print = [](const std::vector<int32_t>& ids) {
      std::cout << nlohmann::json(ids).dump() << "\n";
    };
    if (tk_file.empty() == tk_jsonl.empty())
      throw std::runtime_error("tokenize: give --text-file or --jsonl (one of the two)");
    if (!tk_file.empty()) {
      std::ifstream in(tk_file, std::ios::binary);
      if (!in) throw std::runtime_error(tk_file + ": cannot open");
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      print(tok.encode(text, tk_special));
      return;
    }
    std::ifstream in(tk_jsonl);
    if (!in) throw std::runtime_error(tk_jsonl + ": cannot open");
    std::string line;
    for (size_t n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        throw std::runtime_error(tk_jsonl + ":" + std::to_string(n) + ": not JSON: " + e.what());
      }
      if (!j.is_object() || !j.contains("text") || !j["text"].is_string())
        throw std::runtime_error(tk_jsonl + ":" + std::to_string(n) +
                                 ": expected an object with a string field \"text\"");
      print(tok.encode(j["text"].get<std::string>(), tk_special));
    }
  });
  auto* dt = app.add_subcommand("detokenize", "Print the text of token ids");
  std::string dt_dir, dt_ids;
  dt->add_option("--tokenizer", dt_dir, "directory with tokenizer.json")->required();
  dt->add_option("--ids", dt_ids, "comma-separated token ids")->required();
  dt->callback([&] {
    Tokenizer tok = Tokenizer::from_dir(dt_dir);
    std::cout << tok.decode(parse_ids(dt_ids, "--ids"));
  });

  add_bench_command(app);
  add_tune_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "clshard: error: " << e.what() << "\n";
#ifdef CLSHARD_HAVE_MPI
    // The peers may wait in a collective this rank will never enter: end the whole job.
    if (parallel::mpi_initialized() && parallel::mpi_world_size() > 1) parallel::abort_world(1);
#endif
    return 1;
  }
  return 0;
}

}  // namespace clshard::cli
