#include "models/deepseek_v3_nextn/weights.h"

#include "runtime/safetensors.h"

namespace clshard::deepseek_v3_nextn {

NextNWeights load_weights(const NextNConfig& cfg, const WeightStore& target,
                          const WeightStore& block, Device& dev, uint32_t expert_begin,
                          uint32_t expert_end) {
  const auto& c = cfg.target;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const std::vector<DType> norms = {DType::F32, DType::BF16};
  const std::string& p = cfg.prefix;
  NextNWeights w;
  w.embed = to_device(dev, target.expect("model.embed_tokens.weight", {V, H}, norms));
  w.lm_head = to_device(dev, target.expect("lm_head.weight", {V, H}, norms));
  w.enorm = to_device(dev, block.expect(p + "enorm.weight", {H}, norms));
  w.hnorm = to_device(dev, block.expect(p + "hnorm.weight", {H}, norms));
  w.eh_proj = deepseek_v3::load_linear(block, dev, p + "eh_proj", H, 2 * H);
  w.layer = deepseek_v3::load_layer(c, block, dev, p, cfg.is_moe, expert_begin, expert_end);
  const std::string head_norm = p + "shared_head.norm.weight";
  w.shared_head_norm = to_device(dev, block.has(head_norm)
                                          ? block.expect(head_norm, {H}, norms)
                                          : target.expect("model.norm.weight", {H}, norms));
  return w;
}

}  // namespace clshard::deepseek_v3_nextn
