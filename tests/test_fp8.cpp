// FP8 (e4m3fn, 128x128 block scales): the decode of every code, linear_fp8 against an f32 product
// with the dequantized weight on partial-block shapes, and the shared reference case `fp8_gemm`
// (real F8_E4M3 tensors of the deepseek-v3-tiny-grouped-fp8 checkpoint).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/ops.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "runtime/safetensors.h"
#include "runtime/tensor.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using test::download;
using test::random_vec;
using test::upload;

Device& device() { return test::default_device(); }

std::filesystem::path shared_dir() { return test::shared_dir(); }


// A device weight holding host bytes (copied, so the host vector may go away), with the NaN-code
// scan's result as to_device records it.
Weight fp8_weight(Device& dev, const std::vector<uint8_t>& bytes, int64_t N, int64_t K) {
  Weight w;
  w.mem = dev.alloc(bytes.size(), CL_MEM_READ_ONLY);
  dev.write(w.mem, bytes.data(), bytes.size());
  w.dtype = DType::F8_E4M3;
  w.shape = {N, K};
  w.name = "test.fp8.weight";
  w.fp8_nan_free = fp8_nan_free(bytes.data(), bytes.size());
  return w;
}

uint32_t ceil128(uint32_t v) { return (v + 127) / 128; }

bool same_bits_or_both_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// Both e4m3 decodes of linear_fp8.cl: the device's default (f32-denormal based on PoCL) and the
// f16-based one that devices without denormals get, forced through CLSHARD_FP8_DECODE.
class Fp8Decodes : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "f16")
      setenv("CLSHARD_FP8_DECODE", "f16", 1);
    else
      unsetenv("CLSHARD_FP8_DECODE");
  }
  void TearDown() override { unsetenv("CLSHARD_FP8_DECODE"); }
};
INSTANTIATE_TEST_SUITE_P(Fp8, Fp8Decodes, ::testing::Values("device_default", "f16"),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------------------------------------
// Decode

TEST(Fp8Decode, ReferenceDecodesKnownCodes) {
  using reference::e4m3_to_f32;
  EXPECT_EQ(std::bit_cast<uint32_t>(e4m3_to_f32(0x00)), 0u);
  EXPECT_EQ(std::bit_cast<uint32_t>(e4m3_to_f32(0x80)), 0x80000000u);  // -0
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));                  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x07), 7 * std::ldexp(1.0f, -9));              // largest subnormal
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));                  // smallest normal
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x3C), 1.5f);
  EXPECT_EQ(e4m3_to_f32(0xB8), -1.0f);
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);  // largest finite
  EXPECT_EQ(e4m3_to_f32(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x78), 256.0f);  // exponent 15 is finite in the fn variant
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xFF)));
  // Positive codes are ordered like their values; negative codes mirror them.
  for (int c = 1; c < 0x7F; ++c) {
    EXPECT_LT(e4m3_to_f32(uint8_t(c - 1)), e4m3_to_f32(uint8_t(c))) << "code " << c;
    EXPECT_EQ(e4m3_to_f32(uint8_t(c | 0x80)), -e4m3_to_f32(uint8_t(c))) << "code " << c;
  }
}

// Every code through the kernel's 16-wide decode (row 0 and row 1 hold all 256 codes in the
// vector part) and the scalar tail (the last 7 columns: NaN, -0, subnormals, normals, max), with
// power-of-two block scales so that the scaled values stay exact.
TEST_P(Fp8Decodes, KernelDecodesAll256CodesExactly) {
  Device& dev = device();
  const uint32_t N = 2, K = 263;  // 16 vectors of 16 + a 7-column tail; 3 K blocks
  const uint8_t tail[7] = {0x7F, 0xFF, 0x80, 0x01, 0x87, 0x08, 0x7E};
  std::vector<uint8_t> w(N * K);
  for (uint32_t k = 0; k < 256; ++k) {
    w[k] = uint8_t(k);
    w[K + k] = uint8_t(255 - k);
  }
  for (uint32_t k = 0; k < 7; ++k) w[256 + k] = w[K + 256 + k] = tail[k];
  const std::vector<float> scales = {1.0f, 0.25f, 8.0f};  // [1, 3]
  Weight wq = fp8_weight(dev, w, N, K);
  Weight sc = to_device_f32(dev, scales, {1, 3}, "test.fp8.scale_inv");
  cl::Mem out = dev.alloc(N * K * sizeof(float));
  const KernelShape own = dev.kernel_shape();
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    SCOPED_TRACE(shape == KernelShape::Chunks ? "cpu shape" : "gpu shape");
    dev.set_kernel_shape(shape);
    dev.fill_zero(out, N * K * sizeof(float));
    ops::dequantize_fp8(dev, wq, sc, out);
    dev.set_kernel_shape(own);
    const std::vector<float> got = download(dev, out, N * K);
    for (uint32_t n = 0; n < N; ++n)
      for (uint32_t k = 0; k < K; ++k) {
        const uint8_t code = w[n * K + k];
        const float want = reference::e4m3_to_f32(code) * scales[k / 128];
        EXPECT_TRUE(same_bits_or_both_nan(got[n * K + k], want))
            << "row " << n << " col " << k << " code 0x" << std::hex << int(code) << ": got "
            << got[n * K + k] << " want " << want;
      }
  }
}

// The bf16 dequantization (bf16 compute), in both kernel shapes: every code under scales of three
// magnitudes is the host's nearest-even bf16 of the f32 product, bit for bit; NaN codes stay NaN.
TEST_P(Fp8Decodes, KernelDequantizesAll256CodesToBf16) {
  Device& dev = device();
  const uint32_t N = 2, K = 263;
  std::vector<uint8_t> w(N * K);
  for (uint32_t k = 0; k < K; ++k) {
    w[k] = uint8_t(k);
    w[K + k] = uint8_t(255 - k % 256);
  }
  const std::vector<float> scales = {1.0f, 0.3f, 1.7e-3f};  // [1, 3]: products that round
  Weight wq = fp8_weight(dev, w, N, K);
  Weight sc = to_device_f32(dev, scales, {1, 3}, "test.fp8.scale_inv");
  cl::Mem out = dev.alloc(N * K * 2);
  const KernelShape own = dev.kernel_shape();
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    SCOPED_TRACE(shape == KernelShape::Chunks ? "cpu shape" : "gpu shape");
    dev.set_kernel_shape(shape);
    dev.fill_zero(out, N * K * 2);
    ops::dequantize_fp8_bf16(dev, wq, sc, out);
    dev.set_kernel_shape(own);
    std::vector<uint16_t> got(N * K);
    dev.read(out, got.data(), got.size() * 2);
    size_t rounded = 0;
    for (uint32_t n = 0; n < N; ++n)
      for (uint32_t k = 0; k < K; ++k) {
        const uint8_t code = w[n * K + k];
        const float product = reference::e4m3_to_f32(code) * scales[k / 128];
        const uint16_t want = f32_to_bf16(product);
        if (std::isnan(product)) {
          EXPECT_TRUE(std::isnan(bf16_to_f32(got[n * K + k])))
              << "code 0x" << std::hex << int(code);
          continue;
        }
        rounded += bf16_to_f32(want) != product;
        EXPECT_EQ(got[n * K + k], want)
            << "row " << n << " col " << k << " code 0x" << std::hex << int(code);
      }
    EXPECT_GT(rounded, 100u);  // the scales make most products inexact in bf16: rounding is tested
  }
}

