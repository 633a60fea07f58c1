// MLA ops (runtime/ops_mla.h) against a plain double-precision host reference of DeepSeek's
// attention (the "naive" form: decompress K-nope and V per head, attend with the shared roped
// key), on a paged cache with small shuffled pages, rows with cached and new tokens, and kv_b_proj
// in f32, bf16 and fp8 with partial 128x128 blocks. Both paths (absorbed decode, decompressed
// prefill) run on the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "models/deepseek_v3/presets.h"
#include "runtime/device.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "runtime/step_device.h"
#include "tests/kv_cache_codes.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using ops::MlaPath;
using ops::MlaShape;

// 3 heads; kv_b_proj is [3 * (32 + 24), 144] = [168, 144]: two block rows (the second partial,
// and head 2's rows straddle the boundary) and two block columns (the second 16 wide).
const MlaShape kShape{3, 144, 32, 16, 24};
constexpr float kEps = 1e-6f;
constexpr uint32_t kPageSize = 4;

std::vector<float> random_vector(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The checkpoint-side weight of kv_b_proj in one dtype, and the f32 values it stands for.
struct KvB {
  Weight w, scale;
  std::vector<float> values;  // [rows, kv_lora] as the kernels must see them
};

KvB make_kv_b(Device& dev, DType dt, std::mt19937& rng) {
  const int64_t rows = kShape.n_heads * (kShape.nope + kShape.v), cols = kShape.kv_lora;
  std::vector<float> v = random_vector(size_t(rows * cols), rng, -0.3f, 0.3f);
  KvB k;
  k.w.dtype = dt;
  k.w.shape = {rows, cols};
  k.w.name = "kv_b_proj.weight";
  if (dt == DType::F32) {
    k.values = v;
    k.w.mem = dev.alloc(v.size() * 4);
    dev.write(k.w.mem, v.data(), v.size() * 4);
  } else if (dt == DType::BF16) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
    for (size_t i = 0; i < v.size(); ++i) k.values.push_back(bf16_to_f32(b[i]));
    k.w.mem = dev.alloc(b.size() * 2);
    dev.write(k.w.mem, b.data(), b.size() * 2);
  } else {
    // Block scales that differ per block, so a wrong block index shows.
    const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
    std::vector<float> scale(size_t(rb * cb));
    for (size_t i = 0; i < scale.size(); ++i) scale[i] = 0.3f / 448.0f * float(1 + i);
    std::vector<uint8_t> q(v.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        q[size_t(r * cols + c)] =
            deepseek_v3::f32_to_e4m3(v[size_t(r * cols + c)] / scale[size_t((r / 128) * cb + c / 128)]);
    k.values.resize(v.size());
    reference::dequantize_fp8(q.data(), scale.data(), uint32_t(rows), uint32_t(cols),
                              k.values.data());
    k.w.mem = dev.alloc(q.size());
    dev.write(k.w.mem, q.data(), q.size());
    // As the loader's scan says of such codes: the kernels take their short decode
    // (MlaNanCodes covers the exact one).
    k.w.fp8_nan_free = fp8_nan_free(q.data(), q.size());
    k.scale = to_device_f32(dev, scale, {rb, cb}, "kv_b_proj.weight_scale_inv");
  }
  return k;
}

std::vector<float> inv_freqs() {
  // YaRN-like spread of frequencies (the exact table is the config's business).
  std::vector<float> f(kShape.rope / 2);
  for (size_t i = 0; i < f.size(); ++i) f[i] = std::pow(10000.0f, -2.0f * float(i) / kShape.rope) * (i >= 5 ? 0.1f : 1.0f);
  return f;
}

// RoPE of one vector of kShape.rope values at `pos` (pairs interleaved or half-split), double.
std::vector<double> rope(const float* x, uint32_t pos, const std::vector<float>& inv, bool interleaved) {
  std::vector<double> y(x, x + kShape.rope);
  const uint32_t half = kShape.rope / 2;
  for (uint32_t i = 0; i < half; ++i) {
    const float angle = float(pos) * inv[i];  // f32 angle, as the kernels and references
    const double c = std::cos(double(angle)), s = std::sin(double(angle));
    const uint32_t i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
    y[i0] = x[i0] * c - x[i1] * s;
    y[i1] = x[i0] * s + x[i1] * c;
  }
  return y;
}

// One step of a ragged batch: tokens with raw q [T, heads*qk] and raw kv [T, row].
struct Step {
  StepInputs in;
  std::vector<float> q, kv;
};

// The whole history of each request: raw kv of every position and its page table.
struct Requests {
  std::vector<std::vector<float>> kv;   // [b][pos * row]
  std::vector<uint32_t> table;          // [B, pages_per_row]
  uint32_t pages_per_row = 0, num_pages = 0;
};

class MlaOps : public ::testing::Test {
 protected:
  Device& dev = test::default_device();
  std::mt19937 rng{1234};
  std::vector<float> gamma = random_vector(kShape.kv_lora, rng, 0.5f, 1.5f);
  std::vector<float> inv = inv_freqs();
  Weight gamma_w = to_device_f32(dev, gamma, {kShape.kv_lora}, "kv_a_layernorm.weight");
  cl::Mem inv_mem;
  cl::Mem cache;
  Requests req;
  DType cache_dtype = DType::F32;  // kv_cache.dtype of `cache`
  MlaShape shape() const {
    MlaShape s = kShape;
    s.cache_dtype = cache_dtype;
    return s;
  }

  void SetUp() override {
    inv_mem = dev.alloc(inv.size() * 4);
    dev.write(inv_mem, inv.data(), inv.size() * 4);
  }

  // Requests that will reach `final_lengths`; pages handed out in a shuffled order.
  void plan_pages(const std::vector<uint32_t>& final_lengths) {
    uint32_t total = 0;
    req.pages_per_row = 0;
    for (uint32_t len : final_lengths) {
      req.pages_per_row = std::max(req.pages_per_row, (len + kPageSize - 1) / kPageSize);
      total += (len + kPageSize - 1) / kPageSize;
    }
    req.num_pages = total;
    std::vector<uint32_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0u);
    std::shuffle(ids.begin(), ids.end(), rng);
    req.table.assign(final_lengths.size() * req.pages_per_row, total /*null page*/);
    size_t next = 0;
    for (size_t b = 0; b < final_lengths.size(); ++b)
      for (uint32_t p = 0; p < (final_lengths[b] + kPageSize - 1) / kPageSize; ++p)
        req.table[b * req.pages_per_row + p] = ids[next++];
    req.kv.assign(final_lengths.size(), {});
    const size_t bytes = size_t(total + 1) * kPageSize * kShape.row() * dtype_size(cache_dtype);
    cache = dev.alloc(bytes);
    dev.fill_zero(cache, bytes);
  }

  // A step appending new_tokens[b] tokens to each request, random q and kv.
  Step make_step(const std::vector<uint32_t>& new_tokens) {
    Step s;
    s.in.input_row_offsets = {0};
    for (size_t b = 0; b < new_tokens.size(); ++b) {
      s.in.cache_lengths.push_back(uint32_t(req.kv[b].size() / kShape.row()));
      for (uint32_t i = 0; i < new_tokens[b]; ++i) s.in.tokens.push_back(int32_t(i));
      s.in.input_row_offsets.push_back(uint32_t(s.in.tokens.size()));
    }
    s.in.lookup_table = req.table;
    s.in.pages_per_row = req.pages_per_row;
    const size_t T = s.in.tokens.size();
    s.q = random_vector(T * kShape.n_heads * kShape.qk(), rng);
    s.kv = random_vector(T * kShape.row(), rng, -2.0f, 2.0f);
    return s;
  }

  // Uploads the step and runs mla_rope_store; q comes back roped. Records the kv history.
  DeviceStep store(Step& s, cl::Mem& q_dev, bool interleaved = true) {
    DeviceStep st = upload_step(dev, s.in, kPageSize, req.num_pages, 1u << 20);
    const size_t T = s.in.tokens.size();
    q_dev = dev.alloc(std::max<size_t>(s.q.size(), 1) * 4);
    cl::Mem kv_dev = dev.alloc(std::max<size_t>(s.kv.size(), 1) * 4);
    dev.write(q_dev, s.q.data(), s.q.size() * 4);
    dev.write(kv_dev, s.kv.data(), s.kv.size() * 4);
    ops::mla_rope_store(dev, q_dev, 0, kShape.n_heads * kShape.qk(), kv_dev, 0, kShape.row(),
                        gamma_w, kEps, inv_mem, 1.0f, interleaved, shape(), st.tokens, cache);
    for (size_t b = 0; b < s.in.num_rows(); ++b)
      for (uint32_t t = s.in.input_row_offsets[b]; t < s.in.input_row_offsets[b + 1]; ++t)
        req.kv[b].insert(req.kv[b].end(), s.kv.begin() + t * kShape.row(),
                         s.kv.begin() + (t + 1) * kShape.row());
    (void)T;
    return st;
  }

  // The history the path tests run over: pages for rows that will reach 6, 11 and 22 tokens, of
  // which rows 1 and 2 already hold 7 and 19 in the cache (written by an earlier step).
  void store_history() {
    plan_pages({6, 11, 22});
    Step history = make_step({0, 7, 19});
    cl::Mem q_hist;
    store(history, q_hist);
  }

  // The normalised latent of one raw kv row (double).
  std::vector<double> latent(const float* raw) const {
    double ss = 0;
    for (uint32_t i = 0; i < kShape.kv_lora; ++i) ss += double(raw[i]) * raw[i];
    const double r = 1.0 / std::sqrt(ss / kShape.kv_lora + kEps);
    std::vector<double> c(kShape.kv_lora);
    for (uint32_t i = 0; i < kShape.kv_lora; ++i) c[i] = raw[i] * r * gamma[i];
    return c;
  }

  // DeepSeek's attention for every new token of the step: out [T, heads * v].
  std::vector<double> reference(const Step& s, const std::vector<float>& kv_b, float scale) const {
    const MlaShape& S = kShape;
    const size_t T = s.in.tokens.size();
    std::vector<double> out(T * S.n_heads * S.v);
    for (size_t b = 0; b < s.in.num_rows(); ++b) {
      const uint32_t ctx = uint32_t(req.kv[b].size() / S.row());
      std::vector<std::vector<double>> lat(ctx), kpe(ctx);
      for (uint32_t j = 0; j < ctx; ++j) {
        lat[j] = latent(req.kv[b].data() + j * S.row());
        kpe[j] = rope(req.kv[b].data() + j * S.row() + S.kv_lora, j, inv, true);
        if (cache_dtype != DType::F32) {  // what a narrow cache row holds
          for (auto& x : lat[j]) x = test::cached(cache_dtype, float(x));
          for (auto& x : kpe[j]) x = test::cached(cache_dtype, float(x));
        }
      }
      for (uint32_t t = s.in.input_row_offsets[b]; t < s.in.input_row_offsets[b + 1]; ++t) {
        const uint32_t pos = s.in.cache_lengths[b] + (t - s.in.input_row_offsets[b]);
        for (uint32_t h = 0; h < S.n_heads; ++h) {
          const float* qh = s.q.data() + (t * S.n_heads + h) * S.qk();
          const auto qpe = rope(qh + S.nope, pos, inv, true);
          const float* wk = kv_b.data() + size_t(h) * (S.nope + S.v) * S.kv_lora;
          const float* wv = wk + size_t(S.nope) * S.kv_lora;
          std::vector<double> scores(pos + 1), v_rows((pos + 1) * S.v);
          double mx = -1e300;
          for (uint32_t j = 0; j <= pos; ++j) {
            double sc = 0;
            for (uint32_t d = 0; d < S.nope; ++d) {
              double k = 0;
              for (uint32_t c = 0; c < S.kv_lora; ++c) k += wk[d * S.kv_lora + c] * lat[j][c];
              sc += qh[d] * k;
            }
            for (uint32_t r = 0; r < S.rope; ++r) sc += qpe[r] * kpe[j][r];
            scores[j] = sc * scale;
            mx = std::max(mx, scores[j]);
            for (uint32_t d = 0; d < S.v; ++d) {
              double v = 0;
              for (uint32_t c = 0; c < S.kv_lora; ++c) v += wv[d * S.kv_lora + c] * lat[j][c];
              v_rows[j * S.v + d] = v;
            }
          }
          double sum = 0;
          for (auto& x : scores) sum += (x = std::exp(x - mx));
          for (uint32_t d = 0; d < S.v; ++d) {
            double o = 0;
            for (uint32_t j = 0; j <= pos; ++j) o += scores[j] * v_rows[j * S.v + d];
            out[(t * S.n_heads + h) * S.v + d] = o / sum;
          }
        }
      }
    }
    return out;
  }

  std::vector<float> run_path(MlaPath path, const Step& s, const DeviceStep& st,
                              const cl::Mem& q_dev, const KvB& k, float scale) {
    const size_t T = s.in.tokens.size();
    cl::Mem out = dev.alloc(T * kShape.n_heads * kShape.v * 4);
    const uint32_t ldq = kShape.n_heads * kShape.qk(), ldo = kShape.n_heads * kShape.v;
    const Weight* sc = k.scale ? &k.scale : nullptr;
    if (path == MlaPath::Decode) {
      ops::mla_attention_decode(dev, q_dev, 0, ldq, cache, st.tokens, k.w, sc, shape(), scale, out,
                                ldo);
    } else {
      ops::MlaPrefillPlan plan = ops::upload_mla_prefill_plan(dev, s.in, kPageSize);
      ops::mla_attention_prefill(dev, q_dev, 0, ldq, cache, st.tokens, plan, k.w, sc, shape(),
                                 scale, out, ldo);
    }
    std::vector<float> host(T * kShape.n_heads * kShape.v);
    dev.read(out, host.data(), host.size() * 4);
    return host;
  }
};

