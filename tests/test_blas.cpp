// GEMMs through CLBlast (ops_blas.h): blas_linear against a double-precision host reference on
// odd sizes, f32 and bf16 weight views (offset, row stride), strided x and y, alpha, accumulate,
// bf16 weights widened in several chunks; linear() routing GPU-shape GEMMs there from the tuning's
// blas_gemm_rows and no others, FP8 weights through linear_any dequantized first. On PoCL, with the GPU shape forced (CLBlast runs there, slowly).
//
// Tolerance: CLBlast sums in f32 in its own order: 2 K f32 epsilons of the sum of the products'
// magnitudes (the bound of any summation order), plus 1e-30 for all-zero rows.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/ops.h"
#include "runtime/ops_blas.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using test::download;
using test::random_vec;

// The device in the GPU shape with blas_gemm_rows = `rows`, restored afterwards.
KernelTuning with_blas_rows(const Device& d, uint32_t rows) {
  KernelTuning t = d.tuning();
  t.blas_gemm_rows = rows;
  return t;
}
struct GpuShapeScope {
  test::ShapeScope shape;
  test::TuningScope tuning;
  GpuShapeScope(Device& d, uint32_t rows)
      : shape(d, KernelShape::WorkGroups), tuning(d, with_blas_rows(d, rows)) {}
};

// A [N, K] weight view into a buffer of N rows of stride ld starting `offset` elements in;
// `values` (N x K) become the values the kernels see (bf16-rounded for bf16).
Weight weight_view(Device& dev, DType dt, std::vector<float>& values, uint32_t N, uint32_t K,
                   uint32_t ld, uint32_t offset) {
  Weight w;
  w.dtype = dt;
  w.shape = {N, K};
  w.ld = ld;
  w.offset = offset;
  w.name = "test.weight";
  const size_t total = offset + size_t(N) * ld;
  if (dt == DType::BF16) {
    std::vector<uint16_t> b(total, 0x7fc0);  // NaN outside the view: must not be read
    for (uint32_t n = 0; n < N; ++n)
      for (uint32_t k = 0; k < K; ++k) {
        const uint16_t v = f32_to_bf16(values[size_t(n) * K + k]);
        b[offset + size_t(n) * ld + k] = v;
        values[size_t(n) * K + k] = bf16_to_f32(v);
      }
    w.mem = test::upload_bytes(dev, b.data(), b.size() * 2);
  } else {
    std::vector<float> f(total, std::numeric_limits<float>::quiet_NaN());
    for (uint32_t n = 0; n < N; ++n)
      for (uint32_t k = 0; k < K; ++k) f[offset + size_t(n) * ld + k] = values[size_t(n) * K + k];
    w.mem = test::upload(dev, f);
  }
  return w;
}

struct Problem {
  uint32_t M, N, K;
  uint32_t x_off = 3, ldx, y_off = 5, ldy;
  std::vector<float> x, w, y0;
};

Problem make_problem(uint32_t M, uint32_t N, uint32_t K, uint32_t seed) {
  Problem p{M, N, K};
  p.ldx = K + 4;
  p.ldy = N + 9;
  p.x = random_vec(p.x_off + size_t(M) * p.ldx, seed);
  p.w = random_vec(size_t(N) * K, seed + 1);
  p.y0 = random_vec(p.y_off + size_t(M) * p.ldy, seed + 2);
  return p;
}

// Checks y (the whole buffer) against alpha * x W^T (+ y0 where accumulating) inside the view
// and y0 untouched outside it.
void expect_gemm(const Problem& p, const std::vector<float>& w, const std::vector<float>& y,
                 float alpha, bool accumulate) {
  size_t outside = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const bool in_view = i >= p.y_off && (i - p.y_off) % p.ldy < p.N && (i - p.y_off) / p.ldy < p.M;
    if (!in_view) outside += std::bit_cast<uint32_t>(y[i]) != std::bit_cast<uint32_t>(p.y0[i]);
  }
  EXPECT_EQ(outside, 0u) << "elements outside y's view changed";
  for (uint32_t m = 0; m < p.M; ++m)
    for (uint32_t n = 0; n < p.N; ++n) {
      double sum = 0, mag = 0;
      for (uint32_t k = 0; k < p.K; ++k) {
        const double prod = double(p.x[p.x_off + size_t(m) * p.ldx + k]) * w[size_t(n) * p.K + k];
        sum += prod;
        mag += std::abs(prod);
      }
      const size_t at = p.y_off + size_t(m) * p.ldy + n;
      const double want = alpha * sum + (accumulate ? p.y0[at] : 0.0);
      const double tol = 2.0 * p.K * FLT_EPSILON * std::abs(alpha) * mag + 1e-30 +
                         (accumulate ? FLT_EPSILON * std::abs(p.y0[at]) : 0.0);
      ASSERT_NEAR(y[at], want, tol) << "m=" << m << " n=" << n;
    }
}

