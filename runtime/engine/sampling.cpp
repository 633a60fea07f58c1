#include "runtime/engine/sampling.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "runtime/device.h"
#include "runtime/engine/sampling_kernel.h"

namespace clshard {

namespace {

using sampling_kernel::is_greedy;

// Rows with k above this use the radix select in kernels_cl/sampling.cl instead of the private
// heap (2 KiB of ulong per work-item at 256).
constexpr uint32_t kTopKHeapMax = 256;
constexpr uint32_t kChunk = 16;  // the kernel's float16 chunk; the reference sums in its order
constexpr uint32_t kSegment = 512;  // SEGMENT of kernels_cl/sampling_common.cl
// Lanes per row of the GPU shape (kernels_cl/sampling_wg.cl; a power of two >= 32).
constexpr size_t kSampleWg = 256;
// Tokens per work-item of apply_penalties: rows x (vocab / block) work-items spread a batch over
// the cores even when few rows ask for penalties.
constexpr uint32_t kPenaltyBlock = 4096;

// top_k as the kernel takes it: 0 = no filter.
uint32_t effective_top_k(const SamplingParams& p) { return p.top_k > 0 ? uint32_t(p.top_k) : 0; }

float inverse_temperature(const SamplingParams& p) {
  return 1.0f / std::max(p.temperature, 1e-6f);
}

// Same map as order_key() in the kernel: float order (with -0 < +0) as uint order.
uint32_t order_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u ^ ((0u - (u >> 31)) | 0x80000000u);
}

float clamped(float l) { return std::fmin(l, FLT_MAX); }

// hsum16 in the kernel: halves added pairwise.
float tree_sum16(const float* v) {
  float a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) a[j] = v[j] + v[j + 8];
  for (int j = 0; j < 4; ++j) b[j] = a[j] + a[j + 4];
  for (int j = 0; j < 2; ++j) c[j] = b[j] + b[j + 2];
  return c[0] + c[1];
}

// The segment masses of w in kernels_cl/sampling_common.cl's order (a 512-token segment's chunks
// added lane by lane in id order, then the 16 lanes by tree_sum16), only tokens ranked above
// `pivot` counted unless it is 0.
std::vector<float> segment_masses(const float* logits, const std::vector<float>& w,
                                  uint64_t pivot) {
  const uint32_t vocab = uint32_t(w.size());
  std::vector<float> seg((vocab + kSegment - 1) / kSegment);
  for (uint32_t k = 0; k < seg.size(); ++k) {
    float acc[kChunk] = {};
    for (uint32_t i = k * kSegment; i < std::min(vocab, (k + 1) * kSegment); ++i)
      if (pivot == 0 || token_rank(logits, i) > pivot) acc[i % kChunk] += w[i];
    seg[k] = tree_sum16(acc);
  }
  return seg;
}

// A row's mass: the segment masses in id order.
float sum_segments(const std::vector<float>& seg) {
  float total = 0.0f;
  for (float s : seg) total += s;
  return total;
}

float uniform_draw(uint64_t seed, uint32_t round) {
  const auto x = philox4x32_10({round, 0, 0, 0}, {uint32_t(seed), uint32_t(seed >> 32)});
  return float(x[0] >> 8) * 0x1.0p-24f;
}

// What the kernel computes before drawing: the argmax and the kept masses.
struct RowMasses {
  int32_t argmax = -1;  // -1: nothing allowed
  std::vector<float> w;  // [vocab], 0 outside the kept set
  float total = 0.0f;    // chunked tree sum, as the kernel
};

RowMasses kept_masses(const float* logits, uint32_t vocab, const SamplingParams& p,
                      const uint32_t* bits) {
  RowMasses out;
  std::vector<uint64_t> ranks;
  uint64_t best = 0;
  for (uint32_t i = 0; i < vocab; ++i) {
    if (!token_allowed(logits, bits, i)) continue;
    const uint64_t rank = token_rank(logits, i);
    ranks.push_back(rank);
    if (rank > best) best = rank;
  }
  if (ranks.empty()) return out;
  out.argmax = int32_t(~uint32_t(best));
  if (is_greedy(p)) return out;

  // The k-th best rank is the top-k boundary; the kernel finds the same token by heap or radix.
  uint64_t boundary = 0;
  const uint32_t k = effective_top_k(p);
  if (k > 0 && k < ranks.size()) {
    std::nth_element(ranks.begin(), ranks.begin() + (k - 1), ranks.end(), std::greater<>());
    boundary = ranks[k - 1];
  }
  const float max_logit = clamped(logits[out.argmax]);
  const float inv_t = inverse_temperature(p);
  out.w.assign(vocab, 0.0f);
  for (uint32_t i = 0; i < vocab; ++i) {
    if (!token_allowed(logits, bits, i) || token_rank(logits, i) < boundary) continue;
    const float w = std::exp((clamped(logits[i]) - max_logit) * inv_t);
    if (w >= p.min_p) out.w[i] = w;
  }
  out.total = sum_segments(segment_masses(logits, out.w, 0));
  return out;
}

