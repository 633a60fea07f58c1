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
    if (!logits_per_row.empty()) {
      n = std::min(logits_per_row.at(b), end - begin);
      for (uint32_t i = end - n; i < end; ++i) idx.push_back(i);
      continue;
    }
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

std::vector<float> StepOutputs::read_hidden() const {
  std::vector<float> host;
  for (const auto& h : hidden) {
    const size_t n = size_t(h.count) * hidden_width;
    host.resize(host.size() + n);
    if (n > 0) h.device->read(h.rows, host.data() + host.size() - n, n * sizeof(float));
  }
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
  if (!logits_per_row.empty() && logits_per_row.size() != B)
    throw std::invalid_argument("step: logits_per_row has " +
                                std::to_string(logits_per_row.size()) + " entries for " +
                                std::to_string(B) + " rows");
  if (!adapter_ids.empty() && adapter_ids.size() != B)
    throw std::invalid_argument("step: adapter_ids has " + std::to_string(adapter_ids.size()) +
                                " entries for " + std::to_string(B) + " rows");
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

StepInputs StepInputs::replica_step(size_t r) const {
  if (data_parallel_splits.empty()) {
    if (r != 0) throw std::out_of_range("step: replica " + std::to_string(r) + " of 1");
    return *this;
  }
  if (r + 1 >= data_parallel_splits.size())
    throw std::out_of_range("step: replica " + std::to_string(r) + " of " +
                            std::to_string(data_parallel_splits.size() - 1));
  const uint32_t b0 = data_parallel_splits[r], b1 = data_parallel_splits[r + 1];
  if (b1 < b0 || b1 > num_rows())
    throw std::invalid_argument("step: data_parallel_splits are not increasing within the rows");
  StepInputs s;
  const uint32_t t0 = input_row_offsets[b0], t1 = input_row_offsets[b1];
  s.tokens.assign(tokens.begin() + t0, tokens.begin() + t1);
  for (uint32_t b = b0; b <= b1; ++b) s.input_row_offsets.push_back(input_row_offsets[b] - t0);
  s.cache_lengths.assign(cache_lengths.begin() + b0, cache_lengths.begin() + b1);
  s.pages_per_row = pages_per_row;
  s.lookup_table.assign(lookup_table.begin() + size_t(b0) * pages_per_row,
                        lookup_table.begin() + size_t(b1) * pages_per_row);
  s.return_logits = return_logits;
  s.return_n_logits = return_n_logits;
  if (!logits_per_row.empty())
    s.logits_per_row.assign(logits_per_row.begin() + b0, logits_per_row.begin() + b1);
  s.return_hidden = return_hidden;
  s.hidden_layers = hidden_layers;
  if (!adapter_ids.empty())
    s.adapter_ids.assign(adapter_ids.begin() + b0, adapter_ids.begin() + b1);
  return s;
}

StepInputs merge_replica_steps(const std::vector<StepInputs>& steps, uint32_t null_page) {
  StepInputs m;
  m.input_row_offsets = {0};
  m.data_parallel_splits = {0};
  for (const auto& s : steps) m.pages_per_row = std::max(m.pages_per_row, s.pages_per_row);
  const bool per_row = std::any_of(steps.begin(), steps.end(),
                                   [](const StepInputs& s) { return !s.logits_per_row.empty(); });
  const bool adapters = std::any_of(steps.begin(), steps.end(),
                                    [](const StepInputs& s) { return !s.adapter_ids.empty(); });
  for (const auto& s : steps) {
    if (s.num_replicas() != 1) throw std::invalid_argument("merge_replica_steps: nested replicas");
    if (adapters) {
      if (s.adapter_ids.empty()) m.adapter_ids.insert(m.adapter_ids.end(), s.num_rows(), 0);
      else m.adapter_ids.insert(m.adapter_ids.end(), s.adapter_ids.begin(), s.adapter_ids.end());
    }
    if (per_row) {
      if (s.logits_per_row.empty() && s.num_rows() > 0)
        throw std::invalid_argument("merge_replica_steps: logits_per_row set for some steps only");
      m.logits_per_row.insert(m.logits_per_row.end(), s.logits_per_row.begin(),
                              s.logits_per_row.end());
    }
    if (s.num_rows() > 0) {
      m.return_hidden = s.return_hidden;
      m.hidden_layers = s.hidden_layers;
    }
    const uint32_t base = uint32_t(m.tokens.size());
    m.tokens.insert(m.tokens.end(), s.tokens.begin(), s.tokens.end());
    for (size_t b = 0; b < s.num_rows(); ++b) {
      m.input_row_offsets.push_back(base + s.input_row_offsets[b + 1]);
      m.cache_lengths.push_back(s.cache_lengths[b]);
      for (uint32_t p = 0; p < m.pages_per_row; ++p)
        m.lookup_table.push_back(p < s.pages_per_row ? s.lookup_table[b * s.pages_per_row + p]
                                                     : null_page);
    }
    m.data_parallel_splits.push_back(uint32_t(m.cache_lengths.size()));
    m.return_logits = s.return_logits;
    m.return_n_logits = s.return_n_logits;
  }
  return m;
}

}  // namespace clshard
