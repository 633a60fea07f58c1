#include "models/eagle3_deepseek_v3/weights.h"

#include <set>
#include <stdexcept>

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard::eagle3_deepseek_v3 {

namespace {

const std::vector<DType> kFloatTypes = {DType::F32, DType::BF16};

// Tensors the draft does not use: its own copy of the embedding (the target's is the one MAX
// shares) and the vocabulary maps (read by inspect_draft).
const std::set<std::string> kIgnored = {"embed_tokens.weight", "model.embed_tokens.weight", "d2t",
                                        "t2d"};

// A draft tensor under its name or with the `model.` prefix (both layouts occur); remembers what
// was read so that anything else in the checkpoint is an error.
class DraftTensors {
 public:
  explicit DraftTensors(const WeightStore& s) : s_(s) {}

  std::string resolve(const std::string& name) {
    for (const std::string& n : {name, "model." + name})
      if (s_.has(n)) {
        used_.insert(n);
        return n;
      }
    throw std::runtime_error(s_.dir().string() + ": missing tensor '" + name + "' (or 'model." +
                             name + "') of the Eagle3 draft");
  }
  const TensorView& expect(const std::string& name, std::vector<int64_t> shape,
                           const std::vector<DType>& dtypes) {
    return s_.expect(resolve(name), shape, dtypes);
  }
  Linear linear(Device& dev, const std::string& prefix, int64_t out, int64_t in) {
    const std::string name = resolve(prefix + ".weight");
    const std::string resolved = name.substr(0, name.size() - 7);  // without ".weight"
    if (s_.has(resolved + ".weight_scale_inv")) used_.insert(resolved + ".weight_scale_inv");
    return deepseek_v3::load_linear(s_, dev, resolved, out, in);
  }
  Weight plain(Device& dev, const std::string& name, std::vector<int64_t> shape) {
    return to_device(dev, expect(name, std::move(shape), kFloatTypes));
  }
  void check_all_used(const std::string& kind) const {
    for (const auto& n : s_.names())
      if (!used_.count(n) && !kIgnored.count(n))
        throw std::runtime_error(s_.get(n).file->string() + ": tensor '" + n +
                                 "' is not part of an Eagle3 " + kind + " draft");
  }

 private:
  const WeightStore& s_;
  std::set<std::string> used_;
};

int64_t read_int(const TensorView& t, int64_t i) {
  if (t.dtype == DType::I64) return reinterpret_cast<const int64_t*>(t.data)[i];
  return reinterpret_cast<const int32_t*>(t.data)[i];
}

VocabMap read_vocab_map(const Eagle3Config& c, const WeightStore& s) {
  const int64_t V = c.vocab_size, Vd = c.draft_vocab_size;
  VocabMap m;
  if (!s.has("d2t")) {
    if (Vd != V)
      throw std::runtime_error(c.config_path + ": field 'draft_vocab_size': " + std::to_string(Vd) +
                               " differs from vocab_size " + std::to_string(V) + ", but " +
                               s.dir().string() +
                               " has no 'd2t' tensor mapping draft ids to target ids");
    return m;
  }
  const TensorView& d2t = s.expect("d2t", {Vd}, {DType::I64, DType::I32});
  m.draft_of_target.assign(size_t(V), -1);
  for (int64_t d = 0; d < Vd; ++d) {
    const int64_t t = d + read_int(d2t, d);
    if (t < 0 || t >= V)
      throw std::runtime_error(d2t.file->string() + ": tensor 'd2t' maps draft id " +
                               std::to_string(d) + " to target id " + std::to_string(t) +
                               ", outside the target vocabulary of " + std::to_string(V));
    if (m.draft_of_target[size_t(t)] >= 0)
      throw std::runtime_error(d2t.file->string() + ": tensor 'd2t' maps draft ids " +
                               std::to_string(m.draft_of_target[size_t(t)]) + " and " +
                               std::to_string(d) + " to the same target id " + std::to_string(t));
    m.draft_of_target[size_t(t)] = int32_t(d);
    if (t != d) m.identity = false;
  }
  if (Vd != V) m.identity = false;
  if (s.has("t2d")) {
    const TensorView& t2d = s.expect("t2d", {V}, {DType::Bool, DType::U8});
    for (int64_t t = 0; t < V; ++t)
      if ((t2d.data[t] != 0) != (m.draft_of_target[size_t(t)] >= 0))
        throw std::runtime_error(t2d.file->string() + ": tensor 't2d' marks target id " +
                                 std::to_string(t) + (t2d.data[t] ? " as" : " as not") +
                                 " in the draft vocabulary, but 'd2t' says otherwise");
  }
  if (m.identity) m.draft_of_target.clear();
  return m;
}

}  // namespace

DraftLayout inspect_draft(const Eagle3Config& c, const WeightStore& s) {
  DraftLayout l;
  const std::string name = DraftTensors(s).resolve("fc.weight");
  const TensorView& fc = s.get(name);
  const int64_t H = c.hidden_size, n = int64_t(c.aux_layer_ids.size());
  if (fc.shape.size() != 2 || fc.shape[0] != H || fc.shape[1] % H != 0 || fc.shape[1] / H < 2)
    throw std::runtime_error(fc.file->string() + ": tensor " + fc.describe() + ", expected [" +
                             std::to_string(H) +
                             ", 2H or 3H] with H = hidden_size = " + std::to_string(H));
  if (fc.shape[1] != n * H)
    throw std::runtime_error(fc.file->string() + ": tensor '" + name + "' reads " +
                             std::to_string(fc.shape[1] / H) + " x H, but " + c.config_path +
                             " names " + std::to_string(n) +
                             " layers in eagle_config.eagle_aux_hidden_state_layer_ids");
  l.fc_in = uint32_t(fc.shape[1]);
  l.vocab = read_vocab_map(c, s);
  return l;
}

Eagle3Weights load_weights(const Eagle3Config& c, const DraftLayout& layout, const WeightStore& s,
                           const WeightStore& target, Device& dev) {
  const int64_t H = c.hidden_size, F = c.intermediate_size;
  DraftTensors t(s);
  Eagle3Weights w;
  w.embed =
      to_device(dev, target.expect("model.embed_tokens.weight", {c.vocab_size, H}, kFloatTypes));
  w.fc = t.linear(dev, "fc", H, layout.fc_in);
  const std::string p = "layers.0.";
  w.input_norm = t.plain(dev, p + "input_layernorm.weight", {H});
  w.hidden_norm = t.plain(dev, p + "hidden_norm.weight", {H});
  w.post_attention_norm = t.plain(dev, p + "post_attention_layernorm.weight", {H});
  const std::string a = p + "self_attn.";
  if (c.kind == DraftKind::Mla) {
    const auto& m = c.mla;
    const int64_t Nh = m.num_attention_heads, Lq = m.q_lora_rank, Lkv = m.kv_lora_rank;
    const int64_t Dr = m.qk_rope_head_dim, Dn = m.qk_nope_head_dim, Dv = m.v_head_dim;
    deepseek_v3::MlaWeights& at = w.mla;
    if (Lq > 0) {
      at.q_a = t.linear(dev, a + "q_a_proj", Lq, 2 * H);
      at.q_a_norm = t.plain(dev, a + "q_a_layernorm.weight", {Lq});
      at.q_b = t.linear(dev, a + "q_b_proj", Nh * m.qk_head_dim(), Lq);
    } else {
      at.q = t.linear(dev, a + "q_proj", Nh * m.qk_head_dim(), 2 * H);
    }
    at.kv_a = t.linear(dev, a + "kv_a_proj_with_mqa", Lkv + Dr, 2 * H);
    at.kv_a_norm = t.plain(dev, a + "kv_a_layernorm.weight", {Lkv});
    at.kv_b = t.linear(dev, a + "kv_b_proj", Nh * (Dn + Dv), Lkv);
    at.o = t.linear(dev, a + "o_proj", H, Nh * Dv);
  } else {
    const auto& m = c.mha;
    const int64_t nq = m.num_attention_heads * m.head_dim, nkv = m.num_key_value_heads * m.head_dim;
    w.mha.q = t.linear(dev, a + "q_proj", nq, 2 * H);
    w.mha.k = t.linear(dev, a + "k_proj", nkv, 2 * H);
    w.mha.v = t.linear(dev, a + "v_proj", nkv, 2 * H);
    w.mha.o = t.linear(dev, a + "o_proj", H, nq);
  }
  w.mlp.gate = t.linear(dev, p + "mlp.gate_proj", F, H);
  w.mlp.up = t.linear(dev, p + "mlp.up_proj", F, H);
  w.mlp.down = t.linear(dev, p + "mlp.down_proj", H, F);
  w.final_norm = t.plain(dev, "norm.weight", {H});
  w.lm_head = t.plain(dev, "lm_head.weight", {c.draft_vocab_size, H});
  t.check_all_used(c.kind == DraftKind::Mla ? "MLA" : "MHA");
  return w;
}

}  // namespace clshard::eagle3_deepseek_v3