// walk_segments() in kernels_cl/sampling_common.cl: the segment masses in id order, then chunk by
// chunk and token by token inside the segment that crosses r. `pivot` 0 = unrestricted, else only
// tokens ranked above it count (their masses are the ones in `seg`).
uint32_t walk_cdf(const float* logits, const std::vector<float>& w, const std::vector<float>& seg,
                  float r, uint64_t pivot) {
  const uint32_t vocab = uint32_t(w.size());
  auto mass = [&](uint32_t i) {
    return pivot == 0 || token_rank(logits, i) > pivot ? w[i] : 0.0f;
  };
  // walk_segment() in the kernel.
  auto walk_segment = [&](uint32_t s0, float cum, float r) {
    uint32_t pick = s0;
    for (uint32_t i = s0; i < std::min(vocab, s0 + kSegment); i += kChunk) {
      const uint32_t n = std::min(kChunk, vocab - i);
      float chunk[kChunk] = {};
      for (uint32_t j = 0; j < n; ++j) chunk[j] = mass(i + j);
      const float s = tree_sum16(chunk);
      if (!(s > 0.0f)) continue;
      if (cum + s > r) {
        for (uint32_t j = 0; j < n; ++j) {
          if (chunk[j] > 0.0f) {
            pick = i + j;
            cum += chunk[j];
            if (cum > r) break;
          }
        }
        return pick;
      }
      for (uint32_t j = 0; j < n; ++j)
        if (chunk[j] > 0.0f) pick = i + j;
      cum += s;
    }
    return pick;
  };
  float cum = 0.0f;
  uint32_t last = 0;
  for (uint32_t k = 0; k < seg.size(); ++k) {
    if (seg[k] > 0.0f) last = k;
    if (cum + seg[k] > r) return walk_segment(k * kSegment, cum, r);
    cum += seg[k];
  }
  return walk_segment(last * kSegment, 0.0f, std::numeric_limits<float>::infinity());
}

std::string row_prefix(size_t r) { return "sample_tokens: row " + std::to_string(r) + ": "; }

}  // namespace

namespace sampling_kernel {

bool is_greedy(const SamplingParams& p) { return p.temperature == 0.0f || p.top_k == 1; }

RowArgs row_args(const SamplingParams& p, uint64_t step_seed, const std::string& where) {
  try {
    validate_sampling_params(p);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(where + e.what());
  }
  return {inverse_temperature(p),
          effective_top_k(p),
          p.top_p,
          p.min_p,
          uint32_t(step_seed),
          uint32_t(step_seed >> 32),
          is_greedy(p) ? 1u : 0u,
          0u};
}

// Per row: the kept masses, and for a large top-k first the keys and chunk maxima.
size_t work_floats(uint32_t vocab) { return size_t(vocab) + (vocab + kChunk - 1) / kChunk; }

cl::Kernel kernel(Device& dev, const char* name) {
  return dev.kernel("sampling.cl", name,
                    "-DTOPK_HEAP_MAX=" + std::to_string(kTopKHeapMax) +
                        " -DPENALTY_BLOCK=" + std::to_string(kPenaltyBlock) +
                        " -DMAX_TOP_LOGPROBS=" + std::to_string(kMaxTopLogprobs));
}

cl::Kernel wg_kernel(Device& dev, const char* name) {
  return dev.kernel("sampling_wg.cl", name,
                    "-DSAMPLE_WG=" + std::to_string(kSampleWg) +
                        " -DMAX_TOP_LOGPROBS=" + std::to_string(kMaxTopLogprobs));
}

void launch_rows(Device& dev, const cl::Kernel& k, size_t rows) {
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    const size_t local = kSampleWg;
    dev.launch(k, {rows * kSampleWg, 1, 1}, 1, &local);
  } else {
    dev.launch(k, {rows, 1, 1}, 1);
  }
}

