// bf16 compute (model.compute_dtype: bf16): the rounding kernel against the nearest bf16 found on
// the host, and the bf16 GEMMs (linear_bf16.cl's tiles and, from gemm_bf16_packed_rows rows, its
// packed GEMM; both micro-kernels, forced through the tuning's gemm_bf16_dot: vdpbf16ps where the
// host has it, and the portable one) against a double-precision host reference
// computed on the bf16-rounded inputs, on sizes that are not multiples of the tiles or of the
// 32-element steps: linear (bias, alpha, accumulate), linear_fused (norm, q/k/v side by side) and
// linear_swiglu (norm, GLU epilogue).
//
// Tolerance: the kernel's products of bf16 values are exact in f32, so its error is f32 rounding
// of the sums. The tiles: K / 16 pair-steps per lane (2 adds each), 4 adds across lanes and up to
// 31 tail adds; the bound allows (K / 8 + 40) f32 epsilons of the sum of the products'
// magnitudes. The packed GEMM: one chain of K adds per output, each rounding once to within an
// epsilon of its result, so the bound is an epsilon of the sum of the chain's partial sums'
// magnitudes, taken on the host in the kernel's order (1% more for second-order terms): near
// sqrt(K) epsilons of the products for random signs, where K epsilons would let an f32 product of
// the unrounded x pass at K = 2101. Where the device selects AMX's tiles for the packed GEMM
// (a Xeon with AMX), they round in their own order (PackedAmxRunsWhereSelected), and the cases
// hold them to the same bound. Where the
// input is normalised on the device first (linear_fused, linear_swiglu), an element of the
// normalised row can round to the neighbouring bf16 on the device and not on the host (the f32
// norm differs from the double one in its last bits): those cases add one bf16 step (2^-8) of
// the largest product per output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>

#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/ops.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using test::download;
using test::random_vec;

// A bf16 [rows, K] (or [K]) weight; `values` become what the kernel sees.
Weight bf16_weight(Device& dev, std::vector<float>& values, std::vector<int64_t> shape,
                   const std::string& name) {
  Weight w;
  w.dtype = DType::BF16;
  w.shape = shape;
  w.name = name;
  std::vector<uint16_t> b(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    b[i] = f32_to_bf16(values[i]);
    values[i] = bf16_to_f32(b[i]);
  }
  w.mem = test::upload_bytes(dev, b.data(), b.size() * 2);
  return w;
}

// The bf16 value nearest to f by search over the two neighbours of its truncation (ties: the
// even code).
float nearest_bf16(float f) {
  if (std::isinf(f)) return f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1);
  const double dl = std::abs(double(bf16_to_f32(lo)) - f), dh = std::abs(double(bf16_to_f32(hi)) - f);
  if (dl < dh || (dl == dh && (lo & 1) == 0)) return bf16_to_f32(lo);
  return bf16_to_f32(hi);
}

float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

TEST(RoundBf16, KernelRoundsToNearestEven) {
  Device& dev = test::default_device();
  const uint32_t M = 3, K = 150, ld = 160;  // a partial 64-column chunk, padded rows
  std::vector<float> x = random_vec(size_t(M) * K, 3, 40.0f);
  // Exact ties between two bf16 values: to the even one.
  x[0] = bf16_to_f32(0x3f80) + std::ldexp(1.0f, -8);  // 1 + half a step: down to 1.0
  x[1] = bf16_to_f32(0x3f81) + std::ldexp(1.0f, -8);  // odd lower neighbour: up
  x[2] = -0.0f;
  x[3] = 3.0e38f;  // near the top of the range (finite in bf16)
  x[4] = INFINITY;
  x[5] = 1e-40f;  // an f32 denormal
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4), yb = dev.alloc(size_t(M) * ld * 2),
          yf = dev.alloc(size_t(M) * ld * 4);
  ops::round_bf16(dev, xm, 0, K, M, K, yb, ld);
  ops::round_bf16(dev, xm, 0, K, M, K, yf, ld, true);
  std::vector<uint16_t> b(size_t(M) * ld);
  dev.read(yb, b.data(), b.size() * 2);
  std::vector<float> f = download(dev, yf, size_t(M) * ld);
  for (uint32_t m = 0; m < M; ++m)
    for (uint32_t k = 0; k < K; ++k) {
      const float want = nearest_bf16(x[m * K + k]);
      ASSERT_EQ(bf16_to_f32(b[m * ld + k]), want) << m << "," << k << ": " << x[m * K + k];
      ASSERT_EQ(f[m * ld + k], want) << m << "," << k;
    }
  EXPECT_EQ(b[0], 0x3f80);
  EXPECT_EQ(b[1], 0x3f82);
  EXPECT_EQ(b[2], 0x8000);
}

// The micro-kernel a case forces: vdpbf16ps wherever the host has it (gemm_bf16_dot 1, whatever
// the device's row says: the Xeons' row turns it off for speed, kernel_tuning.cpp, and the tests
// still run it there), or the portable one (gemm_bf16_dot 0).
enum class Variant { DotProduct, Portable };

struct GemmCase {
  uint32_t M, N, K;
  Variant variant;
  KernelShape shape = KernelShape::Chunks;
  uint32_t tm = 0, tn = 0;  // a tile forced for both the prefill and the batch tile; 0: the device's
  uint32_t ptm = 0, pnv = 0;  // the packed GEMM's tile forced (rows x vectors); 0: the device's
};

std::string case_name(const ::testing::TestParamInfo<GemmCase>& p) {
  const GemmCase& c = p.param;
  return "M" + std::to_string(c.M) + "_N" + std::to_string(c.N) + "_K" + std::to_string(c.K) +
         (c.variant == Variant::DotProduct ? "_dot" : "_portable") +
         (c.shape == KernelShape::Chunks ? "" : "_workgroups") +
         (c.tm ? "_tile" + std::to_string(c.tm) + "x" + std::to_string(c.tn) : "") +
         (c.ptm ? "_packed" + std::to_string(c.ptm) + "x" + std::to_string(c.pnv) : "");
}

// The device with the case's kernel shape and micro-kernel, restored afterwards.
KernelTuning case_tuning(const Device& d, const GemmCase& c) {
  KernelTuning t = d.tuning();
  if (c.variant == Variant::Portable) t.gemm_bf16_dot = t.gemm_bf16_amx = 0;
  if (c.variant == Variant::DotProduct) t.gemm_bf16_dot = 1;
  if (c.tm) {
    t.gemm_bf16_amx = 0;  // the tiles, which AMX's packed GEMM would take from 8 rows
    t.gemm_bf16_tm = t.gemm_bf16_batch_tm = c.tm;
    t.gemm_bf16_tn = t.gemm_bf16_batch_tn = c.tn;
  }
  if (c.ptm) {
    t.gemm_bf16_packed_tm = c.ptm;
    t.gemm_bf16_packed_nv = c.pnv;
  }
  return t;
}
struct DeviceScope {
  test::ShapeScope shape;
  test::TuningScope tuning;
  DeviceScope(Device& d, const GemmCase& c) : shape(d, c.shape), tuning(d, case_tuning(d, c)) {}
};

// Whether a GEMM of M rows takes the packed GEMM (bf16_packed.cl) with the device's shape and
// tuning, as ops::linear decides.
bool packed(const Device& dev, uint32_t M) {
  const uint32_t from = ops::bf16_packed_rows_from(dev);
  return dev.kernel_shape() == KernelShape::Chunks && from != 0 && M >= from;
}

// An output's K products p(k) summed exactly (in double), with the magnitudes the bound needs.
struct Sums {
  double sum = 0, abs = 0, big = 0;  // the sum, the sum of |p| and the largest |p|
  double chain = 0;                  // the packed chain's partial sums' magnitudes, summed
};
template <class Product>
Sums sums_of(uint32_t K, Product p) {
  Sums r;
  double partial = 0;
  for (uint32_t k = 0; k < K; k += 2) {  // the packed GEMM's order: each pair's odd element first
    for (const uint32_t e : {k + 1, k}) {
      if (e >= K) continue;
      const double v = p(e);
      r.sum += v;
      r.abs += std::abs(v);
      r.big = std::max(r.big, std::abs(v));
      partial += v;
      r.chain += std::abs(partial);
    }
  }
  return r;
}

// The f32 sum's error bound in the GEMM that ran (above); `extra`: a further term of the output
// (the bias), added once.
double tolerance(uint32_t K, const Sums& s, bool packed, double extra = 0) {
  return packed ? 1.01 * FLT_EPSILON * (s.chain + std::abs(s.sum) + std::abs(extra))
                : (K / 8.0 + 40.0) * FLT_EPSILON * (s.abs + std::abs(extra));
}

class GemmBf16 : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmBf16, SelectsTheDotProductWhereTheHostHasIt) {
  const GemmCase& c = GetParam();
  Device& dev = test::default_device();
  DeviceScope scope(dev, c);
  const bool pocl = dev.info().platform.find("Portable Computing Language") != std::string::npos;
  const bool host = __builtin_cpu_supports("avx512bf16");
  EXPECT_EQ(ops::bf16_dot_product(dev),
            c.variant == Variant::DotProduct && pocl && host && dev.info().kind == DeviceKind::Cpu);
}

