// What every benchmark in perf/ measures the same way: wall time (median of repeats after a
// warm-up that also builds the kernels) and the device's read bandwidth, the decode roofline.
#pragma once

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <CLI/CLI.hpp>

#include "models/registry.h"
#include "runtime/device.h"
#include "runtime/engine/bench.h"
#include "runtime/kernel_tuning.h"
#include "runtime/model.h"
#include "runtime/step.h"

namespace clshard::bench {

using Clock = std::chrono::steady_clock;

// Parses a benchmark's command line into `app`'s options, before anything is measured or written.
// --help prints the usage and ends the program with status 0; an unknown option or a bad value
// prints CLI11's message and ends it with status 2, a usage error. With `print` false (the MPI
// ranks other than 0, which parse the same arguments) it ends the same way without printing, so
// a job shows its usage once. std::exit runs the atexit handlers, parallel::mpi_init's
// MPI_Finalize among them.
inline void parse_args(CLI::App& app, int argc, char** argv, bool print = true) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::ostringstream discard;
    const int code = print ? app.exit(e) : app.exit(e, discard, discard);
    std::exit(code == 0 ? 0 : 2);
  }
}

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

// Read bandwidth in GB/s over 256 MiB by the device's probe in its own kernel shape
// (measure_device_read_bandwidth: the chunked GEMV pattern on CPUs, coalesced work-groups on GPUs).
inline double measure_bandwidth(Device& dev, int reps = 7) {
  return measure_device_read_bandwidth(dev, size_t(256) << 20, reps).gb_s;
}

// Read bandwidth in GB/s of a native STREAM-style loop over 512 MiB (16x the 32 MiB L3 of the
// EPYC; past half of the Xeon's 300 MiB), one thread per hardware thread, best of `reps` passes:
// the runtime's measure_read_bandwidth, which `clshard bench --roofline` reports too (AVX-512
// loads with a prefetch where the CPU has them). It bounds what any kernel can stream, so decode
// rooflines take the higher of this and the OpenCL read kernel: on some runs PoCL's kernel
// measures well below what the memory gives.
inline double stream_read_gbs(int reps = 7, size_t bytes = size_t(512) << 20) {
  return measure_read_bandwidth(std::max(1u, std::thread::hardware_concurrency()), bytes, reps)
      .gb_s;
}

// Bytes of weight copies a kernel benchmark walks so that its weights stream from memory, not
// from the last-level cache: 3x the host's L3 (sysconf; 96 MiB where it says nothing). The
// 2-core Xeon's VM reports 260 MiB, where 96 MiB of copies had stayed in L3.
inline size_t weight_ring_bytes() {
  const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  return std::max(size_t(96) << 20, l3 > 0 ? 3 * size_t(l3) : 0);
}

// GB/s of the FP8 GEMV's one-row tile instructions as a native loop over the same 512 MiB
// (HostReadLoop::E4m3Decode; 0 without AVX-512), one thread per hardware thread, best of `reps`:
// the most those instructions stream on this CPU. On the 2-core Xeon without AMX it read 0.77-0.80x
// of the STREAM loop: three vector instructions and an FMA per 16 codes on the two ports that
// run 512-bit operations.
inline double e4m3_decode_gbs(int reps = 7, size_t bytes = size_t(512) << 20) {
  return measure_read_bandwidth(std::max(1u, std::thread::hardware_concurrency()), bytes, reps,
                                HostReadLoop::E4m3Decode)
      .gb_s;
}

// GB/s of the native loop over a checkpoint's weights where the page cache holds them
// (measure_checkpoint_read_bandwidth, which `clshard bench --roofline` reports too), one thread
// per hardware thread. Next to stream_read_gbs (fresh memory) it says how fast the weights' own
// pages read: on the VM here 20-30% slower for some files (runtime/file_mapping.h), which
// model.mmap: false avoids.
inline double mapped_weights_gbs(const std::filesystem::path& dir, int reps = 3) {
  return measure_checkpoint_read_bandwidth(dir, std::max(1u, std::thread::hardware_concurrency()),
                                           reps)
      .gb_s;
}