double max_abs(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}

TEST(MlaShapes, ValidateAndPathChoice) {
  EXPECT_NO_THROW(ops::validate(MlaShape{128, 512, 128, 64, 128}));  // DeepSeek-V3
  EXPECT_NO_THROW(ops::validate(kShape));
  EXPECT_THROW(ops::validate(MlaShape{4, 72, 32, 16, 32}), std::invalid_argument);
  EXPECT_THROW(ops::validate(MlaShape{4, 64, 30, 16, 32}), std::invalid_argument);
  EXPECT_THROW(ops::validate(MlaShape{0, 64, 32, 16, 32}), std::invalid_argument);
  // MAX's auto mode: decode (absorbed) while every request has at most 8 query tokens.
  EXPECT_EQ(ops::choose_mla_path(MlaPath::Auto, 1), MlaPath::Decode);
  EXPECT_EQ(ops::choose_mla_path(MlaPath::Auto, 8), MlaPath::Decode);
  EXPECT_EQ(ops::choose_mla_path(MlaPath::Auto, 9), MlaPath::Prefill);
  EXPECT_EQ(ops::choose_mla_path(MlaPath::Prefill, 1), MlaPath::Prefill);
  EXPECT_EQ(ops::choose_mla_path(MlaPath::Decode, 500), MlaPath::Decode);
}

