// Each kernel against plain C++ on random inputs, odd sizes included.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/safetensors.h"
#include "tests/kv_cache_codes.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using test::download;
using test::random_vec;
using test::upload;

// A weight in the given dtype, and the f32 values the kernel must see (bf16-rounded).
Weight make_weight(Device& dev, std::vector<float>& values, std::vector<int64_t> shape, DType dt) {
  Weight w;
  w.dtype = dt;
  w.shape = shape;
  w.name = "test";
  if (dt == DType::BF16 || dt == DType::F16) {
    std::vector<uint16_t> b(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      b[i] = dt == DType::BF16 ? f32_to_bf16(values[i]) : f32_to_f16(values[i]);
      values[i] = dt == DType::BF16 ? bf16_to_f32(b[i]) : f16_to_f32(b[i]);
    }
    w.mem = dev.alloc(b.size() * 2);
    dev.write(w.mem, b.data(), b.size() * 2);
  } else {
    w.mem = upload(dev, values);
  }
  return w;
}

struct LinearCase {
  uint32_t M, N, K;
  DType dt;
  KernelShape shape = KernelShape::Chunks;  // WorkGroups: the GPU-shaped variant, run on PoCL
};

using test::ShapeScope;

class LinearKernel : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LinearKernel, MatchesCpp) {
  const auto [M, N, K, dt, shape] = GetParam();
  Device& dev = test::default_device();
  ShapeScope scope(dev, shape);
  auto x = random_vec(size_t(M) * K, 1);
  auto wv = random_vec(size_t(N) * K, 2);
  auto bv = random_vec(N, 3);
  auto y0 = random_vec(size_t(M) * N, 4);
  Weight w = make_weight(dev, wv, {N, K}, dt);
  Weight b = make_weight(dev, bv, {N}, dt);
  cl::Mem xm = upload(dev, x);
  // Plain product with bias.
  cl::Mem ym = dev.alloc(size_t(M) * N * 4);
  ops::linear(dev, xm, 0, K, w, &b, ym, 0, N, M, 0.5f, false);
  // Accumulating into an existing y without bias.
  cl::Mem ya = upload(dev, y0);
  ops::linear(dev, xm, 0, K, w, nullptr, ya, 0, N, M, 2.0f, true);
  auto y = download(dev, ym, size_t(M) * N);
  auto yacc = download(dev, ya, size_t(M) * N);
  double worst = 0;
  for (uint32_t m = 0; m < M; ++m)
    for (uint32_t n = 0; n < N; ++n) {
      double dot = 0;
      for (uint32_t k = 0; k < K; ++k) dot += double(x[m * K + k]) * wv[n * K + k];
      const double tol = 1e-5 * std::sqrt(double(K)) * 4;
      worst = std::max(worst, std::abs(y[m * N + n] - 0.5 * (dot + bv[n])));
      ASSERT_NEAR(y[m * N + n], 0.5 * (dot + bv[n]), tol) << m << "," << n;
      ASSERT_NEAR(yacc[m * N + n], y0[m * N + n] + 2.0 * dot, 2 * tol) << m << "," << n;
    }
  RecordProperty("max_abs_err", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearKernel,
    ::testing::Values(LinearCase{1, 1, 1, DType::F32}, LinearCase{1, 37, 100, DType::F32},
                      LinearCase{3, 64, 64, DType::F32}, LinearCase{4, 5, 17, DType::F32},
                      LinearCase{7, 33, 129, DType::F32}, LinearCase{65, 130, 48, DType::F32},
                      LinearCase{1, 37, 100, DType::BF16}, LinearCase{5, 67, 257, DType::BF16},
                      LinearCase{64, 128, 64, DType::BF16}, LinearCase{1, 37, 100, DType::F16},
                      LinearCase{6, 19, 131, DType::F16},
                      LinearCase{1, 37, 100, DType::F32, KernelShape::WorkGroups},
                      LinearCase{5, 67, 257, DType::BF16, KernelShape::WorkGroups},
                      LinearCase{9, 20, 300, DType::F16, KernelShape::WorkGroups}));

// One row's outputs do not depend on the rows launched beside it: a decode launch (one-row tiles,
// the columns in turn while K <= gemv_stream_k, else side by side) gives the bits of the same row
// inside a 2-row and a 6-row launch (4-row tiles). Plain linear, q/k/v side by side and gate/up +
// SiLU, f32 and bf16, K on both sides of gemv_stream_k (4096 in the EPYC's row, 8192 in the
// default CPU row) and off the 16-wide loads.
struct RowsCase {
  uint32_t K;
  DType dt;
};
class LinearRowsAgree : public ::testing::TestWithParam<RowsCase> {};

TEST_P(LinearRowsAgree, OneRowLaunchGivesTheBitsOfTheBatchedLaunch) {
  const auto [K, dt] = GetParam();
  Device& dev = test::default_device();
  ShapeScope scope(dev, KernelShape::Chunks);
  const uint32_t N = 21, Nk = 6, Nv = 7, F = 9, M = 6;
  auto x = random_vec(size_t(M) * K, 11);
  auto wv = random_vec(size_t(N) * K, 12), kv = random_vec(size_t(Nk) * K, 13),
       vv = random_vec(size_t(Nv) * K, 14), gv = random_vec(size_t(F) * K, 15),
       uv = random_vec(size_t(F) * K, 16);
  Weight w = make_weight(dev, wv, {N, K}, dt), wk = make_weight(dev, kv, {Nk, K}, dt),
         wvv = make_weight(dev, vv, {Nv, K}, dt), gate = make_weight(dev, gv, {F, K}, dt),
         up = make_weight(dev, uv, {F, K}, dt);
  cl::Mem xm = upload(dev, x);
  const uint32_t Q = N + Nk + Nv;
  // Each op writes rows [0, rows) of its output for the x rows starting at row `first`.
  auto run = [&](uint32_t first, uint32_t rows) {
    cl::Mem y = dev.alloc(size_t(rows) * N * 4), q = dev.alloc(size_t(rows) * Q * 4),
            g = dev.alloc(size_t(rows) * F * 4);
    ops::linear(dev, xm, first * K, K, w, nullptr, y, 0, N, rows);
    ops::linear_fused(dev, xm, first * K, K, nullptr, nullptr, 0.0f, {&w, &wk, &wvv}, q, 0, Q,
                      rows);
    ops::linear_swiglu(dev, xm, first * K, K, nullptr, 0.0f, gate, up, g, 0, F, rows);
    return std::array<std::vector<float>, 3>{download(dev, y, size_t(rows) * N),
                                             download(dev, q, size_t(rows) * Q),
                                             download(dev, g, size_t(rows) * F)};
  };
  const auto all = run(0, M), two = run(3, 2);
  const uint32_t widths[3] = {N, Q, F};
  const char* names[3] = {"linear", "q/k/v", "gate/up"};
  for (uint32_t m = 0; m < M; ++m) {
    const auto one = run(m, 1);
    for (int op = 0; op < 3; ++op)
      for (uint32_t n = 0; n < widths[op]; ++n) {
        const float batched = all[op][size_t(m) * widths[op] + n];
        ASSERT_EQ(std::bit_cast<uint32_t>(one[op][n]), std::bit_cast<uint32_t>(batched))
            << names[op] << " row " << m << " column " << n << ": " << one[op][n] << " vs "
            << batched;
        if (m == 3 || m == 4) {
          ASSERT_EQ(std::bit_cast<uint32_t>(two[op][size_t(m - 3) * widths[op] + n]),
                    std::bit_cast<uint32_t>(batched))
              << names[op] << " (2-row launch) row " << m << " column " << n;
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Widths, LinearRowsAgree,
                         ::testing::Values(RowsCase{37, DType::F32}, RowsCase{300, DType::BF16},
                                           RowsCase{2048, DType::BF16}, RowsCase{4103, DType::BF16},
                                           RowsCase{8200, DType::BF16}),
                         [](const ::testing::TestParamInfo<RowsCase>& i) {
                           return "K" + std::to_string(i.param.K) + "_" + dtype_name(i.param.dt);
                         });

// The CPU shape's next-tile weight prefetch (KernelTuning::weight_prefetch, linear_tile.cl) is a
// hint only: linear, q/k/v side by side, and gate/up + SiLU give the same bits with it on and off,
// where a work-item owns several column tiles (N = 2051: the prefetch runs, and past the weight's
// end at the last tile), in 4-row tiles (where it runs), one-row tiles side by side (K = 4103 >
// gemv_stream_k; built with the option, not prefetching) and one-row tiles in turn (K = 300,
// where gate/up prefetches), f32 / bf16 / f16 weights. So is the stream prefetch of one-row tiles
// in turn (KernelTuning::gemv_stream_prefetch): 8 KiB ahead and 64 bytes (the next line) give
// the bits of neither prefetch, with and without the L1 prefetch beside it
// (KernelTuning::stream_prefetch_l1, 1 KiB ahead), which alone gives them too. And those tiles'
// rows read two at a time (KernelTuning::gemv_row_pairs), with either prefetch or none, give the
// bits of one at a time.
struct PrefetchCase {
  uint32_t M, K;
  DType dt;
};
class LinearPrefetch : public ::testing::TestWithParam<PrefetchCase> {};

TEST_P(LinearPrefetch, PrefetchesChangeNoBit) {
  const auto [M, K, dt] = GetParam();
  Device& dev = test::default_device();
  ShapeScope scope(dev, KernelShape::Chunks);
  const KernelTuning saved = dev.tuning();
  test::TuningScope restore(dev, saved);  // run() below sets its own
  const uint32_t N = 2051, Nk = 5, F = 1027;
  auto x = random_vec(size_t(M) * K, 21), wv = random_vec(size_t(N) * K, 22),
       kv = random_vec(size_t(Nk) * K, 23), gv = random_vec(size_t(F) * K, 24),
       uv = random_vec(size_t(F) * K, 25), nv = random_vec(K, 26), y0 = random_vec(size_t(M) * N, 27);
  Weight w = make_weight(dev, wv, {N, K}, dt), wk = make_weight(dev, kv, {Nk, K}, dt),
         gate = make_weight(dev, gv, {F, K}, dt), up = make_weight(dev, uv, {F, K}, dt),
         norm = make_weight(dev, nv, {K}, dt);
  cl::Mem xm = upload(dev, x);
  const uint32_t Q = N + Nk;
  auto run = [&](uint32_t prefetch, uint32_t ahead, uint32_t pairs, uint32_t ahead_l1) {
    KernelTuning t = saved;
    t.weight_prefetch = prefetch;
    t.stream_prefetch = 0;  // FP8's, not these tiles'
    t.stream_prefetch_l1 = ahead_l1;
    t.gemv_stream_prefetch = ahead;
    t.gemv_row_pairs = pairs;
    dev.set_tuning(t);
    EXPECT_EQ(ops::weight_prefetch_option(dev),
              prefetch && test::x86_pocl(dev) ? " -DPREFETCH_X86=1" : "");
    std::string stream;
    if ((ahead || ahead_l1) && test::x86_pocl(dev)) {
      stream = " -DPREFETCH_X86=1";
      if (ahead_l1) stream += " -DSTREAM_PREFETCH_L1=" + std::to_string(ahead_l1);
      if (ahead) stream += " -DGEMV_STREAM_PREFETCH=" + std::to_string(ahead);
    }
    EXPECT_EQ(ops::columns_in_turn_option(dev),
              std::string(" -DCOLUMNS_IN_TURN=1") + (pairs ? " -DGEMV_ROW_PAIRS=1" : "") + stream);
    cl::Mem y = upload(dev, y0), q = dev.alloc(size_t(M) * Q * 4), g = dev.alloc(size_t(M) * F * 4);
    ops::linear(dev, xm, 0, K, w, nullptr, y, 0, N, M, 0.5f, true);
    ops::linear_fused(dev, xm, 0, K, nullptr, &norm, 1e-5f, {&w, &wk}, q, 0, Q, M);
    ops::linear_swiglu(dev, xm, 0, K, &norm, 1e-5f, gate, up, g, 0, F, M);
    return std::array<std::vector<float>, 3>{download(dev, y, size_t(M) * N),
                                             download(dev, q, size_t(M) * Q),
                                             download(dev, g, size_t(M) * F)};
  };
  const auto off = run(0, 0, 0, 0);
  const char* names[3] = {"linear", "q/k/v", "gate/up"};
  const std::array<uint32_t, 4> variants[] = {
      {1, 0, 0, 0},       {1, 8192, 0, 0},    {0, 8192, 0, 0}, {1, 64, 0, 0},
      {0, 0, 1, 0},       {1, 0, 1, 0},       {1, 8192, 1, 0}, {0, 64, 1, 0},
      {1, 8192, 0, 1024}, {0, 8192, 1, 1024}, {0, 0, 0, 1024}};
  for (const auto& [prefetch, ahead, pairs, ahead_l1] : variants) {
    const auto on = run(prefetch, ahead, pairs, ahead_l1);
    for (int op = 0; op < 3; ++op) {
      ASSERT_EQ(on[op].size(), off[op].size());
      for (size_t i = 0; i < on[op].size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(on[op][i]), std::bit_cast<uint32_t>(off[op][i]))
            << names[op] << " element " << i << ": " << on[op][i] << " vs " << off[op][i]
            << " (weight_prefetch " << prefetch << ", gemv_stream_prefetch " << ahead
            << ", gemv_row_pairs " << pairs << ", stream_prefetch_l1 " << ahead_l1 << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tiles, LinearPrefetch,
                         ::testing::Values(PrefetchCase{1, 4103, DType::BF16},
                                           PrefetchCase{1, 300, DType::BF16},
                                           PrefetchCase{6, 300, DType::BF16},
                                           PrefetchCase{9, 77, DType::F32},
                                           PrefetchCase{5, 130, DType::F16}),
                         [](const ::testing::TestParamInfo<PrefetchCase>& i) {
                           return "M" + std::to_string(i.param.M) + "_K" +
                                  std::to_string(i.param.K) + "_" + dtype_name(i.param.dt);
                         });

// Decode batches' tile rows (KernelTuning::linear_batch_tm: 8-row tiles where 4-row ones were)
// change no bit: linear, q/k/v side by side and gate/up + SiLU over f32, bf16 and f16 weights give
// the same outputs with tiles of 4 and of 8 rows at M = 8 (one tile), 13 (a last tile of 5 rows
// computed on 8), 40 and 64 (a work-item's rows), and 70 (past them: 4-row tiles either way,
// where the field must not reach), N and F off the tile widths.
TEST(LinearBatchTiles, TileRowsChangeNoBit) {
  Device& dev = test::default_device();
  ShapeScope scope(dev, KernelShape::Chunks);
  const KernelTuning saved = dev.tuning();
  test::TuningScope restore(dev, saved);
  const uint32_t K = 131, N = 23, Nk = 5, F = 9, Q = N + Nk;
  for (const DType dt : {DType::F32, DType::BF16, DType::F16}) {
    auto wv = random_vec(size_t(N) * K, 31), kv = random_vec(size_t(Nk) * K, 32),
         gv = random_vec(size_t(F) * K, 33), uv = random_vec(size_t(F) * K, 34);
    Weight w = make_weight(dev, wv, {N, K}, dt), wk = make_weight(dev, kv, {Nk, K}, dt),
           gate = make_weight(dev, gv, {F, K}, dt), up = make_weight(dev, uv, {F, K}, dt);
    for (const uint32_t M : {8u, 13u, 40u, 64u, 70u}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " M=" + std::to_string(M));
      cl::Mem xm = upload(dev, random_vec(size_t(M) * K, 35 + M));
      auto run = [&](uint32_t tm) {
        KernelTuning t = saved;
        t.linear_batch_tm = tm;
        dev.set_tuning(t);
        cl::Mem y = dev.alloc(size_t(M) * N * 4), q = dev.alloc(size_t(M) * Q * 4),
                g = dev.alloc(size_t(M) * F * 4);
        ops::linear(dev, xm, 0, K, w, nullptr, y, 0, N, M);
        ops::linear_fused(dev, xm, 0, K, nullptr, nullptr, 0.0f, {&w, &wk}, q, 0, Q, M);
        ops::linear_swiglu(dev, xm, 0, K, nullptr, 0.0f, gate, up, g, 0, F, M);
        return std::array<std::vector<float>, 3>{download(dev, y, size_t(M) * N),
                                                 download(dev, q, size_t(M) * Q),
                                                 download(dev, g, size_t(M) * F)};
      };
      const auto four = run(4), eight = run(8);
      // The field reaches the tiles from 8 rows to 64, not past them.
      EXPECT_EQ(ops::linear_tile_rows(dev, M), M <= 64 ? 8u : 4u);
      const char* names[3] = {"linear", "q/k/v", "gate/up"};
      for (int op = 0; op < 3; ++op)
        for (size_t i = 0; i < four[op].size(); ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(eight[op][i]), std::bit_cast<uint32_t>(four[op][i]))
              << names[op] << " element " << i << ": " << eight[op][i] << " vs " << four[op][i];
    }
  }
}

// The CPU-shape attention tiles prefetch the next 16-position block's keys and values
// (weight_prefetch, attention.cl; on x86 PoCL): a hint only, so with it and without, decode tokens
// of three rows at positions 5, 40 and 70 over 16-slot pages (blocks ahead on the next page, and
// a last block shorter than 16), and one row's 30-token prefill, give the same bits, f32 and bf16
// caches.
TEST(AttentionPrefetch, NextBlockPrefetchChangesNoBit) {
  Device& dev = test::default_device();
  ShapeScope scope(dev, KernelShape::Chunks);
  const KernelTuning saved = dev.tuning();
  test::TuningScope restore(dev, saved);
  const uint32_t nh = 8, nkv = 2, hd = 64, page = 16, ppr = 5, npages = 16;
  const std::vector<uint32_t> lut = {3, 9, 1, 14, 6, 0, 11, 4, 15, 7, 2, 13, 5, 10, 8};
  for (const DType cdt : {DType::F32, DType::BF16}) {
    const size_t esz = dtype_size(cdt), elems = size_t(npages + 1) * 2 * page * nkv * hd;
    const std::vector<float> v = random_vec(elems, 90);
    std::vector<uint8_t> bytes(elems * esz);
    for (size_t i = 0; i < elems; ++i) {
      if (cdt == DType::F32) {
        std::memcpy(bytes.data() + i * 4, &v[i], 4);
      } else {
        const uint16_t h = uint16_t(test::cache_code(cdt, v[i]));
        std::memcpy(bytes.data() + i * 2, &h, 2);
      }
    }
    cl::Mem cm = dev.alloc(bytes.size()), lm = upload(dev, lut);
    dev.write(cm, bytes.data(), bytes.size());
    for (const bool prefill : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(cdt)) + (prefill ? " prefill" : " decode"));
      std::vector<uint32_t> row, pos;
      if (prefill) {
        for (uint32_t p = 0; p < 30; ++p) row.push_back(1), pos.push_back(p);
      } else {
        row = {0, 1, 2};
        pos = {5, 40, 70};
      }
      const uint32_t T = uint32_t(row.size()), ld = nh * hd;
      cl::Mem qm = upload(dev, random_vec(size_t(T) * ld, 91)), rm = upload(dev, row),
              pm = upload(dev, pos);
      ops::StepTokens st{rm, pm, lm, T, ppr, page};
      st.max_query_len = prefill ? T : 1;
      auto run = [&](uint32_t prefetch) {
        KernelTuning t = saved;
        t.weight_prefetch = prefetch;
        dev.set_tuning(t);
        cl::Mem om = dev.alloc(size_t(T) * ld * 4);
        ops::paged_attention(dev, qm, ld, cm, st, nh, nkv, hd, 0.125f, om, ld, cdt);
        return download(dev, om, size_t(T) * ld);
      };
      const std::vector<float> off = run(0), on = run(1);
      for (size_t i = 0; i < off.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(on[i]), std::bit_cast<uint32_t>(off[i]))
            << "element " << i;
    }
  }
}

// A strided view: x rows inside a wider buffer at an offset, y written into a column block — in
// both kernel shapes.
class LinearStrides : public test::BothShapes {};
TEST_P(LinearStrides, OffsetsAndStrides) {
  Device& dev = test::default_device();
  const uint32_t M = 6, N = 10, K = 20, ldx = 31, xoff = 5, ldy = 25, yoff = 7;
  auto xbig = random_vec(size_t(M) * ldx + xoff, 7);
  auto wv = random_vec(size_t(N) * K, 8);
  Weight w = make_weight(dev, wv, {N, K}, DType::F32);
  cl::Mem xm = upload(dev, xbig);
  std::vector<float> ybig(size_t(M) * ldy + yoff, -7.0f);
  cl::Mem ym = upload(dev, ybig);
  ops::linear(dev, xm, xoff, ldx, w, nullptr, ym, yoff, ldy, M);
  auto y = download(dev, ym, ybig.size());
  for (uint32_t m = 0; m < M; ++m)
    for (uint32_t c = 0; c < ldy; ++c) {
      const size_t idx = yoff + size_t(m) * ldy + c;
      if (c < N) {
        double dot = 0;
        for (uint32_t k = 0; k < K; ++k) dot += double(xbig[xoff + m * ldx + k]) * wv[c * K + k];
        EXPECT_NEAR(y[idx], dot, 1e-4);
      } else if (idx < y.size()) {
        EXPECT_EQ(y[idx], -7.0f) << "wrote outside the column block";
      }
    }
  EXPECT_EQ(y[0], -7.0f);
}
INSTANTIATE_TEST_SUITE_P(Shapes, LinearStrides, test::both_shapes(), test::ShapeParamName());

// The GPU shape's lane steps of VW weights (KernelTuning::linear_vector, wg_dots.cl): linear_wg's
// output equals, bit for bit, the host's emulation of its order: lane l's fma chain over the
// columns VW l + j + s VW WG (j < VW) for the whole steps, then l, l + WG, ... over the tail, then
// the local tree (halves, quarters, ...). f32 / bf16 / f16 weights; K with whole steps and a
// tail, and K below one step; x read from an aligned and from an unaligned offset (single vector
// loads or vloadn), the same bits; 1, 2 and 5 rows (groups of fewer rows than linear_rows, and a
// partial second group); q/k/v side by side and gate/up + SiLU equal linear's bits.
struct VectorCase {
  uint32_t K;
  DType dt;
};
class LinearVector : public ::testing::TestWithParam<VectorCase> {};
TEST_P(LinearVector, LaneStepsSumInTheStatedOrder) {
  const auto [K, dt] = GetParam();
  Device& dev = test::default_device();
  ShapeScope scope(dev, KernelShape::WorkGroups);
  const uint32_t M = 5, N = 7, F = 3;  // M = 5: a second, partial group of rows
  auto x = random_vec(size_t(M) * K + 1, 41), wv = random_vec(size_t(N) * K, 42),
       gv = random_vec(size_t(F) * K, 43), uv = random_vec(size_t(F) * K, 44);
  Weight w = make_weight(dev, wv, {N, K}, dt), gate = make_weight(dev, gv, {F, K}, dt),
         up = make_weight(dev, uv, {F, K}, dt);
  cl::Mem xm = upload(dev, x);
  const uint32_t wg = dev.tuning().linear_wg;
  for (uint32_t vw : {1u, 2u, 4u, 8u}) {
    SCOPED_TRACE("VW " + std::to_string(vw));
    KernelTuning t = dev.tuning();
    t.linear_vector = vw;
    test::TuningScope tuned(dev, t);
    // The host's emulation, x's rows starting at x0.
    auto expected = [&](const std::vector<float>& wr, uint32_t n, uint32_t m, uint32_t x0) {
      std::vector<float> lanes(wg, 0.0f);
      const uint32_t span = wg * vw, whole = K / span * span;
      for (uint32_t l = 0; l < wg; ++l) {
        float acc = 0.0f;
        for (uint32_t k = l * vw; k < whole; k += span)
          for (uint32_t j = 0; j < vw; ++j)
            acc = std::fma(x[x0 + size_t(m) * K + k + j], wr[size_t(n) * K + k + j], acc);
        for (uint32_t k = whole + l; k < K; k += wg)
          acc = std::fma(x[x0 + size_t(m) * K + k], wr[size_t(n) * K + k], acc);
        lanes[l] = acc;
      }
      for (uint32_t stride = wg / 2; stride > 0; stride /= 2)
        for (uint32_t l = 0; l < stride; ++l) lanes[l] += lanes[l + stride];
      return lanes[0];
    };
    // 1 and 2 rows: fewer than a group's linear_rows (ops::wg_linear_rows), the same sums.
    for (uint32_t rows : {1u, 2u, M})
      for (uint32_t x0 : {0u, 1u}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + ", x offset " + std::to_string(x0));
        cl::Mem y = dev.alloc(size_t(M) * N * 4), q = dev.alloc(size_t(M) * 2 * N * 4),
                g = dev.alloc(size_t(M) * F * 4);
        ops::linear(dev, xm, x0, K, w, nullptr, y, 0, N, rows);
        ops::linear_fused(dev, xm, x0, K, nullptr, nullptr, 0.0f, {&w, &w}, q, 0, 2 * N, rows);
        ops::linear_swiglu(dev, xm, x0, K, nullptr, 0.0f, gate, up, g, 0, F, rows);
        const auto yv = download(dev, y, size_t(M) * N), qv = download(dev, q, size_t(M) * 2 * N),
                   gu = download(dev, g, size_t(M) * F);
        for (uint32_t m = 0; m < rows; ++m) {
          for (uint32_t n = 0; n < N; ++n) {
            const float want = expected(wv, n, m, x0), got = yv[size_t(m) * N + n];
            ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want))
                << "row " << m << " column " << n << ": " << got << " vs " << want;
            for (uint32_t half : {0u, 1u})
              ASSERT_EQ(std::bit_cast<uint32_t>(qv[size_t(m) * 2 * N + half * N + n]),
                        std::bit_cast<uint32_t>(want))
                  << "q/k/v row " << m << " column " << half * N + n;
          }
          for (uint32_t f = 0; f < F; ++f) {
            const float a = expected(gv, f, m, x0), b = expected(uv, f, m, x0);
            const float want = a / (1.0f + std::exp(-a)) * b;
            EXPECT_NEAR(gu[size_t(m) * F + f], want, 1e-5f * (1.0f + std::abs(want)))
                << "gate/up row " << m << " feature " << f;
          }
        }
      }
  }
}
INSTANTIATE_TEST_SUITE_P(Widths, LinearVector,
                         ::testing::Values(VectorCase{1032, DType::BF16},
                                           VectorCase{1032, DType::F32},
                                           VectorCase{520, DType::F16},
                                           VectorCase{333, DType::BF16},
                                           VectorCase{40, DType::F32}),
                         [](const ::testing::TestParamInfo<VectorCase>& i) {
                           return "K" + std::to_string(i.param.K) + "_" + dtype_name(i.param.dt);
                         });