void require_buffer(const cl::Mem& m, const std::string& where, const char* name, size_t rows,
                    size_t per_row, const char* unit) {
  size_t bytes = 0;
  if (m)
    cl::check(clGetMemObjectInfo(m.get(), CL_MEM_SIZE, sizeof bytes, &bytes, nullptr),
              "clGetMemObjectInfo(CL_MEM_SIZE)");
  if (bytes < rows * per_row * 4)
    throw std::invalid_argument(where + "the " + name + " buffer holds fewer than " +
                                std::to_string(rows) + " x " + std::to_string(per_row) + " " +
                                unit);
}

}  // namespace sampling_kernel

// rank = key << 32 | ~id: larger is better (logit descending, then lower id).
uint64_t token_rank(const float* logits, uint32_t i) {
  return (uint64_t(order_key(clamped(logits[i]))) << 32) | uint64_t(~i);
}

bool token_allowed(const float* logits, const uint32_t* allowed_bits, uint32_t i) {
  if (allowed_bits && !((allowed_bits[i >> 5] >> (i & 31)) & 1u)) return false;
  return logits[i] > -std::numeric_limits<float>::infinity();  // false for NaN too
}

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> key) {
  for (int i = 0; i < 10; ++i) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c[0];
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ key[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ key[1],
         uint32_t(p0)};
    key[0] += 0x9E3779B9u;
    key[1] += 0xBB67AE85u;
  }
  return c;
}

void validate_sampling_params(const SamplingParams& p) {
  // Written as !(ok) so NaN fails every check.
  if (!(p.temperature >= 0.0f) || std::isinf(p.temperature))
    throw std::invalid_argument("temperature must be finite and >= 0, got " +
                                std::to_string(p.temperature));
  if (p.top_k < -1)
    throw std::invalid_argument("top_k must be -1 (all), 0 (all) or positive, got " +
                                std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    throw std::invalid_argument("top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
    throw std::invalid_argument("min_p must be in [0, 1], got " + std::to_string(p.min_p));
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
    throw std::invalid_argument("frequency_penalty must be in [-2, 2], got " +
                                std::to_string(p.frequency_penalty));
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f))
    throw std::invalid_argument("presence_penalty must be in [-2, 2], got " +
                                std::to_string(p.presence_penalty));
  if (!(p.repetition_penalty > 0.0f) || std::isinf(p.repetition_penalty))
    throw std::invalid_argument("repetition_penalty must be finite and > 0, got " +
                                std::to_string(p.repetition_penalty));
  if (p.top_logprobs < 0 || p.top_logprobs > kMaxTopLogprobs)
    throw std::invalid_argument("top_logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) +
                                "], got " + std::to_string(p.top_logprobs));
  if (p.top_logprobs > 0 && !p.logprobs)
    throw std::invalid_argument("top_logprobs needs logprobs");
}

std::vector<int32_t> sample_tokens(Device& dev, const cl::Mem& logits, uint32_t rows,
                                   uint32_t vocab, const std::vector<SamplingParams>& params,
                                   const std::vector<uint64_t>& step_seeds,
                                   const cl::Mem* bitmask) {
  if (params.size() != rows)
    throw std::invalid_argument("sample_tokens: " + std::to_string(params.size()) +
                                " sampling params for " + std::to_string(rows) + " rows");
  if (step_seeds.size() != rows)
    throw std::invalid_argument("sample_tokens: " + std::to_string(step_seeds.size()) +
                                " step seeds for " + std::to_string(rows) + " rows");
  if (rows == 0) return {};
  if (vocab == 0) throw std::invalid_argument("sample_tokens: vocab is 0");
  const uint32_t words = bitmask_words(vocab);
  sampling_kernel::require_buffer(logits, "sample_tokens: ", "logits", rows, vocab, "floats");
  if (bitmask)
    sampling_kernel::require_buffer(*bitmask, "sample_tokens: ", "bitmask", rows, words, "words");

  std::vector<sampling_kernel::RowArgs> args(rows);
  bool any_random = false;
  for (uint32_t r = 0; r < rows; ++r) {
    args[r] = sampling_kernel::row_args(params[r], step_seeds[r], row_prefix(r));
    any_random |= !args[r].greedy;
  }

  Scratch args_buf(dev, rows * sizeof(args[0]));
  dev.write(args_buf.mem(), args.data(), rows * sizeof(args[0]));
  // Greedy batches never touch the scratch.
  Scratch work(dev, (any_random ? rows * sampling_kernel::work_floats(vocab) : 1) * sizeof(float));
  Scratch out(dev, rows * sizeof(int32_t));

  const bool wg = dev.kernel_shape() == KernelShape::WorkGroups;
  cl::Kernel k = wg ? sampling_kernel::wg_kernel(dev, "sample_rows_wg")
                    : sampling_kernel::kernel(dev, "sample_rows");
  const cl::Mem no_bitmask;
  cl::set_args(k, logits, rows, vocab, args_buf.mem(), bitmask ? *bitmask : no_bitmask, words,
               work.mem(), out.mem());
  sampling_kernel::launch_rows(dev, k, rows);
  std::vector<int32_t> tokens(rows);
  dev.read(out.mem(), tokens.data(), rows * sizeof(int32_t));
  for (uint32_t r = 0; r < rows; ++r)
    if (tokens[r] < 0)
      throw std::runtime_error(row_prefix(r) +
                               "no token is allowed (the bitmask and non-finite logits exclude "
                               "all " + std::to_string(vocab) + ")");
  return tokens;
}