TEST(MlaShapes, PrefillRowsFollowThePageTable) {
  StepInputs in;
  in.tokens = {1, 2, 3, 4};
  in.input_row_offsets = {0, 3, 3, 4};  // the middle row sends no token this step
  in.cache_lengths = {2, 6, 5};
  in.pages_per_row = 2;
  in.lookup_table = {7, 3, 2, 0, 1, 9};  // row 0: pages 7, 3; row 2: pages 1, 9
  const auto r = ops::mla_prefill_rows(in, 4);
  EXPECT_EQ(r.ctx_start, (std::vector<uint32_t>{0, 5, 5}));
  EXPECT_EQ(r.src_rows,
            (std::vector<uint32_t>{28, 29, 30, 31, 12, /*row 2*/ 4, 5, 6, 7, 36, 37}));
}

// The cache row is [RMSNorm(c_kv) * gamma | RoPE(k_pe)], q_pe is roped in place, q_nope untouched;
// interleaved pairs (DeepSeek) and half-split pairs (rope_interleave false); in both kernel shapes.
TEST_F(MlaOps, RopeStoreWritesNormalisedLatentAndRopedKey) {
  test::ShapeScope scope(dev, dev.kernel_shape());  // the device's own shape back afterwards
  for (const KernelShape ks : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    for (bool interleaved : {true, false}) {
      dev.set_kernel_shape(ks);
      SCOPED_TRACE(kernel_shape_name(ks));
      plan_pages({6, 3});
      Step s = make_step({6, 3});
      cl::Mem q_dev;
      store(s, q_dev, interleaved);
      std::vector<float> q(s.q.size());
      dev.read(q_dev, q.data(), q.size() * 4);
      std::vector<float> rows(size_t(req.num_pages + 1) * kPageSize * kShape.row());
      dev.read(cache, rows.data(), rows.size() * 4);
      for (size_t b = 0; b < 2; ++b)
        for (uint32_t t = s.in.input_row_offsets[b]; t < s.in.input_row_offsets[b + 1]; ++t) {
          const uint32_t pos = t - s.in.input_row_offsets[b];
          const uint32_t page = req.table[b * req.pages_per_row + pos / kPageSize];
          const float* row = rows.data() + (size_t(page) * kPageSize + pos % kPageSize) * kShape.row();
          const auto lat = latent(s.kv.data() + t * kShape.row());
          for (uint32_t i = 0; i < kShape.kv_lora; ++i) ASSERT_NEAR(row[i], lat[i], 1e-5) << i;
          const auto kpe = rope(s.kv.data() + t * kShape.row() + kShape.kv_lora, pos, inv, interleaved);
          for (uint32_t i = 0; i < kShape.rope; ++i)
            ASSERT_NEAR(row[kShape.kv_lora + i], kpe[i], 1e-5) << i;
          for (uint32_t h = 0; h < kShape.n_heads; ++h) {
            const size_t o = (t * kShape.n_heads + h) * kShape.qk();
            for (uint32_t d = 0; d < kShape.nope; ++d) ASSERT_EQ(q[o + d], s.q[o + d]);
            const auto qpe = rope(s.q.data() + o + kShape.nope, pos, inv, interleaved);
            for (uint32_t i = 0; i < kShape.rope; ++i)
              ASSERT_NEAR(q[o + kShape.nope + i], qpe[i], 1e-5) << interleaved;
          }
        }
    }
  }
}