// MB of file mappings this process has in huge pages now (/proc/self/smaps_rollup's
// FilePmdMapped; 0 where the file cannot be read): how much of a checkpoint its mapping got in
// huge pages (runtime/file_mapping.h).
inline double file_huge_mapped_mb() {
  FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (!f) return 0;
  char line[256];
  size_t kib = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "FilePmdMapped: %zu kB", &kib) == 1) break;
  std::fclose(f);
  return double(kib) * 1024 / 1e6;
}

// Register-only compute peaks of the host CPU (native threads, one per hardware thread): 16
// independent chains of 512-bit f32 FMAs (32 flops each), and of vdpbf16ps (16 lanes x 2 bf16
// products + adds = 64 flops each), no memory operand in the loop. 0 where the CPU lacks the
// instruction. The prefill GEMMs report against these.
struct ComputePeaks {
  double f32_fma_gflops = 0, bf16_dot_gflops = 0;
};
#if defined(__x86_64__) && defined(__GNUC__)
// The sum of a vector's lanes (GCC 12's _mm512_reduce_add_ps warns of an uninitialized variable
// in its own header).
__attribute__((target("avx512f"))) inline float lane_sum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float sum = 0;
  for (float x : lanes) sum += x;
  return sum;
}
__attribute__((target("avx512f"))) inline float fma_chains(long iters, float seed) {
  __m512 acc[16];
  const __m512 a = _mm512_set1_ps(seed), b = _mm512_set1_ps(1.0f - seed);
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(float(j));
  for (long i = 0; i < iters; ++i)
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
  __m512 s = acc[0];
  for (int j = 1; j < 16; ++j) s = _mm512_add_ps(s, acc[j]);
  return lane_sum(s);
}
__attribute__((target("avx512f,avx512bf16"))) inline float dpbf16_chains(long iters, float seed) {
  __m512 acc[16];
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed), _mm512_set1_ps(seed));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f - seed), _mm512_set1_ps(seed));
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_set1_ps(float(j));
  for (long i = 0; i < iters; ++i)
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  __m512 s = acc[0];
  for (int j = 1; j < 16; ++j) s = _mm512_add_ps(s, acc[j]);
  return lane_sum(s);
}
#endif
inline ComputePeaks measure_compute_peaks(int reps = 5, long iters = 20000000) {
  ComputePeaks p;
#if defined(__x86_64__) && defined(__GNUC__)
  const unsigned nthreads = std::max(1u, std::thread::hardware_concurrency());
  volatile float seed = 1e-3f;  // opaque to the compiler: the chains must run
  std::vector<float> sink(nthreads);
  auto run = [&](auto chains) {
    return median_time(reps, [&] {
      std::vector<std::thread> threads;
      for (unsigned i = 0; i < nthreads; ++i)
        threads.emplace_back([&, i] { sink[i] = chains(iters, seed); });
      for (auto& th : threads) th.join();
    });
  };
  const double ops = double(nthreads) * double(iters) * 16;  // instructions per run
  if (__builtin_cpu_supports("avx512f"))
    p.f32_fma_gflops = ops * 32 / run([](long n, float s) { return fma_chains(n, s); }) / 1e9;
  if (__builtin_cpu_supports("avx512bf16"))
    p.bf16_dot_gflops = ops * 64 / run([](long n, float s) { return dpbf16_chains(n, s); }) / 1e9;
  std::printf("compute peak (%u threads, register-only): f32 FMA %.0f GFLOP/s, bf16 dot product "
              "(vdpbf16ps) %.0f GFLOP/s (%.2fx)\n",
              nthreads, p.f32_fma_gflops, p.bf16_dot_gflops,
              p.f32_fma_gflops > 0 ? p.bf16_dot_gflops / p.f32_fma_gflops : 0.0);
#endif
  return p;
}