// ---- penalties ----------------------------------------------------------------------------------

namespace {

// Mirrors PenaltyRowArgs in kernels_cl/sampling.cl.
struct PenaltyRowArgs {
  float frequency, presence, repetition;
  uint32_t row, slot, extra_offset, extra_count, pad;
};
static_assert(sizeof(PenaltyRowArgs) == 32);

// Mirrors LogprobRowArgs in kernels_cl/sampling.cl.
struct LogprobRowArgs {
  uint32_t row;
  int32_t token;
  uint32_t top_n;
  float inv_temperature;
  uint32_t use_mask, pad0, pad1, pad2;
};
static_assert(sizeof(LogprobRowArgs) == 32);

constexpr size_t kLogprobStride = 2 + 2 * size_t(kMaxTopLogprobs);  // floats per row of output

}  // namespace

PenaltyCounts::PenaltyCounts(Device& dev, uint32_t vocab) : dev_(&dev), vocab_(vocab) {
  if (vocab == 0) throw std::invalid_argument("PenaltyCounts: vocab is 0");
}

uint32_t PenaltyCounts::slots_in_use() const {
  return uint32_t(std::count(used_.begin(), used_.end(), true));
}

uint32_t PenaltyCounts::acquire(const std::vector<int32_t>& prompt) {
  const size_t slot_bytes = size_t(vocab_) * 4;
  auto free_slot = std::find(used_.begin(), used_.end(), false);
  uint32_t slot = uint32_t(free_slot - used_.begin());
  if (free_slot == used_.end()) {
    // Grow by doubling; the live slots are copied over on the device.
    const size_t old_slots = used_.size(), new_slots = std::max<size_t>(4, old_slots * 2);
    cl::Mem bigger = dev_->alloc(new_slots * slot_bytes);
    if (old_slots > 0)
      cl::check(clEnqueueCopyBuffer(dev_->queue(), counts_.get(), bigger.get(), 0, 0,
                                    old_slots * slot_bytes, 0, nullptr, nullptr),
                "clEnqueueCopyBuffer(penalty counts)");
    counts_ = std::move(bigger);
    used_.resize(new_slots, false);
  }
  used_[slot] = true;
  dev_->fill_zero(counts_, slot_bytes, size_t(slot) * slot_bytes);
  std::vector<int32_t> tokens;
  for (int32_t t : prompt)
    if (t >= 0 && uint32_t(t) < vocab_) tokens.push_back(t);
  if (!tokens.empty()) {
    Scratch buf(*dev_, tokens.size() * 4);
    dev_->write(buf.mem(), tokens.data(), tokens.size() * 4);
    cl::Kernel k = sampling_kernel::kernel(*dev_, "penalty_counts_prompt");
    cl::set_args(k, counts_, vocab_, slot, buf.mem(), uint32_t(tokens.size()));
    dev_->launch(k, {tokens.size(), 1, 1}, 1);
  }
  return slot;
}

void PenaltyCounts::release(uint32_t slot) {
  if (slot < used_.size()) used_[slot] = false;
}