// A weight's start alignment, recorded when to_device* builds it (Weight::start_align), answers
// the GPU shape's VEC_ALIGNED question as asking OpenCL at each launch did. For a checkpoint
// mapping wrapped at every byte offset 0 .. 64 (64-byte aligned and misaligned), as a whole
// tensor, a block of rows and a column view: the recorded alignment is the start's (where the
// device reads host memory; 64 for a copy), and for every vector width in bytes the old test
// (host pointer and sub-buffer origin both its multiples) gives the same answer. linear_wg at VW
// 4 over a bf16 weight mapped 2 bytes off a 64-byte boundary gives the bits of the same weight
// mapped on one.
TEST(WeightStartAlign, RecordedAlignmentAnswersAsAskingDid) {
  Device& dev = test::default_device();
  ShapeScope scope(dev, KernelShape::WorkGroups);
  KernelTuning t = dev.tuning();
  t.linear_vector = 4;
  test::TuningScope tuned(dev, t);
  const bool wraps_host = dev.info().host_unified_memory;
  const uint32_t M = 3, N = 4, K = t.linear_wg * 4 * 2 + 6;  // whole VW steps and a tail
  const size_t row_bytes = size_t(K) * 2, bytes = N * row_bytes;
  std::vector<uint8_t> storage(2 * bytes + 256);
  uint8_t* base = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64);
  auto start_alignment = [&](const uint8_t* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p) | 64;
    return wraps_host ? uint32_t(a & (~a + 1)) : 64u;
  };
  auto asked_aligned = [](const cl::Mem& m, size_t width) {
    void* host = nullptr;
    size_t origin = 0;
    cl::check(clGetMemObjectInfo(m.get(), CL_MEM_HOST_PTR, sizeof(host), &host, nullptr),
              "CL_MEM_HOST_PTR");
    cl::check(clGetMemObjectInfo(m.get(), CL_MEM_OFFSET, sizeof(origin), &origin, nullptr),
              "CL_MEM_OFFSET");
    return reinterpret_cast<uintptr_t>(host) % width == 0 && origin % width == 0;
  };
  auto view_at = [&](const uint8_t* p) {
    TensorView v;
    v.name = "w";
    v.dtype = DType::BF16;
    v.shape = {N, K};
    v.data = p;
    v.bytes = bytes;
    return v;
  };
  for (size_t at = 0; at <= 64; ++at) {
    SCOPED_TRACE("byte offset " + std::to_string(at));
    const TensorView v = view_at(base + at);
    const std::pair<Weight, const uint8_t*> weights[] = {
        {to_device(dev, v), v.data},
        {to_device_rows(dev, v, 1, N), v.data + row_bytes},
        {to_device_columns(dev, v, 3, K), v.data}};  // a view at element offset 3 of the whole
    for (const auto& [w, start] : weights) {
      SCOPED_TRACE(w.name);
      EXPECT_EQ(w.start_align, start_alignment(start));
      for (size_t width : {2, 4, 8, 16, 32, 64})
        EXPECT_EQ(w.start_align % width == 0, asked_aligned(w.mem, width)) << width << " bytes";
    }
  }

  auto wv = random_vec(size_t(N) * K, 45);
  std::vector<uint16_t> codes(wv.size());
  for (size_t i = 0; i < wv.size(); ++i) codes[i] = f32_to_bf16(wv[i]);
  uint8_t* aligned_at = base;
  uint8_t* misaligned_at = base + (bytes + 63) / 64 * 64 + 2;
  std::memcpy(aligned_at, codes.data(), bytes);
  std::memcpy(misaligned_at, codes.data(), bytes);
  const Weight wa = to_device(dev, view_at(aligned_at));
  const Weight wm = to_device(dev, view_at(misaligned_at));
  EXPECT_EQ(wm.start_align, wraps_host ? 2u : 64u);
  const auto x = random_vec(size_t(M) * K, 46);
  cl::Mem xm = upload(dev, x), ya = dev.alloc(size_t(M) * N * 4), ym = dev.alloc(size_t(M) * N * 4);
  ops::linear(dev, xm, 0, K, wa, nullptr, ya, 0, N, M);
  ops::linear(dev, xm, 0, K, wm, nullptr, ym, 0, N, M);
  const auto yav = download(dev, ya, size_t(M) * N), ymv = download(dev, ym, size_t(M) * N);
  for (uint32_t m = 0; m < M; ++m)
    for (uint32_t n = 0; n < N; ++n) {
      double dot = 0;
      for (uint32_t k = 0; k < K; ++k)
        dot += double(x[size_t(m) * K + k]) * bf16_to_f32(codes[size_t(n) * K + k]);
      const size_t i = size_t(m) * N + n;
      EXPECT_NEAR(yav[i], dot, 1e-3) << "row " << m << " column " << n;
      EXPECT_EQ(std::bit_cast<uint32_t>(ymv[i]), std::bit_cast<uint32_t>(yav[i]))
          << "row " << m << " column " << n;
    }
}