// Whether /proc/cpuinfo lists a flag of the first CPU (Linux names AMX's as amx_tile, amx_bf16
// where the kernel supports them).
bool cpuinfo_flag(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0)
      return (line + " ").find(" " + flag + " ") != std::string::npos;
  return false;
}

// (The forced-tile cases turn AMX off: it would take their rows.)
TEST_P(GemmBf16, SelectsAmxWhereTheHostHasIt) {
  const GemmCase& c = GetParam();
  Device& dev = test::default_device();
  DeviceScope scope(dev, c);
  const bool pocl = dev.info().platform.find("Portable Computing Language") != std::string::npos;
  const bool host = cpuinfo_flag("amx_tile") && cpuinfo_flag("amx_bf16");
  EXPECT_EQ(ops::bf16_amx(dev), c.variant == Variant::DotProduct && c.tm == 0 && pocl && host &&
                                    dev.info().kind == DeviceKind::Cpu);
}

TEST_P(GemmBf16, LinearMatchesDoubleReferenceOnRoundedInputs) {
  const GemmCase& c = GetParam();
  Device& dev = test::default_device();
  DeviceScope scope(dev, c);
  const uint32_t M = c.M, N = c.N, K = c.K, ldx = K + 3, ldy = N + 5;
  std::vector<float> x = random_vec(size_t(M) * ldx, 11);
  std::vector<float> wv = random_vec(size_t(N) * K, 12), bv = random_vec(N, 13);
  std::vector<float> y0 = random_vec(size_t(M) * ldy, 14);
  Weight w = bf16_weight(dev, wv, {N, K}, "w"), b = bf16_weight(dev, bv, {N}, "b");
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
  const float alpha = 0.75f;
  for (bool acc : {false, true}) {
    cl::Mem ym = test::upload_bytes(dev, y0.data(), y0.size() * 4);
    ops::linear(dev, xm, 2, ldx, w, &b, ym, 1, ldy, M, alpha, acc, ComputeDType::BF16);
    cl::Mem yf = test::upload_bytes(dev, y0.data(), y0.size() * 4);
    ops::linear(dev, xm, 2, ldx, w, &b, yf, 1, ldy, M, alpha, acc, ComputeDType::F32);
    std::vector<float> y = download(dev, ym, y0.size()), f32 = download(dev, yf, y0.size());
    size_t moved = 0;
    for (uint32_t m = 0; m < M; ++m)
      for (uint32_t n = 0; n < N; ++n) {
        const Sums s = sums_of(K, [&](uint32_t k) {
          return double(round_bf16(x[m * ldx + 2 + k])) * wv[size_t(n) * K + k];
        });
        const double want = alpha * (s.sum + bv[n]) + (acc ? y0[m * ldy + 1 + n] : 0.0);
        const size_t i = size_t(m) * ldy + 1 + n;
        const double tol =
            alpha * tolerance(K, s, packed(dev, M), bv[n]) + 2 * FLT_EPSILON * std::abs(want);
        ASSERT_NEAR(y[i], want, tol) << "m " << m << " n " << n << " accumulate " << acc;
        moved += std::abs(f32[i] - want) > tol;  // the f32 path does not round x
      }
    // Columns outside [1, 1 + N) of each row are untouched.
    for (uint32_t m = 0; m < M; ++m) {
      EXPECT_EQ(y[size_t(m) * ldy], y0[size_t(m) * ldy]);
      for (uint32_t n = N + 1; n < ldy; ++n) EXPECT_EQ(y[size_t(m) * ldy + n], y0[size_t(m) * ldy + n]);
    }
    EXPECT_GT(moved, size_t(M) * N / 2) << "the reference must tell bf16 from f32 activations";
  }
}

TEST_P(GemmBf16, FusedQkvWithNormMatchesDoubleReference) {
  const GemmCase& c = GetParam();
  Device& dev = test::default_device();
  DeviceScope scope(dev, c);
  const uint32_t M = c.M, K = c.K;
  const uint32_t Ns[3] = {c.N, c.N / 2 + 1, 7};
  const uint32_t N = Ns[0] + Ns[1] + Ns[2], ldy = N + 2;
  const float eps = 1e-5f, alpha = 1.25f;
  std::vector<float> x = random_vec(size_t(M) * K, 21, 3.0f), g = random_vec(K, 22, 2.0f);
  Weight gw = bf16_weight(dev, g, {K}, "norm");
  std::vector<std::vector<float>> wv;
  std::vector<Weight> ws;
  for (int i = 0; i < 3; ++i) {
    wv.push_back(random_vec(size_t(Ns[i]) * K, 23 + i));
    ws.push_back(bf16_weight(dev, wv.back(), {Ns[i], K}, "w" + std::to_string(i)));
  }
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4), ym = dev.alloc(size_t(M) * ldy * 4);
  dev.fill_zero(ym, size_t(M) * ldy * 4);
  ops::linear_fused(dev, xm, 0, K, nullptr, &gw, eps, {&ws[0], &ws[1], &ws[2]}, ym, 0, ldy, M,
                    alpha, false, ComputeDType::BF16);
  std::vector<float> y = download(dev, ym, size_t(M) * ldy);
  for (uint32_t m = 0; m < M; ++m) {
    double ss = 0;
    for (uint32_t k = 0; k < K; ++k) ss += double(x[m * K + k]) * x[m * K + k];
    const double inv = 1.0 / std::sqrt(ss / K + eps);
    std::vector<float> xn(K);
    for (uint32_t k = 0; k < K; ++k) xn[k] = round_bf16(float(x[m * K + k] * inv * g[k]));
    uint32_t col = 0;
    for (int i = 0; i < 3; ++i)
      for (uint32_t n = 0; n < Ns[i]; ++n, ++col) {
        const Sums s =
            sums_of(K, [&](uint32_t k) { return double(xn[k]) * wv[i][size_t(n) * K + k]; });
        const double tol = alpha * (tolerance(K, s, packed(dev, M)) + 2 * std::ldexp(s.big, -8));
        ASSERT_NEAR(y[size_t(m) * ldy + col], alpha * s.sum, tol) << "m " << m << " column " << col;
      }
  }
}

TEST_P(GemmBf16, SwigluWithNormMatchesDoubleReference) {
  const GemmCase& c = GetParam();
  Device& dev = test::default_device();
  DeviceScope scope(dev, c);
  const uint32_t M = c.M, F = c.N, K = c.K;
  const float eps = 1e-6f;
  std::vector<float> x = random_vec(size_t(M) * K, 31, 2.0f), g = random_vec(K, 32, 1.5f);
  std::vector<float> gv = random_vec(size_t(F) * K, 33), uv = random_vec(size_t(F) * K, 34);
  Weight nw = bf16_weight(dev, g, {K}, "norm"), gate = bf16_weight(dev, gv, {F, K}, "gate"),
         up = bf16_weight(dev, uv, {F, K}, "up");
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4), ym = dev.alloc(size_t(M) * F * 4);
  ops::linear_swiglu(dev, xm, 0, K, &nw, eps, gate, up, ym, 0, F, M, ComputeDType::BF16);
  std::vector<float> y = download(dev, ym, size_t(M) * F);
  for (uint32_t m = 0; m < M; ++m) {
    double ss = 0;
    for (uint32_t k = 0; k < K; ++k) ss += double(x[m * K + k]) * x[m * K + k];
    const double inv = 1.0 / std::sqrt(ss / K + eps);
    std::vector<float> xn(K);
    for (uint32_t k = 0; k < K; ++k) xn[k] = round_bf16(float(x[m * K + k] * inv * g[k]));
    for (uint32_t n = 0; n < F; ++n) {
      const Sums g = sums_of(K, [&](uint32_t k) { return double(xn[k]) * gv[size_t(n) * K + k]; });
      const Sums u = sums_of(K, [&](uint32_t k) { return double(xn[k]) * uv[size_t(n) * K + k]; });
      const double sg = g.sum, su = u.sum;
      const double eg = tolerance(K, g, packed(dev, M)) + 2 * std::ldexp(g.big, -8);
      const double eu = tolerance(K, u, packed(dev, M)) + 2 * std::ldexp(u.big, -8);
      const double silu = sg / (1 + std::exp(-sg));
      // d silu / d g <= 1.1 everywhere; plus the epilogue's few f32 roundings.
      const double tol = 1.1 * eg * (std::abs(su) + eu) + std::abs(silu) * eu +
                         8 * FLT_EPSILON * std::abs(silu * su);
      ASSERT_NEAR(y[size_t(m) * F + n], silu * su, tol) << "m " << m << " n " << n;
    }
  }
}