// ---------------------------------------------------------------------------------------------
// linear_fp8 against x . dequant(W)^T computed in double on the host

struct Fp8Problem {
  uint32_t N, K;
  std::vector<uint8_t> w;
  std::vector<float> scales;  // [ceil(N/128), ceil(K/128)]
  std::vector<float> w_deq;   // [N, K]
};

Fp8Problem random_problem(uint32_t N, uint32_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  Fp8Problem p{N, K, std::vector<uint8_t>(size_t(N) * K), {}, std::vector<float>(size_t(N) * K)};
  std::uniform_int_distribution<int> code(0, 255);
  for (auto& b : p.w) {
    do b = uint8_t(code(rng));
    while ((b & 0x7F) == 0x7F);  // no NaN codes in a weight
  }
  // Scales of different magnitudes per block, as a real checkpoint has (~amax/448).
  std::uniform_real_distribution<float> mant(0.5f, 1.0f);
  std::uniform_int_distribution<int> exp2(-12, -4);
  p.scales.resize(size_t(ceil128(N)) * ceil128(K));
  for (auto& s : p.scales) s = std::ldexp(mant(rng), exp2(rng));
  reference::dequantize_fp8(p.w.data(), p.scales.data(), N, K, p.w_deq.data());
  return p;
}

const char* shape_name(KernelShape s) { return s == KernelShape::Chunks ? "cpu shape" : "gpu shape"; }

// Runs y = alpha * x W^T (+ y0) with row strides and offsets around the data, in both kernel
// shapes (the GPU shape's linear_fp8_wg on PoCL), and checks every output against the
// double-precision product: max |diff| <= 1e-5 * max |y| (the fp8_gemm case's fp32 tolerance),
// and that the padding around y was not written.
void check_linear_fp8(uint32_t M, uint32_t N, uint32_t K, float alpha, bool accumulate,
                      uint32_t seed) {
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
               " alpha=" + std::to_string(alpha) + " accumulate=" + std::to_string(accumulate));
  Device& dev = device();
  const Fp8Problem p = random_problem(N, K, seed);
  const uint32_t x_off = 5, ldx = K + 3, y_off = 7, ldy = N + 9;
  std::mt19937 rng(seed + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(x_off + size_t(M) * ldx), y0(y_off + size_t(M) * ldy);
  for (auto& v : x) v = normal(rng);
  for (auto& v : y0) v = normal(rng);

  std::vector<double> want(size_t(M) * N);
  double max_abs = 0;
  for (uint32_t m = 0; m < M; ++m)
    for (uint32_t n = 0; n < N; ++n) {
      double acc = 0;
      for (uint32_t k = 0; k < K; ++k)
        acc += double(x[x_off + size_t(m) * ldx + k]) * double(p.w_deq[size_t(n) * K + k]);
      acc *= alpha;
      if (accumulate) acc += y0[y_off + size_t(m) * ldy + n];
      want[size_t(m) * N + n] = acc;
      max_abs = std::max(max_abs, std::abs(acc));
    }
  ASSERT_GT(max_abs, 0.0);

  Weight wq = fp8_weight(dev, p.w, N, K);
  ASSERT_TRUE(wq.fp8_nan_free);
  Weight sc = to_device_f32(dev, p.scales, {ceil128(N), ceil128(K)}, "test.scale_inv");
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    SCOPED_TRACE(shape_name(shape));
    test::ShapeScope scope(dev, shape);
    cl::Mem xb = upload(dev, x), yb = upload(dev, y0);
    ops::linear_fp8(dev, xb, x_off, ldx, wq, sc, yb, y_off, ldy, M, alpha, accumulate);
    const std::vector<float> y = download(dev, yb, y0.size());
    // The tiles that watch for NaN codes (a weight not scanned) give the same bits.
    Weight watched = wq;
    watched.fp8_nan_free = false;
    cl::Mem yw = upload(dev, y0);
    ops::linear_fp8(dev, xb, x_off, ldx, watched, sc, yw, y_off, ldy, M, alpha, accumulate);
    const std::vector<float> y_watched = download(dev, yw, y0.size());
    size_t differ = 0;
    for (size_t i = 0; i < y.size(); ++i)
      differ += std::bit_cast<uint32_t>(y[i]) != std::bit_cast<uint32_t>(y_watched[i]);
    EXPECT_EQ(differ, 0u) << "outputs whose bits differ with the NaN watch";
    double max_err = 0;
    for (uint32_t m = 0; m < M; ++m)
      for (uint32_t n = 0; n < N; ++n)
        max_err = std::max(
            max_err, std::abs(double(y[y_off + size_t(m) * ldy + n]) - want[size_t(m) * N + n]));
    EXPECT_LE(max_err, 1e-5 * max_abs) << "max abs error " << max_err << " of max |y| " << max_abs;
    // Everything outside the M x N window keeps its old value.
    for (size_t i = 0; i < y.size(); ++i) {
      const bool inside = i >= y_off && (i - y_off) % ldy < N && (i - y_off) / ldy < M;
      if (!inside) {
        ASSERT_EQ(y[i], y0[i]) << "element " << i << " outside the output was written";
      }
    }
  }
}

TEST_P(Fp8Decodes, LinearPartialBlocksAllTileShapes) {
  // N=200, K=300: two block rows (128 + 72), three block columns (128 + 128 + 44), a 12-column
  // tail past the last 16-wide vector and a last N tile of 4 that is complete; M covers one tile
  // in turn (1, 3), tiles in turn of 4 rows and a last one of 1, 2, 3 or 4 (4, 5, 6, 7, 15), 4x4
  // tiles with a partial last row tile (31) and 4x4 tiles over decoded panels (32, 65).
  for (uint32_t M : {1u, 3u, 4u, 5u, 6u, 7u, 15u, 31u, 32u, 65u})
    check_linear_fp8(M, 200, 300, 1.0f, false, 100 + M);
}