// The kernel shapes the paths run under: the CPU shape; the GPU shape with the device's tuning;
// and the GPU shape with 8-position splits over 4-row tiles, 2 heads per work-group and 32 lanes
// (several splits per row, partial tiles), prefill tiles of 3 query tokens over 5 positions
// (tiles straddling rows and pages), and the per-token kernels at 32 lanes, 3 tokens per group.
enum class MlaShapeCase { Cpu, Gpu, GpuSplit8 };
const char* shape_case_name(MlaShapeCase c) {
  return c == MlaShapeCase::Cpu ? "cpu" : c == MlaShapeCase::Gpu ? "gpu" : "gpu_split8";
}

class MlaPaths : public MlaOps,
                 public ::testing::WithParamInterface<std::tuple<DType, MlaShapeCase>> {
 protected:
  void SetUp() override {
    MlaOps::SetUp();
    saved_shape_ = dev.kernel_shape();
    saved_tuning_ = dev.tuning();
    const MlaShapeCase c = std::get<1>(GetParam());
    dev.set_kernel_shape(c == MlaShapeCase::Cpu ? KernelShape::Chunks : KernelShape::WorkGroups);
    if (c == MlaShapeCase::Cpu) {
      // Two heads per decode work-item: two of them per token, the second with a head past the
      // last (computed on, not stored).
      KernelTuning t = saved_tuning_;
      t.mla_heads = 2;
      dev.set_tuning(t);
    }
    if (c == MlaShapeCase::GpuSplit8) {
      KernelTuning t = saved_tuning_;
      t.attn_split = 8;
      t.mla_tile = 4;
      t.mla_heads = 2;
      t.mla_wg = 32;
      t.prefill_q = 3;
      t.prefill_tile = 5;
      t.row_wg = 32;
      t.mla_row_tokens = 3;
      dev.set_tuning(t);
    }
  }
  void TearDown() override {
    dev.set_kernel_shape(saved_shape_);
    dev.set_tuning(saved_tuning_);
    MlaOps::TearDown();
  }
  DType dtype() const { return std::get<0>(GetParam()); }

 private:
  KernelShape saved_shape_ = KernelShape::Chunks;
  KernelTuning saved_tuning_;
};

