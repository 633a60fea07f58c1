// What VNNI int8 dot products would give the FP8 path (issue 12: "try VNNI (int8) for the FP8 path
// with quantized activations and report what it gives"): kernels_cl/linear_int8.cl against the
// exact FP8 GEMV (ops::linear_fp8) on the dsv3-mini shapes, in time and in accuracy.
//
// Weights are drawn as a checkpoint's are made: normal values, each 128 x 128 block scaled by its
// largest |value| / 448 and rounded to e4m3 (deepseek_v3::quantize_fp8_blocks, as make-model's
// FP8 presets). The int8 path quantizes those dequantized weights again, per 128-wide row block
// (linear_int8.cl), and quantizes each call's activations per 128-wide block.
//
// Time: both variants alternate call by call in this process (the machine's speed drifts by a
// third within seconds, so separate runs cannot settle a 10% question), each call walking a ring of
// weight copies larger than the last-level cache so that the weights stream from memory; the int8
// call includes its activation quantization. Printed: the median time per GEMV of each, the median
// of the per-pair ratios with its quartiles, and each one's weight bytes per second against the
// read roofline of the same run.
//
// Accuracy: the relative rms error, against a double product over the dequantized weights and the
// f32 activations, of the exact FP8 GEMV, of the int8 one, and of DeepSeek's own FP8 recipe (the
// activations rounded to e4m3 per 128-wide block by ops::act_quant_fp8, then the FP8 GEMV),
// for normal activations and for normal activations whose every 64th channel is 30x larger (the
// outlier channels of LLM activations).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "bench_util.h"
#include "models/deepseek_v3/presets.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"

namespace clshard {
namespace {

struct Shape {
  uint32_t M, N, K;
};

// One weight as the checkpoint holds it (codes, 128 x 128 scales) and as the int8 path holds it.
struct HostWeight {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // [N / 128, K / 128]
  std::vector<float> dequant;  // e4m3 * scale, the exact weight both paths approximate
  std::vector<uint8_t> q;        // int8 codes + 128 (linear_int8.cl)
  std::vector<float> q_scales;   // [N, K / 128]
  std::vector<float> q_dequant;  // the int8 weight as f32: its own error, apart from x's
};

HostWeight make_weight(uint32_t N, uint32_t K, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> v(size_t(N) * K);
  for (auto& e : v) e = normal(rng);
  const uint32_t KB = K / 128;
  HostWeight w;
  w.codes.resize(v.size());
  w.dequant.resize(v.size());
  w.scales.resize(size_t(N / 128) * KB);
  deepseek_v3::quantize_fp8_blocks(v.data(), N, K, w.codes.data(), w.scales.data());
  reference::dequantize_fp8(w.codes.data(), w.scales.data(), N, K, w.dequant.data());
  w.q.resize(v.size());
  w.q_scales.resize(size_t(N) * KB);
  w.q_dequant.resize(v.size());
  for (uint32_t n = 0; n < N; ++n)
    for (uint32_t kb = 0; kb < KB; ++kb) {
      const float* d = &w.dequant[size_t(n) * K + kb * 128];
      float amax = 0;
      for (int k = 0; k < 128; ++k) amax = std::max(amax, std::fabs(d[k]));
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;
      for (int k = 0; k < 128; ++k) {
        const int q = int(std::lrint(std::clamp(d[k] * inv, -127.0f, 127.0f)));
        w.q[size_t(n) * K + kb * 128 + k] = uint8_t(q + 128);
        w.q_dequant[size_t(n) * K + kb * 128 + k] = float(q) * (amax / 127.0f);
      }
      w.q_scales[size_t(n) * KB + kb] = amax / 127.0f;
    }
  return w;
}

struct DeviceWeight {
  Weight codes, scales;  // the FP8 path's
  cl::Mem q, q_scales;
};

DeviceWeight upload(Device& dev, const HostWeight& h, uint32_t N, uint32_t K) {
  DeviceWeight d;
  d.codes.mem = dev.alloc(h.codes.size(), CL_MEM_READ_ONLY);
  dev.write(d.codes.mem, h.codes.data(), h.codes.size());
  d.codes.dtype = DType::F8_E4M3;
  d.codes.shape = {N, K};
  d.codes.name = "bench.weight";
  d.codes.fp8_nan_free = fp8_nan_free(h.codes.data(), h.codes.size());
  d.scales.mem = dev.alloc(h.scales.size() * 4, CL_MEM_READ_ONLY);
  dev.write(d.scales.mem, h.scales.data(), h.scales.size() * 4);
  d.scales.dtype = DType::F32;
  d.scales.shape = {N / 128, K / 128};
  d.scales.name = "bench.weight_scale_inv";
  d.q = dev.alloc(h.q.size(), CL_MEM_READ_ONLY);
  dev.write(d.q, h.q.data(), h.q.size());
  d.q_scales = dev.alloc(h.q_scales.size() * 4, CL_MEM_READ_ONLY);
  dev.write(d.q_scales, h.q_scales.data(), h.q_scales.size() * 4);
  return d;
}

// The int8 path: the activations' quantization, then the VNNI GEMV. A work-item takes enough
// weight rows that the launch is 16 work-items per compute unit (as the FP8 one-row launches).
struct Int8Gemv {
  Device& dev;
  uint32_t M, N, K, tm;
  cl::Kernel quantize, gemv;
  cl::Mem xq, xs, xoff;
  uint32_t n_rows;