// model.compute_dtype: bf16 below the bf16 panels' 16 rows (ops::linear_any): where the host has
// vdpbf16ps (ops::bf16_dot_product), the tiles in turn sum x rounded to bf16 (nearest even)
// times the codes, each whole 128-code block's products under its scale, subnormal codes counting
// as 0 (vdpbf16ps reads denormal inputs as zero); the partial last block in f32 on x as it is.
// One tile of 1 (M = 1), 2 or 3 rows, and row blocks of 4 with a last one of 1 (M = 5), 2 (6) and
// 3 (15) rows, each row count its own function. Checked against that sum in double precision
// (1e-5 of max |y|), and against the exact product where the host lacks the instruction, for a
// weight with more subnormal codes than kFp8DenormMaxSubnormalShare (the f32 tiles) and at compute
// f32. A NaN code in a whole block and one in the partial block make their features NaN.
TEST(Fp8ComputeBf16, LinearInTurnSumsBf16RoundedRows) {
  Device& dev = device();
  test::DotProductScope dot_product(dev);
  test::ShapeScope scope(dev, KernelShape::Chunks);
  const bool dot = ops::bf16_dot_product(dev);
  std::printf("vdpbf16ps on this host's device: %s\n", dot ? "yes" : "no");
  struct Case {
    uint32_t M, N, K;
    bool many_subnormal;
  };
  for (const Case c :
       {Case{4, 200, 300, false}, Case{5, 131, 2048, false}, Case{8, 64, 256, false},
        Case{15, 40, 136, false}, Case{6, 70, 384, false}, Case{2, 200, 300, false},
        Case{1, 131, 2048, false}, Case{3, 70, 384, false}, Case{8, 64, 256, true}}) {
    for (const ComputeDType compute : {ComputeDType::BF16, ComputeDType::F32}) {
      SCOPED_TRACE("M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) +
                   " K=" + std::to_string(c.K) + (c.many_subnormal ? " many subnormal codes" : "") +
                   (compute == ComputeDType::BF16 ? " bf16 compute" : " f32 compute"));
      const uint32_t M = c.M, N = c.N, K = c.K;
      std::mt19937 rng(7 * M + N + K);
      // Normal codes of both signs, but for 1 in 4096 subnormal ones (many: 1 in 8), and NaN
      // codes in features 3 (a whole block) and 5 (the partial block, where K has one).
      std::uniform_int_distribution<int> normal_code(0x08, 0x7E), sign(0, 1), one_in(0, 4095);
      std::vector<uint8_t> w(size_t(N) * K);
      size_t subnormal = 0;
      for (auto& b : w) {
        const bool sub = c.many_subnormal ? one_in(rng) < 512 : one_in(rng) == 0;
        b = uint8_t((sub ? 1 + one_in(rng) % 7 : normal_code(rng)) | (sign(rng) ? 0x80 : 0));
        subnormal += sub;
      }
      w[size_t(3) * K + 17] = 0x7F;
      const bool tail = K % 128 != 0;
      if (tail) w[size_t(5) * K + K - 1] = 0xFF;
      std::vector<float> scales(size_t(ceil128(N)) * ceil128(K));
      std::uniform_real_distribution<float> mant(0.5f, 1.0f);
      for (auto& v : scales) v = std::ldexp(mant(rng), -8);
      std::normal_distribution<float> nd;
      std::vector<float> x(size_t(M) * K);
      for (auto& v : x) v = nd(rng);
      Weight wq = fp8_weight(dev, w, N, K);
      wq.fp8_subnormal_share = float(double(subnormal) / double(w.size()));
      ASSERT_EQ(wq.fp8_subnormal_share > ops::kFp8DenormMaxSubnormalShare, c.many_subnormal);
      Weight sc = to_device_f32(dev, scales, {ceil128(N), ceil128(K)}, "test.scale_inv");
      const bool bf16_sums = dot && compute == ComputeDType::BF16 && !c.many_subnormal;
      const uint32_t whole = bf16_sums ? K / 128 * 128 : 0;
      cl::Mem xb = upload(dev, x), y = dev.alloc(size_t(M) * N * 4);
      ops::linear_any(dev, xb, 0, K, wq, &sc, y, 0, N, M, 1.0f, false, false, compute);
      const std::vector<float> got = download(dev, y, size_t(M) * N);
      double max_abs = 0, max_err = 0;
      for (uint32_t m = 0; m < M; ++m)
        for (uint32_t n = 0; n < N; ++n) {
          double want = 0;
          bool nan = false;
          for (uint32_t k = 0; k < K; ++k) {
            const uint8_t code = w[size_t(n) * K + k];
            nan = nan || (code & 0x7F) == 0x7F;
            const bool rounded = k < whole;
            const double xv =
                rounded ? bf16_to_f32(f32_to_bf16(x[size_t(m) * K + k])) : x[size_t(m) * K + k];
            const double wv = rounded && (code & 0x78) == 0 ? 0.0 : reference::e4m3_to_f32(code);
            want += xv * wv * scales[size_t(n / 128) * ceil128(K) + k / 128];
          }
          const float g = got[size_t(m) * N + n];
          if (nan) {
            EXPECT_TRUE(std::isnan(g)) << "feature " << n << " row " << m;
            continue;
          }
          max_abs = std::max(max_abs, std::abs(want));
          max_err = std::max(max_err, std::abs(double(g) - want));
        }
      EXPECT_LE(max_err, 1e-5 * max_abs) << "max abs error " << max_err << " of max |y| " << max_abs
                                         << (bf16_sums ? " (bf16 sums)" : " (exact)");
    }
  }
}

TEST_P(Fp8Decodes, LinearEdgeShapes) {
  check_linear_fp8(5, 202, 96, 1.0f, false, 1);   // N tile cut at 2 of 4; K < one block
  check_linear_fp8(2, 131, 10, 1.0f, false, 2);   // K below one vector: the tail alone
  check_linear_fp8(9, 129, 128, 1.0f, false, 3);  // one full K block; a 1-row last block row
  check_linear_fp8(1, 64, 2048, 1.0f, false, 4);  // 16 K blocks, decode
  check_linear_fp8(6, 256, 384, 1.0f, false, 5);  // whole blocks only
}

// Tiles in turn keep their x rows in private memory, up to fp8_stream_k codes each: at the
// largest candidate of `clshard tune` (16384), a K of 16,376 (the last block 120 codes, 8 of
// them the tail), one row, a tile of three and tiles of 4 and 1 (256 KiB of private rows).
TEST_P(Fp8Decodes, LinearLongRowsInTurnAtTheLargestStreamK) {
  Device& dev = device();
  KernelTuning t = dev.tuning();
  t.fp8_stream_k = 16384;
  test::TuningScope tuned(dev, t);
  check_linear_fp8(1, 40, 16376, 1.0f, false, 61);
  check_linear_fp8(3, 40, 16376, 1.0f, true, 62);
  check_linear_fp8(5, 40, 16376, 1.0f, false, 63);
}