// Requests with cached tokens (written by an earlier step) and new ones crossing 4-token pages:
// a multi-token step, then a one-token decode step. Both paths equal the host reference and each
// other, with kv_b_proj in the parameter's dtype.
TEST_P(MlaPaths, DecodeAndPrefillPathsMatchTheReference) {
  const KvB k = make_kv_b(dev, dtype(), rng);
  const float scale = 0.15f;
  store_history();
  for (const std::vector<uint32_t>& new_tokens : {std::vector<uint32_t>{5, 3, 2},
                                                 std::vector<uint32_t>{1, 1, 1}}) {
    Step s = make_step(new_tokens);
    cl::Mem q_dev;
    DeviceStep st = store(s, q_dev);
    const auto want = reference(s, k.values, scale);
    const auto decode = run_path(MlaPath::Decode, s, st, q_dev, k, scale);
    const auto prefill = run_path(MlaPath::Prefill, s, st, q_dev, k, scale);
    double d_dp = 0;
    for (size_t i = 0; i < decode.size(); ++i)
      d_dp = std::max(d_dp, double(std::abs(decode[i] - prefill[i])));
    EXPECT_LT(max_abs(decode, want), 2e-5) << dtype_name(dtype());
    EXPECT_LT(max_abs(prefill, want), 2e-5) << dtype_name(dtype());
    EXPECT_LT(d_dp, 2e-5) << dtype_name(dtype());
  }
}

