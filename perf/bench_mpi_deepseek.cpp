// DeepSeek-V3 DP + EP decode of the dsv3-mini preset over 2 processes (MPI, one CPU sub-device
// each) next to the same 2-device model in one process (the CPU split in two, in-process routes),
// batched decode tokens/s and the share of the step the host waited in collectives. Run under
// mpirun: `mpirun --oversubscribe -np 2 build/perf/bench_mpi_deepseek [--batches 16,64]`.
//
// Each process splits the CPU into 2 sub-devices (one core each) and drives the one at its rank;
// the in-process figure is rank 0 alone on both sub-devices of its split while rank 1 sleeps
// (polling a barrier every millisecond, so it leaves the cores alone). The two are measured in
// alternating rounds (A B A B ...) and each figure is the median over the rounds, since the
// machine's load drifts. Decode steps run against a zero-filled MLA cache at `context` cached
// tokens per request, as bench_deepseek_parallel does.
//
// Usage: bench_mpi_deepseek [--dir D] [--dtype bf16] [--batches 16,64] [--context C] [--steps N]
//                           [--rounds R]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "models/deepseek_v3/model.h"
#include "parallel/collectives.h"
#include "parallel/mpi_transport.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"

using namespace clshard;
using namespace clshard::bench;

namespace {

struct Result {
  double tokens_per_s = 0, wait_share = 0;
};

// Timed decode steps; every process calls it with the same arguments (over MPI).
Result run(deepseek_v3::DeepseekV3Model& model, uint32_t batch, uint32_t context,
           uint32_t steps) {
  const uint32_t page = 64, ppr = (context + steps + 2 + page - 1) / page;
  model.allocate_kv_cache((batch + 1) / 2 * ppr, page);
  // The tokens come from a generator seeded alike in every process, so the processes run the
  // same steps (2 replicas, one per process).
  std::mt19937 rng(7);
  const uint32_t V = model.info().vocab_size;
  model.forward(replica_decode_step(batch, 2, context, ppr, model.kv_num_pages(), V, rng))
      .read_logits();
  const parallel::Communicator* comm = model.communicator();
  const double wait0 = comm->stats().host_wait_seconds;
  const auto t0 = Clock::now();
  for (uint32_t i = 0; i < steps; ++i)
    model.forward(replica_decode_step(batch, 2, context + 1 + i, ppr, model.kv_num_pages(), V, rng))
        .read_logits();
  const double t = seconds_since(t0);
  return {double(batch) * steps / t, (comm->stats().host_wait_seconds - wait0) / t};
}

// A barrier that sleeps between polls (MPI_Barrier spins, taking a core from the peer).
void quiet_barrier() {
  MPI_Request rq;
  MPI_Ibarrier(MPI_COMM_WORLD, &rq);
  for (int done = 0; !done;) {
    MPI_Test(&rq, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  parallel::mpi_init(&argc, &argv);
  const size_t me = size_t(parallel::mpi_world_rank());
  CLI::App app{"DeepSeek-V3 DP + EP decode of dsv3-mini over 2 MPI processes next to the same "
               "2-device model in one process (run under mpirun -np 2)",
               "bench_mpi_deepseek"};
  std::string root_arg = ".cache/models";
  std::string dtype = "bf16";
  std::vector<uint32_t> sizes = {16, 64};
  uint32_t context = 64, steps = 4, rounds = 3;
  app.add_option("--dir", root_arg, "where dsv3-mini-<dtype> lives (written when missing)")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "checkpoint dtype")->capture_default_str();
  app.add_option("--batches", sizes, "comma-separated batch sizes")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--context", context, "cached tokens per request")->capture_default_str();
  app.add_option("--steps", steps, "timed decode steps (at least 1)")->capture_default_str();
  app.add_option("--rounds", rounds, "alternating rounds (at least 1)")->capture_default_str();
  // Every rank parses the same arguments and ends alike on an error; rank 0 prints. Before the
  // world-size check, so --help answers outside mpirun too.
  parse_args(app, argc, argv, me == 0);
  steps = std::max(1u, steps);
  rounds = std::max(1u, rounds);
  const std::filesystem::path root = root_arg;
  if (parallel::mpi_world_size() != 2) {
    if (me == 0) std::fprintf(stderr, "run under mpirun -np 2\n");
    return 2;
  }
  const auto dir = root / ("dsv3-mini-" + dtype);
  if (me == 0) ensure_preset("dsv3-mini", dtype, dir);
  quiet_barrier();
  DeviceSelection sel;
  sel.type = "cpu";
  sel.split = "2";
  DeviceManager mgr(sel);
  if (me == 0)
    std::printf("dsv3-mini %s, decode at context %u, %u timed steps, %u alternating rounds; 2 "
                "sub-devices of %s, %u compute unit(s) each\n",
                dtype.c_str(), context, steps, rounds, mgr[0].info().name.c_str(),
                mgr[0].info().compute_units);

  LoadOptions mpi;
  mpi.devices = {&mgr[me]};
  mpi.data_parallel_degree = mpi.expert_parallel_degree = 2;
  mpi.mpi_ranks = 2;
  mpi.mpi_rank = uint32_t(me);
  deepseek_v3::DeepseekV3Model over_mpi(dir, mpi);
  std::unique_ptr<deepseek_v3::DeepseekV3Model> in_process;
  if (me == 0) {
    LoadOptions two;
    two.devices = mgr.devices();
    two.data_parallel_degree = two.expert_parallel_degree = 2;
    in_process = std::make_unique<deepseek_v3::DeepseekV3Model>(dir, two);
  }
  std::vector<std::vector<double>> tps_local(sizes.size()), tps_mpi(sizes.size()),
      wait_local(sizes.size()), wait_mpi(sizes.size());
  for (uint32_t round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (me == 0) {
        const Result r = run(*in_process, sizes[i], context, steps);
        tps_local[i].push_back(r.tokens_per_s);
        wait_local[i].push_back(r.wait_share);
      }
      quiet_barrier();
      const Result r = run(over_mpi, sizes[i], context, steps);
      tps_mpi[i].push_back(r.tokens_per_s);
      wait_mpi[i].push_back(r.wait_share);
      quiet_barrier();
    }
  }
  if (me == 0) {
    std::printf("%6s %16s %16s %9s %14s %14s\n", "batch", "1 process tok/s", "2 procs tok/s",
                "ratio", "1 proc wait", "2 procs wait");
    for (size_t i = 0; i < sizes.size(); ++i)
      std::printf("%6u %16.2f %16.2f %8.2fx %13.1f%% %13.1f%%\n", sizes[i], median(tps_local[i]),
                  median(tps_mpi[i]), median(tps_mpi[i]) / median(tps_local[i]),
                  100 * median(wait_local[i]), 100 * median(wait_mpi[i]));
    std::printf("(2 sub-devices in one process vs 2 processes over MPI; wait: host time blocked "
                "in collectives as a share of the step, medians over the rounds)\n");
  }
  return 0;
}