// The stream prefetch of tiles in turn (KernelTuning::stream_prefetch and stream_prefetch_l1,
// fp8_tile.cl) is a hint only: with both off, at 8192 bytes ahead and at 64 (the block's own next
// line) into L2, each with 1024 bytes ahead into L1, and the L1 one alone, one to three rows
// give the same bits, over several work-items (N = 515) whose streams run past the weight's end,
// on whole blocks (K = 2048), a partial last block with a tail (K = 300) and one whole block with
// a tail past it (K = 136). On PoCL's CPU device on x86 the option is built in.
TEST_P(Fp8Decodes, LinearStreamPrefetchChangesNoBit) {
  Device& dev = device();
  test::ShapeScope scope(dev, KernelShape::Chunks);
  const KernelTuning saved = dev.tuning();
  test::TuningScope restore(dev, saved);
  const uint32_t N = 515;
  for (const uint32_t K : {2048u, 300u, 136u}) {
    const Fp8Problem p = random_problem(N, K, 70 + K);
    Weight wq = fp8_weight(dev, p.w, N, K);
    Weight sc = to_device_f32(dev, p.scales, {ceil128(N), ceil128(K)}, "test.scale_inv");
    const std::vector<float> x = random_vec(size_t(3) * K, 71 + K);
    cl::Mem xb = upload(dev, x);
    for (const uint32_t M : {1u, 2u, 3u}) {
      SCOPED_TRACE("K=" + std::to_string(K) + " M=" + std::to_string(M));
      auto run = [&](uint32_t ahead, uint32_t ahead_l1) {
        KernelTuning t = saved;
        t.stream_prefetch = ahead;
        t.stream_prefetch_l1 = ahead_l1;
        t.gemv_stream_prefetch = 0;
        t.gemv_row_pairs = 0;  // the bf16 / f32 tiles' (LinearPrefetch), not FP8's
        dev.set_tuning(t);
        std::string prefetch;
        if ((ahead || ahead_l1) && test::x86_pocl(dev)) {
          prefetch = " -DPREFETCH_X86=1";
          if (ahead) prefetch += " -DSTREAM_PREFETCH=" + std::to_string(ahead);
          if (ahead_l1) prefetch += " -DSTREAM_PREFETCH_L1=" + std::to_string(ahead_l1);
        }
        EXPECT_EQ(ops::columns_in_turn_option(dev), " -DCOLUMNS_IN_TURN=1" + prefetch);
        cl::Mem yb = dev.alloc(size_t(M) * N * sizeof(float));
        ops::linear_fp8(dev, xb, 0, K, wq, sc, yb, 0, N, M);
        return download(dev, yb, size_t(M) * N);
      };
      const std::vector<float> off = run(0, 0);
      for (const auto& [ahead, ahead_l1] :
           {std::pair{8192u, 0u}, {64u, 0u}, {8192u, 1024u}, {64u, 1024u}, {0u, 1024u}}) {
        const std::vector<float> on = run(ahead, ahead_l1);
        for (size_t i = 0; i < off.size(); ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(on[i]), std::bit_cast<uint32_t>(off[i]))
              << "element " << i << " with the prefetch " << ahead << " bytes ahead into L2 and "
              << ahead_l1 << " into L1";
      }
    }
  }
}

// fp8_stream_k decides whether tiles of one to four rows read their columns in turn (K at most
// it) or 4-row tiles read four weight rows side by side; both give the same bits (1-3 rows, and
// 5: tiles of 4 and 1 in turn against two 4-row tiles). K = 4608 (dsv3-mini's dense
// down_proj) and 7160 (a partial last block, 8 codes of tail), between the default 4096 and
// 8192, so that one of the two launches takes each path; gemv_stream_k (the bf16 bound) left at
// 4096 changes neither.
TEST_P(Fp8Decodes, LinearFp8StreamKChangesNoBit) {
  Device& dev = device();
  test::ShapeScope scope(dev, KernelShape::Chunks);
  const KernelTuning saved = dev.tuning();
  test::TuningScope restore(dev, saved);
  const uint32_t N = 37;
  for (const uint32_t K : {4608u, 7160u}) {
    const Fp8Problem p = random_problem(N, K, 80 + K);
    Weight wq = fp8_weight(dev, p.w, N, K);
    Weight sc = to_device_f32(dev, p.scales, {ceil128(N), ceil128(K)}, "test.scale_inv");
    const std::vector<float> x = random_vec(size_t(5) * K, 81 + K);
    cl::Mem xb = upload(dev, x);
    for (const uint32_t M : {1u, 2u, 3u, 5u}) {
      SCOPED_TRACE("K=" + std::to_string(K) + " M=" + std::to_string(M));
      auto run = [&](uint32_t stream_k) {
        KernelTuning t = saved;
        t.gemv_stream_k = 4096;
        t.fp8_stream_k = stream_k;
        dev.set_tuning(t);
        EXPECT_EQ(ops::in_turn_max_k(dev, DType::F8_E4M3), stream_k);
        EXPECT_EQ(ops::in_turn_max_k(dev, DType::BF16), 4096u);
        cl::Mem yb = dev.alloc(size_t(M) * N * sizeof(float));
        ops::linear_fp8(dev, xb, 0, K, wq, sc, yb, 0, N, M);
        return download(dev, yb, size_t(M) * N);
      };
      const std::vector<float> side_by_side = run(4096), in_turn = run(8192);
      for (size_t i = 0; i < in_turn.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(in_turn[i]), std::bit_cast<uint32_t>(side_by_side[i]))
            << "element " << i;
    }
  }
}

TEST_P(Fp8Decodes, LinearAlphaAndAccumulate) {
  check_linear_fp8(1, 200, 300, 0.5f, true, 7);
  check_linear_fp8(7, 200, 300, -2.0f, true, 8);
  check_linear_fp8(7, 200, 300, 3.0f, false, 9);
}

// A NaN code (0x7F or 0xFF) makes its output feature NaN, as x . W^T with a NaN weight is, in the
// vector part and in the K % 16 tail, for every row of x; the other features stay exact. Both
// kernel shapes: the CPU one watches the raw bytes (the load-time scan found the codes), the GPU
// one's exact decode yields the NaN.
TEST_P(Fp8Decodes, LinearNanCodePoisonsItsFeatureOnly) {
  // Tiles in turn of one and three rows, four-row tiles, and four-row tiles over a decoded panel
  // (kFp8PanelRowsFrom rows and more), whose watch runs when the panel is made.
  for (const uint32_t M : {1u, 3u, 5u, 40u}) {
  SCOPED_TRACE("M=" + std::to_string(M));
  Device& dev = device();
  const uint32_t N = 12, K = 150;  // tail of 6 columns
  Fp8Problem p = random_problem(N, K, 31);
  p.w[1 * K + 17] = 0x7F;   // feature 1, vector part
  p.w[6 * K + 149] = 0xFF;  // feature 6, tail
  p.w[9 * K + 130] = 0xFF;  // feature 9, second K block
  std::vector<float> x(M * K, 0.25f);
  Weight wq = fp8_weight(dev, p.w, N, K);
  EXPECT_FALSE(wq.fp8_nan_free);  // the scan finds the codes, so the CPU tiles watch for them
  Weight sc = to_device_f32(dev, p.scales, {1, 2}, "test.scale_inv");
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups}) {
    SCOPED_TRACE(shape_name(shape));
    test::ShapeScope scope(dev, shape);
    cl::Mem xb = upload(dev, x), yb = dev.alloc(M * N * sizeof(float));
    ops::linear_fp8(dev, xb, 0, K, wq, sc, yb, 0, N, M);
    const std::vector<float> y = download(dev, yb, M * N);
    for (uint32_t m = 0; m < M; ++m)
      for (uint32_t n = 0; n < N; ++n) {
        if (n == 1 || n == 6 || n == 9) {
          EXPECT_TRUE(std::isnan(y[m * N + n])) << "row " << m << " feature " << n;
          continue;
        }
        double want = 0, mag = 0;
        for (uint32_t k = 0; k < K; ++k) {
          want += 0.25 * p.w_deq[n * K + k];
          mag += std::abs(0.25 * p.w_deq[n * K + k]);
        }
        EXPECT_NEAR(y[m * N + n], want, 1e-6 * mag) << "row " << m << " feature " << n;
      }
  }
  // A weight whose flag says the scan found no NaN code runs the CPU tiles without the watch: the
  // fast decode reads a NaN code as a number, so the flag is the scan's to set, never a guess.
  Weight unwatched = wq;
  unwatched.fp8_nan_free = true;
  test::ShapeScope scope(dev, KernelShape::Chunks);
  cl::Mem xb = upload(dev, x), yb = dev.alloc(M * N * sizeof(float));
  ops::linear_fp8(dev, xb, 0, K, unwatched, sc, yb, 0, N, M);
  EXPECT_TRUE(std::isfinite(download(dev, yb, M * N)[1])) << "feature 1 (a NaN code) unwatched";
  }
}

