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
  for (uint32_t i = 0; i < vocab; i += kChunk) {
    float chunk[kChunk] = {};
    for (uint32_t j = 0; j < kChunk && i + j < vocab; ++j) chunk[j] = out.w[i + j];
    out.total += tree_sum16(chunk);
  }
  return out;
}

// walk_cdf() in the kernel. `pivot` 0 = unrestricted, else only tokens ranked above it count.
uint32_t walk_cdf(const float* logits, const std::vector<float>& w, float r, uint64_t pivot) {
  const uint32_t vocab = uint32_t(w.size());
  auto mass = [&](uint32_t i) {
    return pivot == 0 || token_rank(logits, i) > pivot ? w[i] : 0.0f;
  };
  float cum = 0.0f;
  uint32_t last_chunk = 0;
  for (uint32_t i = 0; i < vocab; i += kChunk) {
    const uint32_t n = std::min(kChunk, vocab - i);
    float chunk[kChunk] = {};
    for (uint32_t j = 0; j < n; ++j) chunk[j] = mass(i + j);
    const float s = tree_sum16(chunk);
    if (s > 0.0f) last_chunk = i;
    if (cum + s > r) {
      uint32_t pick = i;
      for (uint32_t j = 0; j < n; ++j) {
        if (chunk[j] > 0.0f) {
          pick = i + j;
          cum += chunk[j];
          if (cum > r) break;
        }
      }
      return pick;
    }
    cum += s;
  }
  uint32_t pick = last_chunk;
  for (uint32_t j = 0; j < kChunk && last_chunk + j < vocab; ++j)
    if (mass(last_chunk + j) > 0.0f) pick = last_chunk + j;
  return pick;
}

// mass_above() in the kernel: per-lane sums, then the tree.
float mass_above(const float* logits, const std::vector<float>& w, uint64_t pivot) {
  float acc[kChunk] = {};
  for (uint32_t i = 0; i < w.size(); ++i)
    if (token_rank(logits, i) > pivot) acc[i % kChunk] += w[i];
  return tree_sum16(acc);
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
  return dev.kernel("sampling.cl", name, "-DTOPK_HEAP_MAX=" + std::to_string(kTopKHeapMax));
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

  cl::Kernel k = sampling_kernel::kernel(dev, "sample_rows");
  const cl::Mem no_bitmask;
  cl::set_args(k, logits, rows, vocab, args_buf.mem(), bitmask ? *bitmask : no_bitmask, words,
               work.mem(), out.mem());
  dev.launch(k, {rows, 1, 1}, 1);
  std::vector<int32_t> tokens(rows);
  dev.read(out.mem(), tokens.data(), rows * sizeof(int32_t));
  for (uint32_t r = 0; r < rows; ++r)
    if (tokens[r] < 0)
      throw std::runtime_error(row_prefix(r) +
                               "no token is allowed (the bitmask and non-finite logits exclude "
                               "all " + std::to_string(vocab) + ")");
  return tokens;
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
  if (p.top_p >= 1.0f)
    return int32_t(walk_cdf(logits, m.w, uniform_draw(step_seed, 0) * m.total, 0));
  // The kernel's nucleus rejection loop (see kernels_cl/sampling.cl).
  const float target = p.top_p * m.total;
  float set_mass = m.total;
  uint64_t pivot = 0;
  for (uint32_t round = 0;; ++round) {
    const uint32_t j = walk_cdf(logits, m.w, uniform_draw(step_seed, round) * set_mass, pivot);
    const float above = mass_above(logits, m.w, token_rank(logits, j));
    if (above < target) return int32_t(j);
    pivot = token_rank(logits, j);
    set_mass = above;
  }
}

}  // namespace clshard
