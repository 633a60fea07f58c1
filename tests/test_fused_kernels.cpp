// The fused kernels (ops::linear_fused, ops::linear_swiglu) against the unfused ops they
// replace (rmsnorm, one linear per weight, silu_mul), on odd sizes: K and the weights' row counts
// that are not multiples of the 16-wide loads or the 4-column tiles, one-row tiles (M < 4) and
// four-row tiles (M >= 4), f32 and bf16 weights, a norm weight of another dtype than the GEMV's,
// and the work-group kernel shape. The fused launch computes every output with the same
// operations in the same order as the separate launches (the norm is a launch of its own), so
// every case compares bits.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using test::download;
using test::random_vec;

// A [rows, K] (or [K]) weight in dtype dt; `values` become what the kernel sees.
Weight make_weight(Device& dev, std::vector<float>& values, std::vector<int64_t> shape, DType dt,
                   const std::string& name) {
  Weight w;
  w.dtype = dt;
  w.shape = shape;
  w.name = name;
  if (dt == DType::BF16) {
    std::vector<uint16_t> b(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      b[i] = f32_to_bf16(values[i]);
      values[i] = bf16_to_f32(b[i]);
    }
    w.mem = test::upload_bytes(dev, b.data(), b.size() * 2);
  } else {
    w.mem = test::upload_bytes(dev, values.data(), values.size() * 4);
  }
  return w;
}

using test::ShapeScope;

struct FusedCase {
  uint32_t M, K;
  DType weight_dtype, norm_dtype;
  KernelShape shape;
};

std::string case_name(const ::testing::TestParamInfo<FusedCase>& p) {
  const auto& c = p.param;
  return "M" + std::to_string(c.M) + "_K" + std::to_string(c.K) + "_" +
         dtype_name(c.weight_dtype) + "_norm" + dtype_name(c.norm_dtype) +
         (c.shape == KernelShape::Chunks ? "_chunks" : "_workgroups");
}

class FusedKernels : public ::testing::TestWithParam<FusedCase> {
 protected:
  void SetUp() override {
    const auto& c = GetParam();
    x = random_vec(size_t(c.M) * c.K, 1, 2.0f);
    xm = test::upload_bytes(dev, x.data(), x.size() * 4);
    auto g = random_vec(c.K, 2);
    norm = make_weight(dev, g, {c.K}, c.norm_dtype, "norm");
    norm_values = g;
  }
  Weight weight(uint32_t rows, uint32_t seed, const std::string& name) {
    auto v = random_vec(size_t(rows) * GetParam().K, seed, 0.5f);
    return make_weight(dev, v, {rows, GetParam().K}, GetParam().weight_dtype, name);
  }
  // The unfused path's input: rmsnorm(x[rows]) * norm, or x.
  cl::Mem normed(const cl::Mem* rows, uint32_t R) {
    const uint32_t K = GetParam().K;
    cl::Mem out = dev.alloc(size_t(R) * K * 4);
    ops::rmsnorm(dev, xm, 0, K, rows, norm, out, 0, K, R, K, eps);
    return out;
  }
  Device& dev = test::default_device();
  ShapeScope scope{dev, GetParam().shape};
  const float eps = 1e-5f;
  std::vector<float> x, norm_values;
  cl::Mem xm;
  Weight norm;
};

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(0, std::memcmp(&got[i], &want[i], 4))
        << what << " element " << i << ": " << got[i] << " vs " << want[i];
}

// q, k, v with 13, 5 and 7 rows, written at a column offset into rows of 31 floats, accumulated
// onto random values with alpha = 0.5.
TEST_P(FusedKernels, ThreeWeightsAsOneGemvEqualSeparateLaunches) {
  const auto& c = GetParam();
  Weight q = weight(13, 10, "q"), k = weight(5, 11, "k"), v = weight(7, 12, "v");
  const uint32_t ld = 31, off = 3;
  auto y0 = random_vec(size_t(c.M) * ld, 5);
  for (bool norm_first : {false, true}) {
    SCOPED_TRACE(norm_first ? "normalised input" : "raw input");
    // Unfused: separate launches on the same input, which with norm_first is the normalised copy.
    cl::Mem in = norm_first ? normed(nullptr, c.M) : xm;
    cl::Mem want_m = test::upload_bytes(dev, y0.data(), y0.size() * 4);
    uint32_t col = off;
    for (const Weight* w : {&q, &k, &v}) {
      ops::linear(dev, in, 0, c.K, *w, nullptr, want_m, col, ld, c.M, 0.5f, true);
      col += uint32_t(w->dim(0));
    }
    cl::Mem got_m = test::upload_bytes(dev, y0.data(), y0.size() * 4);
    if (norm_first) {
      ops::linear_fused(dev, xm, 0, c.K, nullptr, &norm, eps, {&q, &k, &v}, got_m, off, ld, c.M,
                        0.5f, true);
    } else {
      ops::linear_fused(dev, xm, 0, c.K, nullptr, nullptr, eps, {&q, &k, &v}, got_m, off, ld,
                        c.M, 0.5f, true);
    }
    const auto got = download(dev, got_m, y0.size()), want = download(dev, want_m, y0.size());
    expect_same_bits(got, want, "qkv");
  }
}

