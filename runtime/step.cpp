#include "runtime/step.h"

#include <stdexcept>
#include <string>

#include "runtime/device.h"

namespace clshard {

std::vector<uint32_t> StepInputs::logit_token_indices() const {
  std::vector<uint32_t> idx;
  const size_t B = num_rows();
  for (size_t b = 0; b < B; ++b) {
    const uint32_t begin = input_row_offsets[b], end = input_row_offsets[b + 1];
    uint32_t n = 0;
    switch (return_logits) {
      case ReturnLogits::LastToken: n = end > begin ? 1 : 0; break;
      case ReturnLogits::All: n = end - begin; break;
      case ReturnLogits::Variable: n = std::min(return_n_logits, end - begin); break;
    }
    for (uint32_t i = end - n; i < end; ++i) idx.push_back(i);
  }
  return idx;
}

std::vector<float> StepOutputs::read_logits() const {
  std::vector<float> host(size_t(rows) * vocab);
  if (!host.empty()) device->read(logits, host.data(), host.size() * sizeof(float));
  return host;
}

void StepInputs::validate(uint32_t page_size, uint32_t num_pages) const {
  const size_t B = num_rows();
  if (input_row_offsets.empty() || input_row_offsets[0] != 0)
    throw std::invalid_argument("step: input_row_offsets must start at 0");
  if (input_row_offsets.back() != tokens.size())
    throw std::invalid_argument("step: input_row_offsets end at " +
                                std::to_string(input_row_offsets.back()) + " but there are " +
                                std::to_string(tokens.size()) + " tokens");
  for (size_t b = 0; b < B; ++b)
    if (input_row_offsets[b + 1] < input_row_offsets[b])
      throw std::invalid_argument("step: input_row_offsets decrease at row " + std::to_string(b));
  if (cache_lengths.size() != B)
    throw std::invalid_argument("step: cache_lengths has " + std::to_string(cache_lengths.size()) +
                                " entries for " + std::to_string(B) + " rows");
  if (lookup_table.size() != B * pages_per_row)
    throw std::invalid_argument("step: lookup_table has " + std::to_string(lookup_table.size()) +
                                " entries, expected rows x pages_per_row = " +
                                std::to_string(B * pages_per_row));
  for (size_t b = 0; b < B; ++b) {
    const uint64_t end = uint64_t(cache_lengths[b]) + row_length(b);
    if (end > uint64_t(pages_per_row) * page_size)
      throw std::invalid_argument("step: row " + std::to_string(b) + " reaches position " +
                                  std::to_string(end) + " but its table holds " +
                                  std::to_string(pages_per_row) + " pages of " +
                                  std::to_string(page_size));
    for (uint32_t p = 0; p < (end + page_size - 1) / page_size; ++p)
      if (lookup_table[b * pages_per_row + p] >= num_pages)
        throw std::invalid_argument("step: row " + std::to_string(b) + " page slot " +
                                    std::to_string(p) + " holds page " +
                                    std::to_string(lookup_table[b * pages_per_row + p]) +
                                    " (null or out of range) where a token lives");
  }
}

}  // namespace clshard
