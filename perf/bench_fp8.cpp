// FP8 block-scaled GEMV/GEMM (ops::linear_fp8) on the dsv3-mini shapes (hidden 2048, MoE FFN 512),
// next to the bf16 ops::linear on the same shape, and the GEMMs at compute_dtype bf16.
// bytes_per_second counts weight bytes (1 per element for fp8, 2 for bf16), the decode roofline's
// currency.
//
// Each iteration walks a ring of weight copies 3x the last-level cache (bench_util.h's
// weight_ring_bytes) and waits once at the end, so the weights stream from memory as in a real
// decode step rather than sitting in L3. BM_NativeRead times the native loops over 512 MiB in the
// same run: the STREAM loop, and the FP8 one-row tile's instructions (e4m3 decode), what the FP8
// GEMVs' bytes_per_second compares with.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "models/deepseek_v3/presets.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/ops.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"
#include "runtime/tensor.h"

namespace clshard {
namespace {

Device& device() {
  static DeviceManager mgr(DeviceSelection{});
  return mgr[0];
}

Weight host_weight(Device& dev, const void* data, size_t bytes, DType dtype,
                   std::vector<int64_t> shape) {
  Weight w;
  w.mem = dev.alloc(bytes, CL_MEM_READ_ONLY);
  dev.write(w.mem, data, bytes);
  w.dtype = dtype;
  w.shape = std::move(shape);
  w.name = "bench.weight";
  // As a checkpoint's weights get it from the load-time scan (to_device).
  if (dtype == DType::F8_E4M3) {
    const Fp8CodeScan scan = scan_fp8_codes(static_cast<const uint8_t*>(data), bytes);
    w.fp8_nan_free = scan.nan_free;
    w.fp8_subnormal_share = float(double(scan.subnormal) / double(bytes));
  }
  return w;
}

struct Ring {
  std::vector<Weight> weights, scales;
};

Ring make_ring(Device& dev, uint32_t N, uint32_t K, bool fp8) {
  const size_t elem = fp8 ? 1 : 2, bytes = size_t(N) * K * elem;
  const size_t copies = std::max<size_t>(2, (bench::weight_ring_bytes() + bytes - 1) / bytes);
  std::mt19937 rng(1);
  Ring ring;
  if (fp8) {
    // Normal values quantized as DeepSeek-V3's checkpoints are: per 128 x 128 block, codes of
    // value / (amax / 448) and that scale. About 0.01% of the codes come out subnormal, as of a
    // trained model's weights quantized so (random codes of uniform exponents had 11%, which made
    // the short e4m3 decode 20x slower: ops::fp8_decode_option).
    std::normal_distribution<float> normal;
    std::vector<float> values(size_t(N) * K);
    for (auto& v : values) v = normal(rng);
    const uint32_t nb = (K + 127) / 128;
    std::vector<float> s(size_t((N + 127) / 128) * nb, 0.0f);
    for (size_t i = 0; i < values.size(); ++i) {
      float& amax = s[(i / K) / 128 * nb + (i % K) / 128];
      amax = std::max(amax, std::fabs(values[i]));
    }
    for (float& v : s) v = v / 448;
    std::vector<uint8_t> w(size_t(N) * K);
    for (size_t i = 0; i < w.size(); ++i)
      w[i] = deepseek_v3::f32_to_e4m3(values[i] / s[(i / K) / 128 * nb + (i % K) / 128]);
    for (size_t c = 0; c < copies; ++c) {
      ring.weights.push_back(host_weight(dev, w.data(), w.size(), DType::F8_E4M3, {N, K}));
      ring.scales.push_back(host_weight(dev, s.data(), s.size() * 4, DType::F32,
                                        {int64_t(N + 127) / 128, int64_t(K + 127) / 128}));
    }
  } else {
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<uint16_t> w(size_t(N) * K);
    for (auto& v : w) v = f32_to_bf16(normal(rng));
    for (size_t c = 0; c < copies; ++c)
      ring.weights.push_back(host_weight(dev, w.data(), w.size() * 2, DType::BF16, {N, K}));
  }
  return ring;
}

void run(benchmark::State& state, bool fp8, ComputeDType compute = ComputeDType::F32) {
  const uint32_t M = uint32_t(state.range(0)), N = uint32_t(state.range(1)),
                 K = uint32_t(state.range(2));
  Device& dev = device();
  const Ring ring = make_ring(dev, N, K, fp8);
  std::vector<float> xh(size_t(M) * K, 0.01f);
  cl::Mem x = dev.alloc(xh.size() * 4), y = dev.alloc(size_t(M) * N * 4);
  dev.write(x, xh.data(), xh.size() * 4);
  auto step = [&] {
    for (size_t c = 0; c < ring.weights.size(); ++c) {
      if (fp8)
        ops::linear_any(dev, x, 0, K, ring.weights[c], &ring.scales[c], y, 0, N, M, 1.0f, false,
                        false, compute);
      else
        ops::linear(dev, x, 0, K, ring.weights[c], nullptr, y, 0, N, M);
    }
    dev.finish();
  };
  step();  // builds the kernel and touches every buffer once
  for (auto _ : state) step();
  const double calls = double(state.iterations()) * double(ring.weights.size());
  state.SetBytesProcessed(int64_t(calls * double(N) * K * (fp8 ? 1 : 2)));
  state.counters["GFLOP/s"] =
      benchmark::Counter(calls * 2.0 * M * N * K * 1e-9, benchmark::Counter::kIsRate);
  // Seconds per call (printed with an SI prefix: 105u = 105 us).
  state.counters["s/call"] =
      benchmark::Counter(calls, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// The native read loops (runtime/engine/bench.h), one thread per hardware thread, best of 5
// passes over 512 MiB: bytes_per_second is that pass's rate.
void BM_NativeRead(benchmark::State& state, HostReadLoop loop) {
  HostReadBandwidth r;
  for (auto _ : state)
    r = measure_read_bandwidth(std::max(1u, std::thread::hardware_concurrency()), size_t(512) << 20,
                               5, loop);
  if (r.gb_s <= 0) state.SkipWithError("this loop cannot run on this host");
  state.counters["bytes_per_second"] = r.gb_s * 1e9;
}
BENCHMARK_CAPTURE(BM_NativeRead, stream, HostReadLoop::Fastest)->Iterations(1)->UseRealTime();
BENCHMARK_CAPTURE(BM_NativeRead, e4m3_decode, HostReadLoop::E4m3Decode)
    ->Iterations(1)
    ->UseRealTime();

void BM_LinearFp8(benchmark::State& state) { run(state, true); }
void BM_LinearBf16(benchmark::State& state) { run(state, false); }
// model.compute_dtype: bf16 — FP8 GEMMs of 16+ rows dequantize to bf16, then the bf16 GEMM; 4-15
// rows take tiles in turn with vdpbf16ps where the host has it.
void BM_LinearFp8ComputeBf16(benchmark::State& state) { run(state, true, ComputeDType::BF16); }
void BM_LinearBf16ComputeBf16(benchmark::State& state) { run(state, false, ComputeDType::BF16); }

// What every shape list below is timed with: {M, N, K} arguments, microseconds of wall time.
#define SHAPE_TIMING \
  ArgNames({"M", "N", "K"})->Unit(benchmark::kMicrosecond)->UseRealTime()->MinTime(0.5)

// {M, N, K}: decode GEMVs on a 2048x2048 projection, the expert gate/up (512x2048) and down
// (2048x512) projections and a 7168-row projection; one prefill-sized GEMM.
#define SHAPES                 \
  Args({1, 2048, 2048})        \
      ->Args({1, 512, 2048})   \
      ->Args({1, 2048, 512})   \
      ->Args({1, 7168, 2048})  \
      ->Args({64, 2048, 2048}) \
      ->SHAPE_TIMING
BENCHMARK(BM_LinearFp8)->SHAPES;
BENCHMARK(BM_LinearBf16)->SHAPES;

// GEMMs of decode batches, an expert's prefill rows and a prefill, in f32 and bf16 compute.
#define GEMM_SHAPES \
  Args({8, 2048, 2048})->Args({64, 2048, 2048})->Args({512, 2048, 2048})->SHAPE_TIMING
// Batched decode: f32 tiles in turn against bf16 compute's (vdpbf16ps where the host has it).
#define BATCH_SHAPES          \
  Args({4, 2048, 2048})       \
      ->Args({8, 2048, 2048}) \
      ->Args({8, 512, 2048})  \
      ->Args({8, 7168, 2048}) \
      ->SHAPE_TIMING
BENCHMARK(BM_LinearFp8)->BATCH_SHAPES;
BENCHMARK(BM_LinearFp8ComputeBf16)->BATCH_SHAPES;
BENCHMARK(BM_LinearFp8)->GEMM_SHAPES;
BENCHMARK(BM_LinearFp8ComputeBf16)->GEMM_SHAPES;
BENCHMARK(BM_LinearBf16ComputeBf16)->GEMM_SHAPES;

}  // namespace
}  // namespace clshard

BENCHMARK_MAIN();