// compute_dtype f32 over the same bf16 weights: the rows are not rounded. From
// gemm_bf16_packed_rows rows on the CPU shape the packed GEMM runs on the f32 rows as they are
// (bf16_packed.cl's PANEL_XF32, one chain per output in the order sums_of takes), else the f32
// tiles: linear (bias, alpha, accumulate, an offset and padded rows), linear_fused (three weights
// side by side) and linear_swiglu, each against the double reference on the unrounded rows within
// the bound of the GEMM that ran. Where the packed GEMM runs, the tiles (packed GEMM off) must give
// other bits for over a tenth of the outputs: the cases do reach it. (AMX's f32 terms, which would
// take these rows on a host with AMX, are off: GemmF32AmxTerms.)
TEST_P(GemmBf16, F32RowsOverBf16WeightsMatchDoubleReference) {
  const GemmCase& c = GetParam();
  Device& dev = test::default_device();
  DeviceScope scope(dev, c);
  KernelTuning no_terms = dev.tuning();
  no_terms.gemm_f32_amx_rows = 0;
  test::TuningScope fma_kernels(dev, no_terms);
  const uint32_t M = c.M, N = c.N, K = c.K, ldx = K + 3, ldy = 4 * N + 10;
  // f32 rows take the packed GEMM from gemm_bf16_packed_rows rows (AMX's threshold is bf16's).
  const uint32_t from = dev.tuning().gemm_bf16_packed_rows;
  const bool pk = dev.kernel_shape() == KernelShape::Chunks && from != 0 && M >= from;
  // Where the panel does not fit the device's local memory, launch_bf16_packed declines and the
  // tiles run (an NVIDIA work-group's 48 KiB at K = 2101).
  const bool pk_runs =
      pk && ops::packed_gemm_shape(dev, ops::PackedRows::F32, false, std::nullopt, true, K).fits;
  std::vector<float> x = random_vec(size_t(M) * ldx, 41, 2.0f);
  std::vector<float> wv = random_vec(size_t(N) * K, 42), uv = random_vec(size_t(N) * K, 43),
                     vv = random_vec(size_t(7) * K, 44), bv = random_vec(N, 45);
  std::vector<float> y0 = random_vec(size_t(M) * ldy, 46);
  Weight w = bf16_weight(dev, wv, {N, K}, "w"), u = bf16_weight(dev, uv, {N, K}, "u"),
         v = bf16_weight(dev, vv, {7, K}, "v"), b = bf16_weight(dev, bv, {N}, "b");
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
  const float alpha = 0.75f;
  auto product = [&](const std::vector<float>& wt, uint32_t m, uint32_t n) {
    return sums_of(K,
                   [&](uint32_t k) { return double(x[m * ldx + 2 + k]) * wt[size_t(n) * K + k]; });
  };
  // The three launches into y: linear at column 1, linear_fused's w|u|v from N + 1, swiglu from
  // 3 N + 8.
  auto run = [&](bool acc) {
    cl::Mem ym = test::upload_bytes(dev, y0.data(), y0.size() * 4);
    ops::linear(dev, xm, 2, ldx, w, &b, ym, 1, ldy, M, alpha, acc, ComputeDType::F32);
    ops::linear_fused(dev, xm, 2, ldx, nullptr, nullptr, 0.0f, {&w, &u, &v}, ym, N + 1, ldy, M,
                      1.0f, false, ComputeDType::F32);
    ops::linear_swiglu(dev, xm, 2, ldx, nullptr, 0.0f, w, u, ym, 3 * N + 8, ldy, M,
                       ComputeDType::F32);
    return download(dev, ym, y0.size());
  };
  for (bool acc : {false, true}) {
    const std::vector<float> y = run(acc);
    for (uint32_t m = 0; m < M; ++m) {
      const float* row = &y[size_t(m) * ldy];
      for (uint32_t n = 0; n < N; ++n) {
        const Sums s = product(wv, m, n), su = product(uv, m, n);
        const double want = alpha * (s.sum + bv[n]) + (acc ? y0[m * ldy + 1 + n] : 0.0);
        ASSERT_NEAR(row[1 + n], want,
                    alpha * tolerance(K, s, pk, bv[n]) + 2 * FLT_EPSILON * std::abs(want))
            << "linear m " << m << " n " << n << " accumulate " << acc;
        if (acc) continue;
        ASSERT_NEAR(row[N + 1 + n], s.sum, tolerance(K, s, pk)) << "fused w m " << m << " n " << n;
        ASSERT_NEAR(row[2 * N + 1 + n], su.sum, tolerance(K, su, pk)) << "fused u m " << m;
        const double eg = tolerance(K, s, pk), eu = tolerance(K, su, pk);
        const double silu = s.sum / (1 + std::exp(-s.sum));
        ASSERT_NEAR(row[3 * N + 8 + n], silu * su.sum,
                    1.1 * eg * (std::abs(su.sum) + eu) + std::abs(silu) * eu +
                        8 * FLT_EPSILON * std::abs(silu * su.sum))
            << "swiglu m " << m << " n " << n;
      }
      for (uint32_t n = 0; n < 7; ++n) {
        const Sums s = product(vv, m, n);
        ASSERT_NEAR(row[3 * N + 1 + n], s.sum, tolerance(K, s, pk)) << "fused v m " << m;
      }
    }
  }
  if (!pk_runs) return;
  std::vector<float> packed_out = run(false), tiles_out;
  {
    KernelTuning t = dev.tuning();
    t.gemm_bf16_packed_rows = 0;
    test::TuningScope off(dev, t);
    tiles_out = run(false);
  }
  size_t differ = 0;
  for (size_t i = 0; i < packed_out.size(); ++i)
    differ += std::memcmp(&packed_out[i], &tiles_out[i], 4) != 0;
  EXPECT_GT(differ, size_t(M) * N / 10);
}

// The M x N outputs of the bf16-compute GEMM over x [M, K] under the device's present tuning:
// linear with w, or with glu linear_swiglu with gate w and up u.
std::vector<float> bf16_product(Device& dev, bool glu, const cl::Mem& x, const Weight& w,
                                const Weight& u, uint32_t M, uint32_t N, uint32_t K) {
  cl::Mem y = dev.alloc(size_t(M) * N * 4);
  if (glu)
    ops::linear_swiglu(dev, x, 0, K, nullptr, 0.0f, w, u, y, 0, N, M, ComputeDType::BF16);
  else
    ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, M, 1.0f, false, ComputeDType::BF16);
  return download(dev, y, size_t(M) * N);
}

// Case c's GEMM at bf16 compute over x (linear with w, or with glu linear_swiglu with gate w and up
// u), run with vdpbf16ps (where the host has it) and with the portable micro-kernel: the same bits.
// With expect_packed, both runs must take the packed GEMM.
void expect_variants_agree(Device& dev, GemmCase c, bool glu, const cl::Mem& x, const Weight& w,
                           const Weight& u, bool expect_packed) {
  const uint32_t M = c.M, N = c.N, K = c.K;
  std::vector<float> out[2];
  for (Variant v : {Variant::DotProduct, Variant::Portable}) {
    c.variant = v;
    DeviceScope scope(dev, c);
    if (expect_packed) {
      ASSERT_TRUE(packed(dev, M));
    }
    out[int(v)] = bf16_product(dev, glu, x, w, u, M, N, K);
  }
  for (size_t i = 0; i < out[0].size(); ++i)
    ASSERT_EQ(std::memcmp(&out[0][i], &out[1][i], 4), 0) << i;
}

// The operands of the micro-kernel comparisons below: x rows [M, K] (f32, up to 4 in magnitude)
// and a bf16 weight w and a second one u (GLU's up) [N, K], random from seed, seed + 1, seed + 2.
struct GluOperands {
  cl::Mem x;
  Weight w, u;
};
GluOperands glu_operands(Device& dev, uint32_t M, uint32_t N, uint32_t K, uint32_t seed) {
  std::vector<float> x = random_vec(size_t(M) * K, seed, 4.0f),
                     wv = random_vec(size_t(N) * K, seed + 1),
                     uv = random_vec(size_t(N) * K, seed + 2);
  return {test::upload_bytes(dev, x.data(), x.size() * 4), bf16_weight(dev, wv, {N, K}, "w"),
          bf16_weight(dev, uv, {N, K}, "u")};
}

// The two micro-kernels add the same exact products in the same order (vdpbf16ps's: the odd
// element of each pair, then the even one) and reduce the lanes in hsum16's order (the dot
// product 16 accumulators at once, the portable kernel one by one): on inputs without bf16
// denormals they agree to the bit. Where the device has no dot product both runs are the portable
// kernel. Odd K (rows on 2-byte boundaries: the portable kernel's ushort loads) and even K (its
// 4-byte word loads); linear and the GLU epilogue; tiles of 24, 32, 4 and 6 sums (3 x 2; with GLU 3 + 3) (the reduction's
// groups of 16, whole and padded) besides the device's own.
TEST(GemmBf16Variants, DotProductAndPortableAgreeToTheBit) {
  Device& dev = test::default_device();
  KernelTuning no_amx = dev.tuning();
  no_amx.gemm_bf16_amx = 0;  // the tiles, which AMX's packed GEMM would take from 8 rows
  test::TuningScope scope(dev, no_amx);
  const uint32_t M = 9, N = 23;
  for (const uint32_t K : {333u, 334u}) {
    const GluOperands ops_in = glu_operands(dev, M, N, K, 41);
    const cl::Mem& xm = ops_in.x;
    const Weight &w = ops_in.w, &u = ops_in.u;
    for (const auto& [tm, tn] : std::vector<std::pair<uint32_t, uint32_t>>{
             {0, 0}, {4, 6}, {8, 4}, {4, 1}, {3, 2}}) {
      for (const bool glu : {false, true}) {
        SCOPED_TRACE("K=" + std::to_string(K) + " tile " + std::to_string(tm) + "x" +
                     std::to_string(tn) + (glu ? " glu" : ""));
        expect_variants_agree(dev,
                              GemmCase{M, N, K, Variant::DotProduct, KernelShape::Chunks, tm, tn},
                              glu, xm, w, u, false);
      }
    }
  }
}

