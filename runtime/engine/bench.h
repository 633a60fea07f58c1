// `clshard bench`: throughput and latency of a deployment over a grid of batch sizes, prompt
// lengths and completion lengths. Model-agnostic: requests of random token ids go through the real
// Engine (continuous batching, data-parallel replicas, speculative decoding), so the figures are
// what the batch job would see.
//
// One configuration = `batch` requests of `prompt_len` random token ids each (seeded), submitted
// together, each generating exactly `gen_len` tokens (EOS ignored). Measured from the submission:
//   prefill phase  until every request has its first token; prefill_tok_s = prompt tokens / phase
//   decode phase   from there to the last token; decode_tok_s = tokens delivered in it / phase
//   ttft           per request, submission to its first token
//   itl            gaps between the steps that deliver a request's tokens (a speculative step that
//                  delivers several tokens counts once, as serving benchmarks count stream chunks)
//   tpot           per request, (last token - first token) / (tokens - 1)
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine/deployment.h"
#include "runtime/engine/engine.h"

namespace clshard {

struct BenchShape {
  uint32_t batch = 1;
  uint32_t prompt_len = 128;
  uint32_t gen_len = 32;
};

struct BenchOptions {
  std::vector<uint32_t> batches = {1};
  std::vector<uint32_t> prompt_lens = {128};
  std::vector<uint32_t> gen_lens = {32};
  uint64_t seed = 0;  // of the random prompts
  // One warm-up run per batch size before the measured ones (kernels compiled and cached, KV pages
  // touched); never part of a figure.
  bool warmup = true;
};

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0;
};
// Linear interpolation between closest ranks (numpy's default); all zero for no samples.
Percentiles percentiles(std::vector<double> samples);

struct BenchResult {
  BenchShape shape;
  uint64_t prompt_tokens = 0, output_tokens = 0;
  double total_s = 0, prefill_s = 0, decode_s = 0;
  uint64_t decode_tokens = 0;  // tokens delivered in the decode phase
  double prefill_tok_s = 0;
  std::optional<double> decode_tok_s;  // none when no token comes after the prefill phase
  double output_tok_s = 0;             // output tokens / total time
  Percentiles ttft_ms, itl_ms;
  double tpot_ms_mean = 0;
  EngineStats engine;  // steps, host and device time, preemptions, speculative figures
  bool speculative = false;
};

// "1,8,32" -> {1, 8, 32}: positive integers separated by commas, nothing else. The error names
// the flag and the item: "--batch: 'x' is not a positive integer (expected a list like 1,8,32)".
std::vector<uint32_t> parse_size_list(const std::string& text, const std::string& flag);

// `len` token ids drawn uniformly from [0, vocab) excluding `avoid` (the EOS ids), reproducible
// from (seed, index).
std::vector<int32_t> synthetic_prompt(uint32_t vocab, uint32_t len, uint64_t seed, uint64_t index,
                                      const std::vector<int32_t>& avoid = {});

// Runs one configuration on a fresh engine of the deployment.
BenchResult run_bench_shape(Deployment& d, const BenchShape& shape, uint64_t seed);

// Every configuration of the grid (batch-major, then prompt length, then completion length),
// warm-up first; progress lines go to `progress`.
std::vector<BenchResult> run_bench(Deployment& d, const BenchOptions& opts,
                                   std::ostream& progress);

// The record of one configuration: at least batch, prompt_len, gen_len, prefill_tok_s,
// decode_tok_s, ttft_ms_p50/p90/p99, itl_ms_p50/p90/p99, host_ms_per_step, and acceptance
// figures for speculative deployments.
nlohmann::ordered_json bench_record(const BenchResult& r);

// What the figures were measured on: host, OpenCL devices (driver, version), the deployment
// (file contents, or the --model flags), the model. `commit` is the source's git commit ("" when
// unknown).
nlohmann::ordered_json bench_environment(const Deployment& d, const std::string& commit);

// The results as an aligned text table, one line per configuration.
std::string format_bench_table(const std::vector<BenchResult>& results);

// STREAM-style read bandwidth of host memory: `threads` threads each summing the 64-bit words of
// their part of a `bytes` buffer (rounded down to 128-byte blocks per thread), best of `repeats`
// passes, in GB/s (1e9 bytes per second). The fastest loop uses AVX-512 loads with a prefetch
// where the CPU has them; HostReadLoop::Portable forces the 16-byte vector loop.
// HostReadLoop::E4m3Decode reads the bytes as FP8 weights with the instructions of the FP8 GEMV's
// one-row tile (kernels_cl/fp8_tile.cl): what those instructions can stream on this CPU, next to
// what plain loads can. AVX-512 hosts only (gb_s 0 elsewhere); its sum is not the words'.
enum class HostReadLoop { Fastest, Portable, E4m3Decode };
struct HostReadBandwidth {
  double gb_s = 0;      // 0 where the buffer could not be mapped (or the loop cannot run here)
  size_t bytes = 0;     // bytes read per pass
  uint64_t sum = 0;     // the last pass's sum: word i is i + 1, so W (W + 1) / 2 of W = bytes / 8
  bool avx512 = false;  // an AVX-512 loop ran
};
HostReadBandwidth measure_read_bandwidth(unsigned threads, size_t bytes, int repeats = 5,
                                         HostReadLoop loop = HostReadLoop::Fastest);
// The same loop over memory that is already there (a checkpoint's mapped weights, where they lie):
// from `base` rounded up to 128 bytes, each thread its contiguous share of whole 128-byte blocks
// (r.bytes: what a pass read; 0 and no rate where that is not one block a thread). Its sum is of
// whatever the words hold. Next to measure_read_bandwidth's fresh memory it shows how fast the
// weights' own pages read (model.mmap's comment in runtime/file_mapping.h).
HostReadBandwidth measure_read_bandwidth_of(const void* base, size_t bytes, unsigned threads,
                                            int repeats = 5,
                                            HostReadLoop loop = HostReadLoop::Fastest);
// measure_read_bandwidth_of over a checkpoint directory's weights where the page cache holds them:
// each file's span of tensors through a mapping of its own (the pages the model maps), best of
// `repeats` passes per file, the files' rates combined by their bytes (r.gb_s; r.bytes: a pass
// over them all, r.sum unset).
HostReadBandwidth measure_checkpoint_read_bandwidth(const std::filesystem::path& dir,
                                                    unsigned threads, int repeats = 3);

// Read bandwidth of an OpenCL device over a `bytes` buffer (rounded down to whole slabs) by the
// probe of its kernel shape (kernels_cl/bandwidth.cl): on the CPU shape 64 work-items with 16-wide
// loads over contiguous chunks, on the GPU shape work-groups of 256 lanes with coalesced float4
// loads, 8 groups per compute unit at least. Median of `repeats` timed passes after one untimed.
struct DeviceReadBandwidth {
  double gb_s = 0;
  size_t bytes = 0;     // bytes read per pass: whole steps of the probe, at most the asked bytes
  size_t step_bytes = 0;  // bytes one step of every work-item reads (grows with compute units)
  double sum = 0;       // the partial sums added up (the buffer's contents summed: a check)
  KernelShape shape = KernelShape::Chunks;
};
// `fill` is written into every float of the buffer first (the sum checks it was all read).
DeviceReadBandwidth measure_device_read_bandwidth(Device& dev, size_t bytes, int repeats = 7,
                                                  float fill = 1.0f);

}  // namespace clshard