// The denormal-based decode carries 2^100 on the activation side and 2^-120 on the weights, the
// block scale multiplying the block sums: activations of 1e4 (|x| below the 2^28 limit of x * 2^100)
// and of 1e-20 (products x * w far above the 2^-106 floor), against scales of 1e3 and 2e-3, come
// out as exact as plain f32, in one-row tiles and four-row ones; so does the GPU shape's exact
// decode.
TEST_P(Fp8Decodes, LinearExtremeActivationsAndScales) {
  Device& dev = device();
  const uint32_t N = 8, K = 256;
  Fp8Problem p = random_problem(N, K, 41);
  p.scales = {1e3f, 2e-3f};
  reference::dequantize_fp8(p.w.data(), p.scales.data(), N, K, p.w_deq.data());
  for (float x_mag : {1e4f, 1e-20f}) {
    SCOPED_TRACE(x_mag);
    std::vector<float> x(K);
    for (uint32_t k = 0; k < K; ++k) x[k] = (k % 3 == 0 ? -x_mag : x_mag) * (1 + k % 7) / 7.0f;
    Weight wq = fp8_weight(dev, p.w, N, K);
    Weight sc = to_device_f32(dev, p.scales, {1, 2}, "test.scale_inv");
    for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups})
      for (const uint32_t M : {1u, 4u, 32u}) {  // the row repeated; 32: a decoded panel
        SCOPED_TRACE(std::string(shape_name(shape)) + " M=" + std::to_string(M));
        test::ShapeScope scope(dev, shape);
        std::vector<float> xm;
        for (uint32_t m = 0; m < M; ++m) xm.insert(xm.end(), x.begin(), x.end());
        cl::Mem xb = upload(dev, xm), yb = dev.alloc(M * N * sizeof(float));
        ops::linear_fp8(dev, xb, 0, K, wq, sc, yb, 0, N, M);
        const std::vector<float> y = download(dev, yb, M * N);
        for (uint32_t n = 0; n < N; ++n) {
          double want = 0, mag = 0;
          for (uint32_t k = 0; k < K; ++k) {
            want += double(x[k]) * p.w_deq[n * K + k];
            mag += std::abs(double(x[k]) * p.w_deq[n * K + k]);
          }
          for (uint32_t m = 0; m < M; ++m) {
            ASSERT_TRUE(std::isfinite(y[m * N + n])) << "row " << m << " feature " << n;
            EXPECT_NEAR(y[m * N + n], want, 1e-6 * mag) << "row " << m << " feature " << n;
          }
        }
      }
  }
}

// A row's outputs are the same bits whichever launch computes them (fp8_tile.cl): alone (a one-row
// tile in turn), among 2 or 3 rows (one tile of those rows, in turn), among 9 (four-row tiles) or
// among 40 (four-row tiles over a decoded weight panel, x read unscaled), so a verify step of
// speculative decoding reproduces the decode steps and a prefill's rows are a decode's; with and
// without the NaN watch, in the CPU shape.
TEST_P(Fp8Decodes, LinearRowBitsDoNotDependOnTheBatch) {
  Device& dev = device();
  const uint32_t N = 200, K = 300, M = 40;
  const Fp8Problem p = random_problem(N, K, 51);
  std::mt19937 rng(52);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(M) * K);
  for (auto& v : x) v = normal(rng);
  Weight wq = fp8_weight(dev, p.w, N, K);
  Weight sc = to_device_f32(dev, p.scales, {ceil128(N), ceil128(K)}, "test.scale_inv");
  test::ShapeScope scope(dev, KernelShape::Chunks);
  for (const bool nan_free : {true, false}) {
    SCOPED_TRACE(nan_free ? "no watch" : "watch");
    wq.fp8_nan_free = nan_free;
    auto run = [&](uint32_t m0, uint32_t rows) {
      cl::Mem xb = upload(dev, std::vector<float>(x.begin() + size_t(m0) * K,
                                                  x.begin() + size_t(m0 + rows) * K));
      cl::Mem yb = dev.alloc(size_t(rows) * N * sizeof(float));
      ops::linear_fp8(dev, xb, 0, K, wq, sc, yb, 0, N, rows);
      return download(dev, yb, size_t(rows) * N);
    };
    const std::vector<float> all = run(0, M), nine = run(0, 9), two = run(5, 2),
                             three = run(2, 3);
    for (uint32_t m = 0; m < M; ++m) {
      const std::vector<float> alone = run(m, 1);
      for (uint32_t n = 0; n < N; ++n) {
        ASSERT_EQ(std::bit_cast<uint32_t>(alone[n]), std::bit_cast<uint32_t>(all[m * N + n]))
            << "row " << m << " feature " << n << " alone vs among " << M;
        if (m < 9) {
          ASSERT_EQ(std::bit_cast<uint32_t>(alone[n]), std::bit_cast<uint32_t>(nine[m * N + n]))
              << "row " << m << " feature " << n << " alone vs among 9";
        }
        if (m >= 2 && m < 5) {
          ASSERT_EQ(std::bit_cast<uint32_t>(alone[n]),
                    std::bit_cast<uint32_t>(three[(m - 2) * N + n]))
              << "row " << m << " feature " << n << " alone vs among 3";
        }
        if (m >= 5 && m < 7) {
          ASSERT_EQ(std::bit_cast<uint32_t>(alone[n]),
                    std::bit_cast<uint32_t>(two[(m - 5) * N + n]))
              << "row " << m << " feature " << n << " alone vs among 2";
        }
      }
    }
  }
}