// Both read rooflines of one run, reported side by side; figures are taken against the higher.
// On a device that is not the host's CPU only the device's own probe counts: host memory's
// STREAM figure says nothing about a GPU's memory.
struct Roofline {
  double opencl_gbs = 0, stream_gbs = 0;
  double best() const { return std::max(opencl_gbs, stream_gbs); }
  const char* best_name() const { return stream_gbs >= opencl_gbs ? "STREAM" : "OpenCL"; }
};
inline Roofline measure_roofline(Device& dev, int reps = 7) {
  Roofline r;
  r.opencl_gbs = measure_bandwidth(dev, reps);
  if (!dev.is_cpu()) {
    std::printf("read bandwidth: OpenCL read kernel (%s shape) %.1f GB/s -> roofline OpenCL "
                "%.1f GB/s (the device's memory; no host STREAM figure)\n",
                kernel_shape_name(dev.kernel_shape()), r.opencl_gbs, r.best());
    return r;
  }
  r.stream_gbs = stream_read_gbs(reps);
  std::printf("read bandwidth: OpenCL read kernel %.1f GB/s, native STREAM loop (%u threads) "
              "%.1f GB/s -> roofline %s %.1f GB/s\n",
              r.opencl_gbs, std::max(1u, std::thread::hardware_concurrency()), r.stream_gbs,
              r.best_name(), r.best());
  return r;
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

// A step that appends `n` random tokens to each of `rows` requests holding `cached` tokens each;
// request i owns the pages table[i * pages_per_row, (i + 1) * pages_per_row).
inline StepInputs random_step(const std::vector<uint32_t>& table, uint32_t pages_per_row,
                              uint32_t rows, uint32_t cached, uint32_t n, uint32_t vocab,
                              std::mt19937& rng) {
  StepInputs in;
  in.lookup_table.assign(table.begin(), table.begin() + size_t(rows) * pages_per_row);
  in.pages_per_row = pages_per_row;
  in.input_row_offsets = {0};
  std::uniform_int_distribution<int32_t> tok(0, int32_t(vocab) - 1);
  for (uint32_t b = 0; b < rows; ++b) {
    for (uint32_t i = 0; i < n; ++i) in.tokens.push_back(tok(rng));
    in.input_row_offsets.push_back(uint32_t(in.tokens.size()));
    in.cache_lengths.push_back(cached);
  }
  return in;
}

// One decode step of `batch` requests spread over `replicas` in contiguous blocks (replica-major,
// as MAX orders the flat batch), `cached` tokens each; request i of a replica owns pages
// [i * ppr, (i + 1) * ppr) of that replica's pool (null_page: merge_replica_steps's).
inline StepInputs replica_decode_step(uint32_t batch, uint32_t replicas, uint32_t cached,
                                      uint32_t ppr, uint32_t null_page, uint32_t vocab,
                                      std::mt19937& rng) {
  std::vector<StepInputs> parts;
  for (uint32_t r = 0; r < replicas; ++r) {
    const uint32_t rows = batch / replicas + (r < batch % replicas ? 1 : 0);
    std::vector<uint32_t> table(size_t(rows) * ppr);
    std::iota(table.begin(), table.end(), 0u);
    parts.push_back(random_step(table, ppr, rows, cached, 1, vocab, rng));
  }
  return replicas == 1 ? parts[0] : merge_replica_steps(parts, null_page);
}

// An in-process A/B of one tuning field: --tuning-ab FIELD=VALUE runs the same work under the
// device's tuning (A) and with FIELD set to VALUE (B), the two in turn `rounds` times, A first
// in even rounds and B first in odd ones, so that the machine's load, which moves by tens of
// percent between runs here, falls on both alike. Medians of each side and of the per-round
// ratios A/B (above 1: B is faster).
// B's tuning: the device's with one or more fields changed (FIELD=VALUE[,FIELD=VALUE...]), since
// some fields only pay together (a prefetch that makes another field's access pattern stream).
// The rounds of an A/B split by the read bandwidth a pass of the native loop measured right after
// each (the 2-core EPYC VM moves between ~25-37 and ~55-60 GB/s within minutes, and a change can
// gain in one and nothing in the other: the f32 GEMVs' stream prefetch): the rounds whose pass read
// at least halfway between the lowest and highest pass, and the others, with each side's median
// ratio and its passes' range. Left empty (n_fast 0) when the passes are within 25% of each other.
struct PhaseSplit {
  int n_fast = 0, n_slow = 0;
  double fast_ratio = 0, slow_ratio = 0;
  double fast_lo = 0, fast_hi = 0, slow_lo = 0, slow_hi = 0;  // GB/s
};

struct TuningAB {
  std::vector<std::pair<std::string, uint64_t>> fields;
  double a_median = 0, b_median = 0, ratio_median = 0, ratio_low = 0, ratio_high = 0;
  PhaseSplit phases;
  // "F1=V1,F2=V2", as given.
  std::string label() const {
    std::string l;
    for (const auto& [f, v] : fields) l += (l.empty() ? "" : ",") + f + "=" + std::to_string(v);
    return l;
  }
  KernelTuning applied_to(KernelTuning t) const {
    for (const auto& [f, v] : fields) set_kernel_tuning_field(t, f, v);
    return t;
  }
};

// Parses FIELD=VALUE[,FIELD=VALUE...] against the tuning fields (a usage error naming the fields
// otherwise).
inline TuningAB parse_tuning_ab(const std::string& arg) {
  TuningAB ab;
  const auto& names = kernel_tuning_fields();
  bool ok = !arg.empty();
  for (size_t at = 0; ok && at <= arg.size();) {
    const size_t end = std::min(arg.find(',', at), arg.size());
    const std::string item = arg.substr(at, end - at);
    const size_t eq = item.find('=');
    const std::string field = eq == std::string::npos ? "" : item.substr(0, eq);
    const std::string v = eq == std::string::npos ? "" : item.substr(eq + 1);
    ok = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos &&
         std::find(names.begin(), names.end(), field) != names.end();
    if (ok) ab.fields.emplace_back(field, std::stoull(v));
    at = end + 1;
  }
  if (!ok) {
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
    std::fprintf(stderr,
                 "--tuning-ab %s: expected FIELD=VALUE[,FIELD=VALUE...] with non-negative integer "
                 "VALUEs and each FIELD one of %s\n",
                 arg.c_str(), list.c_str());
    std::exit(2);
  }
  return ab;
}

// The two options of a benchmark that offers the A/B: --tuning-ab FIELD=VALUE and --ab-rounds R.
struct TuningABOptions {
  std::string arg;
  int rounds = 9;
  std::optional<TuningAB> parse() const {
    if (arg.empty()) return std::nullopt;
    return parse_tuning_ab(arg);
  }
};
inline void add_tuning_ab_options(CLI::App& app, TuningABOptions& o) {
  app.add_option("--tuning-ab", o.arg,
                 "FIELD=VALUE[,FIELD=VALUE...]: also time the decode with those tuning fields "
                 "against the device's, in turn (bench_util.h's TuningAB)");
  app.add_option("--ab-rounds", o.rounds, "rounds of --tuning-ab")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
}

// One line of an A/B's figures: "<what>, FIELD=VALUE against the device's tuning (R rounds in
// turn): A -> B <unit>, A/B median [lowest, highest]", the times multiplied by `scale`.
// With rounds in two bandwidth phases (PhaseSplit), a second line gives each phase's A/B.
inline void print_tuning_ab(const std::string& what, const TuningAB& ab, int rounds, double scale,
                            const char* unit) {
  std::printf(
      "%s, %s against the device's tuning (%d rounds in turn): %.3f -> %.3f %s, A/B "
      "%.3f [%.3f, %.3f]\n",
      what.c_str(), ab.label().c_str(), rounds, ab.a_median * scale, ab.b_median * scale, unit,
      ab.ratio_median, ab.ratio_low, ab.ratio_high);
  const PhaseSplit& p = ab.phases;
  if (p.n_fast > 0)
    std::printf(
        "  by the read pass after each round: %d rounds at %.1f-%.1f GB/s A/B %.3f, %d at "
        "%.1f-%.1f GB/s A/B %.3f\n",
        p.n_fast, p.fast_lo, p.fast_hi, p.fast_ratio, p.n_slow, p.slow_lo, p.slow_hi, p.slow_ratio);
}

// A pass of the native read loop over one 512 MiB buffer of the process's own, mapped and
// touched once (a buffer mapped per pass had slowed the decode after it for seconds:
// bench_llama.cpp), in huge pages where the kernel gives them, as measure_read_bandwidth's fresh
// memory; on a device that is not the CPU, the device's own probe (host memory says nothing about
// a GPU's).
class ReadProbe {
 public:
  explicit ReadProbe(Device& dev) : dev_(dev) {
    if (!dev.is_cpu()) return;
    void* mem = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) throw std::runtime_error("ReadProbe: no 512 MiB read buffer");
    mem_.reset(mem);
    ::madvise(mem, kBytes, MADV_HUGEPAGE);
    uint64_t* w = static_cast<uint64_t*>(mem);
    std::iota(w, w + kBytes / 8, uint64_t(1));
  }
  // GB/s, best of `passes`.
  double gb_s(int passes = 2) {
    if (!mem_) return measure_bandwidth(dev_, passes);
    return measure_read_bandwidth_of(mem_.get(), kBytes,
                                     std::max(1u, std::thread::hardware_concurrency()), passes)
        .gb_s;
  }

 private:
  static constexpr size_t kBytes = size_t(512) << 20;
  struct Unmap {
    void operator()(void* m) const { ::munmap(m, kBytes); }
  };
  Device& dev_;
  std::unique_ptr<void, Unmap> mem_;
};