  Int8Gemv(Device& d, uint32_t M_, uint32_t N_, uint32_t K_)
      : dev(d), M(M_), N(N_), K(K_), tm(M_ < 4 ? M_ : 4) {
    quantize = dev.kernel("linear_int8.cl", "quantize_act_int8");
    gemv = dev.kernel("linear_int8.cl", "linear_int8", "-DTM=" + std::to_string(tm));
    xq = dev.alloc(size_t(M) * K);
    xs = dev.alloc(size_t(M) * (K / 128) * 4);
    xoff = dev.alloc(size_t(M) * (K / 128) * 4);
    const uint32_t items = std::max(16u * std::max(dev.info().compute_units, 1u), 32u);
    const uint32_t row_blocks = (M + tm - 1) / tm;
    n_rows = std::max(1u, N * row_blocks / items);
  }
  void quantize_x(const cl::Mem& x) {
    cl::set_args(quantize, x, K, xq, xs, xoff, K, K / 128);
    dev.launch(quantize, {K / 128, M, 1}, 2);
  }
  void gemv_only(const DeviceWeight& w, const cl::Mem& y) {
    cl::set_args(gemv, xq, xs, xoff, w.q, w.q_scales, y, M, N, K, n_rows);
    dev.launch(gemv, {(N + n_rows - 1) / n_rows, (M + tm - 1) / tm, 1}, 2);
  }
  // What the GEMV must give for the activations last quantized: each block's integer dot (exact)
  // times its two scales, summed in double.
  std::vector<double> expected(const HostWeight& w) const {
    const uint32_t KB = K / 128;
    std::vector<int8_t> q(size_t(M) * K);
    std::vector<float> scales(size_t(M) * KB);
    dev.read(xq, q.data(), q.size());
    dev.read(xs, scales.data(), scales.size() * 4);
    std::vector<double> y(size_t(M) * N);
    for (uint32_t m = 0; m < M; ++m)
      for (uint32_t n = 0; n < N; ++n) {
        double sum = 0;
        for (uint32_t kb = 0; kb < KB; ++kb) {
          int64_t dot = 0;
          for (uint32_t k = kb * 128; k < kb * 128 + 128; ++k)
            dot += int64_t(q[size_t(m) * K + k]) * (int(w.q[size_t(n) * K + k]) - 128);
          sum += double(dot) * w.q_scales[size_t(n) * KB + kb] * scales[size_t(m) * KB + kb];
        }
        y[size_t(m) * N + n] = sum;
      }
    return y;
  }
  void run(const cl::Mem& x, const DeviceWeight& w, const cl::Mem& y) {
    quantize_x(x);
    gemv_only(w, y);
  }
};

template <typename T>
double rel_rms(const std::vector<T>& y, const std::vector<double>& ref) {
  double e = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    e += (double(y[i]) - ref[i]) * (double(y[i]) - ref[i]);
    r += ref[i] * ref[i];
  }
  return std::sqrt(e / r);
}

std::vector<double> product(const std::vector<float>& x, const std::vector<float>& w, uint32_t M,
                            uint32_t N, uint32_t K) {
  std::vector<double> y(size_t(M) * N);
  for (uint32_t m = 0; m < M; ++m)
    for (uint32_t n = 0; n < N; ++n) {
      double s = 0;
      for (uint32_t k = 0; k < K; ++k) s += double(x[size_t(m) * K + k]) * w[size_t(n) * K + k];
      y[size_t(m) * N + n] = s;
    }
  return y;
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[size_t(q * double(v.size() - 1) + 0.5)];
}

struct Row {
  Shape shape;
  double seconds[3], roof[3];        // fp8, int8 with its quantization, int8 GEMV alone
  std::array<double, 3> ratio[3];    // fp8 / variant per round: quartiles and median
  double err[2][4];
  double kernel_err = 0;  // the int8 GEMV against its own integer sums done on the host
};

Row run_shape(Device& dev, const Shape& s, int rounds, double roofline_gbs) {
  std::mt19937 rng(s.N * 7 + s.K + s.M);
  const HostWeight hw = make_weight(s.N, s.K, rng);
  const size_t bytes = size_t(s.N) * s.K;
  const size_t copies = std::max<size_t>(2, (bench::weight_ring_bytes() + bytes - 1) / bytes);
  std::vector<DeviceWeight> ring;
  for (size_t c = 0; c < copies; ++c) ring.push_back(upload(dev, hw, s.N, s.K));

  Int8Gemv int8(dev, s.M, s.N, s.K);
  cl::Mem x = dev.alloc(size_t(s.M) * s.K * 4), y = dev.alloc(size_t(s.M) * s.N * 4);
  cl::Mem xq = dev.alloc(size_t(s.M) * s.K * 4);  // x as act_quant_fp8 rounds it
  std::vector<float> yh(size_t(s.M) * s.N);

  // Accuracy, on the first copy: [distribution][fp8, int8, int8 weights with f32 x, e4m3 x].
  Row row{s, {}, {}, {}};
  for (int dist = 0; dist < 2; ++dist) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> xh(size_t(s.M) * s.K);
    for (size_t i = 0; i < xh.size(); ++i)
      xh[i] = normal(rng) * (dist == 1 && (i % s.K) % 64 == 0 ? 30.0f : 1.0f);
    dev.write(x, xh.data(), xh.size() * 4);
    const std::vector<double> ref = product(xh, hw.dequant, s.M, s.N, s.K);
    ops::linear_fp8(dev, x, 0, s.K, ring[0].codes, ring[0].scales, y, 0, s.N, s.M);
    dev.read(y, yh.data(), yh.size() * 4);
    row.err[dist][0] = rel_rms(yh, ref);
    int8.run(x, ring[0], y);
    dev.read(y, yh.data(), yh.size() * 4);
    row.err[dist][1] = rel_rms(yh, ref);
    row.kernel_err = std::max(row.kernel_err, rel_rms(yh, int8.expected(hw)));
    row.err[dist][2] = rel_rms(product(xh, hw.q_dequant, s.M, s.N, s.K), ref);
    ops::act_quant_fp8(dev, x, 0, s.K, s.M, s.K, xq);
    ops::linear_fp8(dev, xq, 0, s.K, ring[0].codes, ring[0].scales, y, 0, s.N, s.M);
    dev.read(y, yh.data(), yh.size() * 4);
    row.err[dist][3] = rel_rms(yh, ref);
  }