// The packed GEMM's two micro-kernels likewise: one chain per output in vdpbf16ps's order, so the
// same bits on inputs without bf16 denormals. Odd and even K, one chunk and several (K = 2101: 1051
// pair steps, whose partial sums wait in local memory between chunks), linear and the GLU
// epilogue, and its tiles of 4 x 3 vectors of 16 columns (the default), 8 x 2 and 6 x 4.
TEST(GemmBf16Variants, PackedDotProductAndPortableAgreeToTheBit) {
  Device& dev = test::default_device();
  KernelTuning no_amx = dev.tuning();
  no_amx.gemm_bf16_amx = 0;  // AMX's tiles round otherwise (PackedAmxRunsWhereSelected)
  test::TuningScope scope(dev, no_amx);
  const uint32_t M = 130, N = 37;
  for (const uint32_t K : {333u, 334u, 2101u}) {
    const GluOperands ops_in = glu_operands(dev, M, N, K, 44);
    const cl::Mem& xm = ops_in.x;
    const Weight &w = ops_in.w, &u = ops_in.u;
    for (const auto& [ptm, pnv] :
         std::vector<std::pair<uint32_t, uint32_t>>{{4, 3}, {8, 2}, {6, 4}}) {
      for (const bool glu : {false, true}) {
        SCOPED_TRACE("K=" + std::to_string(K) + " packed tile " + std::to_string(ptm) + "x" +
                     std::to_string(pnv) + (glu ? " glu" : ""));
        GemmCase c{M, N, K, Variant::DotProduct};
        c.ptm = ptm;
        c.pnv = pnv;
        expect_variants_agree(dev, c, glu, xm, w, u, true);
      }
    }
  }
}

// body(operands, K, glu) over K of one panel chunk and of two (333 and 2101, both odd) and over
// linear and the GLU epilogue, with M x N operands from seed (glu_operands).
void over_chunks_and_glu(Device& dev, uint32_t M, uint32_t N, uint32_t seed,
                         const std::function<void(const GluOperands&, uint32_t, bool)>& body) {
  for (const uint32_t K : {333u, 2101u}) {
    const GluOperands ops_in = glu_operands(dev, M, N, K, seed);
    for (const bool glu : {false, true}) {
      SCOPED_TRACE("K=" + std::to_string(K) + (glu ? " glu" : ""));
      body(ops_in, K, glu);
    }
  }
}

// AMX's tdpbf16ps (bf16_packed.cl, where the host has it) does not round as the chain of the
// other micro-kernels: against host emulations of 16 x 16 outputs over K = 320 it matched
// vdpbf16ps's order in 86, the even-first order in 88 and each 32-element group summed exactly,
// then added, in 143 (2026-11-29, Xeon with AMX). So where the device selects it, some outputs of
// the packed GEMM differ from the dot product's bits (the Sizes cases hold both to the double
// reference), and where it does not, the two runs are the same kernel: linear and the GLU
// epilogue, a partial last row tile, odd K and K of several chunks.
TEST(GemmBf16Variants, PackedAmxRunsWhereSelected) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t M = 133, N = 90;
  over_chunks_and_glu(dev, M, N, 61, [&](const GluOperands& o, uint32_t K, bool glu) {
    std::vector<float> out[2];
    bool selected = false;
    for (const uint32_t amx : {0u, 1u}) {
      KernelTuning t = dev.tuning();
      t.gemm_bf16_amx = amx;
      t.gemm_bf16_packed_rows = 128;
      test::TuningScope scope(dev, t);
      if (amx) selected = ops::bf16_amx(dev);
      out[amx] = bf16_product(dev, glu, o.x, o.w, o.u, M, N, K);
    }
    size_t differ = 0;
    for (size_t i = 0; i < out[0].size(); ++i)
      differ += std::memcmp(&out[0][i], &out[1][i], 4) != 0;
    if (selected) {
      EXPECT_GT(differ, out[0].size() / 10) << "AMX's tiles must have run";
    } else {
      EXPECT_EQ(differ, 0u);
    }
  });
}

// A packed GEMM output's bits do not depend on the tile around it: 2 vectors of 16 columns against
// 3 (with GLU 2 against 4), with AMX where the device selects it and with the micro-kernels
// elsewhere: linear and the GLU epilogue, 45 rows (a partial last row tile), K of one chunk and of
// two (the partial sums between them).
TEST(GemmBf16Packed, OutputBitsDoNotDependOnTheTile) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t M = 45, N = 90;
  over_chunks_and_glu(dev, M, N, 81, [&](const GluOperands& o, uint32_t K, bool glu) {
    std::vector<float> out[2];
    for (const uint32_t nv : {2u, 3u}) {
      KernelTuning t = dev.tuning();
      t.gemm_bf16_packed_rows = 8;
      t.gemm_bf16_packed_nv = glu && nv == 3 ? 4 : nv;
      test::TuningScope scope(dev, t);
      ASSERT_TRUE(packed(dev, M));
      out[nv - 2] = bf16_product(dev, glu, o.x, o.w, o.u, M, N, K);
    }
    for (size_t i = 0; i < out[0].size(); ++i)
      ASSERT_EQ(std::memcmp(&out[0][i], &out[1][i], 4), 0) << i;
  });
}

// Nor on the chunks its panel runs in (gemm_bf16_packed_kp): a row's partial sums wait in local
// memory between chunks as f32, and the chain goes on in the same order. K = 333 (167 pair steps)
// in one chunk against chunks of 48 steps (the last one short); K = 2101 (1051 steps) in chunks of
// 1024 against 256 and 16 (66 chunks).
TEST(GemmBf16Packed, OutputBitsDoNotDependOnTheChunk) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t M = 45, N = 90;
  over_chunks_and_glu(dev, M, N, 83, [&](const GluOperands& o, uint32_t K, bool glu) {
    const std::vector<uint32_t> chunks =
        K < 1000 ? std::vector<uint32_t>{1024, 48} : std::vector<uint32_t>{1024, 256, 16};
    std::vector<std::vector<float>> out;
    for (const uint32_t kp : chunks) {
      KernelTuning t = dev.tuning();
      t.gemm_bf16_packed_rows = 8;
      t.gemm_bf16_packed_kp = kp;
      test::TuningScope scope(dev, t);
      ASSERT_TRUE(packed(dev, M));
      out.push_back(bf16_product(dev, glu, o.x, o.w, o.u, M, N, K));
    }
    for (size_t c = 1; c < out.size(); ++c) {
      SCOPED_TRACE("chunk of " + std::to_string(chunks[c]) + " steps");
      for (size_t i = 0; i < out[0].size(); ++i)
        ASSERT_EQ(std::memcmp(&out[0][i], &out[c][i], 4), 0) << i;
    }
  });
}

// Nor on whether the portable micro-kernel's panel holds the weights as bf16 pairs that each step
// widens or as f32 widened once at the pack (gemm_bf16_packed_wf32): the same products in the same
// order. bf16 rows (compute_dtype bf16, the dot product off) and f32 rows (f32 compute over bf16
// weights, packed_f32_rows); linear and the GLU epilogue, a partial last row tile, K of one chunk
// and of two.
TEST(GemmBf16Packed, WidenedPanelGivesTheWordPanelsBits) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t M = 45, N = 90;
  over_chunks_and_glu(dev, M, N, 85, [&](const GluOperands& o, uint32_t K, bool glu) {
    for (const ComputeDType compute : {ComputeDType::BF16, ComputeDType::F32}) {
      SCOPED_TRACE(compute == ComputeDType::BF16 ? "bf16 rows" : "f32 rows");
      std::vector<float> out[2];
      for (const uint32_t wf32 : {0u, 1u}) {
        KernelTuning t = dev.tuning();
        t.gemm_bf16_dot = 0;
        t.gemm_bf16_amx = 0;
        t.gemm_f32_amx_rows = 0;
        t.gemm_bf16_packed_rows = 8;
        t.gemm_bf16_packed_kp = 256;  // a widened panel that fits (WidenedPanelWhereItFits)
        t.gemm_bf16_packed_wf32 = wf32;
        test::TuningScope scope(dev, t);
        ASSERT_TRUE(packed(dev, M));
        const ops::PackedRows rows =
            compute == ComputeDType::BF16 ? ops::PackedRows::Bf16 : ops::PackedRows::F32;
        EXPECT_EQ(ops::packed_gemm_shape(dev, rows, glu, std::nullopt, false, K)
                          .options.find(" -DPANEL_WF32=1") != std::string::npos,
                  wf32 == 1);
        cl::Mem y = dev.alloc(size_t(M) * N * 4);
        if (glu)
          ops::linear_swiglu(dev, o.x, 0, K, nullptr, 0.0f, o.w, o.u, y, 0, N, M, compute);
        else
          ops::linear(dev, o.x, 0, K, o.w, nullptr, y, 0, N, M, 1.0f, false, compute);
        out[wf32] = download(dev, y, size_t(M) * N);
      }
      for (size_t i = 0; i < out[0].size(); ++i)
        ASSERT_EQ(std::memcmp(&out[0][i], &out[1][i], 4), 0) << i;
    }
  });
}

