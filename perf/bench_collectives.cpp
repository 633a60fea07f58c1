// Collectives on 2 CPU sub-devices (one core each): how long allgather, allreduce and the
// expert-parallel all-to-all take, their bandwidth, and the share of a decode step they would take
// in the deployments that use them:
//   * DeepSeek-V3 dsv3-mini, DP attention + EP MoE over both devices: per MoE layer one dispatch
//     and one combine all-to-all of the routed (token, expert) rows, then the last-token hidden
//     rows allgathered and the vocab-parallel logits gathered by columns (max-reference.md §3.2);
//   * Llama 3.2 1B tensor-parallel over both devices: two allreduces of [B, H] per layer and the
//     vocab-parallel logits gathered by columns.
// The step they are set against is the memory roofline of the step: the weight bytes each device
// streams, at the read bandwidth both sub-devices reach together (measured here). A real step is
// slower than its roofline, so the share printed is an upper bound.
//
// Every timing enqueues the collective and waits for both devices (the host drives collectives,
// so that round trip is part of the cost); medians of --reps runs after a warm-up.
//
// Usage: bench_collectives [--reps N] [--split S]   (S: devices.split, default 2)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "parallel/collectives.h"
#include "perf/bench_util.h"
#include "runtime/device.h"
#include "runtime/device_manager.h"

using namespace clshard;
using namespace clshard::parallel;
using Clock = std::chrono::steady_clock;

