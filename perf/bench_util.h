// What every benchmark in perf/ measures the same way: wall time (median of repeats after a
// warm-up that also builds the kernels) and the device's read bandwidth, the decode roofline.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/model.h"

namespace clshard::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The collectives' bandwidth rows (bench_collectives, bench_mpi_collectives) for one message size
// over n ranks. busbw counts the bytes each rank receives from its peers per second (NCCL's
// convention: allgather (n-1)/n of the result, allreduce 2(n-1)/n of the vector, all-to-all
// (n-1)/n of what a rank sends).
inline void print_collective_header() {
  std::printf("%-15s %12s %12s %12s %12s\n", "collective", "bytes/rank", "time us", "algbw GB/s",
              "busbw GB/s");
}
inline void print_collective_rows(size_t bytes, size_t n, double allgather_s, double allreduce_s,
                                  double all_to_all_s) {
  const double b = double(bytes), fn = double(n);
  std::printf("%-15s %12zu %12.1f %12.2f %12.2f\n", "allgather", bytes, allgather_s * 1e6,
              b * fn / allgather_s / 1e9, b * (fn - 1) / allgather_s / 1e9);
  std::printf("%-15s %12zu %12.1f %12.2f %12.2f\n", "allreduce", bytes, allreduce_s * 1e6,
              b / allreduce_s / 1e9, 2 * b * (fn - 1) / fn / allreduce_s / 1e9);
  std::printf("%-15s %12zu %12.1f %12.2f %12.2f\n", "all_to_all_rows", bytes, all_to_all_s * 1e6,
              b / all_to_all_s / 1e9, b * (fn - 1) / fn / all_to_all_s / 1e9);
}

// The first line every benchmark prints: which device the figures are for.
inline void print_device(const Device& dev) {
  std::printf("device: %s (%s), %u compute units\n", dev.info().name.c_str(),
              dev.info().platform.c_str(), dev.info().compute_units);
}

// Median of `reps` timings of fn(); fn must end with a finish (or a blocking read).
template <typename F>
double median_time(int reps, F fn) {
  std::vector<double> t;
  fn();
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    fn();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Read bandwidth in GB/s over 256 MiB with the GEMV kernels' access pattern (bandwidth.cl).
inline double measure_bandwidth(Device& dev, int reps = 7) {
  const size_t bytes = size_t(256) << 20;
  cl::Mem big = dev.alloc(bytes);
  dev.fill_zero(big, bytes);
  const uint32_t items = 64, chunk16 = uint32_t(bytes / 4 / 16 / items);
  cl::Mem sums = dev.alloc(items * 4);
  cl::Kernel k = dev.kernel("bandwidth.cl", "read_sum");
  const double t = median_time(reps, [&] {
    cl::set_args(k, big, chunk16, sums);
    dev.launch(k, {items, 1, 1});
    dev.finish();
  });
  return double(bytes) / t / 1e9;
}

// The preset checkpoint `dir` (make-model's), written first when it is not there yet.
inline std::filesystem::path ensure_preset(const std::string& preset, const std::string& dtype,
                                           const std::filesystem::path& dir) {
  if (std::filesystem::exists(dir / "model.safetensors") &&
      std::filesystem::exists(dir / "config.json"))
    return dir;
  std::printf("writing %s --dtype %s to %s ...\n", preset.c_str(), dtype.c_str(), dir.c_str());
  std::fflush(stdout);
  const auto t0 = Clock::now();
  make_model(preset, dir, MakeModelOptions{dtype, 0});
  std::printf("  done in %.1f s\n", seconds_since(t0));
  return dir;
}

}  // namespace clshard::bench