// Two timings (seconds, as a() and b() measure them) taken in turn `rounds` times, a first in
// even rounds and b first in odd ones: the medians of each and of the per-round ratios a/b
// (above 1: b is faster), and the lowest and highest ratio.
// With read_gbs, a read pass after each round splits the ratios by bandwidth phase (PhaseSplit).
struct InTurn {
  double a_median = 0, b_median = 0, ratio_median = 0, ratio_low = 0, ratio_high = 0;
  PhaseSplit phases;
};
template <typename FA, typename FB>
InTurn time_in_turn(int rounds, FA a, FB b, const std::function<double()>& read_gbs = {}) {
  std::vector<double> ta, tb, ratio, gbs;
  for (int r = 0; r < rounds; ++r) {
    double t[2];
    for (int k = 0; k < 2; ++k) {
      const bool side_b = (k == 0) == (r % 2 == 1);
      t[side_b] = side_b ? b() : a();
    }
    ta.push_back(t[0]);
    tb.push_back(t[1]);
    ratio.push_back(t[0] / t[1]);
    if (read_gbs) gbs.push_back(read_gbs());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  InTurn out;
  out.a_median = median(ta);
  out.b_median = median(tb);
  out.ratio_median = median(ratio);
  if (!gbs.empty()) {
    const auto [lo, hi] = std::minmax_element(gbs.begin(), gbs.end());
    if (*hi >= 1.25 * *lo) {
      const double mid = (*lo + *hi) / 2;
      std::vector<double> fast, slow, fast_g, slow_g;
      for (size_t r = 0; r < gbs.size(); ++r) {
        (gbs[r] >= mid ? fast : slow).push_back(ratio[r]);
        (gbs[r] >= mid ? fast_g : slow_g).push_back(gbs[r]);
      }
      PhaseSplit& p = out.phases;
      p.n_fast = int(fast.size());
      p.n_slow = int(slow.size());
      p.fast_ratio = median(fast);
      p.slow_ratio = median(slow);
      p.fast_lo = *std::min_element(fast_g.begin(), fast_g.end());
      p.fast_hi = *std::max_element(fast_g.begin(), fast_g.end());
      p.slow_lo = *std::min_element(slow_g.begin(), slow_g.end());
      p.slow_hi = *std::max_element(slow_g.begin(), slow_g.end());
    }
  }
  std::sort(ratio.begin(), ratio.end());
  out.ratio_low = ratio.front();
  out.ratio_high = ratio.back();
  return out;
}

// The decode's fraction of the read roofline taken in turn with the read loop: `rounds` rounds,
// each one decode timing (seconds per token, as time_decode() measures it) and right after it one
// read pass (best of 2), each round's fraction bytes / t / bandwidth against its own pass. A
// shared machine's bandwidth moves within minutes (the 2-core EPYC VM, 2026-11-30: the native
// loop read 33-36 GB/s for most of an hour and 55-59 GB/s at times), so a figure taken minutes
// from the decode put the same build's decode at 52% and at 104% of "the" roofline. The pass is
// ReadProbe's.
struct RooflineInTurn {
  int rounds = 0;
  double t_median = 0, gbs_median = 0;  // seconds per token; GB/s
  double fraction_median = 0, fraction_low = 0, fraction_high = 0;
};
template <typename F>
RooflineInTurn roofline_in_turn(Device& dev, int rounds, double bytes_per_token, F time_decode) {
  ReadProbe probe(dev);
  std::vector<double> ts, gbs, fraction;
  for (int r = 0; r < rounds; ++r) {
    const double t = time_decode();
    const double g = probe.gb_s(2);
    ts.push_back(t);
    gbs.push_back(g);
    fraction.push_back(bytes_per_token / t / (g * 1e9));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  RooflineInTurn out;
  out.rounds = rounds;
  out.t_median = median(ts);
  out.gbs_median = median(gbs);
  out.fraction_median = median(fraction);
  out.fraction_low = *std::min_element(fraction.begin(), fraction.end());
  out.fraction_high = *std::max_element(fraction.begin(), fraction.end());
  return out;
}

// --compute-dtype f32|bf16 (the deployment's model.compute_dtype) and --no-mmap (model.mmap:
// false), as the end-to-end benchmarks take them.
inline void add_compute_dtype_option(CLI::App& app, std::string& compute_dtype) {
  app.add_option("--compute-dtype", compute_dtype, "the deployment's model.compute_dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
}
inline void add_no_mmap_flag(CLI::App& app, bool& no_mmap) {
  app.add_flag("--no-mmap", no_mmap,
               "model.mmap: false: the checkpoint files read into memory at load, not mapped");
}

// --roofline-rounds R: the rounds of roofline_in_turn a benchmark's batch-1 decode takes.
inline void add_roofline_rounds_option(CLI::App& app, int& rounds) {
  app.add_option("--roofline-rounds", rounds,
                 "rounds of the batch-1 decode in turn with a pass of the read loop (the decode "
                 "figure and its fraction of the roofline are their medians)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
}

// Times fn() (seconds, as it measures them) under both tunings; `dev`'s tuning is A again after.
template <typename F>
void run_tuning_ab(Device& dev, TuningAB& ab, int rounds, F fn) {
  const KernelTuning a = dev.tuning();
  const KernelTuning b = ab.applied_to(a);
  dev.set_tuning(b);
  fn();  // builds B's kernels
  ReadProbe probe(dev);
  const InTurn t = time_in_turn(
      rounds,
      [&] {
        dev.set_tuning(a);
        return fn();
      },
      [&] {
        dev.set_tuning(b);
        return fn();
      },
      [&] { return probe.gb_s(2); });
  dev.set_tuning(a);
  ab.phases = t.phases;
  ab.a_median = t.a_median;
  ab.b_median = t.b_median;
  ab.ratio_median = t.ratio_median;
  ab.ratio_low = t.ratio_low;
  ab.ratio_high = t.ratio_high;
}

// The process's CPU time so far (user and system, every thread), in seconds.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

}  // namespace clshard::bench