void PenaltyCounts::add(const std::vector<std::pair<uint32_t, int32_t>>& slot_tokens) {
  std::vector<uint32_t> pairs;
  for (const auto& [slot, token] : slot_tokens) {
    if (slot >= used_.size() || !used_[slot])
      throw std::logic_error("PenaltyCounts::add: slot " + std::to_string(slot) + " is not in use");
    if (token < 0 || uint32_t(token) >= vocab_) continue;
    pairs.push_back(slot);
    pairs.push_back(uint32_t(token));
  }
  if (pairs.empty()) return;
  const uint32_t n = uint32_t(pairs.size() / 2);
  Scratch buf(*dev_, pairs.size() * 4);
  dev_->write(buf.mem(), pairs.data(), pairs.size() * 4);
  cl::Kernel k = sampling_kernel::kernel(*dev_, "penalty_counts_add");
  cl::set_args(k, counts_, vocab_, buf.mem(), n);
  dev_->launch(k, {n, 1, 1}, 1);
}

void apply_penalties(const PenaltyCounts& counts, const cl::Mem& src, const cl::Mem& dst,
                     uint32_t rows, const std::vector<PenaltyRow>& penalised) {
  Device& dev = counts.device();
  const uint32_t vocab = counts.vocab();
  const bool in_place = src.get() == dst.get();
  sampling_kernel::require_buffer(src, "apply_penalties: ", "source logits", rows, vocab,
                                  "floats");
  if (!in_place)
    sampling_kernel::require_buffer(dst, "apply_penalties: ", "destination logits", rows, vocab,
                                    "floats");
  std::vector<PenaltyRowArgs> args;
  std::vector<int32_t> extra;
  std::vector<bool> listed(rows, false);
  for (const PenaltyRow& p : penalised) {
    const std::string where = "apply_penalties: row " + std::to_string(p.row) + ": ";
    if (p.row >= rows) throw std::invalid_argument(where + "outside the " +
                                                   std::to_string(rows) + " rows");
    if (listed[p.row]) throw std::invalid_argument(where + "listed twice");
    try {
      validate_sampling_params(p.params);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(where + e.what());
    }
    listed[p.row] = true;
    args.push_back({p.params.frequency_penalty, p.params.presence_penalty,
                    p.params.repetition_penalty, p.row, p.slot, uint32_t(extra.size()),
                    uint32_t(p.extra_tokens.size()), 0});
    extra.insert(extra.end(), p.extra_tokens.begin(), p.extra_tokens.end());
  }
  // Out of place, every other row goes through as a neutral row (a copy).
  if (!in_place)
    for (uint32_t r = 0; r < rows; ++r)
      if (!listed[r]) args.push_back({0.0f, 0.0f, 1.0f, r, 0, 0, 0, 0});
  if (args.empty()) return;
  if (!counts.counts()) throw std::logic_error("apply_penalties: no slot was ever acquired");
  Scratch args_buf(dev, args.size() * sizeof(args[0]));
  dev.write(args_buf.mem(), args.data(), args.size() * sizeof(args[0]));
  if (extra.empty()) extra.push_back(-1);
  Scratch extra_buf(dev, extra.size() * 4);
  dev.write(extra_buf.mem(), extra.data(), extra.size() * 4);
  cl::Kernel k = sampling_kernel::kernel(dev, "apply_penalties");
  cl::set_args(k, src, dst, vocab, args_buf.mem(), counts.counts(), extra_buf.mem());
  dev.launch(k, {args.size(), (vocab + kPenaltyBlock - 1) / kPenaltyBlock, 1}, 2);
}