// The CPU shape's decode prefetches the cache row two positions on (KernelTuning::weight_prefetch,
// mla.cl; on x86 PoCL): a hint only, so with it and without, tokens over 1 to 22 cached positions
// on 4-token pages (the row ahead often on the next page) give the same bits, 1 and 2 heads per
// work-item.
TEST_F(MlaOps, DecodeRowPrefetchChangesNoBit) {
  test::ShapeScope scope(dev, KernelShape::Chunks);
  const KernelTuning saved = dev.tuning();
  test::TuningScope restore(dev, saved);
  const KvB k = make_kv_b(dev, DType::BF16, rng);
  store_history();
  Step s = make_step({1, 1, 1});
  cl::Mem q_dev;
  DeviceStep st = store(s, q_dev);
  for (const uint32_t heads : {1u, 2u}) {
    auto run = [&](uint32_t prefetch) {
      KernelTuning t = saved;
      t.weight_prefetch = prefetch;
      t.mla_heads = heads;
      dev.set_tuning(t);
      EXPECT_EQ(ops::weight_prefetch_option(dev),
                prefetch && test::x86_pocl(dev) ? " -DPREFETCH_X86=1" : "");
      return run_path(MlaPath::Decode, s, st, q_dev, k, 0.15f);
    };
    const std::vector<float> off = run(0), on = run(1);
    for (size_t i = 0; i < off.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(on[i]), std::bit_cast<uint32_t>(off[i]))
          << "element " << i << ", " << heads << " heads per work-item";
  }
}

// kv_cache.dtype: bf16 and fp8. The store writes each row element as the host's rounding of its
// f32 value (bit-exact against the f32 cache's row through tests/kv_cache_codes.h, latent and roped
// key), and both paths read the narrow rows: they match the host reference computed over the
// rounded rows (bf16 1e-3, measured up to 3.7e-4; fp8 1e-2, measured up to 1.8e-6: a row element
// the host rounds to the neighbouring code from its double latent moves an output, by more for
// fp8's wider steps) and each other (2e-5, as with f32).
class MlaNarrowCache : public MlaPaths {};

TEST_P(MlaNarrowCache, StoreRoundsAndBothPathsReadTheNarrowRows) {
  const DType narrow = dtype();  // the cache's; kv_b is bf16
  const KvB k = make_kv_b(dev, DType::BF16, rng);
  const float scale = 0.15f;
  plan_pages({6, 11, 22});
  // The f32 cache's rows of the same history first, kept aside.
  Step history = make_step({0, 7, 19});
  const Requests fresh = req;
  cl::Mem q_hist;
  store(history, q_hist);
  std::vector<float> f32_rows(size_t(req.num_pages + 1) * kPageSize * kShape.row());
  dev.read(cache, f32_rows.data(), f32_rows.size() * 4);
  req = fresh;
  cache_dtype = narrow;
  const size_t bytes = size_t(req.num_pages + 1) * kPageSize * kShape.row() * dtype_size(narrow);
  cache = dev.alloc(bytes);
  dev.fill_zero(cache, bytes);
  store(history, q_hist);
  std::vector<uint8_t> rows(bytes);
  dev.read(cache, rows.data(), bytes);
  for (size_t i = 0; i < f32_rows.size(); ++i)
    ASSERT_EQ(test::stored_code(narrow, rows, i), test::cache_code(narrow, f32_rows[i]))
        << "cache element " << i;
  for (const std::vector<uint32_t>& new_tokens : {std::vector<uint32_t>{5, 3, 2},
                                                 std::vector<uint32_t>{1, 1, 1}}) {
    Step s = make_step(new_tokens);
    cl::Mem q_dev;
    DeviceStep st = store(s, q_dev);
    const auto want = reference(s, k.values, scale);
    const auto decode = run_path(MlaPath::Decode, s, st, q_dev, k, scale);
    const auto prefill = run_path(MlaPath::Prefill, s, st, q_dev, k, scale);
    double d_dp = 0;
    for (size_t i = 0; i < decode.size(); ++i)
      d_dp = std::max(d_dp, double(std::abs(decode[i] - prefill[i])));
    const double bound = narrow == DType::BF16 ? 1e-3 : 1e-2;
    EXPECT_LT(max_abs(decode, want), bound);
    EXPECT_LT(max_abs(prefill, want), bound);
    EXPECT_LT(d_dp, 2e-5);
    std::printf("[ measured ] %s cache: decode %.3g, prefill %.3g from the reference\n",
                dtype_name(narrow), max_abs(decode, want), max_abs(prefill, want));
  }
}

