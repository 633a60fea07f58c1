// Collectives between processes over MPI (parallel/mpi_transport.h): run it as
//   mpirun --oversubscribe -np 2 build/perf/bench_mpi_collectives [--reps N]
// Each process drives one CPU sub-device of one core (devices.split = the number of processes,
// sub-device = its rank), as bench_collectives runs 2 sub-devices in one process, so the two
// tables compare the transports: one phase's latency (16 KiB) and bus bandwidth by message size.
// Every timing is rank 0's: the ranks meet at a barrier, run the collective and finish their
// queue; medians of --reps runs after a warm-up. busbw as in bench_collectives (NCCL's convention).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "parallel/collectives.h"
#include "parallel/mpi_transport.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"

using namespace clshard;
using namespace clshard::parallel;
using Clock = std::chrono::steady_clock;

namespace {

int g_reps = 15;

double median_seconds(const std::function<void()>& run, Device& dev) {
  std::vector<double> t;
  for (int i = 0; i < g_reps + 1; ++i) {
    mpi_barrier();
    const auto t0 = Clock::now();
    run();
    dev.finish();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// This rank's span: a buffer here, the length only elsewhere.
std::vector<DeviceSpan> spans(size_t me, size_t n, const cl::Mem& mine, size_t count) {
  std::vector<DeviceSpan> s(n);
  for (size_t r = 0; r < n; ++r) s[r] = {r == me ? mine : cl::Mem(), 0, count};
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  mpi_init(&argc, &argv);
  const size_t me = size_t(mpi_world_rank()), n = size_t(mpi_world_size());
  CLI::App app{"Collectives between processes over MPI, one one-core CPU sub-device each: latency "
               "and bus bandwidth by message size (run under mpirun)",
               "bench_mpi_collectives"};
  app.add_option("--reps", g_reps, "timed runs per figure (the median is printed; at least 1)")
      ->capture_default_str();
  // Every rank parses the same arguments and ends alike on an error; rank 0 prints.
  bench::parse_args(app, argc, argv, me == 0);
  g_reps = std::max(1, g_reps);
  DeviceSelection sel;
  sel.type = "cpu";
  sel.split = std::to_string(n);
  DeviceManager m(sel);
  Device& dev = m[me % m.size()];
  Communicator comm(std::make_unique<MpiTransport>(dev));
  if (me == 0) {
    std::printf("%zu processes over MPI, each on %s (%u compute unit(s))\n\n", n,
                dev.info().name.c_str(), dev.info().compute_units);
    bench::print_collective_header();
  }
  for (size_t bytes : {size_t(16) << 10, size_t(256) << 10, size_t(4) << 20, size_t(32) << 20}) {
    const size_t floats = bytes / 4, width = 1024;
    cl::Mem send = dev.alloc(bytes), recv = dev.alloc(bytes * n);
    dev.fill_zero(send, bytes);
    dev.fill_zero(recv, bytes * n);
    const double ag = median_seconds(
        [&] { comm.allgather(spans(me, n, send, floats), spans(me, n, recv, floats * n), "bench"); },
        dev);
    const double ar =
        median_seconds([&] { comm.allreduce(spans(me, n, send, floats), "bench"); }, dev);
    // Every rank sends floats / width rows, spread evenly over the destinations.
    const size_t rows = floats / width;
    std::vector<std::vector<DeviceSpan>> s(n);
    for (size_t i = 0; i < n; ++i) {
      size_t at = 0;
      for (size_t j = 0; j < n; ++j) {
        const size_t k = rows / n + (j < rows % n ? 1 : 0);
        s[i].push_back({i == me ? send : cl::Mem(), at * width, k * width});
        at += k;
      }
    }
    const double aa = median_seconds(
        [&] { comm.all_to_all_rows(s, spans(me, n, recv, rows * width), width, "bench"); }, dev);
    if (me == 0) bench::print_collective_rows(bytes, n, ag, ar, aa);
  }
  return 0;
}