// The widened panel is taken where it fits the device's local memory with the rows' partial sums,
// and the pairs' panel (half its bytes) beyond while that fits: over chunks of 16 to 65536 steps at
// K = 2^20 + 1, each choice is the one the local memory allows (the panel's whole groups of 16
// steps, 16 columns per vector, 4 bytes a word, twice that widened; the partial sums 4 bytes per
// row and column), and the choices run widened, then pairs, then no fit, never back. On the
// 512 KiB of PoCL here the widened panel runs to at least 256 steps and the pairs follow; the
// 48 KiB of an NVIDIA work-group hold neither beside 512 rows' partial sums (launch_bf16_packed
// then declines, and the tiles run).
TEST(GemmBf16Packed, WidenedPanelWhereItFits) {
  Device& dev = test::default_device();
  KernelTuning t = dev.tuning();
  t.gemm_bf16_dot = 0;
  t.gemm_bf16_amx = 0;
  t.gemm_bf16_packed_wf32 = 1;
  const uint64_t local_mem = dev.info().local_mem;
  int phase = 0;  // 0 widened, 1 pairs, 2 neither fits
  uint32_t widened_up_to = 0;
  for (uint32_t kp = 16; kp <= 65536; kp += 16) {
    t.gemm_bf16_packed_kp = kp;
    test::TuningScope scope(dev, t);
    const ops::PackedGemmShape s = ops::packed_gemm_shape(dev, ops::PackedRows::F32, true,
                                                          std::nullopt, false, (1u << 20) + 1);
    ASSERT_EQ(s.chunk_steps, kp);
    ASSERT_GT(s.partial_rows, 0u);
    const uint64_t panel = uint64_t(kp + 15) / 16 * 16 * 16 * s.nv * 4,
                   partial = uint64_t(s.partial_rows) * 16 * s.nv * 4;
    const bool widened = s.options.find(" -DPANEL_WF32=1") != std::string::npos;
    ASSERT_EQ(widened, 2 * panel + partial <= local_mem) << kp;
    ASSERT_EQ(s.fits, (widened ? 2 : 1) * panel + partial <= local_mem) << kp;
    const int now = widened ? 0 : s.fits ? 1 : 2;
    ASSERT_GE(now, phase) << "chunk " << kp << " steps, local memory " << local_mem << " bytes";
    phase = now;
    if (widened) widened_up_to = kp;
  }
  if (local_mem >= 512 * 1024) {
    EXPECT_GE(widened_up_to, 256u);
  }
}

// The packed GEMM takes bf16 weights from gemm_bf16_packed_rows rows and not below, sums each row
// alone (the first 130 rows of a 200-row product are a 130-row product's, bit for bit), and rounds
// in its own order: some of its outputs differ from the tiles' (where a row takes which GEMM, it
// gets that GEMM's bits). With AMX (where the device selects it) each row is summed alone too:
// its first 9 and 130 rows of a 200-row product are those of the 9- and 130-row products (9 rows
// take the packed GEMM with AMX only; elsewhere the tiles, so only the 130 rows are compared).
TEST(GemmBf16Packed, TakesItsRowsAndSumsEachRowAlone) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t N = 50, K = 301;
  std::vector<float> x = random_vec(size_t(200) * K, 47, 4.0f), wv = random_vec(size_t(N) * K, 48);
  Weight w = bf16_weight(dev, wv, {N, K}, "w");
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
  bool amx_selected = false;
  auto run = [&](uint32_t M, uint32_t packed_rows, uint32_t amx = 0) {
    KernelTuning t = dev.tuning();
    t.gemm_bf16_amx = amx;  // off: AMX's own threshold is AmxTakesThePackedGemmFromItsRows'
    t.gemm_bf16_packed_rows = packed_rows;
    test::TuningScope scope(dev, t);
    amx_selected = ops::bf16_amx(dev);
    cl::Mem ym = dev.alloc(size_t(M) * N * 4);
    ops::linear(dev, xm, 0, K, w, nullptr, ym, 0, N, M, 1.0f, false, ComputeDType::BF16);
    return download(dev, ym, size_t(M) * N);
  };
  const std::vector<float> packed130 = run(130, 128), packed200 = run(200, 128);
  const std::vector<float> below = run(130, 131), never = run(130, 0);
  size_t differ = 0;
  for (size_t i = 0; i < packed130.size(); ++i) {
    ASSERT_EQ(std::memcmp(&packed130[i], &packed200[i], 4), 0) << i;
    ASSERT_EQ(std::memcmp(&below[i], &never[i], 4), 0) << i;
    differ += std::memcmp(&packed130[i], &below[i], 4) != 0;
  }
  EXPECT_GT(differ, packed130.size() / 10) << "the packed GEMM must have run from its rows";
  const std::vector<float> amx9 = run(9, 128, 1), amx130 = run(130, 128, 1),
                           amx200 = run(200, 128, 1);
  for (size_t i = 0; i < amx130.size(); ++i) {
    ASSERT_EQ(std::memcmp(&amx130[i], &amx200[i], 4), 0) << i;
    if (amx_selected && i < amx9.size()) {
      ASSERT_EQ(std::memcmp(&amx9[i], &amx200[i], 4), 0) << i;
    }
  }
}

// Where the device selects AMX, the packed GEMM takes bf16 compute from gemm_bf16_amx_rows rows
// when that is fewer than gemm_bf16_packed_rows (0 there: never): 9 rows with the threshold at 8
// are AMX's bits (a tenth of the outputs or more differ from the tiles'), with it at 10 and with
// the packed GEMM off the tiles' bits. Where it does not, all three are the tiles'. (The streaming
// GEMM, which would take the 9 rows first, is off: AmxStreamGetsThePackedGemmsBits.)
TEST(GemmBf16Packed, AmxTakesThePackedGemmFromItsRows) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t M = 9, N = 70, K = 301;
  std::vector<float> x = random_vec(size_t(M) * K, 71, 4.0f), wv = random_vec(size_t(N) * K, 72);
  Weight w = bf16_weight(dev, wv, {N, K}, "w");
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
  bool amx = false;
  auto run = [&](uint32_t packed_rows, uint32_t amx_rows) {
    KernelTuning t = dev.tuning();
    t.gemm_bf16_packed_rows = packed_rows;
    t.gemm_bf16_amx_rows = amx_rows;
    t.gemm_bf16_amx_stream_rows = 0;
    test::TuningScope scope(dev, t);
    amx = ops::bf16_amx(dev);
    EXPECT_EQ(ops::bf16_packed_rows_from(dev), packed_rows == 0 ? 0u
                                               : amx            ? std::min(packed_rows, amx_rows)
                                                                : packed_rows);
    cl::Mem ym = dev.alloc(size_t(M) * N * 4);
    ops::linear(dev, xm, 0, K, w, nullptr, ym, 0, N, M, 1.0f, false, ComputeDType::BF16);
    return download(dev, ym, size_t(M) * N);
  };
  const std::vector<float> at8 = run(128, 8), at10 = run(128, 10), off = run(0, 8);
  size_t differ = 0;
  for (size_t i = 0; i < off.size(); ++i) {
    ASSERT_EQ(std::memcmp(&at10[i], &off[i], 4), 0) << i;
    differ += std::memcmp(&at8[i], &off[i], 4) != 0;
  }
  if (amx) {
    EXPECT_GT(differ, off.size() / 10) << "AMX's tiles must have run at 9 rows";
  } else {
    EXPECT_EQ(differ, 0u);
  }
}

// The inputs of the AMX tests below, drawn from seeds seed .. seed + 7: x [rows, K] (scale 4), w
// and u [N, K], bias b [N], q/k/v's three weights of Ns rows and y0 [rows, ldy]; wv, uv, bv and qv
// the weights' values as the kernels see them (rounded to bf16).
struct AmxInputs {
  std::vector<float> x, wv, uv, bv, y0;
  std::vector<std::vector<float>> qv;
  Weight w, u, b;
  std::vector<Weight> qkv;
  cl::Mem xm;
};
AmxInputs amx_inputs(Device& dev, uint32_t rows, uint32_t K, uint32_t N, uint32_t ldy,
                     const uint32_t (&Ns)[3], uint32_t seed) {
  AmxInputs in;
  in.x = random_vec(size_t(rows) * K, seed, 4.0f);
  in.wv = random_vec(size_t(N) * K, seed + 1);
  in.uv = random_vec(size_t(N) * K, seed + 2);
  in.bv = random_vec(N, seed + 3);
  in.y0 = random_vec(size_t(rows) * ldy, seed + 4);
  in.w = bf16_weight(dev, in.wv, {N, K}, "w");
  in.u = bf16_weight(dev, in.uv, {N, K}, "u");
  in.b = bf16_weight(dev, in.bv, {N}, "b");
  for (uint32_t i = 0; i < 3; ++i) {
    in.qv.push_back(random_vec(size_t(Ns[i]) * K, seed + 5 + i));
    in.qkv.push_back(bf16_weight(dev, in.qv.back(), {Ns[i], K}, "qkv" + std::to_string(i)));
  }
  in.xm = test::upload_bytes(dev, in.x.data(), in.x.size() * 4);
  return in;
}