  // Time: rounds of one ring pass per variant, the order rotated every round.
  auto pass = [&](int variant) {
    if (variant == 2) int8.quantize_x(x);  // the GEMV alone reads activations quantized before
    dev.finish();
    const auto t0 = bench::Clock::now();
    for (const DeviceWeight& w : ring) {
      if (variant == 0)
        ops::linear_fp8(dev, x, 0, s.K, w.codes, w.scales, y, 0, s.N, s.M);
      else if (variant == 1)
        int8.run(x, w, y);
      else
        int8.gemv_only(w, y);
    }
    dev.finish();
    return bench::seconds_since(t0) / double(ring.size());
  };
  for (int v = 0; v < 3; ++v) pass(v);
  std::vector<double> t[3], ratio[3];
  for (int r = 0; r < rounds; ++r) {
    double round_t[3];
    for (int j = 0; j < 3; ++j) {
      const int v = (r + j) % 3;
      round_t[v] = pass(v);
    }
    for (int v = 0; v < 3; ++v) {
      t[v].push_back(round_t[v]);
      ratio[v].push_back(round_t[0] / round_t[v]);
    }
  }
  const double wbytes = double(bytes);
  for (int v = 0; v < 3; ++v) {
    row.seconds[v] = quantile(t[v], 0.5);
    row.roof[v] = wbytes / row.seconds[v] / 1e9 / roofline_gbs;
    row.ratio[v] = {quantile(ratio[v], 0.25), quantile(ratio[v], 0.5), quantile(ratio[v], 0.75)};
  }
  return row;
}

}  // namespace
}  // namespace clshard

