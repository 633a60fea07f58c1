// Llama 3 and its siblings in the model registry: one Llama3Model per data-parallel replica, each
// tensor-parallel over its device group.
#include "models/llama3/model.h"
#include "models/llama3/plan.h"
#include "models/llama3/presets.h"
#include "models/registry.h"
#include "parallel/data_parallel_lm.h"
#include "parallel/mpi_transport.h"

#include <algorithm>

namespace clshard::llama3 {

namespace {

std::unique_ptr<CausalLM> load(const std::filesystem::path& dir, const LoadOptions& opts,
                               const parallel::Topology& topology) {
  // Replicas of tensor-parallel groups, as the topology gives them; one group needs no
  // data-parallel wrapper. Over MPI a process builds the replicas it has devices of, and the
  // replicas' logits meet over a communicator of every device.
  std::vector<std::unique_ptr<CausalLM>> replicas;
  for (size_t r = 0; r < topology.replicas(); ++r) {
    const auto procs = topology.processes_of_replica(r);
    const bool here = std::find(procs.begin(), procs.end(), opts.process()) != procs.end();
    replicas.push_back(here ? std::make_unique<Llama3Model>(dir, opts, topology, r) : nullptr);
  }
  if (replicas.size() == 1) return std::move(replicas[0]);
  if (opts.mpi_ranks == 0) return std::make_unique<parallel::DataParallelLM>(std::move(replicas));
#ifdef CLSHARD_HAVE_MPI
  auto comm = std::make_unique<parallel::Communicator>(
      std::make_unique<parallel::MpiTransport>(opts.devices, 0));
  return std::make_unique<parallel::DataParallelLM>(std::move(replicas), topology,
                                                    std::move(comm));
#else
  throw std::invalid_argument("Llama 3: this build has no MPI transport");
#endif
}

nlohmann::json plan(const nlohmann::json& cfg, const std::filesystem::path& path) {
  return plan_memory(Llama3Config::from_json(cfg, path.string()),
                     cfg.contains("torch_dtype") && cfg["torch_dtype"] == "float32" ? 4 : 2);
}

}  // namespace

void register_folder(ModelRegistry& registry) {
  ModelFamily f;
  f.name = "Llama 3";
  f.architectures = {"LlamaForCausalLM",  "llama",           "GraniteForCausalLM",
                     "OlmoForCausalLM",   "ExaoneForCausalLM", "MistralForCausalLM"};
  f.layout = parallel::Layout::TensorParallelReplicas;
  f.load = load;
  f.plan = plan;
  f.presets = preset_names();
  f.write_preset = write_preset;
  registry.add(std::move(f));
}

}  // namespace clshard::llama3