// The three GEMMs of the AMX tests below over x's M rows at `compute`, each into a copy of y0's
// first M rows [M, ldy]: 0, linear with w and bias b, alpha 0.5, accumulating; 1, q/k/v's three
// weights side by side; 2, GLU with gate w and up u.
std::vector<std::vector<float>> three_products(Device& dev, ComputeDType compute, const cl::Mem& xm,
                                               uint32_t K, const Weight& w, const Weight& b,
                                               const Weight& u, const std::vector<Weight>& qkv,
                                               const std::vector<float>& y0, uint32_t M,
                                               uint32_t ldy) {
  std::vector<std::vector<float>> out;
  for (int op = 0; op < 3; ++op) {
    cl::Mem y = test::upload_bytes(dev, y0.data(), size_t(M) * ldy * 4);
    if (op == 0)
      ops::linear(dev, xm, 0, K, w, &b, y, 0, ldy, M, 0.5f, true, compute);
    else if (op == 1)
      ops::linear_fused(dev, xm, 0, K, nullptr, nullptr, 0.0f, {&qkv[0], &qkv[1], &qkv[2]}, y, 0,
                        ldy, M, 1.0f, false, compute);
    else
      ops::linear_swiglu(dev, xm, 0, K, nullptr, 0.0f, w, u, y, 0, ldy, M, compute);
    out.push_back(download(dev, y, size_t(M) * ldy));
  }
  return out;
}

// Decode batches with AMX (up to gemm_bf16_amx_stream_rows rows) read the bf16 weights where they
// lie as AMX's A operand (bf16_amx_stream.cl): each output gets the bits of the packed GEMM's AMX
// tiles over the same rows, whose operands it exchanges (tdpbf16ps adds a group's products in the
// same order either way round on the Xeon with AMX here), with 1, 2 and 4 groups of 16 weight
// rows per unit. Over 4, 9, 16, 23 and 32 rows (one and two tiles of batch rows): linear with a
// bias, alpha and accumulation into a strided y, q/k/v side by side whose second and third weights
// start off a 16-row group (the staged sources), and the GLU epilogue; N = 90 (a partial last unit,
// staged) and K = 333 (odd: the last group staged, zero past K) and 2048 (whole groups only; the
// packed GEMM in two chunks there). That the streaming GEMM ran: the packed GEMM off, its bits
// still AMX's (a tenth or more of the outputs differ from the tiles'). Where the device does not
// select AMX it never runs: the tiles' bits with it on and off.
TEST(GemmBf16Packed, AmxStreamGetsThePackedGemmsBits) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t N = 90, ldy = N + 3;
  const uint32_t Ns[3] = {37, 19, 34};  // q/k/v: k starts at 37, v at 56
  for (const uint32_t K : {333u, 2048u}) {
    const AmxInputs in = amx_inputs(dev, 32, K, N, ldy, Ns, 91);
    for (const uint32_t M : {4u, 9u, 16u, 23u, 32u}) {
      // 0: linear (bias, alpha 0.5, accumulating), 1: q/k/v, 2: GLU; each [M, ldy].
      auto run = [&](uint32_t stream_rows, uint32_t packed_rows, uint32_t na) {
        KernelTuning t = dev.tuning();
        t.gemm_bf16_amx_stream_rows = stream_rows;
        t.gemm_bf16_amx_stream_na = na;
        t.gemm_bf16_packed_rows = packed_rows;
        t.gemm_bf16_amx_rows = 1;
        test::TuningScope scope(dev, t);
        return three_products(dev, ComputeDType::BF16, in.xm, K, in.w, in.b, in.u, in.qkv, in.y0, M,
                              ldy);
      };
      const bool amx = ops::bf16_amx(dev);
      {
        KernelTuning t = dev.tuning();
        t.gemm_bf16_amx_stream_rows = 40;
        test::TuningScope scope(dev, t);
        EXPECT_EQ(ops::bf16_amx_stream_rows(dev), amx ? 32u : 0u) << "at most 32 rows";
      }
      const auto packed_amx = run(0, 128, 2), tiles = run(0, 0, 2);
      for (const uint32_t na : {1u, 2u, 4u}) {
        const auto streamed = run(32, 0, na);
        for (int op = 0; op < 3; ++op) {
          SCOPED_TRACE("K=" + std::to_string(K) + " M=" + std::to_string(M) +
                       " na=" + std::to_string(na) + " op " + std::to_string(op));
          size_t differ = 0;
          for (size_t i = 0; i < streamed[op].size(); ++i) {
            ASSERT_EQ(std::memcmp(&streamed[op][i], &(amx ? packed_amx : tiles)[op][i], 4), 0)
                << "row " << i / ldy << " column " << i % ldy;
            differ += std::memcmp(&streamed[op][i], &tiles[op][i], 4) != 0;
          }
          if (amx) {
            EXPECT_GT(differ, streamed[op].size() / 10) << "AMX must have run";
          }
        }
      }
    }
  }
}

// compute_dtype f32 over bf16 weights with AMX (from KernelTuning's gemm_f32_amx_rows rows, here
// set to 4): each f32 row as three bf16 terms whose sum is the row exactly (linear_bf16.cl's
// bf16_terms), each term's products with the bf16 weights exact in f32. Through identity weights (N
// = K; and q/k/v, the identity's rows over three weights starting at rows 37 and 56) every output
// is one element of x times 1 plus zeros, so its terms add without rounding: y must equal x bit for
// bit, where one term gives bf16(x) and two lose x's last 8 significand bits. Over 4, 9, 17 and 32
// rows (the streaming GEMM, one and two tiles of batch rows) and 33 and 70 (the packed one), K =
// 333 (staged last groups) and 2100 (the packed GEMM in two panel chunks). The rows: random values
// with all 24 significand bits in use and exponents over [2^-27, 2^24], and +-3e38 (a rounded
// first term would overflow) and +-1e-30. (Values below 2^-110 or so would lose their last terms
// to AMX's flush of bf16 denormals, and -0.0 comes back +0.0, as from every f32 kernel: sums start
// at +0.) Where the device does not select AMX, the f32 kernels give x too.
TEST(GemmF32AmxTerms, IdentityWeightsGiveTheRowsBackBitForBit) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  KernelTuning t = dev.tuning();
  t.gemm_f32_amx_rows = 4;
  test::TuningScope from4(dev, t);
  std::mt19937 rng(7);
  for (const uint32_t K : {333u, 2100u}) {
    std::vector<float> eye(size_t(K) * K, 0.0f);
    for (uint32_t k = 0; k < K; ++k) eye[size_t(k) * K + k] = 1.0f;
    const Weight w = bf16_weight(dev, eye, {K, K}, "eye");
    std::vector<Weight> qkv;
    const uint32_t starts[4] = {0, 37, 56, K};
    for (int i = 0; i < 3; ++i) {
      std::vector<float> part(eye.begin() + size_t(starts[i]) * K,
                              eye.begin() + size_t(starts[i + 1]) * K);
      qkv.push_back(bf16_weight(dev, part, {starts[i + 1] - starts[i], K}, "qkv"));
    }
    for (const uint32_t M : {4u, 9u, 17u, 32u, 33u, 70u}) {
      std::vector<float> x(size_t(M) * K);
      for (float& v : x) {
        const uint32_t bits = (uint32_t(rng()) & 0x807FFFFFu) | 1u | ((100u + rng() % 51) << 23);
        std::memcpy(&v, &bits, 4);
      }
      const float special[] = {3e38f, -3e38f, 1e-30f, -1e-30f};
      for (size_t i = 0; i < std::size(special); ++i) x[i * (K + 1) % x.size()] = special[i];
      cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
      cl::Mem y = dev.alloc(x.size() * 4), q = dev.alloc(x.size() * 4);
      ops::linear(dev, xm, 0, K, w, nullptr, y, 0, K, M, 1.0f, false, ComputeDType::F32);
      ops::linear_fused(dev, xm, 0, K, nullptr, nullptr, 0.0f, {&qkv[0], &qkv[1], &qkv[2]}, q, 0, K,
                        M, 1.0f, false, ComputeDType::F32);
      const std::vector<float> yl = download(dev, y, x.size()), yq = download(dev, q, x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(std::memcmp(&yl[i], &x[i], 4), 0)
            << "linear K " << K << " M " << M << " at " << i << ": " << yl[i] << " for " << x[i];
        ASSERT_EQ(std::memcmp(&yq[i], &x[i], 4), 0)
            << "q/k/v K " << K << " M " << M << " at " << i << ": " << yq[i] << " for " << x[i];
      }
    }
  }
}