// gate and up of 19 rows: silu(gate) * up in one launch, into rows of 23 floats at column 2.
TEST_P(FusedKernels, SwigluGemvEqualsGateUpThenSiluMul) {
  const auto& c = GetParam();
  const uint32_t F = 19, ld = 23, off = 2;
  Weight gate = weight(F, 20, "gate"), up = weight(F, 21, "up");
  auto y0 = random_vec(size_t(c.M) * ld, 6);
  for (bool norm_first : {false, true}) {
    SCOPED_TRACE(norm_first ? "normalised input" : "raw input");
    cl::Mem in = norm_first ? normed(nullptr, c.M) : xm;
    cl::Mem gu = dev.alloc(size_t(c.M) * 2 * F * 4);
    ops::linear(dev, in, 0, c.K, gate, nullptr, gu, 0, 2 * F, c.M);
    ops::linear(dev, in, 0, c.K, up, nullptr, gu, F, 2 * F, c.M);
    cl::Mem want_m = test::upload_bytes(dev, y0.data(), y0.size() * 4);
    cl::Mem act = dev.alloc(size_t(c.M) * F * 4);
    ops::silu_mul(dev, gu, 0, 2 * F, gu, F, 2 * F, act, F, c.M, F);
    ops::copy_rows(dev, act, 0, F, want_m, off, ld, c.M, F);
    cl::Mem got_m = test::upload_bytes(dev, y0.data(), y0.size() * 4);
    ops::linear_swiglu(dev, xm, 0, c.K, norm_first ? &norm : nullptr, eps, gate, up, got_m, off,
                       ld, c.M);
    // gate and up have the separate GEMVs' bits; silu's exp runs 16 wide in the fused epilogue
    // and in silu_mul but for a row's last F % 16 columns, one at a time there, which may round
    // the last bit differently.
    const auto got = download(dev, got_m, y0.size()), want = download(dev, want_m, y0.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 4 * FLT_EPSILON * std::fabs(want[i])) << "element " << i;
  }
}

// The lm_head's launch: the norm of gathered rows (3 of the M + 2 rows of x), then the GEMV.
TEST_P(FusedKernels, GatheredRowsNormThenGemvEqualsUnfused) {
  const auto& c = GetParam();
  const uint32_t V = 29;
  Weight head = weight(V, 30, "lm_head");
  // x has c.M rows; gather rows (last, first, last) so a repeated row is covered.
  std::vector<uint32_t> rows = {c.M - 1, 0, c.M - 1};
  cl::Mem rm = test::upload_bytes(dev, rows.data(), rows.size() * 4);
  const uint32_t R = uint32_t(rows.size());
  cl::Mem in = normed(&rm, R);
  cl::Mem want_m = dev.alloc(size_t(R) * V * 4), got_m = dev.alloc(size_t(R) * V * 4);
  ops::linear(dev, in, 0, c.K, head, nullptr, want_m, 0, V, R, 0.25f);
  ops::linear_fused(dev, xm, 0, c.K, &rm, &norm, eps, {&head}, got_m, 0, V, R, 0.25f);
  const auto got = download(dev, got_m, size_t(R) * V), want = download(dev, want_m, size_t(R) * V);
  expect_same_bits(got, want, "lm_head");
}

TEST(FusedKernelErrors, WeightsOfDifferentKAreRejected) {
  Device& dev = test::default_device();
  std::vector<float> a(4 * 8, 0.5f), b(4 * 9, 0.5f);
  Weight wa = make_weight(dev, a, {4, 8}, DType::F32, "a");
  Weight wb = make_weight(dev, b, {4, 9}, DType::F32, "b");
  cl::Mem x = dev.alloc(9 * 4), y = dev.alloc(8 * 4);
  try {
    ops::linear_fused(dev, x, 0, 9, nullptr, nullptr, 1e-5f, {&wa, &wb}, y, 0, 8, 1);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "linear_fused: weight 'b' is [4, 9] F32, 'a' [4, 8] F32: one launch needs one K "
                 "and dtype");
  }
}

TEST(FusedKernelErrors, RowGatherWithoutNormIsRejected) {
  Device& dev = test::default_device();
  std::vector<float> a(4 * 8, 0.5f);
  Weight wa = make_weight(dev, a, {4, 8}, DType::F32, "a");
  const uint32_t row = 0;
  cl::Mem x = dev.alloc(8 * 4), y = dev.alloc(4 * 4), rows = test::upload_bytes(dev, &row, 4);
  try {
    ops::linear_fused(dev, x, 0, 8, &rows, nullptr, 1e-5f, {&wa}, y, 0, 4, 1);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "linear_fused: a row gather needs the norm, which gathers them");
  }
}

INSTANTIATE_TEST_SUITE_P(
    OddSizes, FusedKernels,
    ::testing::Values(FusedCase{1, 37, DType::F32, DType::F32, KernelShape::Chunks},
                      FusedCase{1, 50, DType::BF16, DType::BF16, KernelShape::Chunks},
                      FusedCase{3, 67, DType::BF16, DType::F32, KernelShape::Chunks},
                      FusedCase{6, 37, DType::F32, DType::BF16, KernelShape::Chunks},
                      FusedCase{5, 70, DType::BF16, DType::BF16, KernelShape::Chunks},
                      FusedCase{3, 37, DType::BF16, DType::BF16, KernelShape::WorkGroups},
                      FusedCase{6, 70, DType::F32, DType::BF16, KernelShape::WorkGroups}),
    case_name);

}  // namespace
}  // namespace clshard
