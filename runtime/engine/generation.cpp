#include "runtime/engine/generation.h"

#include <stdexcept>
#include <string>

#include "runtime/engine/draft_step.h"

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

namespace {

// Sequences spread over the model's replicas round-robin; the step holds each replica's rows in
// replica order, each replica's pages numbered in its own pool.
struct ReplicaLayout {
  std::vector<size_t> order;      // step row -> sequence index
  std::vector<size_t> row_of;     // sequence index -> step row
  StepInputs step;                // tokens empty; tables, splits, cache lengths 0
};

ReplicaLayout layout_rows(CausalLM& model, const std::vector<uint32_t>& lengths,
                          uint32_t page_size) {
  const size_t R = model.num_replicas(), B = lengths.size();
  std::vector<std::vector<size_t>> members(R);
  for (size_t i = 0; i < B; ++i) members[i % R].push_back(i);
  uint32_t max_pages = 1;
  for (const auto& m : members) {
    uint32_t total = 0;
    for (size_t i : m) total += (lengths[i] + page_size - 1) / page_size;
    max_pages = std::max(max_pages, total);
  }
  if (model.kv_page_size() != page_size || model.kv_num_pages() < max_pages)
    model.allocate_kv_cache(max_pages, page_size);
  ReplicaLayout L;
  L.row_of.resize(B);
  std::vector<StepInputs> parts;
  for (const auto& m : members) {
    StepInputs s;
    s.input_row_offsets = {0};
    std::vector<uint32_t> lens;
    for (size_t i : m) {
      L.row_of[i] = L.order.size();
      L.order.push_back(i);
      lens.push_back(lengths[i]);
      s.input_row_offsets.push_back(0);
      s.cache_lengths.push_back(0);
    }
    uint32_t ppr = 1;
    for (uint32_t len : lens) ppr = std::max(ppr, (len + page_size - 1) / page_size);
    s.pages_per_row = ppr;
    s.lookup_table.assign(lens.size() * ppr, model.kv_num_pages());
    uint32_t next = 0;
    for (size_t b = 0; b < lens.size(); ++b)
      for (uint32_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p)
        s.lookup_table[b * ppr + p] = next++;
    parts.push_back(std::move(s));
  }
  L.step = R == 1 ? parts[0] : merge_replica_steps(parts, model.kv_num_pages());
  return L;
}

// Sets the step's tokens: row b gets rows[b].
void set_tokens(StepInputs& s, const std::vector<std::vector<int32_t>>& rows) {
  s.tokens.clear();
  s.input_row_offsets = {0};
  for (const auto& r : rows) {
    s.tokens.insert(s.tokens.end(), r.begin(), r.end());
    s.input_row_offsets.push_back(uint32_t(s.tokens.size()));
  }
}

}  // namespace

std::vector<std::vector<float>> all_position_logits(CausalLM& model,
                                                    const std::vector<std::vector<int32_t>>& seqs,
                                                    uint32_t page_size) {
  std::vector<uint32_t> lengths;
  for (const auto& s : seqs) lengths.push_back(uint32_t(s.size()));
  ReplicaLayout L = layout_rows(model, lengths, page_size);
  std::vector<std::vector<int32_t>> rows;
  for (size_t i : L.order) rows.push_back(seqs[i]);
  set_tokens(L.step, rows);
  L.step.return_logits = ReturnLogits::All;
  StepOutputs out = model.forward(L.step);
  const std::vector<float> all = out.read_logits();
  std::vector<std::vector<float>> per_seq(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const size_t b = L.row_of[i];
    per_seq[i].assign(all.begin() + size_t(out.logit_offsets[b]) * out.vocab,
                      all.begin() + size_t(out.logit_offsets[b + 1]) * out.vocab);
  }
  return per_seq;
}

std::vector<std::vector<float>> all_position_draft_logits(
    CausalLM& target, DraftModel& draft, const std::vector<std::vector<int32_t>>& seqs,
    uint32_t page_size) {
  std::vector<uint32_t> lengths;
  for (const auto& s : seqs) {
    if (s.size() < 2) throw std::invalid_argument("draft logits need sequences of 2 tokens or more");
    lengths.push_back(uint32_t(s.size()));
  }
  ReplicaLayout L = layout_rows(target, lengths, page_size);
  std::vector<std::vector<int32_t>> rows;
  for (size_t i : L.order) rows.push_back(seqs[i]);
  set_tokens(L.step, rows);
  L.step.return_logits = ReturnLogits::LastToken;
  L.step.return_hidden = draft.info().target_hidden;
  L.step.hidden_layers = draft.info().target_layers;
  const StepOutputs out = target.forward(L.step);
  draft.allocate_kv_cache(target.kv_num_pages(), page_size);

  const StepInputs& m = L.step;
  DraftStep ds(target.num_replicas(), m.pages_per_row);
  for (size_t b = 0, r = 0; b < m.num_rows(); ++b) {
    while (!m.data_parallel_splits.empty() && b >= m.data_parallel_splits[r + 1]) ++r;
    const uint32_t base =
        m.data_parallel_splits.empty() ? 0 : m.input_row_offsets[m.data_parallel_splits[r]];
    const uint32_t n = m.row_length(b) - 1;
    ds.add_row(r, {rows[b].begin() + 1, rows[b].end()}, 0,
               m.lookup_table.data() + b * m.pages_per_row, n, m.input_row_offsets[b] - base);
  }
  ds.finish_splits();
  std::vector<Scratch> keep;
  const StepOutputs dout =
      draft.forward(ds.in, ds.gather(out.hidden, out.hidden_width, keep), out.hidden_width);
  const std::vector<float> all = dout.read_logits();
  std::vector<std::vector<float>> per_seq(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const size_t b = L.row_of[i];
    per_seq[i].assign(all.begin() + size_t(dout.logit_offsets[b]) * dout.vocab,
                      all.begin() + size_t(dout.logit_offsets[b + 1]) * dout.vocab);
  }
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
  ReplicaLayout L = layout_rows(model, lengths, page_size);
  std::vector<std::vector<int32_t>> rows;
  for (size_t i : L.order) rows.push_back(prompts[i]);
  StepInputs& in = L.step;
  set_tokens(in, rows);
  for (uint32_t step = 0; step < max_new_tokens; ++step) {
    StepOutputs out = model.forward(in);
    const std::vector<float> logits = out.read_logits();
    for (size_t b = 0; b < B; ++b) {
      in.cache_lengths[b] += in.row_length(b);
      rows[b] = {argmax(logits.data() + size_t(b) * out.vocab, out.vocab)};
      generated[L.order[b]].push_back(rows[b][0]);
    }
    set_tokens(in, rows);
  }
  return generated;
}

}  // namespace clshard
