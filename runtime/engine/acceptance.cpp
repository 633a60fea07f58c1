#include "runtime/engine/acceptance.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>

#include "runtime/device.h"
#include "runtime/engine/sampling_kernel.h"

namespace clshard {

namespace {

const std::string kWhere = "accept_drafts: ";

// Mirrors AcceptRowArgs in kernels_cl/sampling.cl.
struct AcceptRowArgs {
  sampling_kernel::RowArgs sampling;
  uint32_t logit_offset;
  uint32_t draft_offset;
  uint32_t num_drafts;
  uint32_t thinking;
};
static_assert(sizeof(AcceptRowArgs) == 48);

std::string request_prefix(size_t b) { return kWhere + "request " + std::to_string(b) + ": "; }

// Checks everything but the parameters and the buffers; returns the number of logits rows used
// (logit_offsets[B]).
uint32_t validate_batch(uint32_t vocab, const std::vector<uint32_t>& logit_offsets,
                        const std::vector<int32_t>& drafts,
                        const std::vector<uint32_t>& draft_offsets, size_t batch,
                        const std::vector<uint64_t>& step_seeds,
                        const std::vector<uint8_t>& thinking, const RelaxedAcceptance& relaxed) {
  const std::string b_str = std::to_string(batch);
  if (step_seeds.size() != batch)
    throw std::invalid_argument(kWhere + std::to_string(step_seeds.size()) + " step_seeds for " +
                                b_str + " requests (params)");
  if (!thinking.empty() && thinking.size() != batch)
    throw std::invalid_argument(kWhere + std::to_string(thinking.size()) + " thinking flags for " +
                                b_str + " requests (params); pass none or one per request");
  if (logit_offsets.size() != batch + 1)
    throw std::invalid_argument(kWhere + "logit_offsets has " +
                                std::to_string(logit_offsets.size()) + " entries for " + b_str +
                                " requests (params); it needs " + std::to_string(batch + 1));
  if (draft_offsets.size() != batch + 1)
    throw std::invalid_argument(kWhere + "draft_offsets has " +
                                std::to_string(draft_offsets.size()) + " entries for " + b_str +
                                " requests (params); it needs " + std::to_string(batch + 1));
  if (vocab == 0) throw std::invalid_argument(kWhere + "vocab is 0");
  if (relaxed.top_k < 1) throw std::invalid_argument(kWhere + "relaxed.top_k must be >= 1, got 0");
  if (!(relaxed.delta >= 0.0f) || std::isinf(relaxed.delta))
    throw std::invalid_argument(kWhere + "relaxed.delta must be finite and >= 0, got " +
                                std::to_string(relaxed.delta));
  for (size_t b = 0; b < batch; ++b) {
    if (draft_offsets[b + 1] < draft_offsets[b])
      throw std::invalid_argument(request_prefix(b) + "draft_offsets decrease (" +
                                  std::to_string(draft_offsets[b]) + " then " +
                                  std::to_string(draft_offsets[b + 1]) + ")");
    const uint64_t k = draft_offsets[b + 1] - draft_offsets[b];
    if (logit_offsets[b + 1] < logit_offsets[b] ||
        uint64_t(logit_offsets[b + 1] - logit_offsets[b]) != k + 1)
      throw std::invalid_argument(
          request_prefix(b) + "logit_offsets give " +
          std::to_string(int64_t(logit_offsets[b + 1]) - int64_t(logit_offsets[b])) +
          " verification rows for " + std::to_string(k) +
          " drafts; it needs num_drafts + 1 = " + std::to_string(k + 1));
  }
  if (draft_offsets[batch] != drafts.size())
    throw std::invalid_argument(kWhere + "draft_offsets end at " +
                                std::to_string(draft_offsets[batch]) + " but drafts has " +
                                std::to_string(drafts.size()) + " tokens");
  for (size_t j = draft_offsets[0]; j < drafts.size(); ++j)
    if (drafts[j] < 0 || uint32_t(drafts[j]) >= vocab)
      throw std::invalid_argument(
          kWhere + "drafts[" + std::to_string(j) + "] = " + std::to_string(drafts[j]) +
          " is outside the vocabulary (0.." + std::to_string(vocab - 1) + ")");
  return logit_offsets[batch];
}

// Turns the per-request (accepted, next) pairs into the result; a next token of -1 means the row
// it came from allows nothing.
AcceptanceResult make_result(const std::vector<int32_t>& pairs,
                             const std::vector<uint32_t>& logit_offsets, uint32_t vocab) {
  const size_t batch = pairs.size() / 2;
  AcceptanceResult res;
  res.num_accepted.resize(batch);
  res.next_token.resize(batch);
  for (size_t b = 0; b < batch; ++b) {
    res.num_accepted[b] = uint32_t(pairs[2 * b]);
    res.next_token[b] = pairs[2 * b + 1];
    if (res.next_token[b] < 0)
      throw std::runtime_error(request_prefix(b) + "verification row " +
                               std::to_string(pairs[2 * b]) + " (logits row " +
                               std::to_string(logit_offsets[b] + uint32_t(pairs[2 * b])) +
                               ") allows no token (the bitmask and non-finite logits exclude all " +
                               std::to_string(vocab) + ")");
  }
  return res;
}

// relaxed_accepts() in kernels_cl/sampling_common.cl, with the probabilities in double.
bool relaxed_accepts_host(const float* row, uint32_t vocab, const uint32_t* bits, uint32_t d,
                          uint32_t argmax, const RelaxedAcceptance& relaxed) {
  if (!token_allowed(row, bits, d)) return false;
  const double max_logit = std::fmin(row[argmax], FLT_MAX);
  const uint64_t d_rank = token_rank(row, d);
  double z = 0.0;
  uint32_t above = 0;
  for (uint32_t j = 0; j < vocab; ++j) {
    if (!token_allowed(row, bits, j)) continue;
    z += std::exp(double(std::fmin(row[j], FLT_MAX)) - max_logit);
    above += token_rank(row, j) > d_rank;
  }
  const double p_d = std::exp(double(std::fmin(row[d], FLT_MAX)) - max_logit) / z;
  return above < relaxed.top_k && p_d >= 1.0 / z - double(relaxed.delta);
}

}  // namespace

AcceptanceResult accept_drafts(Device& dev, const cl::Mem& logits, uint32_t vocab,
                               const std::vector<uint32_t>& logit_offsets,
                               const std::vector<int32_t>& drafts,
                               const std::vector<uint32_t>& draft_offsets,
                               const std::vector<SamplingParams>& params,
                               const std::vector<uint64_t>& step_seeds,
                               const std::vector<uint8_t>& thinking,
                               const RelaxedAcceptance& relaxed, const cl::Mem* bitmask) {
  const size_t batch = params.size();
  const uint32_t rows = validate_batch(vocab, logit_offsets, drafts, draft_offsets, batch,
                                       step_seeds, thinking, relaxed);
  std::vector<AcceptRowArgs> args(batch);
  bool any_random = false;
  for (size_t b = 0; b < batch; ++b) {
    args[b] = {sampling_kernel::row_args(params[b], step_seeds[b], request_prefix(b)),
               logit_offsets[b], draft_offsets[b], draft_offsets[b + 1] - draft_offsets[b],
               thinking.empty() ? 0u : uint32_t(thinking[b] != 0)};
    any_random |= !args[b].sampling.greedy;
  }
  if (batch == 0) return {};
  const uint32_t words = bitmask_words(vocab);
  sampling_kernel::require_buffer(logits, kWhere, "logits", rows, vocab, "floats");
  if (bitmask) sampling_kernel::require_buffer(*bitmask, kWhere, "bitmask", rows, words, "words");

  Scratch args_buf(dev, batch * sizeof(AcceptRowArgs));
  dev.write(args_buf.mem(), args.data(), batch * sizeof(AcceptRowArgs));
  Scratch drafts_buf(dev, std::max<size_t>(drafts.size(), 1) * sizeof(int32_t));
  if (!drafts.empty()) dev.write(drafts_buf.mem(), drafts.data(), drafts.size() * sizeof(int32_t));
  // One row of sampling scratch per request, reused across its positions.
  Scratch work(dev, (any_random ? batch * sampling_kernel::work_floats(vocab) : 1) * sizeof(float));
  Scratch out(dev, batch * 2 * sizeof(int32_t));

  // A work-item per request on CPUs, a work-group per request on GPUs (sampling_wg.cl): both
  // draw what sample_tokens draws in that shape, bit for bit.
  const bool wg = dev.kernel_shape() == KernelShape::WorkGroups;
  cl::Kernel k = wg ? sampling_kernel::wg_kernel(dev, "accept_rows_wg")
                    : sampling_kernel::kernel(dev, "accept_rows");
  const cl::Mem no_bitmask;
  cl::set_args(k, logits, uint32_t(batch), vocab, args_buf.mem(), drafts_buf.mem(),
               bitmask ? *bitmask : no_bitmask, words, relaxed.top_k, relaxed.delta, work.mem(),
               out.mem());
  sampling_kernel::launch_rows(dev, k, batch);
  std::vector<int32_t> pairs(batch * 2);
  dev.read(out.mem(), pairs.data(), pairs.size() * sizeof(int32_t));
  return make_result(pairs, logit_offsets, vocab);
}

AcceptanceResult accept_drafts_reference(
    const std::vector<float>& logits, uint32_t vocab, const std::vector<uint32_t>& logit_offsets,
    const std::vector<int32_t>& drafts, const std::vector<uint32_t>& draft_offsets,
    const std::vector<SamplingParams>& params, const std::vector<uint64_t>& step_seeds,
    const std::vector<uint8_t>& thinking, const RelaxedAcceptance& relaxed,
    const std::vector<uint32_t>& bitmask) {
  const size_t batch = params.size();
  const uint32_t rows = validate_batch(vocab, logit_offsets, drafts, draft_offsets, batch,
                                       step_seeds, thinking, relaxed);
  for (size_t b = 0; b < batch; ++b) {
    try {
      validate_sampling_params(params[b]);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(request_prefix(b) + e.what());
    }
  }
  const uint32_t words = bitmask_words(vocab);
  if (logits.size() < size_t(rows) * vocab)
    throw std::invalid_argument(kWhere + "the logits hold fewer than " + std::to_string(rows) +
                                " x " + std::to_string(vocab) + " floats");
  if (!bitmask.empty() && bitmask.size() < size_t(rows) * words)
    throw std::invalid_argument(kWhere + "the bitmask holds fewer than " + std::to_string(rows) +
                                " x " + std::to_string(words) + " words");

  SamplingParams argmax_params;
  argmax_params.temperature = 0.0f;
  std::vector<int32_t> pairs(batch * 2);
  for (size_t b = 0; b < batch; ++b) {
    const uint32_t k = draft_offsets[b + 1] - draft_offsets[b];
    for (uint32_t i = 0;; ++i) {
      const size_t r = size_t(logit_offsets[b]) + i;
      const float* row = &logits[r * vocab];
      const uint32_t* bits = bitmask.empty() ? nullptr : &bitmask[r * words];
      const int32_t draft = i < k ? drafts[draft_offsets[b] + i] : -1;
      int32_t t;
      if (draft >= 0 && !thinking.empty() && thinking[b]) {
        t = sample_reference(row, vocab, argmax_params, 0, bits);
        if (t >= 0 && relaxed_accepts_host(row, vocab, bits, uint32_t(draft), uint32_t(t), relaxed))
          continue;
      } else {
        t = sample_reference(row, vocab, params[b], step_seeds[b] + i, bits);
        if (draft >= 0 && t == draft) continue;
      }
      pairs[2 * b] = int32_t(i);
      pairs[2 * b + 1] = t;
      break;
    }
  }
  return make_result(pairs, logit_offsets, vocab);
}

}  // namespace clshard
