#include "parallel/deployment_plan.h"

#include <sstream>
#include <stdexcept>

#include "parallel/signals.h"
#include "parallel/topology.h"

namespace clshard::parallel {

namespace {
std::string gib(uint64_t b) {
  std::ostringstream o;
  o.precision(2);
  o << std::fixed << double(b) / double(1ull << 30) << " GiB";
  return o.str();
}
}  // namespace

std::vector<DeviceMemory> plan_devices(const nlohmann::json& ck, const Topology& t,
                                       const DeploymentShape& s) {
  const bool moe = ck.contains("moe");
  const uint64_t weights_total = ck["weights"].contains("bytes_main")
                                     ? ck["weights"]["bytes_main"].get<uint64_t>()
                                     : ck["weights"]["bytes_total"].get<uint64_t>();
  const uint64_t routed = moe ? ck["weights"]["routed_expert_bytes_main"].get<uint64_t>() : 0;
  const uint64_t kv_page_full = ck["kv_cache"]["bytes_per_token"].get<uint64_t>() * s.page_size;
  const uint64_t activations = ck["activations"]["bytes"].get<uint64_t>();
  const size_t n = t.devices();
  // Each device holds its tensor-parallel share of everything but the routed experts (heads, MLP
  // columns and vocabulary split), and of those its expert-parallel rank's block.
  ExpertPlacement experts;
  uint32_t E = 0;
  uint64_t k = 0, H = 0;
  if (moe) {
    E = ck["moe"]["n_routed_experts"].get<uint32_t>();
    k = ck["moe"]["num_experts_per_tok"].get<uint64_t>();
    H = ck["moe"]["hidden_size"].get<uint64_t>();
    experts = t.expert_blocks(E);
  }
  std::vector<DeviceMemory> rows;
  for (size_t d = 0; d < n; ++d) {
    DeviceMemory m;
    m.device = d;
    m.replica = t.replica_of_device(d);
    m.experts = moe ? experts.count(d) : 0;
    m.draft_weights =
        s.draft_weight_bytes + (E ? s.draft_routed_expert_bytes * m.experts / E : 0);
    m.lora = s.lora_bytes;
    m.weights = (weights_total - routed) / t.tensor_degree() + (E ? routed * m.experts / E : 0) +
                m.draft_weights + m.lora;
    m.kv_bytes_per_page =
        kv_page_full / t.tensor_degree() + s.draft_kv_bytes_per_token * s.page_size;
    // Each step's token-expert rows leave and come back: send and receive room for both trips.
    m.ep_buffers =
        moe && n > 1 ? 4 * uint64_t(s.max_batch_input_tokens) * k * H * sizeof(float) : 0;
    m.activations = activations;
    rows.push_back(m);
  }
  for (auto& m : rows) {
    m.signal_buffers = n > 1 ? SignalBuffers::words(n) * sizeof(uint32_t) : 0;
    const uint64_t budget = uint64_t(double(s.device_memory_bytes) * s.memory_fraction);
    const uint64_t fixed = m.weights + m.activations + m.ep_buffers + m.signal_buffers;
    m.fits = fixed < budget;
    m.kv_pages = m.fits && m.kv_bytes_per_page ? (budget - fixed) / m.kv_bytes_per_page : 0;
    m.kv_bytes = m.kv_pages * m.kv_bytes_per_page;
  }
  return rows;
}

std::string format_device_plan(const std::vector<DeviceMemory>& rows, const DeploymentShape& s) {
  std::ostringstream o;
  o << "per device (" << gib(s.device_memory_bytes) << " each, memory_fraction " << s.memory_fraction
    << ", page_size " << s.page_size << "):\n";
  o << "  device replica experts      weights  activations   EP buffers    KV pages     KV bytes\n";
  for (const auto& m : rows) {
    char line[200];
    std::snprintf(line, sizeof line, "  %6zu %7zu %7u %12s %12s %12s %11llu %12s%s\n", m.device,
                  m.replica, m.experts, gib(m.weights).c_str(), gib(m.activations).c_str(),
                  gib(m.ep_buffers).c_str(), (unsigned long long)m.kv_pages,
                  gib(m.kv_bytes).c_str(), m.fits ? "" : "  DOES NOT FIT");
    o << line;
  }
  return o.str();
}

}  // namespace clshard::parallel