namespace {

// The CPU device(s), split as asked ("" for whole), or every CPU device with all = true.
DeviceSelection cpu_devices(const std::string& split, bool all = false) {
  DeviceSelection sel;
  sel.type = "cpu";
  sel.split = split;
  sel.all = all;
  return sel;
}


int g_reps = 15;
double g_timed_seconds = 0;  // every timed run, warm-ups included

double median_seconds(const std::function<void()>& run, const std::vector<Device*>& devs) {
  std::vector<double> t;
  for (int i = 0; i < g_reps + 1; ++i) {
    const auto t0 = Clock::now();
    run();
    for (Device* d : devs) d->finish();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    g_timed_seconds += s;
    if (i > 0) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Read bandwidth of all devices at once (bandwidth.cl, the GEMV access pattern), GB/s in total.
double concurrent_read_bandwidth(const std::vector<Device*>& devs) {
  const size_t bytes = size_t(128) << 20;
  const uint32_t items = 16, chunk16 = uint32_t(bytes / 4 / 16 / items);
  std::vector<cl::Mem> big, sums;
  std::vector<cl::Kernel> kernels;
  for (Device* d : devs) {
    big.push_back(d->alloc(bytes));
    d->fill_zero(big.back(), bytes);
    sums.push_back(d->alloc(items * 4));
    kernels.push_back(d->kernel("bandwidth.cl", "read_sum"));
  }
  const double t = median_seconds(
      [&] {
        for (size_t i = 0; i < devs.size(); ++i) {
          cl::set_args(kernels[i], big[i], chunk16, sums[i]);
          devs[i]->launch(kernels[i], {items, 1, 1}, 1);
          clFlush(devs[i]->queue());
        }
      },
      devs);
  return double(bytes) * double(devs.size()) / t / 1e9;
}

struct Buffers {
  std::vector<cl::Mem> send, recv;
};

Buffers alloc_all(const std::vector<Device*>& devs, size_t send_floats, size_t recv_floats) {
  Buffers b;
  for (Device* d : devs) {
    b.send.push_back(d->alloc(std::max<size_t>(send_floats, 1) * 4));
    b.recv.push_back(d->alloc(std::max<size_t>(recv_floats, 1) * 4));
    d->fill_zero(b.send.back(), std::max<size_t>(send_floats, 1) * 4);
    d->fill_zero(b.recv.back(), std::max<size_t>(recv_floats, 1) * 4);
  }
  return b;
}

double time_allgather(Communicator& c, size_t floats_per_rank) {
  const size_t n = c.size();
  std::vector<Device*> devs;
  for (size_t i = 0; i < n; ++i) devs.push_back(&c.device(i));
  Buffers b = alloc_all(devs, floats_per_rank, floats_per_rank * n);
  std::vector<DeviceSpan> s, r;
  for (size_t i = 0; i < n; ++i) {
    s.push_back({b.send[i], 0, floats_per_rank});
    r.push_back({b.recv[i], 0, floats_per_rank * n});
  }
  return median_seconds([&] { c.allgather(s, r, "bench"); }, devs);
}

// The vocab-parallel logits: every rank holds [rows, cols] of the [rows, n * cols] matrix.
double time_allgather_columns(Communicator& c, size_t rows, size_t cols) {
  const size_t n = c.size();
  std::vector<Device*> devs;
  for (size_t i = 0; i < n; ++i) devs.push_back(&c.device(i));
  Buffers b = alloc_all(devs, rows * cols, rows * cols * n);
  std::vector<DeviceSpan> s, r;
  for (size_t i = 0; i < n; ++i) {
    s.push_back({b.send[i], 0, rows * cols});
    r.push_back({b.recv[i], 0, rows * cols * n});
  }
  return median_seconds([&] { c.allgather_columns(s, r, rows, "bench"); }, devs);
}

double time_allreduce(Communicator& c, size_t floats) {
  const size_t n = c.size();
  std::vector<Device*> devs;
  for (size_t i = 0; i < n; ++i) devs.push_back(&c.device(i));
  Buffers b = alloc_all(devs, floats, 0);
  std::vector<DeviceSpan> bufs;
  for (size_t i = 0; i < n; ++i) bufs.push_back({b.send[i], 0, floats});
  return median_seconds([&] { c.allreduce(bufs, "bench"); }, devs);
}

// Every rank sends `rows_per_rank` rows of `width`, spread evenly over the destinations.
double time_all_to_all(Communicator& c, size_t rows_per_rank, size_t width) {
  const size_t n = c.size();
  std::vector<Device*> devs;
  for (size_t i = 0; i < n; ++i) devs.push_back(&c.device(i));
  Buffers b = alloc_all(devs, rows_per_rank * width, rows_per_rank * width * n);
  std::vector<std::vector<DeviceSpan>> s(n);
  std::vector<DeviceSpan> r;
  for (size_t i = 0; i < n; ++i) {
    size_t at = 0;
    for (size_t j = 0; j < n; ++j) {
      const size_t rows = rows_per_rank / n + (j < rows_per_rank % n ? 1 : 0);
      s[i].push_back({b.send[i], at * width, rows * width});
      at += rows;
    }
    r.push_back({b.recv[i], 0, rows_per_rank * width * n});
  }
  return median_seconds([&] { c.all_to_all_rows(s, r, width, "bench"); }, devs);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Collectives on CPU sub-devices: allgather, allreduce and all-to-all latency and "
               "bandwidth, and their share of a decode step's roofline",
               "bench_collectives"};
  std::string split = "2";
  app.add_option("--reps", g_reps, "timed runs per figure (the median is printed; at least 1)")
      ->capture_default_str();
  app.add_option("--split", split, "devices.split of the CPU device")->capture_default_str();
  bench::parse_args(app, argc, argv);
  g_reps = std::max(1, g_reps);
  DeviceManager m(cpu_devices(split));
  auto devs = m.devices();
  Communicator comm(devs);
  const size_t n = devs.size();
  std::printf("%zu devices: %s (%u compute unit(s) each), one context\n", n,
              devs[0]->info().name.c_str(), devs[0]->info().compute_units);
  const double read_bw = concurrent_read_bandwidth(devs);
  std::printf("read bandwidth, all devices at once: %.1f GB/s\n\n", read_bw);

  // One untimed round: the first collectives after the bandwidth probe measured ~3x slower
  // (whatever PoCL's workers do after a long kernel), which is not what a step sees.
  time_allgather(comm, 4096);
  time_allreduce(comm, 4096);

  // Bandwidth by message size (bench::print_collective_rows says how busbw counts).
  bench::print_collective_header();
  for (size_t bytes : {size_t(16) << 10, size_t(256) << 10, size_t(4) << 20, size_t(32) << 20}) {
    const size_t floats = bytes / 4;
    const double ag = time_allgather(comm, floats);
    const double ar = time_allreduce(comm, floats);
    const double aa = time_all_to_all(comm, floats / 1024, 1024);
    bench::print_collective_rows(bytes, n, ag, ar, aa);
  }

  // dsv3-mini (models/deepseek_v3/presets.cpp): hidden 2048, 6 layers of which the first dense
  // (ffn 4608), 64 routed experts of ffn 512 with top-8, one shared expert, MLA with q_lora 768,
  // kv_lora 512, 16 heads of 128 + 64 (rope), v 128; vocab 32000; bf16 weights.
  const double H = 2048, V = 32000, layers = 6, moe_layers = 5, experts = 64, top_k = 8;
  const double attn = H * 768 + 768 * 16 * 192 + H * (512 + 64) + 512 * 16 * 256 + 16 * 128 * H;
  const double expert = 3 * H * 512;
  std::printf("\ndsv3-mini decode step, DP attention + EP MoE over %zu devices (bf16 weights)\n", n);
  std::printf("%6s %14s %14s %14s %12s %10s\n", "batch", "a2a us/layer", "gathers us",
              "collectives ms", "roofline ms", "share");
  for (size_t batch : {size_t(16), size_t(64)}) {
    const size_t rows_per_rank = (batch + n - 1) / n;  // requests per replica
    // Routed experts a device streams: those its block holds that some token picked.
    const double picks = double(batch) * top_k;
    const double touched = experts * (1 - std::pow(1 - 1 / experts, picks));
    const double params_per_device =
        layers * attn + 3 * H * 4608 + moe_layers * (touched / double(n) * expert + expert) +
        V * H / double(n) /* vocab-parallel lm_head */;
    const double roofline_s = params_per_device * 2 * double(n) / (read_bw * 1e9);
    // Dispatch and combine move rows_per_rank * top_k rows of H each way.
    const double a2a = time_all_to_all(comm, rows_per_rank * size_t(top_k), size_t(H));
    const double gathers = time_allgather(comm, rows_per_rank * size_t(H)) +
                           time_allgather_columns(comm, batch, size_t(V) / n);
    const double coll = moe_layers * 2 * a2a + gathers;
    std::printf("%6zu %14.1f %14.1f %14.2f %12.2f %9.1f%%\n", batch, 2 * a2a * 1e6,
                gathers * 1e6, coll * 1e3, roofline_s * 1e3,
                100 * coll / (coll + roofline_s));
  }

  // Llama 3.2 1B tensor parallel: hidden 2048, 16 layers, ffn 8192, 32 heads / 8 kv heads of 64,
  // vocab 128256 (tied); each device streams 1/n of the weights; two allreduces of [B, H] per
  // layer, the vocab-parallel logits allgathered.
  const double lH = 2048, lV = 128256, lL = 16;
  const double l_params = lL * (lH * 2048 + 2 * lH * 512 + 2048 * lH + 3 * lH * 8192) + lV * lH;
  std::printf("\nLlama 3.2 1B decode step, tensor parallel over %zu devices (bf16 weights)\n", n);
  std::printf("%6s %14s %14s %14s %12s %10s\n", "batch", "allreduce us", "logits us",
              "collectives ms", "roofline ms", "share");
  for (size_t batch : {size_t(1), size_t(16), size_t(64)}) {
    const double ar = time_allreduce(comm, batch * size_t(lH));
    const double logits = time_allgather_columns(comm, batch, size_t(lV) / n);
    const double coll = lL * 2 * ar + logits;
    const double roofline_s = l_params / double(n) * 2 * double(n) / (read_bw * 1e9);
    std::printf("%6zu %14.1f %14.1f %14.2f %12.2f %9.1f%%\n", batch, ar * 1e6, logits * 1e6,
                coll * 1e3, roofline_s * 1e3, 100 * coll / (coll + roofline_s));
  }
  const auto& st = comm.stats();
  std::printf("\n%llu collectives in %llu phases; the host waited for signals %.0f%% of the "
              "timed time (read bandwidth runs included)\n",
              (unsigned long long)st.collectives, (unsigned long long)st.phases,
              100 * st.host_wait_seconds / g_timed_seconds);
  return 0;
}