TEST(BlasLinear, MatchesTheDoubleReferenceOnOddSizesAndViews) {
  Device& dev = test::default_device();
  GpuShapeScope scope(dev, 0);
  for (const DType dt : {DType::F32, DType::BF16})
    for (const auto& [M, N, K] : {std::tuple<uint32_t, uint32_t, uint32_t>{5, 29, 333},
                                  {67, 131, 97}})
      for (const bool accumulate : {false, true})
        for (const size_t widened : {ops::kBlasWidenedWeightBytes, size_t(97 * 4 * 40)}) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + " M=" + std::to_string(M) + " N=" +
                       std::to_string(N) + " K=" + std::to_string(K) +
                       (accumulate ? " accumulate" : "") + " widened " + std::to_string(widened));
          Problem p = make_problem(M, N, K, 7 + M);
          // Without accumulate, y's view starts as NaN: the product must not read it.
          if (!accumulate)
            for (uint32_t m = 0; m < M; ++m)
              for (uint32_t n = 0; n < N; ++n)
                p.y0[p.y_off + size_t(m) * p.ldy + n] = std::numeric_limits<float>::quiet_NaN();
          std::vector<float> w = p.w;
          const Weight wt = weight_view(dev, dt, w, N, K, K + 6, 11);
          cl::Mem x = test::upload(dev, p.x), y = test::upload(dev, p.y0);
          ops::blas_linear(dev, x, p.x_off, p.ldx, wt, y, p.y_off, p.ldy, M, 0.5f, accumulate,
                           widened);
          std::vector<float> got = download(dev, y, p.y0.size());
          if (!accumulate)  // y0's NaNs inside the view were overwritten
            for (uint32_t m = 0; m < M; ++m)
              for (uint32_t n = 0; n < N; ++n)
                p.y0[p.y_off + size_t(m) * p.ldy + n] = 0.0f;
          expect_gemm(p, w, got, 0.5f, accumulate);
        }
}

// linear() hands GPU-shape GEMMs of blas_gemm_rows rows and more to blas_linear (the same bits as
// calling it), fewer rows, a bias, the CPU shape or blas_gemm_rows 0 to our kernels (the bits of
// linear_wg / linear.cl with the routing off).
TEST(BlasLinear, LinearRoutesByTheTuningsRows) {
  Device& dev = test::default_device();
  const uint32_t N = 40, K = 70;
  std::vector<float> wv = random_vec(size_t(N) * K, 3);
  const Weight w = weight_view(dev, DType::BF16, wv, N, K, K, 0);
  auto run = [&](uint32_t M, uint32_t rows, KernelShape shape, bool direct) {
    GpuShapeScope scope(dev, rows);
    dev.set_kernel_shape(shape);
    const std::vector<float> xv = random_vec(size_t(M) * K, 4);
    cl::Mem x = test::upload(dev, xv), y = dev.alloc(size_t(M) * N * 4);
    if (direct)
      ops::blas_linear(dev, x, 0, K, w, y, 0, N, M, 1.0f, false);
    else
      ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, M);
    return download(dev, y, size_t(M) * N);
  };
  auto bits_equal = [](const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
    return true;
  };
  const auto gpu = KernelShape::WorkGroups, cpu = KernelShape::Chunks;
  EXPECT_TRUE(bits_equal(run(64, 64, gpu, false), run(64, 64, gpu, true)));
  EXPECT_TRUE(bits_equal(run(63, 64, gpu, false), run(63, 0, gpu, false)));
  EXPECT_TRUE(bits_equal(run(64, 64, cpu, false), run(64, 0, cpu, false)));

  GpuShapeScope scope(dev, 64);
  Weight fp8 = w;
  fp8.dtype = DType::F8_E4M3;
  EXPECT_TRUE(ops::blas_linear_applies(dev, 64, w, nullptr));
  EXPECT_FALSE(ops::blas_linear_applies(dev, 63, w, nullptr));
  EXPECT_FALSE(ops::blas_linear_applies(dev, 64, w, &w));  // a bias
  EXPECT_FALSE(ops::blas_linear_applies(dev, 64, fp8, nullptr));
  dev.set_kernel_shape(KernelShape::Chunks);
  EXPECT_FALSE(ops::blas_linear_applies(dev, 64, w, nullptr));
  try {
    ops::blas_linear(dev, test::upload(dev, std::vector<float>(K)), 0, K, fp8,
                     dev.alloc(size_t(N) * 4), 0, N, 1, 1.0f, false);
    FAIL() << "an F8_E4M3 weight was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'test.weight' is F8_E4M3, expected F32 or BF16"),
              std::string::npos)
        << e.what();
  }
}