// Two weights side by side in one launch (ops::linear_fp8_pair, MLA's q_a and kv_a): every output
// the bits of linear_fp8 over its own weight, for M from one row (tiles in turn of 1-4 rows) to 4x4
// tiles and decoded panels (40), with the second weight's columns written past the first's and
// nothing around them touched. N0 = 132 (a multiple of the tile's 4 but not of 128, so the
// second weight's scale rows start afresh mid-block of the first), and N0 = 130, which takes two
// launches. A NaN code in the second weight poisons its feature alone (the watch on for both).
TEST_P(Fp8Decodes, LinearPairIsTwoLinearsBitForBit) {
  Device& dev = device();
  const uint32_t K = 300, N1 = 76;
  test::ShapeScope scope(dev, KernelShape::Chunks);
  for (const uint32_t N0 : {132u, 130u}) {
    const Fp8Problem p0 = random_problem(N0, K, 61), p1 = random_problem(N1, K, 62);
    for (const bool nan : {false, true}) {
      std::vector<uint8_t> w1_bytes = p1.w;
      if (nan) w1_bytes[size_t(5) * K + 211] = 0xFF;  // feature N0 + 5
      Weight w0 = fp8_weight(dev, p0.w, N0, K), w1 = fp8_weight(dev, w1_bytes, N1, K);
      Weight s0 = to_device_f32(dev, p0.scales, {ceil128(N0), ceil128(K)}, "test.scale0");
      Weight s1 = to_device_f32(dev, p1.scales, {ceil128(N1), ceil128(K)}, "test.scale1");
      for (const uint32_t M : {1u, 2u, 3u, 5u, 40u}) {
        SCOPED_TRACE("N0=" + std::to_string(N0) + " M=" + std::to_string(M) +
                     (nan ? " with a NaN code" : ""));
        std::mt19937 rng(M);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        const uint32_t x_off = 3, ldx = K + 5, y_off = 2, ldy = N0 + N1 + 7;
        std::vector<float> x(x_off + size_t(M) * ldx), y0(y_off + size_t(M) * ldy);
        for (auto& v : x) v = normal(rng);
        for (auto& v : y0) v = normal(rng);
        cl::Mem xb = upload(dev, x), pair = upload(dev, y0), apart = upload(dev, y0);
        ops::linear_fp8_pair(dev, xb, x_off, ldx, w0, s0, w1, s1, pair, y_off, ldy, M, 0.5f, true);
        ops::linear_fp8(dev, xb, x_off, ldx, w0, s0, apart, y_off, ldy, M, 0.5f, true);
        ops::linear_fp8(dev, xb, x_off, ldx, w1, s1, apart, y_off + N0, ldy, M, 0.5f, true);
        const std::vector<float> got = download(dev, pair, y0.size()),
                                 want = download(dev, apart, y0.size());
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_TRUE(same_bits_or_both_nan(got[i], want[i]))
              << "element " << i << ": " << got[i] << " against " << want[i];
        for (uint32_t m = 0; m < M; ++m)
          for (uint32_t n = 0; n < N0 + N1; ++n) {
            const float v = got[y_off + size_t(m) * ldy + n];
            ASSERT_EQ(std::isnan(v), nan && n == N0 + 5) << "row " << m << " feature " << n;
          }
      }
    }
  }
  Weight a = fp8_weight(dev, std::vector<uint8_t>(8 * 256, 0x38), 8, 256);
  Weight b = fp8_weight(dev, std::vector<uint8_t>(8 * 128, 0x38), 8, 128);
  Weight sa = to_device_f32(dev, std::vector<float>(2, 1.0f), {1, 2}, "test.scale_a");
  Weight sb = to_device_f32(dev, std::vector<float>(1, 1.0f), {1, 1}, "test.scale_b");
  cl::Mem xb = dev.alloc(256 * 4), yb = dev.alloc(16 * 4);
  try {
    ops::linear_fp8_pair(dev, xb, 0, 256, a, sa, b, sb, yb, 0, 16, 1);
    FAIL() << "weights of 256 and 128 columns side by side";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("has 256 columns, 'test.fp8.weight' 128"),
              std::string::npos)
        << e.what();
  }
}

// The load-time NaN scan: every code at every place of an 18-byte run (two 8-code words and a
// tail of 2) is found exactly when it is 0x7F or 0xFF.
TEST(Fp8NanScan, FindsExactlyTheNanCodesAnywhere) {
  for (int code = 0; code < 256; ++code)
    for (size_t at = 0; at < 18; ++at) {
      std::vector<uint8_t> bytes(18, 0x7E);  // 448, the largest finite code, everywhere else
      bytes[at] = uint8_t(code);
      ASSERT_EQ(fp8_nan_free(bytes.data(), bytes.size()), (code & 0x7F) != 0x7F)
          << "code " << code << " at " << at;
    }
  EXPECT_TRUE(fp8_nan_free(nullptr, 0));
}

// A checkpoint tensor view of N x K e4m3 codes held in `bytes`.
TensorView fp8_view(const std::vector<uint8_t>& bytes, int64_t N, int64_t K) {
  TensorView v;
  v.name = "test.fp8";
  v.dtype = DType::F8_E4M3;
  v.shape = {N, K};
  v.data = bytes.data();
  v.bytes = bytes.size();
  return v;
}

// The same pass counts the subnormal codes (exponent bits 0, mantissa not: 0x01-0x07 and
// 0x81-0x87): every code at every place of an 18-byte run of one other code each, and all 256
// codes at once (14 subnormal, 2 NaN).
TEST(Fp8CodeScan, CountsExactlyTheSubnormalCodesAnywhere) {
  for (int code = 0; code < 256; ++code)
    for (const uint8_t around : {uint8_t(0x00), uint8_t(0x38), uint8_t(0x83)})
      for (size_t at = 0; at < 18; ++at) {
        std::vector<uint8_t> bytes(18, around);
        bytes[at] = uint8_t(code);
        auto subnormal = [](int c) { return (c & 0x78) == 0 && (c & 0x07) != 0; };
        const Fp8CodeScan scan = scan_fp8_codes(bytes.data(), bytes.size());
        ASSERT_EQ(scan.subnormal, 17 * subnormal(around) + subnormal(code))
            << "code " << code << " at " << at << " among " << int(around);
        ASSERT_EQ(scan.nan_free, (code & 0x7F) != 0x7F);
      }
  std::vector<uint8_t> all(256);
  for (int c = 0; c < 256; ++c) all[size_t(c)] = uint8_t(c);
  const Fp8CodeScan scan = scan_fp8_codes(all.data(), all.size());
  EXPECT_EQ(scan.subnormal, 14u);
  EXPECT_FALSE(scan.nan_free);
}

// to_device records the share of subnormal codes of the bytes it covers.
TEST(Fp8CodeScan, ToDeviceRecordsTheSubnormalShare) {
  Device& dev = device();
  const int64_t N = 4, K = 64;
  std::vector<uint8_t> bytes(N * K, 0x38);
  for (int64_t i = 0; i < 32; ++i) bytes[size_t(i * 8)] = uint8_t(i % 2 ? 0x05 : 0x81);
  TensorView v = fp8_view(bytes, N, K);
  EXPECT_EQ(to_device(dev, v).fp8_subnormal_share, 32.0f / 256);
  EXPECT_EQ(to_device_rows(dev, v, 1, 2).fp8_subnormal_share, 8.0f / 64);
  EXPECT_EQ(to_device_columns(dev, v, 1, 8).fp8_subnormal_share, 0.0f);  // misses column 0
}

