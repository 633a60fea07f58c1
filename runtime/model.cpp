#include "runtime/model.h"

#include <stdexcept>

namespace clshard {

void ModelInfo::cap_max_seq_len(std::optional<uint32_t> max_length,
                                const std::filesystem::path& dir) {
  if (!max_length) return;
  if (*max_length > max_seq_len)
    throw std::runtime_error("model.max_length " + std::to_string(*max_length) +
                             " exceeds max_position_embeddings " + std::to_string(max_seq_len) +
                             " of " + dir.string());
  max_seq_len = *max_length;
}

void ModelInfo::set_special_tokens(const std::vector<int64_t>& eos, std::optional<int64_t> bos) {
  eos_token_ids.clear();
  for (int64_t e : eos) eos_token_ids.push_back(int32_t(e));
  if (bos) bos_token_id = int32_t(*bos);
}

}  // namespace clshard