// FP8 NaN codes (0x7F, 0xFF) in kv_b_proj, which the load-time scan reports: a NaN in head 1's V
// row 5 makes that head's output feature 5 NaN for every token; one in head 2's K-nope row 3 makes
// a column of its absorbed query NaN, so every score and output of head 2 is NaN. Both paths; all
// other outputs equal the reference over the codes as drawn (2e-5).
class MlaNanCodes : public MlaPaths {};

TEST_P(MlaNanCodes, NanCodesReachTheirHeadsOutputsOnly) {
  KvB k = make_kv_b(dev, DType::F8_E4M3, rng);
  const uint32_t L = kShape.kv_lora, head_rows = kShape.nope + kShape.v;
  std::vector<uint8_t> codes(size_t(kShape.n_heads) * head_rows * L);
  dev.read(k.w.mem, codes.data(), codes.size());
  codes[size_t(1 * head_rows + kShape.nope + 5) * L + 7] = 0x7F;
  codes[size_t(2 * head_rows + 3) * L + 100] = 0xFF;
  dev.write(k.w.mem, codes.data(), codes.size());
  k.w.fp8_nan_free = fp8_nan_free(codes.data(), codes.size());
  ASSERT_FALSE(k.w.fp8_nan_free);
  const float scale = 0.15f;
  store_history();
  Step s = make_step({5, 3, 2});
  cl::Mem q_dev;
  DeviceStep st = store(s, q_dev);
  const auto want = reference(s, k.values, scale);
  for (MlaPath path : {MlaPath::Decode, MlaPath::Prefill}) {
    const auto got = run_path(path, s, st, q_dev, k, scale);
    for (size_t i = 0; i < got.size(); ++i) {
      const uint32_t h = uint32_t(i / kShape.v % kShape.n_heads), d = uint32_t(i % kShape.v);
      if (h == 2 || (h == 1 && d == 5))
        ASSERT_TRUE(std::isnan(got[i])) << ops::mla_path_name(path) << " output " << i;
      else
        ASSERT_NEAR(got[i], want[i], 2e-5) << ops::mla_path_name(path) << " output " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MlaNanCodes,
    ::testing::Combine(::testing::Values(DType::F8_E4M3),
                       ::testing::Values(MlaShapeCase::Cpu, MlaShapeCase::Gpu)),
    [](const auto& info) { return std::string(shape_case_name(std::get<1>(info.param))); });

INSTANTIATE_TEST_SUITE_P(Shapes, MlaNarrowCache,
                         ::testing::Combine(::testing::Values(DType::BF16, DType::F8_E4M3),
                                            ::testing::Values(MlaShapeCase::Cpu, MlaShapeCase::Gpu,
                                                              MlaShapeCase::GpuSplit8)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_cache_" +
                                  shape_case_name(std::get<1>(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(KvBDtypes, MlaPaths,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16,
                                                              DType::F8_E4M3),
                                            ::testing::Values(MlaShapeCase::Cpu, MlaShapeCase::Gpu,
                                                              MlaShapeCase::GpuSplit8)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_" +
                                  shape_case_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace clshard