// Runs longer than the scan's 255-word count per byte lane: every code subnormal (each lane at
// its most, 255, before the lanes are added), and random codes, against a count byte by byte, at
// lengths on and around the multiples of 2040 bytes.
TEST(Fp8CodeScan, CountsLongRunsByteForByte) {
  auto subnormal = [](uint8_t c) { return (c & 0x78) == 0 && (c & 0x07) != 0; };
  std::mt19937 rng(7);
  for (const size_t n : {size_t(2040), size_t(2041), size_t(4079), size_t(4080), size_t(20413)}) {
    const std::vector<uint8_t> all_subnormal(n, 0x85);
    const Fp8CodeScan full = scan_fp8_codes(all_subnormal.data(), n);
    EXPECT_EQ(full.subnormal, n) << n << " bytes";
    EXPECT_TRUE(full.nan_free);
    std::vector<uint8_t> random(n);
    for (auto& c : random) c = uint8_t(rng() % 8 == 0 ? rng() % 8 : rng() % 256);  // many subnormal
    uint64_t expected = 0;
    bool nan = false;
    for (uint8_t c : random) {
      expected += subnormal(c);
      nan = nan || (c & 0x7F) == 0x7F;
    }
    const Fp8CodeScan scan = scan_fp8_codes(random.data(), n);
    EXPECT_EQ(scan.subnormal, expected) << n << " bytes";
    EXPECT_EQ(scan.nan_free, !nan) << n << " bytes";
  }
}

// The e4m3 decode per weight: on the CPU device (which keeps f32 denormals) the short one up to
// kFp8DenormMaxSubnormalShare of subnormal codes, the f16 one past it (each FMA on a denormal
// costs x86 a microcode assist); CLSHARD_FP8_DECODE=f16 forces the latter.
TEST(Fp8CodeScan, SubnormalShareChoosesTheDecodeOnCpus) {
  Device& dev = test::cpu_device();
  ASSERT_EQ(dev.info().kind, DeviceKind::Cpu);
  EXPECT_EQ(ops::fp8_decode_option(dev, 0.0f), "-DFP8_DENORM=1");
  EXPECT_EQ(ops::fp8_decode_option(dev, ops::kFp8DenormMaxSubnormalShare), "-DFP8_DENORM=1");
  EXPECT_EQ(ops::fp8_decode_option(dev, 2 * ops::kFp8DenormMaxSubnormalShare), "-DFP8_DENORM=0");
  setenv("CLSHARD_FP8_DECODE", "f16", 1);
  EXPECT_EQ(ops::fp8_decode_option(dev, 0.0f), "-DFP8_DENORM=0");
  unsetenv("CLSHARD_FP8_DECODE");
}

// to_device and its row and column slices record the scan of the bytes they cover.
TEST(Fp8NanScan, ToDeviceRecordsItForTheBytesItCovers) {
  Device& dev = device();
  const int64_t N = 6, K = 20;
  std::vector<uint8_t> bytes(N * K, 0x38);
  bytes[4 * K + 13] = 0xFF;  // row 4, column 13
  TensorView v = fp8_view(bytes, N, K);
  EXPECT_FALSE(to_device(dev, v).fp8_nan_free);
  EXPECT_TRUE(to_device_rows(dev, v, 0, 4).fp8_nan_free);
  EXPECT_FALSE(to_device_rows(dev, v, 3, 6).fp8_nan_free);
  EXPECT_TRUE(to_device_columns(dev, v, 0, 13).fp8_nan_free);
  EXPECT_FALSE(to_device_columns(dev, v, 10, 20).fp8_nan_free);
  bytes[4 * K + 13] = 0x38;
  EXPECT_TRUE(to_device(dev, v).fp8_nan_free);
  v.dtype = DType::BF16;  // not FP8: nothing recorded
  v.shape = {N, K / 2};
  EXPECT_FALSE(to_device(dev, v).fp8_nan_free);
}

TEST(LinearFp8, RejectsWrongDtypeAndScaleShape) {
  Device& dev = device();
  const Fp8Problem p = random_problem(200, 300, 11);
  Weight wq = fp8_weight(dev, p.w, 200, 300);
  Weight sc = to_device_f32(dev, p.scales, {2, 3}, "good.scale_inv");
  Weight bad_scale = to_device_f32(dev, p.scales, {3, 2}, "bad.scale_inv");
  Weight f32_weight = to_device_f32(dev, p.w_deq, {200, 300}, "f32.weight");
  cl::Mem x = dev.alloc(300 * sizeof(float)), y = dev.alloc(200 * sizeof(float));
  try {
    ops::linear_fp8(dev, x, 0, 300, wq, bad_scale, y, 0, 200, 1);
    FAIL() << "a [3, 2] scale for a [200, 300] weight was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected F32 [2, 3]"), std::string::npos) << e.what();
  }
  try {
    ops::linear_fp8(dev, x, 0, 300, f32_weight, sc, y, 0, 200, 1);
    FAIL() << "an F32 weight was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("F8_E4M3"), std::string::npos) << e.what();
  }
}