// The same GEMMs on random rows against the double reference on the unrounded rows: linear with a
// bias, alpha 0.5 and accumulation into a strided y, q/k/v whose second and third weights start
// off a 16-row group, and GLU, N = 90, over the rows and K of the test above. The bound: three
// times the packed chain's (tolerance), since each group of 16 pair steps adds three terms'
// products (the second and third 2^-8 and 2^-16 of the first), each tdpbf16ps rounding in its own
// order. That AMX ran: over a tenth of the outputs differ from the f32 kernels'
// (gemm_f32_amx_rows 0); without AMX the bits are the f32 kernels' with the field 4 and 0.
TEST(GemmF32AmxTerms, RandomRowsMatchDoubleReferenceAndRunWhereSelected) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const bool amx = ops::bf16_amx(dev);
  const uint32_t N = 90, ldy = N + 3;
  const uint32_t Ns[3] = {37, 19, 34};
  for (const uint32_t K : {333u, 2100u}) {
    const AmxInputs in = amx_inputs(dev, 70, K, N, ldy, Ns, 81);
    const std::vector<float>&x = in.x, &wv = in.wv, &uv = in.uv, &bv = in.bv, &y0 = in.y0;
    for (const uint32_t M : {4u, 9u, 17u, 32u, 33u, 70u}) {
      SCOPED_TRACE("K " + std::to_string(K) + " M " + std::to_string(M));
      // 0: linear (bias, alpha 0.5, accumulating), 1: q/k/v, 2: GLU; each [M, ldy].
      auto run = [&](uint32_t from) {
        KernelTuning t = dev.tuning();
        t.gemm_f32_amx_rows = from;
        test::TuningScope scope(dev, t);
        return three_products(dev, ComputeDType::F32, in.xm, K, in.w, in.b, in.u, in.qkv, in.y0, M,
                              ldy);
      };
      const auto terms = run(4), fma = run(0);
      auto product = [&](const std::vector<float>& wt, uint32_t m, uint32_t n) {
        return sums_of(K, [&](uint32_t k) { return double(x[m * K + k]) * wt[size_t(n) * K + k]; });
      };
      auto bound = [&](const Sums& s, double extra = 0) {
        return 3 * tolerance(K, s, true, extra);
      };
      for (uint32_t m = 0; m < M; ++m) {
        const float* y = &terms[0][size_t(m) * ldy];
        const float* q = &terms[1][size_t(m) * ldy];
        const float* g = &terms[2][size_t(m) * ldy];
        for (uint32_t n = 0; n < N; ++n) {
          const Sums s = product(wv, m, n), su = product(uv, m, n);
          const double want = 0.5 * (s.sum + bv[n]) + y0[size_t(m) * ldy + n];
          ASSERT_NEAR(y[n], want, 0.5 * bound(s, bv[n]) + 2 * FLT_EPSILON * std::abs(want))
              << "linear m " << m << " n " << n;
          const double eg = bound(s), eu = bound(su), silu = s.sum / (1 + std::exp(-s.sum));
          ASSERT_NEAR(g[n], silu * su.sum,
                      1.1 * eg * (std::abs(su.sum) + eu) + std::abs(silu) * eu +
                          8 * FLT_EPSILON * std::abs(silu * su.sum))
              << "swiglu m " << m << " n " << n;
        }
        for (uint32_t i = 0, col = 0; i < 3; ++i)
          for (uint32_t n = 0; n < Ns[i]; ++n, ++col) {
            const Sums s = product(in.qv[i], m, n);
            ASSERT_NEAR(q[col], s.sum, bound(s)) << "q/k/v m " << m << " column " << col;
          }
      }
      for (int op = 0; op < 3; ++op) {
        size_t differ = 0;
        for (size_t i = 0; i < terms[op].size(); ++i)
          differ += std::memcmp(&terms[op][i], &fma[op][i], 4) != 0;
        if (amx)
          EXPECT_GT(differ, terms[op].size() / 10) << "AMX must have run, op " << op;
        else
          EXPECT_EQ(differ, 0u) << "op " << op;
      }
    }
  }
}

// The next column tile's weight prefetch (weight_prefetch, x86 PoCL) is a hint only: the same
// bits with it on and off, for linear, fused q/k/v and the GLU epilogue, on work-items that own
// several column tiles (M = 9, N = 3100: 2 to 4 tiles each), and in the packed GEMM, whose
// work-items prefetch the next one's weights (M = 130).
class GemmBf16Prefetch : public ::testing::TestWithParam<uint32_t> {};
TEST_P(GemmBf16Prefetch, WeightPrefetchLeavesTheBits) {
  Device& dev = test::default_device();
  const uint32_t M = GetParam(), N = 3100, K = 96;
  std::vector<float> x = random_vec(size_t(M) * K, 51, 4.0f);
  std::vector<float> g = random_vec(size_t(N) * K, 52), u = random_vec(size_t(N) * K, 53),
                     v = random_vec(size_t(N / 4) * K, 54);
  Weight wg = bf16_weight(dev, g, {N, K}, "gate"), wu = bf16_weight(dev, u, {N, K}, "up"),
         wv = bf16_weight(dev, v, {N / 4, K}, "v");
  cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
  const uint32_t qkv_n = 2 * N + N / 4;
  std::vector<float> out[2][3];
  for (uint32_t prefetch : {0u, 1u}) {
    KernelTuning t = dev.tuning();
    t.weight_prefetch = prefetch;
    t.gemm_bf16_packed_rows = t.gemm_bf16_amx_rows = 128;  // M = 9 the tiles, 130 the packed
    test::TuningScope scope(dev, t);
    cl::Mem y = dev.alloc(size_t(M) * N * 4), q = dev.alloc(size_t(M) * qkv_n * 4),
            s = dev.alloc(size_t(M) * N * 4);
    ops::linear(dev, xm, 0, K, wg, nullptr, y, 0, N, M, 1.0f, false, ComputeDType::BF16);
    ops::linear_fused(dev, xm, 0, K, nullptr, nullptr, 1e-5f, {&wg, &wu, &wv}, q, 0, qkv_n, M,
                      1.0f, false, ComputeDType::BF16);
    ops::linear_swiglu(dev, xm, 0, K, nullptr, 1e-5f, wg, wu, s, 0, N, M, ComputeDType::BF16);
    out[prefetch][0] = download(dev, y, size_t(M) * N);
    out[prefetch][1] = download(dev, q, size_t(M) * qkv_n);
    out[prefetch][2] = download(dev, s, size_t(M) * N);
  }
  for (int op = 0; op < 3; ++op)
    for (size_t i = 0; i < out[0][op].size(); ++i)
      ASSERT_EQ(std::memcmp(&out[0][op][i], &out[1][op][i], 4), 0) << "op " << op << " at " << i;
}
// bf16 compute below kGemmRowsFrom rows (decode's GEMVs): where ops::bf16_gemv holds, one-row
// tiles reading their columns in turn (bf16_tile.cl), whose rows must carry the bits the same rows
// get inside a 9-row batch (the batch tile), so that a row's logits do not depend on what else
// the step holds (speculative decoding's verify against plain decode). Elsewhere those rows run
// as compute f32: then their bits are the f32 GEMM's. 1, 2 and 3 rows; K = 333 (10 whole
// 32-element steps, an odd tail, rows on 2-byte boundaries), 1024 and 4133 (past gemv_stream_k's
// 4096 on the EPYC: the one-row tile's columns side by side); N = 23 over several column
// tiles per work-item (3100); linear with bias, alpha and accumulate, linear_fused (norm, q/k/v
// side by side) and linear_swiglu (norm, the GLU epilogue, whose gate|up rows prefetch the next
// tile's). Where the bf16 sums run, over half the outputs must differ from the f32 GEMM's; with
// the tuning's gemm_bf16_gemv = 0 one row gets the f32 GEMM's bits.
TEST(GemmBf16Gemv, RowsBelowFourCarryTheBatchTilesBits) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const bool gemv = ops::bf16_gemv(dev);
  std::printf("bf16 GEMVs on this device: %s\n", gemv ? "yes (vdpbf16ps, no AMX)" : "no (f32)");
  const uint32_t B = 9;
  for (const uint32_t K : {333u, 1024u, 4133u})
    for (const uint32_t N : {23u, 3100u}) {
      std::vector<float> x = random_vec(size_t(B) * K, 51 + K, 3.0f), g = random_vec(K, 52, 2.0f),
                         bv = random_vec(N, 53), y0 = random_vec(size_t(B) * N, 54);
      Weight norm = bf16_weight(dev, g, {K}, "norm"), bias = bf16_weight(dev, bv, {N}, "bias");
      std::vector<Weight> ws;
      for (uint32_t i = 0; i < 3; ++i) {
        std::vector<float> v = random_vec(size_t(N) * K, 55 + i);
        ws.push_back(bf16_weight(dev, v, {N, K}, "w" + std::to_string(i)));
      }
      const cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
      // The three ops over rows [r0, r0 + M) of x, at compute c: linear's, q/k/v's and SwiGLU's
      // outputs one after another.
      auto run = [&](uint32_t r0, uint32_t M, ComputeDType c) {
        std::vector<float> out;
        cl::Mem y = test::upload_bytes(dev, y0.data() + size_t(r0) * N, size_t(M) * N * 4);
        ops::linear(dev, xm, r0 * K, K, ws[0], &bias, y, 0, N, M, 0.75f, true, c);
        std::vector<float> part = download(dev, y, size_t(M) * N);
        out.insert(out.end(), part.begin(), part.end());
        y = dev.alloc(size_t(M) * 3 * N * 4);
        ops::linear_fused(dev, xm, r0 * K, K, nullptr, &norm, 1e-5f, {&ws[0], &ws[1], &ws[2]}, y, 0,
                          3 * N, M, 1.0f, false, c);
        part = download(dev, y, size_t(M) * 3 * N);
        out.insert(out.end(), part.begin(), part.end());
        y = dev.alloc(size_t(M) * N * 4);
        ops::linear_swiglu(dev, xm, r0 * K, K, &norm, 1e-5f, ws[1], ws[2], y, 0, N, M, c);
        part = download(dev, y, size_t(M) * N);
        out.insert(out.end(), part.begin(), part.end());
        return out;
      };
      const std::vector<float> batch = run(0, B, ComputeDType::BF16);
      for (const uint32_t M : {1u, 2u, 3u}) {
        const uint32_t r0 = 5 - M;  // rows in the middle of the batch
        SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) +
                     " K=" + std::to_string(K));
        const std::vector<float> got = run(r0, M, ComputeDType::BF16);
        const std::vector<float> f32 = run(r0, M, ComputeDType::F32);
        // Where output i of the M rows sits in the batch's outputs: each op's block of B rows.
        size_t differ = 0;
        const uint32_t widths[3] = {N, 3 * N, N};
        size_t at_m = 0, at_b = 0;
        for (const uint32_t w : widths) {
          for (size_t i = 0; i < size_t(M) * w; ++i) {
            const float want = gemv ? batch[at_b + size_t(r0) * w + i] : f32[at_m + i];
            ASSERT_EQ(std::bit_cast<uint32_t>(got[at_m + i]), std::bit_cast<uint32_t>(want))
                << "output " << i << " of an op of width " << w;
            differ += got[at_m + i] != f32[at_m + i];
          }
          at_m += size_t(M) * w;
          at_b += size_t(B) * w;
        }
        if (gemv) {
          EXPECT_GT(differ, got.size() / 2);
        }
      }
      // gemm_bf16_gemv = 0 in the tuning keeps them f32.
      KernelTuning off = dev.tuning();
      off.gemm_bf16_gemv = 0;
      test::TuningScope scope(dev, off);
      ASSERT_FALSE(ops::bf16_gemv(dev));
      const std::vector<float> got = run(2, 1, ComputeDType::BF16),
                               f32 = run(2, 1, ComputeDType::F32);
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(f32[i])) << i;
    }
}

