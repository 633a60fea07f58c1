#include "runtime/generation.h"

#include <stdexcept>
#include <string>

namespace clshard {

int32_t argmax(const float* row, uint32_t n) {
  int32_t best = 0;
  for (uint32_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = int32_t(i);
  return best;
}

std::vector<uint32_t> plan_static_pages(CausalLM& model, const std::vector<uint32_t>& lengths,
                                        uint32_t page_size, uint32_t* pages_per_row) {
  uint32_t ppr = 1, total = 0;
  for (uint32_t len : lengths) {
    const uint32_t p = (len + page_size - 1) / page_size;
    ppr = std::max(ppr, p);
    total += p;
  }
  if (model.kv_page_size() != page_size || model.kv_num_pages() < std::max(total, 1u))
    model.allocate_kv_cache(std::max(total, 1u), page_size);
  const uint32_t null_page = model.kv_num_pages();
  std::vector<uint32_t> table(lengths.size() * ppr, null_page);
  uint32_t next = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    const uint32_t p = (lengths[b] + page_size - 1) / page_size;
    for (uint32_t i = 0; i < p; ++i) table[b * ppr + i] = next++;
  }
  *pages_per_row = ppr;
  return table;
}

std::vector<std::vector<float>> all_position_logits(CausalLM& model,
                                                    const std::vector<std::vector<int32_t>>& seqs,
                                                    uint32_t page_size) {
  StepInputs in;
  in.input_row_offsets.push_back(0);
  std::vector<uint32_t> lengths;
  for (const auto& s : seqs) {
    in.tokens.insert(in.tokens.end(), s.begin(), s.end());
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(0);
    lengths.push_back(uint32_t(s.size()));
  }
  in.lookup_table = plan_static_pages(model, lengths, page_size, &in.pages_per_row);
  in.return_logits = ReturnLogits::All;
  StepOutputs out = model.forward(in);
  const std::vector<float> all = out.read_logits();
  std::vector<std::vector<float>> per_seq;
  for (size_t b = 0; b < seqs.size(); ++b)
    per_seq.emplace_back(all.begin() + size_t(out.logit_offsets[b]) * out.vocab,
                         all.begin() + size_t(out.logit_offsets[b + 1]) * out.vocab);
  return per_seq;
}

std::vector<std::vector<int32_t>> greedy_generate(CausalLM& model,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  uint32_t max_new_tokens, uint32_t page_size) {
  const size_t B = prompts.size();
  std::vector<std::vector<int32_t>> generated(B);
  if (B == 0 || max_new_tokens == 0) return generated;
  std::vector<uint32_t> lengths;
  for (const auto& p : prompts) {
    if (p.empty()) throw std::invalid_argument("greedy_generate: empty prompt");
    lengths.push_back(uint32_t(p.size()) + max_new_tokens);
  }
  StepInputs in;
  in.lookup_table = plan_static_pages(model, lengths, page_size, &in.pages_per_row);
  in.input_row_offsets.push_back(0);
  for (const auto& p : prompts) {
    in.tokens.insert(in.tokens.end(), p.begin(), p.end());
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(0);
  }
  for (uint32_t step = 0; step < max_new_tokens; ++step) {
    StepOutputs out = model.forward(in);
    const std::vector<float> logits = out.read_logits();
    for (size_t b = 0; b < B; ++b) {
      in.cache_lengths[b] += in.row_length(b);
      generated[b].push_back(argmax(logits.data() + size_t(b) * out.vocab, out.vocab));
    }
    in.tokens.clear();
    for (size_t b = 0; b < B; ++b) {
      in.tokens.push_back(generated[b].back());
      in.input_row_offsets[b + 1] = uint32_t(b + 1);
    }
  }
  return generated;
}

}  // namespace clshard