int main(int argc, char** argv) {
  using namespace clshard;
  CLI::App app{"The FP8 GEMV against int8 VNNI dot products (kernels_cl/linear_int8.cl): time "
               "and accuracy on the dsv3-mini shapes",
               "bench_fp8_int8"};
  int rounds = 30;
  app.add_option("--rounds", rounds, "timed rounds per shape (a ring pass of each variant, the "
                 "order rotated)")->check(CLI::PositiveNumber);
  bench::parse_args(app, argc, argv);
  if (!__builtin_cpu_supports("avx512vnni")) {
    std::fprintf(stderr, "bench_fp8_int8: the host CPU does not report avx512_vnni\n");
    return 1;
  }
  DeviceManager mgr(DeviceSelection{});
  Device& dev = mgr[0];
  if (!dev.is_cpu()) {
    std::fprintf(stderr, "bench_fp8_int8: device 0 is not the host CPU (%s)\n", dev.label().c_str());
    return 1;
  }
  bench::print_device(dev);
  const bench::Roofline roof = bench::measure_roofline(dev);
  const Shape shapes[] = {{1, 2048, 2048}, {1, 7168, 2048}, {1, 512, 2048}, {1, 2048, 512},
                          {2, 2048, 2048}, {8, 2048, 2048}, {64, 2048, 2048}};
  std::vector<Row> rows;
  for (const Shape& s : shapes) {
    std::fprintf(stderr, "M %u, N %u, K %u ...\n", s.M, s.N, s.K);
    rows.push_back(run_shape(dev, s, rounds, roof.best()));
  }
  std::printf("\nTime per GEMV (us), weight bytes per second as %% of the %.1f GB/s roofline, and the "
              "speed-up over the FP8 GEMV (median of %d rounds' ratios [quartiles]):\n",
              roof.best(), rounds);
  std::printf("%4s %5s %5s | %-16s | %-34s | %-34s\n", "M", "N", "K", "fp8",
              "int8 with its activation quantization", "int8 GEMV alone");
  for (const Row& r : rows) {
    std::printf("%4u %5u %5u | %7.1f %5.0f%%   ", r.shape.M, r.shape.N, r.shape.K, r.seconds[0] * 1e6,
                100 * r.roof[0]);
    for (int v = 1; v < 3; ++v)
      std::printf("| %7.1f %4.0f%% %4.2fx [%4.2f, %4.2f] ", r.seconds[v] * 1e6, 100 * r.roof[v],
                  r.ratio[v][1], r.ratio[v][0], r.ratio[v][2]);
    std::printf("\n");
  }
  std::printf("\nRelative rms error against a double product over the dequantized FP8 weights and "
              "the f32 activations:\n  fp8: the FP8 GEMV; int8: the int8 GEMV; w8: the int8 weights "
              "with f32 activations (host);\n  e4m3 x: DeepSeek's act_quant recipe, activations "
              "rounded to e4m3 per 128-wide block (act_quant_fp8), then the FP8 GEMV\n");
  std::printf("%4s %5s %5s | %-31s | %-31s\n", "M", "N", "K", "normal x: fp8 int8 w8 e4m3x",
              "every 64th channel x30: same");
  for (const Row& r : rows) {
    std::printf("%4u %5u %5u ", r.shape.M, r.shape.N, r.shape.K);
    for (int d = 0; d < 2; ++d)
      std::printf("| %.1e %.1e %.1e %.1e ", r.err[d][0], r.err[d][1], r.err[d][2], r.err[d][3]);
    std::printf("\n");
  }
  // The kernel itself: its outputs against the same quantized values summed exactly on the host
  // (f32 scales and sums leave about 1e-7).
  double worst = 0;
  for (const Row& r : rows) worst = std::max(worst, r.kernel_err);
  std::printf("\nint8 GEMV against its integer sums on the host: largest relative rms error %.1e\n",
              worst);
  if (!(worst < 1e-5)) {
    std::fprintf(stderr, "bench_fp8_int8: the int8 GEMV is wrong (relative rms error %.1e against "
                 "the host's sums of the same codes, expected below 1e-5)\n", worst);
    return 1;
  }
  return 0;
}