// The fused ops' norm writes its rows rounded to bf16 where gemm_bf16 follows on the CPU shape
// (ops.cpp's GemmInput), in round_bf16's layout, so that no round_bf16 launch comes between: the
// outputs must keep the bits of the norm into f32 rows and the same op on them without a norm
// (which rounds them with round_bf16). linear_fused (q/k/v side by side; and with a row gather,
// as the logits' rows take it) and linear_swiglu, at 1 row (the GEMV where the host has
// vdpbf16ps), 9 (the batch tile) and 130 (the packed GEMM), K = 333 (a partial 32-element step)
// and 2048.
TEST(GemmBf16Norm, RowsRoundedByTheNormKeepTheBits) {
  Device& dev = test::default_device();
  test::ShapeScope shape(dev, KernelShape::Chunks);
  const uint32_t B = 130, N = 37;
  const float eps = 1e-5f;
  for (const uint32_t K : {333u, 2048u}) {
    std::vector<float> x = random_vec(size_t(B) * K, 61 + K, 3.0f), g = random_vec(K, 62, 2.0f);
    Weight norm = bf16_weight(dev, g, {K}, "norm");
    std::vector<Weight> ws;
    for (uint32_t i = 0; i < 3; ++i) {
      std::vector<float> v = random_vec(size_t(N) * K, 63 + i);
      ws.push_back(bf16_weight(dev, v, {N, K}, "w" + std::to_string(i)));
    }
    const cl::Mem xm = test::upload_bytes(dev, x.data(), x.size() * 4);
    std::vector<uint32_t> gather(B);
    for (uint32_t m = 0; m < B; ++m) gather[m] = (m * 7 + 3) % B;
    const cl::Mem rows = test::upload_bytes(dev, gather.data(), gather.size() * 4);
    for (const uint32_t M : {1u, 9u, 130u}) {
      SCOPED_TRACE("M=" + std::to_string(M) + " K=" + std::to_string(K));
      for (const bool gathered : {false, true}) {
        const cl::Mem* r = gathered ? &rows : nullptr;
        cl::Mem normed = dev.alloc(size_t(M) * K * 4);
        ops::rmsnorm(dev, xm, 0, K, r, norm, normed, 0, K, M, K, eps);
        cl::Mem want = dev.alloc(size_t(M) * 3 * N * 4), got = dev.alloc(size_t(M) * 3 * N * 4);
        ops::linear_fused(dev, normed, 0, K, nullptr, nullptr, eps, {&ws[0], &ws[1], &ws[2]}, want,
                          0, 3 * N, M, 0.5f, false, ComputeDType::BF16);
        ops::linear_fused(dev, xm, 0, K, r, &norm, eps, {&ws[0], &ws[1], &ws[2]}, got, 0, 3 * N, M,
                          0.5f, false, ComputeDType::BF16);
        const std::vector<float> w = download(dev, want, size_t(M) * 3 * N),
                                 o = download(dev, got, size_t(M) * 3 * N);
        for (size_t i = 0; i < w.size(); ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(o[i]), std::bit_cast<uint32_t>(w[i]))
              << "q/k/v output " << i << (gathered ? " (gathered rows)" : "");
        if (gathered) continue;
        cl::Mem want_s = dev.alloc(size_t(M) * N * 4), got_s = dev.alloc(size_t(M) * N * 4);
        ops::linear_swiglu(dev, normed, 0, K, nullptr, eps, ws[1], ws[2], want_s, 0, N, M,
                           ComputeDType::BF16);
        ops::linear_swiglu(dev, xm, 0, K, &norm, eps, ws[1], ws[2], got_s, 0, N, M,
                           ComputeDType::BF16);
        const std::vector<float> ws_ = download(dev, want_s, size_t(M) * N),
                                 os = download(dev, got_s, size_t(M) * N);
        for (size_t i = 0; i < ws_.size(); ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(os[i]), std::bit_cast<uint32_t>(ws_[i]))
              << "SwiGLU output " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, GemmBf16Prefetch, ::testing::Values(9u, 130u),
                         [](const auto& info) { return "M" + std::to_string(info.param); });

INSTANTIATE_TEST_SUITE_P(
    Sizes, GemmBf16,
    ::testing::Values(
        GemmCase{4, 9, 32, Variant::DotProduct}, GemmCase{5, 37, 70, Variant::DotProduct},
        GemmCase{13, 29, 333, Variant::DotProduct}, GemmCase{67, 19, 97, Variant::DotProduct},
        GemmCase{5, 37, 70, Variant::Portable}, GemmCase{13, 29, 333, Variant::Portable},
        GemmCase{67, 19, 97, Variant::Portable},
        GemmCase{6, 21, 45, Variant::DotProduct, KernelShape::WorkGroups},
        // Work-items of several column tiles: each loads its next tile's weight
        // rows ahead (and prefetches them on x86 PoCL) while the last row tile runs.
        GemmCase{9, 3100, 70, Variant::DotProduct}, GemmCase{9, 3100, 70, Variant::Portable},
        // Several row blocks (64 rows each) by several column blocks: the launch's
        // two dimensions (row blocks first) each cover their whole range.
        GemmCase{130, 3100, 70, Variant::DotProduct},
        // The tiles the tuning table names (decode batches take the batch tile,
        // from gemm_bf16_rows rows the prefill one), forced whatever the device:
        // 8-row tiles over one partial row tile, two, and whole row blocks.
        GemmCase{5, 37, 70, Variant::DotProduct, KernelShape::Chunks, 8, 4},
        GemmCase{13, 3100, 333, Variant::DotProduct, KernelShape::Chunks, 8, 4},
        GemmCase{67, 29, 97, Variant::DotProduct, KernelShape::Chunks, 8, 4},
        GemmCase{13, 29, 333, Variant::Portable, KernelShape::Chunks, 8, 4},
        GemmCase{9, 3100, 70, Variant::DotProduct, KernelShape::Chunks, 4, 6},
        // The packed GEMM (from gemm_bf16_packed_rows rows): rows and columns past
        // its tiles, odd K, and K of several chunks (1051 pair steps) whose partial
        // sums wait in local memory; the tiles the tuning table can name.
        GemmCase{129, 61, 333, Variant::DotProduct}, GemmCase{129, 61, 333, Variant::Portable},
        GemmCase{131, 37, 2101, Variant::DotProduct}, GemmCase{131, 37, 2101, Variant::Portable},
        GemmCase{130, 70, 97, Variant::DotProduct, KernelShape::Chunks, 0, 0, 8, 2},
        GemmCase{130, 70, 97, Variant::DotProduct, KernelShape::Chunks, 0, 0, 6, 4},
        GemmCase{133, 200, 97, Variant::Portable, KernelShape::Chunks, 0, 0, 8, 3}),
    case_name);

}  // namespace
}  // namespace clshard