// linear_any on an FP8 weight in the GPU shape: from blas_gemm_rows rows the bits of blas_linear
// over the host's f32 dequantization (the kernel's dequantization is exact, so the same SGEMM
// input), fewer rows the bits of linear_fp8; a weight whose f32 form passes kBlasFp8WeightBytes
// is not routed.
TEST(BlasLinear, Fp8WeightsAreDequantizedThenMultiplied) {
  Device& dev = test::default_device();
  GpuShapeScope scope(dev, 64);
  const uint32_t N = 150, K = 200, KB = 2, NB = 2;  // partial 128-blocks both ways
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> code(0, 255);
  std::vector<uint8_t> codes(size_t(N) * K);
  for (auto& c : codes) {
    do c = uint8_t(code(rng));
    while ((c & 0x7F) == 0x7F);  // no NaN codes
  }
  std::vector<float> scales(size_t(NB) * KB);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = std::ldexp(1.0f + 0.25f * i, -8 + int(i));
  std::vector<float> deq(size_t(N) * K);
  reference::dequantize_fp8(codes.data(), scales.data(), N, K, deq.data());
  Weight w8;
  w8.mem = test::upload_bytes(dev, codes.data(), codes.size());
  w8.dtype = DType::F8_E4M3;
  w8.shape = {N, K};
  w8.name = "test.fp8";
  Weight sc;
  sc.mem = test::upload(dev, scales);
  sc.shape = {NB, KB};
  sc.name = "test.fp8.scale_inv";
  Weight wf;
  wf.mem = test::upload(dev, deq);
  wf.shape = {N, K};
  wf.name = "test.f32";
  for (const uint32_t M : {67u, 5u}) {
    SCOPED_TRACE("M=" + std::to_string(M));
    const std::vector<float> xv = random_vec(size_t(M) * K, 8), y0 = random_vec(size_t(M) * N, 9);
    auto run = [&](int path) {
      cl::Mem x = test::upload(dev, xv), y = test::upload(dev, y0);
      if (path == 0) ops::linear_any(dev, x, 0, K, w8, &sc, y, 0, N, M, 0.5f, true);
      if (path == 1) ops::blas_linear(dev, x, 0, K, wf, y, 0, N, M, 0.5f, true);
      if (path == 2) ops::linear_fp8(dev, x, 0, K, w8, sc, y, 0, N, M, 0.5f, true);
      return download(dev, y, y0.size());
    };
    const std::vector<float> got = run(0), want = run(M >= 64 ? 1 : 2);
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i)
      differ += std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]);
    EXPECT_EQ(differ, 0u);
  }
  EXPECT_TRUE(ops::blas_fp8_applies(dev, 64, w8));
  Weight big = w8;
  big.shape = {int64_t(ops::kBlasFp8WeightBytes / 4 / 1024) + 1, 1024};
  EXPECT_FALSE(ops::blas_fp8_applies(dev, 64, big));
  EXPECT_FALSE(ops::blas_fp8_applies(dev, 63, w8));
}

}  // namespace
}  // namespace clshard