// The CPU shape and the GPU shape (run on PoCL), a row narrower and one wider than a work-group.
struct NormCase {
  KernelShape shape;
  uint32_t H;
};
class NormKernel : public ::testing::TestWithParam<NormCase> {};

TEST_P(NormKernel, RmsNormWithAndWithoutGather) {
  Device& dev = test::default_device();
  ShapeScope scope(dev, GetParam().shape);
  const uint32_t R = 5, H = GetParam().H;
  auto x = random_vec(size_t(R) * H, 11, 3.0f);
  auto wv = random_vec(H, 12);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    auto wcopy = wv;
    Weight w = make_weight(dev, wcopy, {H}, dt);
    cl::Mem xm = upload(dev, x), ym = dev.alloc(size_t(R) * H * 4);
    std::vector<uint32_t> rows = {4, 0, 2};
    cl::Mem rm = dev.alloc(rows.size() * 4);
    dev.write(rm, rows.data(), rows.size() * 4);
    ops::rmsnorm(dev, xm, 0, H, nullptr, w, ym, 0, H, R, H, 1e-5f);
    auto y = download(dev, ym, size_t(R) * H);
    ops::rmsnorm(dev, xm, 0, H, &rm, w, ym, 0, H, 3, H, 1e-5f);
    auto yg = download(dev, ym, size_t(3) * H);
    for (uint32_t r = 0; r < R; ++r) {
      double ss = 0;
      for (uint32_t i = 0; i < H; ++i) ss += double(x[r * H + i]) * x[r * H + i];
      const double inv = 1.0 / std::sqrt(ss / H + 1e-5);
      for (uint32_t i = 0; i < H; ++i) {
        const double want = x[r * H + i] * inv * wcopy[i];
        ASSERT_NEAR(y[r * H + i], want, 1e-5);
        for (size_t g = 0; g < rows.size(); ++g) {
          if (rows[g] == r) {
            ASSERT_NEAR(yg[g * H + i], want, 1e-5);
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, NormKernel,
                         ::testing::Values(NormCase{KernelShape::Chunks, 77},
                                           NormCase{KernelShape::WorkGroups, 77},
                                           NormCase{KernelShape::WorkGroups, 1031}),
                         [](const auto& info) {
                           return std::string(kernel_shape_name(info.param.shape)) + "_H" +
                                  std::to_string(info.param.H);
                         });

class RowKernels : public test::BothShapes {};

// In both kernel shapes; H = 9 and 77 (more columns than the GPU shape's lanes, not a multiple);
// ids of another vocabulary shard give zero rows.
TEST_P(RowKernels, EmbeddingLooksUpAndScales) {
  Device& dev = test::default_device();
  for (const uint32_t H : {9u, 77u}) {
    const uint32_t V = 13, begin = 4;
    auto table = random_vec(size_t(V) * H, 21);
    Weight w = make_weight(dev, table, {V, H}, DType::BF16);
    std::vector<int32_t> toks = {16, 4, 9, 9, 2, 17};  // 2 and 17: outside [4, 17)
    cl::Mem tm = dev.alloc(toks.size() * 4), ym = dev.alloc(toks.size() * H * 4);
    dev.write(tm, toks.data(), toks.size() * 4);
    ops::embedding(dev, tm, uint32_t(toks.size()), w, ym, 2.5f, begin);
    auto y = download(dev, ym, toks.size() * H);
    for (size_t t = 0; t < toks.size(); ++t) {
      const int id = toks[t] - int(begin);
      for (uint32_t i = 0; i < H; ++i)
        ASSERT_EQ(y[t * H + i], id >= 0 && id < int(V) ? 2.5f * table[id * H + i] : 0.0f)
            << "token " << t << " column " << i;
    }
  }
}

TEST_P(RowKernels, SiluMulOverStackedGateUp) {
  Device& dev = test::default_device();
  const uint32_t T = 3, F = 300;  // F over one 256-column chunk, not a multiple of the lanes
  auto gu = random_vec(size_t(T) * 2 * F, 31, 4.0f);
  cl::Mem m = upload(dev, gu);
  ops::silu_mul(dev, m, 0, 2 * F, m, F, 2 * F, m, 2 * F, T, F);
  auto y = download(dev, m, gu.size());
  for (uint32_t t = 0; t < T; ++t)
    for (uint32_t i = 0; i < F; ++i) {
      const double g = gu[t * 2 * F + i], u = gu[t * 2 * F + F + i];
      EXPECT_NEAR(y[t * 2 * F + i], g / (1 + std::exp(-g)) * u, 1e-5);
      EXPECT_EQ(y[t * 2 * F + F + i], gu[t * 2 * F + F + i]);  // up is left as it was
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RowKernels,
                         test::both_shapes(), test::ShapeParamName());

// The shapes and tunings the attention kernels run under: the CPU shape, and the GPU shape with
// the device's own tuning (one split for these short rows), with splits of 16 positions over
// 8-position tiles and 32 lanes (several splits per row, partial tiles, one head per group), and
// with the split scratch capped so the split count has to shrink.
struct AttentionCase {
  const char* name;
  KernelShape shape;
  uint32_t split = 0, tile = 0, wg = 0, heads = 0;  // 0: the device's tuning
  uint64_t scratch = 0;
  DType cache = DType::F32;  // kv_cache.dtype
};
class AttentionKernels : public ::testing::TestWithParam<AttentionCase> {};

KernelTuning tuning_for(Device& dev, const AttentionCase& c) {
  KernelTuning t = dev.tuning();
  if (c.split) t.attn_split = c.split;
  if (c.tile) t.attn_tile = c.tile;
  if (c.wg) t.attn_wg = c.wg;
  if (c.heads) t.attn_heads = c.heads;
  if (c.scratch) t.split_scratch_bytes = c.scratch;
  return t;
}

// RoPE + KV store + paged attention against a direct C++ computation, two rows with different
// cached lengths, pages scattered in the pool (not in order). With a bf16 or fp8 cache: every
// stored key and value is the host's rounding of the kernel's f32 value (bit-exact), and the
// attention output matches a double computation over the rounded keys and values (2e-3: the host's
// RoPE may round a key to the neighbouring code where the kernel's f32 rotation differs in the last
// bit) and the f32 cache's output within the narrow type's precision (bf16 2e-2, fp8 6e-2 here,
// outputs of magnitude <= 1).
TEST_P(AttentionKernels, RopeStoreAndPagedAttentionMatchCpp) {
  Device& dev = test::default_device();
  ShapeScope scope(dev, GetParam().shape);
  test::TuningScope tuned(dev, tuning_for(dev, GetParam()));
  // GQA groups of 2, 4 and 3 query heads per KV head: the CPU shape's work-items take 2, 4 and
  // 1 heads each (they share a key and value load).
  // Pages of 16 positions; for the CPU shape, which walks a block of 16 positions from one page
  // lookup, also pages of 8 and 24, whose blocks cross a page boundary.
  struct Paging {
    uint32_t page, ppr;
    std::vector<uint32_t> lut;  // ppr pages of row 0, then row 1's, scattered over the cache
  };
  std::vector<Paging> pagings = {{16, 3, {5, 2, 7, 0, 3, 8}}};
  if (GetParam().shape == KernelShape::Chunks) {
    pagings.push_back({8, 5, {9, 2, 7, 0, 3, 8, 1, 6, 4, 5}});
    pagings.push_back({24, 2, {3, 1, 0, 2}});
  }
  for (const auto& [nh, nkv] : {std::pair<uint32_t, uint32_t>{4, 2}, {8, 2}, {6, 2}})
  for (const Paging& paging : pagings) {
    SCOPED_TRACE("heads " + std::to_string(nh) + "/" + std::to_string(nkv) + ", page " +
                 std::to_string(paging.page));
    const uint32_t hd = 16, page = paging.page;
    const uint32_t npages = *std::max_element(paging.lut.begin(), paging.lut.end());
    const uint32_t ld = (nh + 2 * nkv) * hd;
    // Row 0: 37 cached tokens + 3 new; row 1: 0 cached + 18 new.
    const std::vector<uint32_t> cached = {37, 0}, fresh = {3, 18};
    const uint32_t ppr = paging.ppr;
    const std::vector<uint32_t>& lut = paging.lut;
    std::vector<float> inv(hd / 2);
    for (uint32_t i = 0; i < hd / 2; ++i) inv[i] = std::pow(10000.0f, -float(2 * i) / hd);
    // Full K/V history per row (pre-rope q/k/v for every position).
    std::vector<std::vector<float>> hist(2);
    for (int b = 0; b < 2; ++b) hist[b] = random_vec(size_t(cached[b] + fresh[b]) * ld, 40 + b);
    auto rope = [&](float* x, uint32_t pos) {
      for (uint32_t i = 0; i < hd / 2; ++i) {
        const float a = float(pos) * inv[i];
        const float c = std::cos(a), s = std::sin(a), x0 = x[i], x1 = x[i + hd / 2];
        x[i] = x0 * c - x1 * s;
        x[i + hd / 2] = x1 * c + x0 * s;
      }
    };
    const DType cdt = GetParam().cache;
    const bool narrow = cdt != DType::F32;
    const size_t cache_elems = size_t(npages + 1) * 2 * page * nkv * hd;
    cl::Mem cache = dev.alloc(cache_elems * dtype_size(cdt));
    dev.fill_zero(cache, cache_elems * dtype_size(cdt));
    cl::Mem f32_cache = dev.alloc(cache_elems * 4);  // the f32 path beside a narrow cache
    dev.fill_zero(f32_cache, cache_elems * 4);
    cl::Mem invm = upload(dev, inv);
    std::vector<float> f32_att;  // the f32 cache's attention output of the last step
    auto run_step = [&](const std::vector<std::pair<uint32_t, uint32_t>>& spans,
                        std::vector<float>* att_out, std::vector<float>* qkv_rows) {
      // spans[b] = (first position, count) of row b's new tokens in this step.
      std::vector<float> qkv;
      std::vector<uint32_t> row, pos;
      for (uint32_t b = 0; b < spans.size(); ++b)
        for (uint32_t j = 0; j < spans[b].second; ++j) {
          const uint32_t p = spans[b].first + j;
          qkv.insert(qkv.end(), hist[b].begin() + size_t(p) * ld, hist[b].begin() + size_t(p + 1) * ld);
          row.push_back(b);
          pos.push_back(p);
        }
      const uint32_t T = uint32_t(row.size());
      cl::Mem qm = upload(dev, qkv), rm = dev.alloc(T * 4), pm = dev.alloc(T * 4),
              lm = dev.alloc(lut.size() * 4), om = dev.alloc(size_t(T) * nh * hd * 4);
      dev.write(rm, row.data(), T * 4);
      dev.write(pm, pos.data(), T * 4);
      dev.write(lm, lut.data(), lut.size() * 4);
      ops::StepTokens st{rm, pm, lm, T, ppr, page};
      if (narrow) {  // the same step over an f32 cache, from the same pre-rope rows
        cl::Mem q32 = upload(dev, qkv), o32 = dev.alloc(size_t(T) * nh * hd * 4);
        ops::rope_store_kv(dev, q32, ld, nh, nkv, hd, invm, invm, 0xffffffffu, st, f32_cache);
        ops::paged_attention(dev, q32, ld, f32_cache, st, nh, nkv, hd, 0.25f, o32, nh * hd);
        f32_att = download(dev, o32, size_t(T) * nh * hd);
      }
      ops::rope_store_kv(dev, qm, ld, nh, nkv, hd, invm, invm, 0xffffffffu, st, cache, cdt);
      ops::paged_attention(dev, qm, ld, cache, st, nh, nkv, hd, 0.25f, om, nh * hd, cdt);
      *att_out = download(dev, om, size_t(T) * nh * hd);
      *qkv_rows = download(dev, qm, qkv.size());
      if (narrow) {
        // Each new token's key (roped, in qkv) and value, as stored: the host's rounding of the
        // kernel's f32 value (nearest even; fp8 saturating), bit for bit.
        std::vector<uint8_t> c(cache_elems * dtype_size(cdt));
        dev.read(cache, c.data(), c.size());
        for (uint32_t t = 0; t < T; ++t) {
          const uint32_t slot_page = lut[row[t] * ppr + pos[t] / page], slot = pos[t] % page;
          for (uint32_t i = 0; i < nkv * hd; ++i) {
            const size_t k_at = (size_t(slot_page) * 2 * page + slot) * nkv * hd + i;
            const size_t v_at = k_at + size_t(page) * nkv * hd;
            ASSERT_EQ(test::stored_code(cdt, c, k_at),
                      test::cache_code(cdt, (*qkv_rows)[t * ld + nh * hd + i]))
                << "key " << t;
            ASSERT_EQ(test::stored_code(cdt, c, v_at),
                      test::cache_code(cdt, (*qkv_rows)[t * ld + (nh + nkv) * hd + i]))
                << "value";
          }
        }
      }
    };
    // The cache's rounding of a key or value element.
    auto cached_value = [&](float x) { return narrow ? test::cached(cdt, x) : x; };
    std::vector<float> att, roped;
    run_step({{0, cached[0]}, {0, 0}}, &att, &roped);  // fill row 0's history first
    run_step({{cached[0], fresh[0]}, {0, fresh[1]}}, &att, &roped);
    // C++ reference for the second step's tokens.
    size_t t = 0;
    for (uint32_t b = 0; b < 2; ++b) {
      std::vector<float> h = hist[b];
      for (uint32_t p = 0; p < cached[b] + fresh[b]; ++p)
        for (uint32_t head = 0; head < nh + nkv; ++head) rope(&h[size_t(p) * ld + head * hd], p);
      for (uint32_t j = 0; j < fresh[b]; ++j, ++t) {
        const uint32_t p = cached[b] + j;
        for (uint32_t i = 0; i < ld - nkv * hd; ++i)
          ASSERT_NEAR(roped[t * ld + i], h[size_t(p) * ld + i], 1e-5) << "roped q/k";
        for (uint32_t head = 0; head < nh; ++head) {
          const uint32_t kvh = head / (nh / nkv);
          std::vector<double> s(p + 1);
          double mx = -1e30;
          for (uint32_t q = 0; q <= p; ++q) {
            double d = 0;
            for (uint32_t i = 0; i < hd; ++i)
              d += double(h[size_t(p) * ld + head * hd + i]) *
                   cached_value(h[size_t(q) * ld + (nh + kvh) * hd + i]);
            s[q] = d * 0.25;
            mx = std::max(mx, s[q]);
          }
          double sum = 0;
          for (auto& v : s) sum += (v = std::exp(v - mx));
          for (uint32_t i = 0; i < hd; ++i) {
            double o = 0;
            for (uint32_t q = 0; q <= p; ++q)
              o += s[q] / sum * cached_value(h[size_t(q) * ld + (nh + nkv + kvh) * hd + i]);
            const size_t at = t * nh * hd + head * hd + i;
            ASSERT_NEAR(att[at], o, narrow ? 2e-3 : 1e-5) << "row " << b << " pos " << p;
            if (narrow) {
              ASSERT_NEAR(att[at], f32_att[at], cdt == DType::F8_E4M3 ? 6e-2 : 2e-2)
                  << "row " << b << " pos " << p;
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionKernels,
    ::testing::Values(AttentionCase{"cpu", KernelShape::Chunks},
                      AttentionCase{"gpu", KernelShape::WorkGroups},
                      AttentionCase{"gpu_split16_tile8", KernelShape::WorkGroups, 16, 8, 32, 1},
                      AttentionCase{"gpu_scratch_capped", KernelShape::WorkGroups, 8, 8, 64, 2,
                                    13000},
                      AttentionCase{"cpu_bf16_cache", KernelShape::Chunks, 0, 0, 0, 0, 0,
                                    DType::BF16},
                      AttentionCase{"gpu_bf16_cache", KernelShape::WorkGroups, 0, 0, 0, 0, 0,
                                    DType::BF16},
                      AttentionCase{"gpu_split16_tile8_bf16_cache", KernelShape::WorkGroups, 16,
                                    8, 32, 1, 0, DType::BF16},
                      AttentionCase{"cpu_fp8_cache", KernelShape::Chunks, 0, 0, 0, 0, 0,
                                    DType::F8_E4M3},
                      AttentionCase{"gpu_split16_tile8_fp8_cache", KernelShape::WorkGroups, 16, 8,
                                    32, 1, 0, DType::F8_E4M3}),
    [](const auto& info) { return std::string(info.param.name); });

// Prefill attention on odd sizes: GQA groups of 3 and 5 query heads, head_dim 24 (and 128, Llama
// 3 8B's, on the CPU shape: 8 value vectors, 2 rows' accumulators at a time), three rows in
// one step (a prefix of 21 cached tokens + 19 new ones ending in a partial page, 13 new tokens
// from position 0, one decode token after 30 cached), pages scattered, strided q and out. The
// keys and values are written into the cache from the host (as codes for narrow caches), and every
// output matches a double-precision computation over the values the cache holds (1e-5; outputs
// of magnitude <= 1). max_query_len 19 routes the GPU shape to the tiled prefill kernel
// (paged_attention_prefill_wg; query tiles straddle rows); "split_k" leaves it unknown (0), so
// the same step takes the split-K kernel. Compute bf16 where the device takes it
// (ops::attention_bf16: the CPU shape's tiles with vdpbf16ps): the reference rounds the queries
// times scale, the keys and the values to bf16 as the kernel does, and the kernel also rounds
// each softmax weight (relative error <= 2^-8), so an output may differ from the reference by up
// to 2^-8 of the largest |value| (plus the 1e-5).
struct PrefillCase {
  const char* name;
  KernelShape shape;
  uint32_t nh, nkv;
  uint32_t q_tile = 0, kv_tile = 0, wg = 0, heads = 0;  // 0: the device's tuning
  DType cache = DType::F32;
  bool split_k = false;
  ComputeDType compute = ComputeDType::F32;
  uint32_t hd = 24;  // head_dim
};
class PrefillAttention : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(PrefillAttention, MatchesDoubleReferenceWithCachedPrefix) {
  const PrefillCase& c = GetParam();
  Device& dev = test::default_device();
  ShapeScope scope(dev, c.shape);
  KernelTuning tu = test::with_bf16_dot(dev.tuning());
  if (c.q_tile) tu.prefill_q = c.q_tile;
  if (c.kv_tile) tu.prefill_tile = c.kv_tile;
  if (c.wg) tu.prefill_wg = c.wg;
  if (c.heads) tu.prefill_heads = c.heads;
  test::TuningScope tuned(dev, tu);
  const uint32_t nh = c.nh, nkv = c.nkv, hd = c.hd, page = 16, npages = 12, ppr = 3;
  const std::vector<uint32_t> cached = {21, 0, 30}, fresh = {19, 13, 1};
  const std::vector<uint32_t> lut = {7, 2, 10, 4, 0, 12, 9, 1, 5};  // 12: the null page
  const DType cdt = c.cache;
  const size_t esz = dtype_size(cdt), kv_row = size_t(nkv) * hd;
  const size_t cache_elems = size_t(npages + 1) * 2 * page * kv_row;
  std::vector<uint8_t> bytes(cache_elems * esz, 0);
  // hist[b][p]: the key and value rows of position p as the cache holds them (f32 values).
  std::vector<std::vector<float>> keys(3), vals(3);
  for (uint32_t b = 0; b < 3; ++b) {
    const uint32_t ctx = cached[b] + fresh[b];
    keys[b] = random_vec(ctx * kv_row, 60 + b);
    vals[b] = random_vec(ctx * kv_row, 70 + b);
    for (uint32_t p = 0; p < ctx; ++p)
      for (size_t i = 0; i < kv_row; ++i) {
        const size_t k_at = (size_t(lut[b * ppr + p / page]) * 2 * page + p % page) * kv_row + i;
        const size_t v_at = k_at + size_t(page) * kv_row;
        for (auto [at, x] : {std::pair{k_at, &keys[b][p * kv_row + i]},
                             std::pair{v_at, &vals[b][p * kv_row + i]}}) {
          if (cdt == DType::F32) {
            std::memcpy(bytes.data() + at * 4, x, 4);
            continue;
          }
          const uint32_t code = test::cache_code(cdt, *x);
          *x = test::cache_value(cdt, code);
          if (cdt == DType::BF16) {
            const uint16_t h = uint16_t(code);
            std::memcpy(bytes.data() + at * 2, &h, 2);
          } else {
            bytes[at] = uint8_t(code);
          }
        }
      }
  }
  std::vector<uint32_t> row, pos;
  for (uint32_t b = 0; b < 3; ++b)
    for (uint32_t j = 0; j < fresh[b]; ++j) {
      row.push_back(b);
      pos.push_back(cached[b] + j);
    }
  const uint32_t T = uint32_t(row.size()), ldq = nh * hd + 8, ldo = nh * hd + 5;
  const float scale = 0.3f;
  const auto q = random_vec(size_t(T) * ldq, 80, 2.0f);
  cl::Mem cm = dev.alloc(bytes.size()), qm = upload(dev, q), rm = dev.alloc(T * 4),
          pm = dev.alloc(T * 4), lm = dev.alloc(lut.size() * 4);
  dev.write(cm, bytes.data(), bytes.size());
  dev.write(rm, row.data(), T * 4);
  dev.write(pm, pos.data(), T * 4);
  dev.write(lm, lut.data(), lut.size() * 4);
  std::vector<float> init(size_t(T) * ldo, 7.0f);  // untouched columns keep their value
  cl::Mem om = upload(dev, init);
  ops::StepTokens st{rm, pm, lm, T, ppr, page};
  st.max_query_len = c.split_k ? 0 : 19;
  ops::paged_attention(dev, qm, ldq, cm, st, nh, nkv, hd, scale, om, ldo, cdt, c.compute);
  const auto out = download(dev, om, init.size());
  const bool bf16 = ops::attention_bf16(dev, c.compute);
  auto rounded = [&](float x) { return bf16 ? test::cached(DType::BF16, x) : x; };
  double vmax = 0;
  for (const auto& v : vals)
    for (float x : v) vmax = std::max(vmax, double(std::abs(rounded(x))));
  const double tol = (bf16 ? std::ldexp(vmax, -8) : 0.0) + 1e-5;
  double worst = 0;
  for (uint32_t t = 0; t < T; ++t) {
    const uint32_t b = row[t], p = pos[t];
    for (uint32_t h = 0; h < nh; ++h) {
      const uint32_t kvh = h / (nh / nkv);
      std::vector<double> s(p + 1);
      double mx = -1e300, sum = 0;
      for (uint32_t j = 0; j <= p; ++j) {
        double d = 0;
        for (uint32_t i = 0; i < hd; ++i) {
          const float qi = q[size_t(t) * ldq + h * hd + i];
          d += bf16 ? double(rounded(qi * scale)) * rounded(keys[b][j * kv_row + kvh * hd + i])
                    : double(qi) * keys[b][j * kv_row + kvh * hd + i] * scale;
        }
        mx = std::max(mx, s[j] = d);
      }
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (uint32_t i = 0; i < hd; ++i) {
        double o = 0;
        for (uint32_t j = 0; j <= p; ++j)
          o += s[j] / sum * rounded(vals[b][j * kv_row + kvh * hd + i]);
        const double err = std::abs(out[size_t(t) * ldo + h * hd + i] - o);
        worst = std::max(worst, err);
        ASSERT_LT(err, tol) << "token " << t << " (row " << b << " pos " << p << ") head " << h;
      }
    }
    for (uint32_t i = nh * hd; i < ldo; ++i) ASSERT_EQ(out[size_t(t) * ldo + i], 7.0f);
  }
  std::printf("[ measured ] %s: max abs error %.3g (bound %.3g)%s\n", c.name, worst, tol,
              bf16 ? ", bf16 dot products" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillAttention,
    ::testing::Values(
        PrefillCase{"cpu_gqa3", KernelShape::Chunks, 6, 2},
        PrefillCase{"cpu_gqa4", KernelShape::Chunks, 8, 2},
        PrefillCase{"cpu_gqa5_bf16_cache", KernelShape::Chunks, 5, 1, 0, 0, 0, 0, DType::BF16},
        PrefillCase{"cpu_gqa2_fp8_cache", KernelShape::Chunks, 4, 2, 0, 0, 0, 0, DType::F8_E4M3},
        PrefillCase{"cpu_gqa3_bf16_compute", KernelShape::Chunks, 6, 2, 0, 0, 0, 0, DType::F32,
                    false, ComputeDType::BF16},
        PrefillCase{"cpu_gqa5_bf16_cache_bf16_compute", KernelShape::Chunks, 5, 1, 0, 0, 0, 0,
                    DType::BF16, false, ComputeDType::BF16},
        PrefillCase{"cpu_gqa2_fp8_cache_bf16_compute", KernelShape::Chunks, 4, 2, 0, 0, 0, 0,
                    DType::F8_E4M3, false, ComputeDType::BF16},
        PrefillCase{"cpu_gqa4_hd128_bf16_compute", KernelShape::Chunks, 8, 2, 0, 0, 0, 0,
                    DType::F32, false, ComputeDType::BF16, 128},
        PrefillCase{"cpu_gqa4_hd128", KernelShape::Chunks, 8, 2, 0, 0, 0, 0, DType::F32, false,
                    ComputeDType::F32, 128},
        PrefillCase{"gpu_gqa3", KernelShape::WorkGroups, 6, 2},
        PrefillCase{"gpu_gqa5_q5_kv7_wg32", KernelShape::WorkGroups, 5, 1, 5, 7, 32, 5},
        PrefillCase{"gpu_gqa3_q3_kv16_heads1", KernelShape::WorkGroups, 6, 2, 3, 16, 64, 1},
        PrefillCase{"gpu_gqa5_bf16_cache", KernelShape::WorkGroups, 5, 1, 4, 8, 64, 0, DType::BF16},
        PrefillCase{"gpu_gqa3_fp8_cache", KernelShape::WorkGroups, 6, 2, 0, 0, 0, 0,
                    DType::F8_E4M3},
        PrefillCase{"gpu_gqa5_split_k", KernelShape::WorkGroups, 5, 1, 0, 0, 0, 0, DType::F32,
                    true}),
    [](const auto& info) { return std::string(info.param.name); });

// The CPU shape's tiles read keys and values 8 floats at a time at least: other widths are an
// error that names them (the GPU shape takes any even width).
TEST(AttentionTiles, KeyWidthsOfNoMultipleOf8AreAnError) {
  Device& dev = test::default_device();
  ShapeScope scope(dev, KernelShape::Chunks);
  cl::Mem buf = dev.alloc(4096), rows = upload(dev, std::vector<uint32_t>{0});
  ops::StepTokens st{rows, rows, rows, 1, 1, 16};
  ops::PagedKvLayout lay;
  lay.page_stride = 2 * 16 * 20;
  lay.slot_stride = 20;
  lay.v_off = 16 * 20;
  lay.dk = lay.dv = 20;
  try {
    ops::paged_attention_prefill(dev, buf, 0, 20, 20, buf, st, 1, lay, nullptr, 1.0f, buf, 20, 20);
    FAIL() << "no error for keys of 20 floats";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("keys (0 + 20) and values (20) in multiples of 8 floats"),
              std::string::npos)
        << e.what();
  }
}

// The CPU shape's tiles (attention.cl's paged_attention_tiles) give a token's output the same bits
// in any step: the step of all new tokens of three rows (19 after 21 cached, 13 from position 0,
// one decode token after 30), each token alone, and the rows in reverse order (tiles cut
// elsewhere, other tokens beside each one). GQA groups of 4 (4 heads per work-item, 4 tokens)
// and 3 (3 heads, 5 tokens); head_dim 24 (a half vector); pages of 16 scattered. At both compute
// dtypes (bf16: the bf16 dot products where ops::attention_bf16 holds, speculative decoding's
// verified runs against decode).
TEST(AttentionTiles, ATokensOutputHasTheSameBitsInAnyStep) {
  Device& dev = test::default_device();
  test::DotProductScope dot(dev);
  ShapeScope scope(dev, KernelShape::Chunks);
  const uint32_t hd = 24, page = 16, ppr = 3;
  const std::vector<uint32_t> cached = {21, 0, 30}, fresh = {19, 13, 1};
  const std::vector<uint32_t> lut = {7, 2, 10, 4, 0, 11, 9, 1, 5};
  for (ComputeDType compute : {ComputeDType::F32, ComputeDType::BF16})
    for (const auto& [nh, nkv] : {std::pair<uint32_t, uint32_t>{8, 2}, {6, 2}}) {
      SCOPED_TRACE("heads " + std::to_string(nh) + "/" + std::to_string(nkv) + ", compute " +
                   compute_dtype_name(compute));
      const size_t kv_row = size_t(nkv) * hd;
      cl::Mem cache = upload(dev, random_vec(size_t(12) * 2 * page * kv_row, 90));
      cl::Mem lm = upload(dev, lut);
      std::vector<uint32_t> all_rows, all_pos;
      for (uint32_t b = 0; b < 3; ++b)
        for (uint32_t j = 0; j < fresh[b]; ++j) {
          all_rows.push_back(b);
          all_pos.push_back(cached[b] + j);
        }
      const uint32_t T = uint32_t(all_rows.size()), ldq = nh * hd;
      const auto q = random_vec(size_t(T) * ldq, 91, 2.0f);
      // The outputs of the given tokens (indexes into all_rows) as one step, in that order.
      auto step = [&](const std::vector<uint32_t>& tokens) {
        std::vector<uint32_t> row, pos;
        std::vector<float> qs;
        for (uint32_t t : tokens) {
          row.push_back(all_rows[t]);
          pos.push_back(all_pos[t]);
          qs.insert(qs.end(), q.begin() + size_t(t) * ldq, q.begin() + size_t(t + 1) * ldq);
        }
        const uint32_t n = uint32_t(tokens.size());
        cl::Mem qm = upload(dev, qs), rm = upload(dev, row), pm = upload(dev, pos),
                om = dev.alloc(size_t(n) * ldq * 4);
        ops::StepTokens st{rm, pm, lm, n, ppr, page};
        st.max_query_len = 19;
        ops::paged_attention(dev, qm, ldq, cache, st, nh, nkv, hd, 0.3f, om, ldq, DType::F32,
                             compute);
        return download(dev, om, size_t(n) * ldq);
      };
      std::vector<uint32_t> in_order(T), reversed;
      for (uint32_t t = 0; t < T; ++t) in_order[t] = t;
      for (uint32_t b = 3; b-- > 0;)
        for (uint32_t t = 0; t < T; ++t)
          if (all_rows[t] == b) reversed.push_back(t);
      const auto whole = step(in_order), other = step(reversed);
      for (uint32_t i = 0; i < T; ++i) {
        const uint32_t t = reversed[i];
        const auto alone = step({t});
        for (uint32_t k = 0; k < ldq; ++k) {
          ASSERT_EQ(std::memcmp(&whole[size_t(t) * ldq + k], &alone[k], 4), 0)
              << "token " << t << " (row " << all_rows[t] << " pos " << all_pos[t] << ") element "
              << k << ": " << whole[size_t(t) * ldq + k] << " in the step, " << alone[k]
              << " alone";
          ASSERT_EQ(std::memcmp(&whole[size_t(t) * ldq + k], &other[size_t(i) * ldq + k], 4), 0)
              << "token " << t << " element " << k << " in reversed order";
        }
      }
    }
}

// MLA's decompressed prefill (a DecompressedKv: K-nope and V from f32 rows, the roped key shared
// by all heads from the cache) on the CPU shape's tiles at both compute dtypes: 3 heads, K-nope 16
// + rope 8, values of 24 (a half vector), two rows (8 new tokens after 13 cached, 5 from position
// 0), pages of 16 scattered. Each output against a double reference over the queries times scale,
// keys and values as the kernel takes them (rounded to bf16 where ops::attention_bf16 holds):
// 1e-5, and with bf16 the weights' rounding's bound 2^-8 of the largest |value| more.
TEST(AttentionTiles, DecompressedKeysMatchTheReferenceAtBothComputeDtypes) {
  Device& dev = test::default_device();
  test::DotProductScope dot(dev);
  ShapeScope scope(dev, KernelShape::Chunks);
  const uint32_t nh = 3, nope = 16, rope = 8, dv = 24, page = 16, ppr = 2, qk = nope + rope;
  const std::vector<uint32_t> cached = {13, 0}, fresh = {8, 5}, ctx_start = {0, 21};
  const std::vector<uint32_t> lut = {3, 0, 1, 2};
  const uint32_t head_ld = nope + dv, ldkv = nh * head_ld, L = 26;
  const auto kv = random_vec(size_t(L) * ldkv, 120);
  const auto cache = random_vec(size_t(4) * page * rope, 121);
  std::vector<uint32_t> row, pos;
  for (uint32_t b = 0; b < 2; ++b)
    for (uint32_t j = 0; j < fresh[b]; ++j) {
      row.push_back(b);
      pos.push_back(cached[b] + j);
    }
  const uint32_t T = uint32_t(row.size()), ldq = nh * qk, ldo = nh * dv;
  const auto q = random_vec(size_t(T) * ldq, 122, 2.0f);
  const float scale = 0.3f;
  cl::Mem qm = upload(dev, q), cm = upload(dev, cache), kvm = upload(dev, kv),
          csm = upload(dev, ctx_start), rm = upload(dev, row), pm = upload(dev, pos),
          lm = upload(dev, lut), om = dev.alloc(size_t(T) * ldo * 4);
  ops::StepTokens st{rm, pm, lm, T, ppr, page};
  st.max_query_len = 8;
  ops::PagedKvLayout lay;
  lay.page_stride = uint64_t(page) * rope;
  lay.slot_stride = rope;
  lay.heads_per_kv = 1;
  lay.dk = qk;
  lay.dv = dv;
  ops::DecompressedKv dense{&kvm, &csm, ldkv, head_ld, nope};
  for (ComputeDType compute : {ComputeDType::F32, ComputeDType::BF16}) {
    ops::paged_attention_prefill(dev, qm, 0, ldq, qk, cm, st, nh, lay, &dense, scale, om, ldo, dv,
                                 compute);
    const auto out = download(dev, om, size_t(T) * ldo);
    const bool bf16 = ops::attention_bf16(dev, compute);
    auto rounded = [&](float x) { return bf16 ? test::cached(DType::BF16, x) : x; };
    double vmax = 0;
    for (float x : kv) vmax = std::max(vmax, double(std::abs(rounded(x))));
    const double tol = (bf16 ? std::ldexp(vmax, -8) : 0.0) + 1e-5;
    double worst = 0;
    for (uint32_t t = 0; t < T; ++t)
      for (uint32_t h = 0; h < nh; ++h) {
        const uint32_t b = row[t], p = pos[t];
        auto kv_row = [&](uint32_t j) {
          return kv.data() + size_t(ctx_start[b] + j) * ldkv + h * head_ld;
        };
        std::vector<double> s(p + 1);
        double mx = -1e300, sum = 0;
        for (uint32_t j = 0; j <= p; ++j) {
          const float* rk =
              cache.data() + (size_t(lut[b * ppr + j / page]) * page + j % page) * rope;
          double d = 0;
          for (uint32_t i = 0; i < qk; ++i) {
            const float qi = q[size_t(t) * ldq + h * qk + i],
                        ki = i < nope ? kv_row(j)[i] : rk[i - nope];
            d += bf16 ? double(rounded(qi * scale)) * rounded(ki) : double(qi) * ki * scale;
          }
          mx = std::max(mx, s[j] = d);
        }
        for (auto& v : s) sum += (v = std::exp(v - mx));
        for (uint32_t i = 0; i < dv; ++i) {
          double o = 0;
          for (uint32_t j = 0; j <= p; ++j) o += s[j] / sum * rounded(kv_row(j)[nope + i]);
          const double err = std::abs(out[size_t(t) * ldo + h * dv + i] - o);
          worst = std::max(worst, err);
          ASSERT_LT(err, tol) << compute_dtype_name(compute) << ": token " << t << " head " << h
                              << " element " << i;
        }
      }
    std::printf("[ measured ] compute %s: max abs error %.3g (bound %.3g)%s\n",
                compute_dtype_name(compute), worst, tol, bf16 ? ", bf16 dot products" : "");
  }
}

// Compute bf16 rounds the queries (times scale) and the softmax weights to bf16 where the device
// takes bf16 attention (ops::attention_bf16), and not with f32. One token at position 1 over two
// keys (head_dim 8): key 0 is zeros (score 0), key 1 is -e0 and q = (1 + 2^-10) e0, so the score is
// -(1 + 2^-10) in f32 and -1 with q rounded; values 0 and e0. Output element 0 is w / (1 + w) in
// f32 (w = exp(-(1 + 2^-10))), and with bf16 the weight rounded, 0.3671875 (exp(-1) = 0.36788 to
// nearest even), over the f32 sum 1 + exp(-1).
TEST(AttentionTiles, Bf16ComputeRoundsQueriesAndWeights) {
  Device& dev = test::default_device();
  test::DotProductScope dot(dev);
  ShapeScope scope(dev, KernelShape::Chunks);
  const uint32_t hd = 8, page = 16;
  std::vector<float> cache(size_t(2) * page * hd, 0.0f);  // one page: [K, V][slot][hd]
  cache[size_t(1) * hd] = -1.0f;                          // key 1 = -e0
  cache[size_t(page + 1) * hd] = 1.0f;                    // value 1 = e0
  std::vector<float> q(hd, 0.0f);
  q[0] = 1.0f + std::ldexp(1.0f, -10);
  cl::Mem cm = upload(dev, cache), qm = upload(dev, q), om = dev.alloc(hd * 4);
  cl::Mem rm = upload(dev, std::vector<uint32_t>{0}), pm = upload(dev, std::vector<uint32_t>{1}),
          lm = upload(dev, std::vector<uint32_t>{0});
  ops::StepTokens st{rm, pm, lm, 1, 1, page};
  for (ComputeDType compute : {ComputeDType::F32, ComputeDType::BF16}) {
    ops::paged_attention(dev, qm, hd, cm, st, 1, 1, hd, 1.0f, om, hd, DType::F32, compute);
    const auto out = download(dev, om, hd);
    const bool bf16 = ops::attention_bf16(dev, compute);
    const double w = std::exp(-double(q[0]));
    const double want = bf16 ? 0.3671875 / (1.0 + std::exp(-1.0)) : w / (1.0 + w);
    EXPECT_NEAR(out[0], want, 1e-6) << compute_dtype_name(compute) << (bf16 ? " (bf16 dots)" : "");
    for (uint32_t i = 1; i < hd; ++i) EXPECT_EQ(out[i], 0.0f) << i;
  }
  EXPECT_EQ(ops::attention_bf16(dev, ComputeDType::BF16), ops::bf16_dot_product(dev));
}

}  // namespace
}  // namespace clshard
