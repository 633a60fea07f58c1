#include "models/deepseek_v3/weights.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard::deepseek_v3 {

namespace {

const std::vector<DType> kFloatTypes = {DType::F32, DType::BF16};
const std::vector<DType> kLinearTypes = {DType::F32, DType::BF16, DType::F8_E4M3};
constexpr int64_t kFp8Block = 128;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// "model.layers.N.rest" -> (N, rest).
std::optional<std::pair<int64_t, std::string>> split_layer_name(const std::string& name) {
  static const std::string prefix = "model.layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  size_t i = prefix.size(), j = i;
  while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
  if (j == i || j >= name.size() || name[j] != '.') return std::nullopt;
  return std::pair{std::stoll(name.substr(i, j - i)), name.substr(j + 1)};
}

// "mlp.experts.E.rest" -> E.
std::optional<int64_t> expert_index(const std::string& rest) {
  static const std::string prefix = "mlp.experts.";
  if (rest.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  size_t i = prefix.size(), j = i;
  while (j < rest.size() && std::isdigit(static_cast<unsigned char>(rest[j]))) ++j;
  if (j == i) return std::nullopt;
  return std::stoll(rest.substr(i, j - i));
}

void check_names(const DeepseekV3Config& c, const WeightStore& s) {
  const int64_t L = c.num_hidden_layers, last = L + c.num_nextn_predict_layers;
  const std::string cfg = (s.dir() / "config.json").string();
  std::map<int64_t, int64_t> experts_in_layer;  // main layers: highest expert id + 1
  for (const auto& name : s.names()) {
    auto parts = split_layer_name(name);
    if (!parts) continue;
    const auto [layer, rest] = *parts;
    if (layer >= last)
      throw std::runtime_error(
          s.get(name).file->string() + ": tensor '" + name + "' belongs to layer " +
          std::to_string(layer) + ", but " + cfg + " has num_hidden_layers = " +
          std::to_string(L) + " and num_nextn_predict_layers = " +
          std::to_string(c.num_nextn_predict_layers) + " (layers 0.." + std::to_string(last - 1) +
          ")");
    if (auto e = expert_index(rest)) {
      if (*e >= c.n_routed_experts)
        throw std::runtime_error(s.get(name).file->string() + ": tensor '" + name +
                                 "' is expert " + std::to_string(*e) + ", but " + cfg +
                                 " has n_routed_experts = " + std::to_string(c.n_routed_experts) +
                                 " (wrong expert count)");
      if (layer < L) experts_in_layer[layer] = std::max(experts_in_layer[layer], *e + 1);
    }
  }
  for (int64_t l = 0; l < L; ++l) {
    const int64_t found = experts_in_layer.count(l) ? experts_in_layer[l] : 0;
    if (c.is_moe_layer(l) && found != c.n_routed_experts)
      throw std::runtime_error(s.dir().string() + ": layer " + std::to_string(l) + " has " +
                               std::to_string(found) + " routed experts, but " + cfg +
                               " has n_routed_experts = " + std::to_string(c.n_routed_experts) +
                               " (wrong expert count)");
    if (!c.is_moe_layer(l) && found != 0)
      throw std::runtime_error(s.dir().string() + ": layer " + std::to_string(l) +
                               " has routed experts, but " + cfg +
                               " makes it dense (first_k_dense_replace = " +
                               std::to_string(c.first_k_dense_replace) +
                               ", moe_layer_freq = " + std::to_string(c.moe_layer_freq) + ")");
  }
}

class Loader {
 public:
  Loader(const WeightStore& s, Device& dev) : s_(s), dev_(dev) {}

  Weight plain(const std::string& name, std::vector<int64_t> shape,
               const std::vector<DType>& dtypes = kFloatTypes) {
    return to_device(dev_, s_.expect(name, shape, dtypes));
  }

  Linear linear(const std::string& prefix, int64_t out, int64_t in) {
    return load_linear(s_, dev_, prefix, out, in);
  }

  MlpWeights mlp(const std::string& prefix, int64_t hidden, int64_t inter) {
    MlpWeights m;
    m.gate = linear(prefix + "gate_proj", inter, hidden);
    m.up = linear(prefix + "up_proj", inter, hidden);
    m.down = linear(prefix + "down_proj", hidden, inter);
    return m;
  }

 private:
  const WeightStore& s_;
  Device& dev_;
};

// The layer's routed experts [begin, end), then its shared expert when it has the routed
// experts' shape, as one buffer over the mapped file: a view, no copy, so that one launch reaches
// every expert (ops::moe_grouped_linear). Needs a device that reads host memory, one file holding
// them all, one dtype, and every tensor at an offset its element size divides (safetensors does
// not promise alignment); otherwise empty, and the experts run one by one.
ops::GroupedExperts group_experts(const WeightStore& s, Device& dev, const std::string& p,
                                  uint32_t begin, uint32_t end, int64_t H, int64_t F,
                                  bool with_shared) {
  ops::GroupedExperts g;
  if (begin >= end || !dev.info().host_unified_memory) return g;
  static const char* kMats[3] = {"gate_proj", "up_proj", "down_proj"};
  std::vector<const TensorView*> views;  // [e][0..2] weights, [e][3..5] scales (FP8)
  auto add = [&](const std::string& ep) {
    for (const char* m : kMats) views.push_back(&s.get(ep + m + ".weight"));
    for (const char* m : kMats)
      views.push_back(views[views.size() - 3]->dtype == DType::F8_E4M3
                          ? &s.get(ep + m + ".weight_scale_inv")
                          : nullptr);
  };
  for (uint32_t e = begin; e < end; ++e) add(p + "mlp.experts." + std::to_string(e) + ".");
  if (with_shared) add(p + "mlp.shared_experts.");
  const DType dt = views[0]->dtype;
  const uint8_t* lo = views[0]->data;
  const uint8_t* hi = lo;
  for (size_t i = 0; i < views.size(); ++i) {
    const TensorView* v = views[i];
    if (!v) continue;
    if (v->file != views[0]->file || v->dtype != (i % 6 < 3 ? dt : DType::F32)) return g;
    lo = std::min(lo, v->data);
    hi = std::max(hi, v->data + v->bytes);
  }
  if (size_t(hi - lo) > dev.info().max_alloc) return g;
  std::vector<uint64_t> table(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    if (!views[i]) continue;
    const size_t es = dtype_size(views[i]->dtype), at = size_t(views[i]->data - lo);
    if (at % es != 0) return g;
    table[i] = at / es;
  }
  g.mem = dev.wrap_host(lo, size_t(hi - lo));
  g.table = dev.alloc(table.size() * sizeof(uint64_t), CL_MEM_READ_ONLY);
  dev.write(g.table, table.data(), table.size() * sizeof(uint64_t));
  g.dtype = dt;
  g.n_experts = uint32_t(views.size() / 6);
  g.hidden = uint32_t(H);
  g.inter = uint32_t(F);
  g.pairs_aligned = reinterpret_cast<uintptr_t>(lo) % 4 == 0 &&
                    ops::grouped_rows_aligned(table, g.hidden, g.inter);
  return g;
}

}  // namespace

Linear load_linear(const WeightStore& s, Device& dev, const std::string& prefix, int64_t out,
                   int64_t in) {
  Linear l;
  const TensorView& w = s.expect(prefix + ".weight", {out, in}, kLinearTypes);
  l.w = to_device(dev, w);
  if (w.dtype == DType::F8_E4M3) {
    const std::string sname = prefix + ".weight_scale_inv";
    const std::vector<int64_t> sshape = {ceil_div(out, kFp8Block), ceil_div(in, kFp8Block)};
    if (!s.has(sname))
      throw std::runtime_error(w.file->string() + ": tensor '" + w.name +
                               "' is F8_E4M3 but its block scales '" + sname + "' [" +
                               std::to_string(sshape[0]) + ", " + std::to_string(sshape[1]) +
                               "] F32 are missing");
    l.scale_inv = to_device(dev, s.expect(sname, sshape, {DType::F32}));
  }
  return l;
}

std::vector<int64_t> mtp_layers_present(const DeepseekV3Config& c, const WeightStore& s) {
  std::set<int64_t> ids;
  for (const auto& name : s.names())
    if (auto parts = split_layer_name(name); parts && parts->first >= c.num_hidden_layers)
      ids.insert(parts->first);
  return {ids.begin(), ids.end()};
}

LayerWeights load_layer(const DeepseekV3Config& c, const WeightStore& s, Device& dev,
                        const std::string& p, bool is_moe, uint32_t expert_begin,
                        uint32_t expert_end) {
  const int64_t H = c.hidden_size, Nh = c.num_attention_heads;
  const int64_t Dqk = c.qk_head_dim(), Dv = c.v_head_dim, Dn = c.qk_nope_head_dim;
  const int64_t Lkv = c.kv_lora_rank, Dr = c.qk_rope_head_dim, Lq = c.q_lora_rank;
  const int64_t E = c.n_routed_experts, F = c.moe_intermediate_size;
  Loader ld(s, dev);
  expert_end = uint32_t(std::min<int64_t>(expert_end, E));
  if (expert_begin > expert_end)
    throw std::invalid_argument("load_weights: expert block [" + std::to_string(expert_begin) +
                                ", " + std::to_string(expert_end) + ") is reversed");
  LayerWeights L;
  L.input_norm = ld.plain(p + "input_layernorm.weight", {H});
  L.post_attention_norm = ld.plain(p + "post_attention_layernorm.weight", {H});
  MlaWeights& a = L.attn;
  if (Lq > 0) {
    a.q_a = ld.linear(p + "self_attn.q_a_proj", Lq, H);
    a.q_a_norm = ld.plain(p + "self_attn.q_a_layernorm.weight", {Lq});
    a.q_b = ld.linear(p + "self_attn.q_b_proj", Nh * Dqk, Lq);
  } else {
    a.q = ld.linear(p + "self_attn.q_proj", Nh * Dqk, H);
  }
  a.kv_a = ld.linear(p + "self_attn.kv_a_proj_with_mqa", Lkv + Dr, H);
  a.kv_a_norm = ld.plain(p + "self_attn.kv_a_layernorm.weight", {Lkv});
  a.kv_b = ld.linear(p + "self_attn.kv_b_proj", Nh * (Dn + Dv), Lkv);
  a.o = ld.linear(p + "self_attn.o_proj", H, Nh * Dv);
  L.is_moe = is_moe;
  if (L.is_moe) {
    L.moe.router = ld.plain(p + "mlp.gate.weight", {E, H});
    L.moe.correction_bias = ld.plain(p + "mlp.gate.e_score_correction_bias", {E}, {DType::F32});
    L.moe.first_expert = expert_begin;
    for (int64_t e = expert_begin; e < expert_end; ++e)
      L.moe.experts.push_back(ld.mlp(p + "mlp.experts." + std::to_string(e) + ".", H, F));
    if (c.n_shared_experts > 0)
      L.moe.shared = ld.mlp(p + "mlp.shared_experts.", H, c.n_shared_experts * F);
    // The shared expert joins the grouped launches when it is one routed expert wide.
    L.moe.grouped_has_shared = c.n_shared_experts == 1;
    L.moe.grouped = group_experts(s, dev, p, expert_begin, expert_end, H, F,
                                  L.moe.grouped_has_shared);
    if (L.moe.grouped.dtype == DType::F8_E4M3) {
      // The experts' own load-time scans (to_device) cover the grouped buffer's weights: the same
      // tensors, not read again. NaN-free where all are; one launch decodes them all, so their
      // mean share of subnormal codes (all of one size).
      bool nan_free = true;
      double share = 0;
      size_t mats = 0;
      auto add = [&](const MlpWeights& m) {
        for (const Weight* w : {&m.gate.w, &m.up.w, &m.down.w}) {
          nan_free = nan_free && w->fp8_nan_free;
          share += w->fp8_subnormal_share;
          ++mats;
        }
      };
      if (L.moe.grouped_has_shared) add(L.moe.shared);
      for (const MlpWeights& m : L.moe.experts) add(m);
      L.moe.grouped.fp8_nan_free = nan_free;
      L.moe.grouped.fp8_subnormal_share = mats ? float(share / double(mats)) : 0.0f;
    }
  } else {
    L.mlp = ld.mlp(p + "mlp.", H, c.intermediate_size);
  }
  return L;
}

DeepseekV3Weights load_weights(const DeepseekV3Config& c, const WeightStore& s, Device& dev,
                               uint32_t expert_begin, uint32_t expert_end) {
  check_names(c, s);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  Loader ld(s, dev);
  DeepseekV3Weights w;
  w.embed = ld.plain("model.embed_tokens.weight", {V, H});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    w.layers.push_back(load_layer(c, s, dev, "model.layers." + std::to_string(l) + ".",
                                  c.is_moe_layer(l), expert_begin, expert_end));
  w.final_norm = ld.plain("model.norm.weight", {H});
  w.lm_head = ld.plain("lm_head.weight", {V, H});
  return w;
}

}  // namespace clshard::deepseek_v3
