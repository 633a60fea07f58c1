// measure_device_throughput (parallel/placement.h): the one part of placement that runs kernels,
// kept apart so the placement rules link without the device layer (the fuzz build of the
// deployment parser, tests/fuzz/).
#include <algorithm>
#include <chrono>

#include "parallel/placement.h"
#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/tensor.h"

namespace clshard::parallel {

std::vector<double> measure_device_throughput(const std::vector<Device*>& devices) {
  // 16 tokens through a 1024 x 1024 f32 expert-sized matrix: a batched-decode expert matmul, big
  // enough (4 MiB, ~34 MFLOP) that launch overhead does not decide the figure, small enough to
  // measure in a few milliseconds.
  constexpr uint32_t N = 1024, K = 1024, M = 16;
  constexpr int calls_per_burst = 4, bursts = 3;
  std::vector<float> w(size_t(N) * K), x(size_t(M) * K);
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i % 97) - 48) * (1.0f / 64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 13) - 6) * (1.0f / 8);
  std::vector<double> out;
  for (Device* dev : devices) {
    Weight weight = to_device_f32(*dev, w, {N, K}, "throughput probe");
    cl::Mem xs = dev->alloc(x.size() * sizeof(float));
    cl::Mem ys = dev->alloc(size_t(M) * N * sizeof(float));
    dev->write(xs, x.data(), x.size() * sizeof(float));
    ops::linear(*dev, xs, 0, K, weight, nullptr, ys, 0, N, M);  // compile and first touch
    dev->finish();
    double best = 1e30;
    for (int b = 0; b < bursts; ++b) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls_per_burst; ++c)
        ops::linear(*dev, xs, 0, K, weight, nullptr, ys, 0, N, M);
      dev->finish();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                                .count());
    }
    out.push_back(double(calls_per_burst) * M * N * K / best);
  }
  return out;
}

}  // namespace clshard::parallel