// linear_any with ComputeDType::BF16 on an FP8 weight in the CPU shape (GEMMs of 16 rows and
// more: linear_fp8_bf16's panels): the bits of the bf16 GEMM over the host's bf16 dequantization,
// at odd sizes with partial blocks, alpha and accumulate, in the prefill tile and the batch tile,
// and from gemm_bf16_packed_rows rows in the packed GEMM (dequantized as it packs; 129 rows with K
// of two chunks and an odd tail), with the dot product and the portable micro-kernel (over the
// panel of weights widened to f32 where the device's tuning has bf16 pairs, and the other way
// round: gemm_bf16_packed_wf32), and with the NaN watch (the weight's scan unknown: the exact
// decode); fewer rows, and every GEMM in the GPU shape (which keeps FP8 weights in its tiles), keep
// linear_fp8's bits, but for 1-15 rows where the host has vdpbf16ps (their own sums:
// Fp8ComputeBf16.LinearInTurnSumsBf16RoundedRows).
TEST_P(Fp8Decodes, LinearAnyBf16ComputeIsTheBf16GemmOfTheDequantizedWeight) {
  Device& dev = device();
  test::ShapeScope scope(dev, dev.kernel_shape());  // the device's own shape back afterwards
  const KernelTuning tuning = dev.tuning();
  for (const KernelShape shape : {KernelShape::Chunks, KernelShape::WorkGroups})
  for (const auto& [M, N, K] : {std::tuple<uint32_t, uint32_t, uint32_t>{64, 200, 300},
                               {97, 131, 259}, {17, 131, 259}, {8, 131, 259}, {1, 200, 300},
                               {130, 131, 259}, {129, 40, 2101}})
  for (const bool portable : {false, true}) {
    dev.set_kernel_shape(shape);
    KernelTuning t = tuning;
    t.gemm_bf16_dot = portable ? 0 : 1;  // vdpbf16ps where the host has it, else the portable
    if (portable) {
      t.gemm_bf16_amx = 0;
      t.gemm_bf16_packed_wf32 = tuning.gemm_bf16_packed_wf32 ? 0 : 1;  // the other panel
    }
    test::TuningScope tuned(dev, t);
    const bool bf16_route = M >= 16 && shape == KernelShape::Chunks;
    if (M < 16 && shape == KernelShape::Chunks && ops::bf16_dot_product(dev)) continue;
    SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                 (shape == KernelShape::Chunks ? " cpu shape" : " gpu shape") +
                 (portable ? " portable" : ""));
    const Fp8Problem p = random_problem(N, K, 21 + M);
    std::vector<uint16_t> wb(size_t(N) * K);
    for (uint32_t n = 0; n < N; ++n)
      for (uint32_t k = 0; k < K; ++k)
        wb[size_t(n) * K + k] = f32_to_bf16(reference::e4m3_to_f32(p.w[size_t(n) * K + k]) *
                                            p.scales[(n / 128) * ceil128(K) + k / 128]);
    Weight wq = fp8_weight(dev, p.w, N, K);
    EXPECT_TRUE(wq.fp8_nan_free);
    wq.fp8_nan_free = M != 97 && M != 129;  // the watch: the exact decode in the panels
    Weight sc = to_device_f32(dev, p.scales, {ceil128(N), ceil128(K)}, "test.scale_inv");
    Weight wbf;
    wbf.mem = test::upload(dev, wb);
    wbf.dtype = DType::BF16;
    wbf.shape = {N, K};
    wbf.name = "test.bf16";
    const std::vector<float> x = random_vec(size_t(M) * K, 3), y0 = random_vec(size_t(M) * N, 4);
    auto run = [&](const Weight& w, const Weight* s, ComputeDType c) {
      cl::Mem xb = upload(dev, x), yb = upload(dev, y0);
      ops::linear_any(dev, xb, 0, K, w, s, yb, 0, N, M, 0.5f, true, false, c);
      return download(dev, yb, y0.size());
    };
    const auto got = run(wq, &sc, ComputeDType::BF16);
    const auto want =
        bf16_route ? run(wbf, nullptr, ComputeDType::BF16) : run(wq, &sc, ComputeDType::F32);
    const auto f32 = run(wq, &sc, ComputeDType::F32);
    size_t differs_from_f32 = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
          << "output " << i;
      differs_from_f32 += got[i] != f32[i];
    }
    if (bf16_route) {
      EXPECT_GT(differs_from_f32, got.size() / 2);  // the bf16 path really ran
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The shared reference case: real checkpoint tensors, x and y = x . w_dequant^T in float64.

TEST_P(Fp8Decodes, LinearReferenceCaseFp8Gemm) {
  Device& dev = device();
  const auto ref = shared_dir() / "reference";
  const auto index = read_json_file(ref / "index.json");
  const nlohmann::json* fp8_case = nullptr;
  for (const auto& c : index["cases"])
    if (c["id"] == "deepseek-v3-tiny-grouped-fp8/fp8_gemm") fp8_case = &c;
  ASSERT_NE(fp8_case, nullptr) << "no fp8_gemm case in " << (ref / "index.json");
  ASSERT_EQ((*fp8_case)["kind"], "fp8_gemm");
  const double rel_tol = (*fp8_case)["tolerance"]["gemm_fp32"]["rel"].get<double>();  // 1e-5
  WeightStore store(ref / (*fp8_case)["checkpoint"].get<std::string>());

  ASSERT_FALSE((*fp8_case)["weights"].empty());
  for (const auto& wc : (*fp8_case)["weights"]) {
    const std::string name = wc["tensor"];
    SCOPED_TRACE(name);
    const auto wshape = wc["weight_shape"].get<std::vector<int64_t>>();
    const auto sshape = wc["scale_shape"].get<std::vector<int64_t>>();
    const TensorView& wv = store.expect(name, wshape, {DType::F8_E4M3});
    const TensorView& sv = store.expect(wc["scale_tensor"], sshape, {DType::F32});
    const uint32_t N = uint32_t(wshape[0]), K = uint32_t(wshape[1]);
    const auto& files = wc["files"];
    const std::vector<float> x = test::read_f32(ref / files["x"]["file"].get<std::string>());
    const std::vector<float> w_dequant =
        test::read_f32(ref / files["w_dequant"]["file"].get<std::string>());
    const std::vector<float> y_ref =
        test::read_f32(ref / files["y_dequant_only"]["file"].get<std::string>());
    const uint32_t M = files["x"]["shape"][0].get<uint32_t>();
    ASSERT_EQ(x.size(), size_t(M) * K);
    ASSERT_EQ(w_dequant.size(), size_t(N) * K);
    ASSERT_EQ(y_ref.size(), size_t(M) * N);

    // Host dequantization reproduces the reference's float32(e4m3fn) * scale bit for bit. The
    // scale tensor is copied out of the mapping: safetensors does not promise 4-byte alignment.
    std::vector<float> scales(sv.bytes / sizeof(float));
    std::memcpy(scales.data(), sv.data, sv.bytes);
    std::vector<float> host_deq(size_t(N) * K);
    reference::dequantize_fp8(wv.data, scales.data(), N, K, host_deq.data());
    size_t host_mismatches = 0;
    for (size_t i = 0; i < host_deq.size(); ++i)
      host_mismatches += !same_bits_or_both_nan(host_deq[i], w_dequant[i]);
    EXPECT_EQ(host_mismatches, 0u) << "host dequantization differs from w_dequant";

    // The device's dequantization is the same, bit for bit.
    Weight wq = to_device(dev, wv);
    Weight sc = to_device(dev, sv);
    cl::Mem deq = dev.alloc(size_t(N) * K * sizeof(float));
    ops::dequantize_fp8(dev, wq, sc, deq);
    const std::vector<float> dev_deq = download(dev, deq, size_t(N) * K);
    size_t dev_mismatches = 0;
    for (size_t i = 0; i < dev_deq.size(); ++i)
      dev_mismatches += !same_bits_or_both_nan(dev_deq[i], w_dequant[i]);
    EXPECT_EQ(dev_mismatches, 0u) << "device dequantization differs from w_dequant";

    // The GEMM: per row (the rows span scales from 1e-6 to 5000), max |diff| <= rel * max |y|;
    // the all-zero row must come out exactly zero.
    cl::Mem xb = upload(dev, x), yb = dev.alloc(size_t(M) * N * sizeof(float));
    ops::linear_fp8(dev, xb, 0, K, wq, sc, yb, 0, N, M);
    const std::vector<float> y = download(dev, yb, size_t(M) * N);
    for (uint32_t m = 0; m < M; ++m) {
      double max_y = 0, max_err = 0;
      for (uint32_t n = 0; n < N; ++n) {
        max_y = std::max(max_y, std::abs(double(y_ref[m * N + n])));
        max_err = std::max(max_err, std::abs(double(y[m * N + n]) - double(y_ref[m * N + n])));
      }
      if (max_y == 0)
        EXPECT_EQ(max_err, 0.0) << "row " << m << " should be exactly zero";
      else
        EXPECT_LE(max_err, rel_tol * max_y)
            << "row " << m << ": max |diff| " << max_err << " of max |y| " << max_y;
    }
  }
}

}  // namespace
}  // namespace clshard