std::vector<TokenLogprobs> compute_logprobs(Device& dev, const cl::Mem& logits, uint32_t vocab,
                                            const std::vector<LogprobRow>& rows,
                                            const cl::Mem* bitmask) {
  if (rows.empty()) return {};
  if (vocab == 0) throw std::invalid_argument("compute_logprobs: vocab is 0");
  uint32_t max_row = 0;
  std::vector<LogprobRowArgs> args;
  bool any_mask = false;
  for (const LogprobRow& r : rows) {
    if (r.top_n > uint32_t(kMaxTopLogprobs))
      throw std::invalid_argument("compute_logprobs: row " + std::to_string(r.row) +
                                  ": top_logprobs must be in [0, " +
                                  std::to_string(kMaxTopLogprobs) + "], got " +
                                  std::to_string(r.top_n));
    if (r.use_bitmask && !bitmask)
      throw std::invalid_argument("compute_logprobs: row " + std::to_string(r.row) +
                                  " asks for the bitmask but none was given");
    any_mask |= r.use_bitmask;
    max_row = std::max(max_row, r.row);
    args.push_back({r.row, r.token, r.top_n, r.inv_temperature, r.use_bitmask ? 1u : 0u, 0, 0, 0});
  }
  const uint32_t words = bitmask_words(vocab);
  sampling_kernel::require_buffer(logits, "compute_logprobs: ", "logits", max_row + 1, vocab,
                                  "floats");
  if (any_mask)
    sampling_kernel::require_buffer(*bitmask, "compute_logprobs: ", "bitmask", max_row + 1, words,
                                    "words");
  Scratch args_buf(dev, args.size() * sizeof(args[0]));
  dev.write(args_buf.mem(), args.data(), args.size() * sizeof(args[0]));
  Scratch out(dev, args.size() * kLogprobStride * 4);
  const bool wg = dev.kernel_shape() == KernelShape::WorkGroups;
  cl::Kernel k = wg ? sampling_kernel::wg_kernel(dev, "row_logprobs_wg")
                    : sampling_kernel::kernel(dev, "row_logprobs");
  const cl::Mem no_bitmask;
  cl::set_args(k, logits, vocab, args_buf.mem(), any_mask ? *bitmask : no_bitmask, words,
               out.mem());
  sampling_kernel::launch_rows(dev, k, args.size());
  std::vector<float> host(args.size() * kLogprobStride);
  dev.read(out.mem(), host.data(), host.size() * 4);
  std::vector<TokenLogprobs> result(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) {
    const float* o = host.data() + j * kLogprobStride;
    TokenLogprobs& t = result[j];
    t.token = rows[j].token;
    t.logprob = o[0];
    uint32_t n;
    std::memcpy(&n, &o[1], 4);
    for (uint32_t i = 0; i < n && i < rows[j].top_n; ++i) {
      int32_t id;
      std::memcpy(&id, &o[2 + 2 * i], 4);
      t.top.push_back({id, o[3 + 2 * i]});
    }
  }
  return result;
}

std::vector<float> sampling_distribution(const float* logits, uint32_t vocab,
                                         const SamplingParams& p, const uint32_t* allowed_bits) {
  validate_sampling_params(p);
  const RowMasses m = kept_masses(logits, vocab, p, allowed_bits);
  if (m.argmax < 0) throw std::invalid_argument("sampling_distribution: no token is allowed");
  std::vector<float> dist(vocab, 0.0f);
  if (is_greedy(p)) {
    dist[m.argmax] = 1.0f;
    return dist;
  }
  std::vector<uint32_t> kept;
  for (uint32_t i = 0; i < vocab; ++i)
    if (m.w[i] > 0.0f) kept.push_back(i);
  std::sort(kept.begin(), kept.end(), [&](uint32_t a, uint32_t b) {
    return token_rank(logits, a) > token_rank(logits, b);
  });
  double total = 0.0;
  for (uint32_t i : kept) total += m.w[i];
  if (p.top_p < 1.0f) {
    // Smallest best-first prefix whose mass reaches top_p of the total.
    const double target = double(p.top_p) * total;
    double before = 0.0;
    size_t n = 0;
    while (n < kept.size() && before < target) before += m.w[kept[n++]];
    kept.resize(n);
    total = before;
  }
  for (uint32_t i : kept) dist[i] = float(m.w[i] / total);
  return dist;
}

int32_t sample_reference(const float* logits, uint32_t vocab, const SamplingParams& p,
                         uint64_t step_seed, const uint32_t* allowed_bits) {
  validate_sampling_params(p);
  const RowMasses m = kept_masses(logits, vocab, p, allowed_bits);
  if (m.argmax < 0 || is_greedy(p)) return m.argmax;
  std::vector<float> seg = segment_masses(logits, m.w, 0);
  if (p.top_p >= 1.0f)
    return int32_t(walk_cdf(logits, m.w, seg, uniform_draw(step_seed, 0) * m.total, 0));
  // The kernel's nucleus rejection loop (see kernels_cl/sampling.cl).
  const float target = p.top_p * m.total;
  float set_mass = m.total;
  uint64_t pivot = 0;
  for (uint32_t round = 0;; ++round) {
    const uint32_t j =
        walk_cdf(logits, m.w, seg, uniform_draw(step_seed, round) * set_mass, pivot);
    seg = segment_masses(logits, m.w, token_rank(logits, j));
    const float above = sum_segments(seg);
    if (above < target) return int32_t(j);
    pivot = token_rank(logits, j);
    set_mass = above;
  }
}

}  // namespace clshard
