#include "runtime/engine/bench.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "runtime/device.h"
#include "runtime/safetensors.h"

namespace clshard {

namespace {

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string shape_name(const BenchShape& s) {
  return "batch " + std::to_string(s.batch) + ", prompt " + std::to_string(s.prompt_len) +
         ", gen " + std::to_string(s.gen_len);
}

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace

Percentiles percentiles(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    const double rank = q * double(v.size() - 1);
    const size_t lo = size_t(std::floor(rank)), hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
  };
  p.p50 = at(0.50);
  p.p90 = at(0.90);
  p.p99 = at(0.99);
  return p;
}

std::vector<uint32_t> parse_size_list(const std::string& text, const std::string& flag) {
  std::vector<uint32_t> out;
  const std::string expected = " (expected a list like 1,8,32)";
  if (text.empty()) throw std::runtime_error(flag + ": empty list" + expected);
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string item =
        text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    const bool digits = !item.empty() && item.size() <= 9 &&
                        std::all_of(item.begin(), item.end(), [](char c) {
                          return c >= '0' && c <= '9';
                        });
    if (!digits || std::stoul(item) == 0)
      throw std::runtime_error(flag + ": '" + item + "' is not a positive integer" + expected);
    out.push_back(uint32_t(std::stoul(item)));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

std::vector<int32_t> synthetic_prompt(uint32_t vocab, uint32_t len, uint64_t seed, uint64_t index,
                                      const std::vector<int32_t>& avoid) {
  // One generator per request, seeded from (seed, index) through seed_seq so that neighbouring
  // indices give unrelated streams.
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), uint32_t(index), uint32_t(index >> 32)};
  std::mt19937_64 gen(seq);
  std::uniform_int_distribution<int32_t> pick(0, int32_t(vocab) - 1);
  std::vector<int32_t> ids;
  ids.reserve(len);
  while (ids.size() < len) {
    const int32_t t = pick(gen);
    if (std::find(avoid.begin(), avoid.end(), t) == avoid.end()) ids.push_back(t);
  }
  return ids;
}

namespace {

// Every request must reach gen_len tokens (with speculation, K draft positions beyond them too).
void check_fits(const Deployment& d, const BenchShape& shape) {
  const uint32_t K = d.draft ? d.limits.num_speculative_tokens : 0;
  const uint64_t need = uint64_t(shape.prompt_len) + shape.gen_len + K;
  if (need > d.limits.max_length)
    throw std::runtime_error("bench: prompt " + std::to_string(shape.prompt_len) + " + gen " +
                             std::to_string(shape.gen_len) +
                             (K ? " + " + std::to_string(K) + " drafts" : std::string()) +
                             " tokens exceed the model's max_length " +
                             std::to_string(d.limits.max_length) + " (" +
                             d.config.where("model.max_length") + ")");
}

}  // namespace

BenchResult run_bench_shape(Deployment& d, const BenchShape& shape, uint64_t seed) {
  check_fits(d, shape);
  auto engine = d.make_engine();
  const ModelInfo& info = d.model->info();

  // Per request: when each of its delivering steps handed it tokens, and how many.
  struct Trace {
    std::vector<Clock::time_point> chunk_time;
    std::vector<size_t> chunk_step;
    std::vector<uint32_t> chunk_tokens;
    uint64_t tokens = 0;
  };
  std::map<uint64_t, Trace> traces;
  size_t step_index = 0;
  engine->on_token([&](const TokenEvent& e) {
    Trace& t = traces[e.handle];
    if (t.chunk_step.empty() || t.chunk_step.back() != step_index) {
      t.chunk_time.push_back(Clock::now());
      t.chunk_step.push_back(step_index);
      t.chunk_tokens.push_back(0);
    }
    ++t.chunk_tokens.back();
    ++t.tokens;
  });

  const SamplingParams sampling = Deployment::sampling_params(d.config.sampling);
  std::vector<GenerationRequest> requests;
  for (uint32_t i = 0; i < shape.batch; ++i) {
    GenerationRequest g;
    g.prompt = synthetic_prompt(info.vocab_size, shape.prompt_len, seed, i, info.eos_token_ids);
    g.sampling = sampling;
    g.max_tokens = shape.gen_len;
    g.ignore_eos = true;  // exactly gen_len tokens; the deployment's stop lists are not used
    requests.push_back(std::move(g));
  }

  const auto t0 = Clock::now();
  for (auto& g : requests) engine->submit(std::move(g));
  std::vector<Clock::time_point> step_end;
  uint64_t finished = 0;
  while (engine->has_work()) {
    for (const GenerationResult& r : engine->step()) {
      if (r.reason == EndReason::Error)
        throw std::runtime_error("bench: " + shape_name(shape) + ": a request failed: " + r.error);
      if (r.token_ids.size() != shape.gen_len)
        throw std::runtime_error("bench: " + shape_name(shape) + ": a request ended after " +
                                 std::to_string(r.token_ids.size()) + " tokens, not " +
                                 std::to_string(shape.gen_len));
      ++finished;
    }
    step_end.push_back(Clock::now());
    ++step_index;
  }
  const auto t_end = Clock::now();
  if (finished != shape.batch || traces.size() != shape.batch)
    throw std::logic_error("bench: " + std::to_string(finished) + " of " +
                           std::to_string(shape.batch) + " requests finished");

  BenchResult res;
  res.shape = shape;
  res.engine = engine->stats();
  res.speculative = d.draft != nullptr;
  res.total_s = seconds(t0, t_end);
  res.prompt_tokens = uint64_t(shape.batch) * shape.prompt_len;
  size_t prefill_last_step = 0;
  std::vector<double> ttft, itl;
  double tpot_sum = 0;
  for (const auto& [handle, t] : traces) {
    res.output_tokens += t.tokens;
    prefill_last_step = std::max(prefill_last_step, t.chunk_step.front());
    ttft.push_back(1e3 * seconds(t0, t.chunk_time.front()));
    for (size_t c = 1; c < t.chunk_time.size(); ++c)
      itl.push_back(1e3 * seconds(t.chunk_time[c - 1], t.chunk_time[c]));
    if (t.tokens > 1)
      tpot_sum += 1e3 * seconds(t.chunk_time.front(), t.chunk_time.back()) / double(t.tokens - 1);
  }
  // The prefill phase ends with the step that gave the last request its first token.
  res.prefill_s = seconds(t0, step_end.at(prefill_last_step));
  res.decode_s = seconds(step_end.at(prefill_last_step), t_end);
  for (const auto& [handle, t] : traces)
    for (size_t c = 0; c < t.chunk_step.size(); ++c)
      if (t.chunk_step[c] > prefill_last_step) res.decode_tokens += t.chunk_tokens[c];
  res.prefill_tok_s = res.prefill_s > 0 ? double(res.prompt_tokens) / res.prefill_s : 0;
  res.ttft_ms = percentiles(ttft);
  res.itl_ms = percentiles(itl);
  res.tpot_ms_mean = shape.gen_len > 1 ? tpot_sum / double(shape.batch) : 0;
  if (res.decode_tokens > 0 && res.decode_s > 0)
    res.decode_tok_s = double(res.decode_tokens) / res.decode_s;
  res.output_tok_s = res.total_s > 0 ? double(res.output_tokens) / res.total_s : 0;
  return res;
}

std::vector<BenchResult> run_bench(Deployment& d, const BenchOptions& opts,
                                   std::ostream& progress) {
  if (opts.batches.empty() || opts.prompt_lens.empty() || opts.gen_lens.empty())
    throw std::invalid_argument("bench: empty grid");
  std::vector<BenchShape> grid;
  for (uint32_t b : opts.batches)
    for (uint32_t p : opts.prompt_lens)
      for (uint32_t g : opts.gen_lens) grid.push_back({b, p, g});
  // Checked before any run, so a long sweep does not fail half-way on a too-long configuration.
  for (const BenchShape& s : grid) check_fits(d, s);
  if (opts.warmup) {
    const uint32_t prompt = *std::min_element(opts.prompt_lens.begin(), opts.prompt_lens.end());
    const uint32_t gen =
        std::min<uint32_t>(4, *std::min_element(opts.gen_lens.begin(), opts.gen_lens.end()));
    for (uint32_t b : std::set<uint32_t>(opts.batches.begin(), opts.batches.end())) {
      const BenchShape w{b, prompt, gen};
      progress << "bench: warm-up (not measured): " << shape_name(w) << "\n" << std::flush;
      run_bench_shape(d, w, opts.seed + 1);
    }
  }
  std::vector<BenchResult> results;
  for (size_t i = 0; i < grid.size(); ++i) {
    progress << "bench: [" << i + 1 << "/" << grid.size() << "] " << shape_name(grid[i]) << " ..."
             << std::flush;
    results.push_back(run_bench_shape(d, grid[i], opts.seed));
    const BenchResult& r = results.back();
    progress << " " << fixed(r.total_s, 2) << " s, prefill " << fixed(r.prefill_tok_s, 1)
             << " tok/s, decode "
             << (r.decode_tok_s ? fixed(*r.decode_tok_s, 1) + " tok/s" : std::string("-"))
             << "\n" << std::flush;
  }
  return results;
}

nlohmann::ordered_json bench_record(const BenchResult& r) {
  nlohmann::ordered_json j;
  j["batch"] = r.shape.batch;
  j["prompt_len"] = r.shape.prompt_len;
  j["gen_len"] = r.shape.gen_len;
  j["prompt_tokens"] = r.prompt_tokens;
  j["output_tokens"] = r.output_tokens;
  j["total_s"] = r.total_s;
  j["prefill_s"] = r.prefill_s;
  j["decode_s"] = r.decode_s;
  j["prefill_tok_s"] = r.prefill_tok_s;
  j["decode_tok_s"] = r.decode_tok_s ? nlohmann::ordered_json(*r.decode_tok_s) : nullptr;
  j["decode_tokens"] = r.decode_tokens;
  j["output_tok_s"] = r.output_tok_s;
  j["ttft_ms_p50"] = r.ttft_ms.p50;
  j["ttft_ms_p90"] = r.ttft_ms.p90;
  j["ttft_ms_p99"] = r.ttft_ms.p99;
  j["itl_ms_p50"] = r.itl_ms.p50;
  j["itl_ms_p90"] = r.itl_ms.p90;
  j["itl_ms_p99"] = r.itl_ms.p99;
  j["tpot_ms_mean"] = r.tpot_ms_mean;
  const EngineStats& e = r.engine;
  const double steps = double(std::max<uint64_t>(e.steps, 1));
  j["steps"] = e.steps;
  j["host_ms_per_step"] = 1e3 * e.host_s / steps;
  j["device_ms_per_step"] = 1e3 * e.device_s / steps;
  j["preemptions"] = e.preemptions;
  if (r.speculative) {
    const SpeculativeStats& s = e.speculative;
    j["drafted"] = s.drafted;
    j["accepted"] = s.accepted;
    j["acceptance_rate"] = s.acceptance_rate();
    j["mean_accepted_length"] = s.mean_accepted_length();
    nlohmann::ordered_json by = nlohmann::ordered_json::array();
    for (size_t k = 0; k < s.drafted_at.size(); ++k)
      by.push_back(s.drafted_at[k] ? double(s.accepted_at[k]) / double(s.drafted_at[k]) : 0.0);
    j["acceptance_by_position"] = by;
    j["draft_ms_per_step"] = 1e3 * s.draft_s / steps;
  }
  return j;
}

namespace {

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "";
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

nlohmann::ordered_json bench_environment(const Deployment& d, const std::string& commit) {
  const DeployConfig& cfg = d.config;
  nlohmann::ordered_json env;
  env["time_utc"] = utc_now();
  env["clshard_commit"] = commit.empty() ? nlohmann::ordered_json(nullptr)
                                         : nlohmann::ordered_json(commit);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  env["host"] = {{"cpu", cpu_model_name()},
                 {"hardware_threads", std::thread::hardware_concurrency()},
                 {"memory_bytes", pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0}};
  nlohmann::ordered_json devs = nlohmann::ordered_json::array();
  for (Device* dev : d.devices->devices()) {
    const DeviceInfo& i = dev->info();
    devs.push_back({{"name", i.name},
                    {"vendor", i.vendor},
                    {"platform", i.platform},
                    {"platform_version", i.platform_version},
                    {"driver_version", i.driver_version},
                    {"opencl_version", i.opencl_version},
                    {"compute_units", i.compute_units},
                    {"global_mem_bytes", i.global_mem},
                    {"sub_device", i.is_sub_device}});
  }
  env["devices"] = devs;
  nlohmann::ordered_json dep;
  dep["source"] = cfg.source;
  std::ifstream file(cfg.source, std::ios::binary);
  if (cfg.source != "--model" && file) {
    std::ostringstream text;
    text << file.rdbuf();
    dep["file_contents"] = text.str();
  }
  dep["parallel"] = {{"data", cfg.parallel.data},
                     {"tensor", cfg.parallel.tensor},
                     {"expert", cfg.parallel.expert}};
  dep["cluster_transport"] = to_string(cfg.cluster.transport);
  dep["mpi_ranks"] = d.mpi_ranks;
  dep["replicas"] = d.model->num_replicas();
  dep["kv_cache"] = {{"page_size", d.limits.page_size}, {"pages_per_replica", d.limits.total_pages}};
  dep["batch"] = {{"max_batch_size", d.limits.max_batch_size},
                  {"max_batch_input_tokens", d.limits.max_batch_input_tokens}};
  dep["sampling"] = {{"temperature", cfg.sampling.temperature},
                     {"top_k", cfg.sampling.top_k},
                     {"top_p", cfg.sampling.top_p},
                     {"min_p", cfg.sampling.min_p},
                     {"seed", cfg.sampling.seed}};
  dep["speculative"] = {{"method", to_string(cfg.speculative.method)},
                        {"num_speculative_tokens", cfg.speculative.num_speculative_tokens}};
  env["deployment"] = dep;
  const ModelInfo& m = d.model->info();
  env["model"] = {{"path", cfg.model.path.string()},
                  {"architecture", m.architecture},
                  {"vocab_size", m.vocab_size},
                  {"hidden_size", m.hidden_size},
                  {"num_layers", m.num_layers},
                  {"max_seq_len", m.max_seq_len},
                  {"weight_bytes", m.weight_bytes}};
  return env;
}

std::string format_bench_table(const std::vector<BenchResult>& results) {
  const bool spec = std::any_of(results.begin(), results.end(),
                                [](const BenchResult& r) { return r.speculative; });
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head = {"batch",   "prompt", "gen",    "prefill tok/s", "decode tok/s",
                                   "TTFT p50", "p90",   "p99 ms", "ITL p50",       "p90",
                                   "p99 ms",  "host ms/step", "steps"};
  if (spec) head.push_back("accepted (by position)");
  rows.push_back(head);
  for (const BenchResult& r : results) {
    std::vector<std::string> row = {std::to_string(r.shape.batch),
                                    std::to_string(r.shape.prompt_len),
                                    std::to_string(r.shape.gen_len),
                                    fixed(r.prefill_tok_s, 1),
                                    r.decode_tok_s ? fixed(*r.decode_tok_s, 1) : "-",
                                    fixed(r.ttft_ms.p50, 1),
                                    fixed(r.ttft_ms.p90, 1),
                                    fixed(r.ttft_ms.p99, 1),
                                    fixed(r.itl_ms.p50, 1),
                                    fixed(r.itl_ms.p90, 1),
                                    fixed(r.itl_ms.p99, 1),
                                    fixed(1e3 * r.engine.host_s /
                                              double(std::max<uint64_t>(r.engine.steps, 1)),
                                          2),
                                    std::to_string(r.engine.steps)};
    if (spec) {
      const SpeculativeStats& s = r.engine.speculative;
      std::string a = fixed(100.0 * s.acceptance_rate(), 1) + "% (";
      for (size_t k = 0; k < s.drafted_at.size(); ++k)
        a += (k ? " " : "") +
             fixed(s.drafted_at[k] ? 100.0 * double(s.accepted_at[k]) / double(s.drafted_at[k])
                                   : 0.0,
                   0) +
             "%";
      row.push_back(a + ")");
    }
    rows.push_back(row);
  }
  std::vector<size_t> width(head.size(), 0);
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  std::string out;
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) {
      const bool last = c + 1 == row.size();
      const std::string pad(width[c] - row[c].size(), ' ');
      out += last ? row[c] : pad + row[c] + "  ";
    }
    out += "\n";
  }
  return out;
}

namespace {

typedef uint64_t Lanes __attribute__((vector_size(16)));
constexpr size_t kLanesPerBlock = 8;  // one block: 128 bytes, two cache lines

// One thread's pass over `blocks` blocks: the sum of their 64-bit words (a check that every word
// was read, and a use of the reads, so they cannot be optimised away).
// 16-byte vectors of integers (SSE2 on any x86-64; the compiler's vector extension elsewhere) and
// 8 accumulators: one load-add per vector without spills, bound by memory, not by adds. That is
// all the portable form can do: it read 21.6 GB/s here where the AVX-512 form below read 26.9
// (2-core Xeon with AMX, 2026-11-29), and scalar code at GCC 12's -O2 14.8.
uint64_t sum_blocks_portable(const Lanes* p, size_t blocks) {
  Lanes a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
  for (size_t i = 0; i < blocks * kLanesPerBlock; i += kLanesPerBlock) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
    a4 += p[i + 4];
    a5 += p[i + 5];
    a6 += p[i + 6];
    a7 += p[i + 7];
  }
  const Lanes s = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
  return s[0] + s[1];
}

#if defined(__x86_64__) && defined(__GNUC__)
// Full-width loads, and a prefetch 4 KiB ahead (the distance the GEMV kernels prefetch at,
// KernelTuning::gemv_stream_prefetch's order): the most a native loop read on these machines, so
// a roofline taken against it is not flattered.
__attribute__((target("avx512f"))) uint64_t sum_blocks_avx512(const Lanes* p, size_t blocks) {
  const char* c = reinterpret_cast<const char*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0;
  for (size_t i = 0; i < blocks * 128; i += 128) {
    _mm_prefetch(c + i + 4096, _MM_HINT_T0);
    _mm_prefetch(c + i + 4096 + 64, _MM_HINT_T0);
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(c + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(c + i + 64));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(a0, a1));
  uint64_t s = 0;
  for (uint64_t v : lanes) s += v;
  return s;
}

// The FP8 GEMV's one-row tile in turn (fp8_tile.cl's fp8_in_turn_sums with FP8_DENORM=1) as a
// native loop: per 16 codes the sign-extending load, the shift and the mask of common.cl's
// e4m3x16_decode_scaled and one FMA into the block's sums; per 128-code block the two 8 KiB
// prefetches (the device row's stream_prefetch) and the FMA under the block's scale. x is a
// 2048-wide row in L1, as the kernel's private copy. The buffer's words make subnormal codes,
// whose FMAs would each cost an assist (the host gives weights with many the f16 decode), so the
// pass runs with denormal inputs read as zero. (GCC 12 warns of an uninitialized variable inside
// its own sign-extend and shift intrinsics; its vector extensions' conversion, which does not warn,
// came out as scalar code and read 1.5 GB/s.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f,avx512bw"))) uint64_t sum_blocks_e4m3(const Lanes* p,
                                                                     size_t blocks) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // DAZ | FTZ
  alignas(64) static const auto x_row = [] {
    std::array<float, 2048> x{};
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0x1p100f * float(1 + i % 7);  // FP8_X_SCALE
    return x;
  }();
  const __m512i mask = _mm512_set1_epi32(int(0x87F00000u));
  const char* c = reinterpret_cast<const char*>(p);
  __m512 acc = _mm512_setzero_ps();
  for (size_t b = 0; b < blocks; ++b, c += 128) {
    _mm_prefetch(c + 8192, _MM_HINT_T1);
    _mm_prefetch(c + 8192 + 64, _MM_HINT_T1);
    const float* x = x_row.data() + (b % 16) * 128;
    __m512 blk = _mm512_setzero_ps();
    for (int u = 0; u < 8; ++u) {
      const __m512i w =
          _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(c) + u));
      blk = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, 20), mask)),
                            _mm512_load_ps(x + 16 * u), blk);
    }
    acc = _mm512_fmadd_ps(blk, _mm512_set1_ps(0x1p-120f), acc);
  }
  _mm_setcsr(csr);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  uint64_t s = 0;
  for (float v : lanes) s += std::bit_cast<uint32_t>(v);
  return s;
}
#pragma GCC diagnostic pop
#endif

}  // namespace

namespace {

using SumBlocks = uint64_t (*)(const Lanes*, size_t);

// nullptr: the loop cannot run on this host.
SumBlocks pick_loop(HostReadLoop loop, HostReadBandwidth& r) {
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (loop == HostReadLoop::E4m3Decode && avx512) {
    r.avx512 = true;
    return sum_blocks_e4m3;
  }
  if (loop == HostReadLoop::Fastest && __builtin_cpu_supports("avx512f")) {
    r.avx512 = true;
    return sum_blocks_avx512;
  }
#endif
  return loop == HostReadLoop::E4m3Decode ? nullptr : sum_blocks_portable;
}

// `threads` threads, thread id summing `blocks` blocks from part(id) (nullptr: no memory, and no
// rate), `repeats` timed passes between barriers: the best pass's rate into r.gb_s, the last
// pass's sums into r.sum. part runs on the thread that reads the part (first touch).
template <typename Part>
void read_passes(unsigned threads, size_t blocks, int repeats, SumBlocks sum_blocks, Part part,
                 HostReadBandwidth& r) {
  std::vector<const Lanes*> parts(threads, nullptr);
  std::vector<uint64_t> sums(threads, 0);
  std::barrier gate{std::ptrdiff_t(threads)};
  Clock::time_point t0;
  bool all_parts = false;
  auto work = [&](unsigned id) {
    parts[id] = part(id);
    gate.arrive_and_wait();
    if (id == 0)
      all_parts = std::all_of(parts.begin(), parts.end(), [](const Lanes* q) { return q; });
    for (int rep = 0; rep < repeats; ++rep) {
      gate.arrive_and_wait();
      if (id == 0) t0 = Clock::now();
      if (parts[id]) sums[id] = sum_blocks(parts[id], blocks);
      gate.arrive_and_wait();
      if (id == 0 && all_parts)
        r.gb_s = std::max(r.gb_s, double(r.bytes) / seconds(t0, Clock::now()) / 1e9);
    }
  };
  std::vector<std::thread> pool;
  for (unsigned id = 1; id < threads; ++id) pool.emplace_back(work, id);
  work(0);
  for (auto& t : pool) t.join();
  for (uint64_t s : sums) r.sum += s;
}

constexpr size_t kBlockBytes = kLanesPerBlock * sizeof(Lanes);

}  // namespace

HostReadBandwidth measure_read_bandwidth(unsigned threads, size_t bytes, int repeats,
                                         HostReadLoop loop) {
  threads = std::max(1u, threads);
  const size_t blocks = std::max<size_t>(bytes / threads / kBlockBytes, 1);
  const size_t part_bytes = blocks * kBlockBytes;
  HostReadBandwidth r;
  r.bytes = part_bytes * threads;
  const SumBlocks sum_blocks = pick_loop(loop, r);
  if (!sum_blocks) return r;
  // Page-aligned parts in huge pages where the kernel gives them, as big checkpoints are mapped
  // (runtime/file_mapping.h). Word i of the whole is i + 1, so a pass's sum says it read each once.
  std::vector<void*> mapped(threads, nullptr);
  read_passes(
      threads, blocks, std::max(1, repeats), sum_blocks,
      [&](unsigned id) -> const Lanes* {
        void* mem =
            ::mmap(nullptr, part_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) return nullptr;
        mapped[id] = mem;
        ::madvise(mem, part_bytes, MADV_HUGEPAGE);
        // Each thread first touches its own part (its NUMA node's memory).
        uint64_t* words = static_cast<uint64_t*>(mem);
        const uint64_t first = uint64_t(id) * (part_bytes / 8);
        for (size_t i = 0; i < part_bytes / 8; ++i) words[i] = first + i + 1;
        return static_cast<const Lanes*>(mem);
      },
      r);
  for (void* m : mapped)
    if (m) ::munmap(m, part_bytes);
  return r;
}

HostReadBandwidth measure_read_bandwidth_of(const void* base, size_t bytes, unsigned threads,
                                            int repeats, HostReadLoop loop) {
  threads = std::max(1u, threads);
  const auto at = reinterpret_cast<uintptr_t>(base);
  const uintptr_t start = (at + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
  const size_t usable = bytes > start - at ? bytes - (start - at) : 0;
  const size_t blocks = usable / threads / kBlockBytes;
  HostReadBandwidth r;
  r.bytes = blocks * kBlockBytes * threads;
  const SumBlocks sum_blocks = pick_loop(loop, r);
  if (blocks == 0 || !sum_blocks) return r;
  read_passes(
      threads, blocks, std::max(1, repeats), sum_blocks,
      [&](unsigned id) {
        return reinterpret_cast<const Lanes*>(start + size_t(id) * blocks * kBlockBytes);
      },
      r);
  return r;
}

HostReadBandwidth measure_checkpoint_read_bandwidth(const std::filesystem::path& dir,
                                                    unsigned threads, int repeats) {
  const WeightStore store(dir);
  std::map<const std::filesystem::path*, std::pair<const uint8_t*, const uint8_t*>> spans;
  for (const std::string& name : store.names()) {
    const TensorView& v = store.get(name);
    auto [it, fresh] = spans.try_emplace(v.file, v.data, v.data + v.bytes);
    it->second.first = std::min(it->second.first, v.data);
    it->second.second = std::max(it->second.second, v.data + v.bytes);
  }
  HostReadBandwidth all;
  double seconds = 0;
  for (const auto& [file, span] : spans) {
    const HostReadBandwidth r =
        measure_read_bandwidth_of(span.first, size_t(span.second - span.first), threads, repeats);
    all.avx512 = r.avx512;
    if (r.gb_s <= 0) continue;
    all.bytes += r.bytes;
    seconds += double(r.bytes) / (r.gb_s * 1e9);
  }
  if (seconds > 0) all.gb_s = double(all.bytes) / seconds / 1e9;
  return all;
}

}  // namespace clshard

namespace clshard {

DeviceReadBandwidth measure_device_read_bandwidth(Device& dev, size_t bytes, int repeats,
                                                  float fill) {
  DeviceReadBandwidth r;
  r.shape = dev.kernel_shape();
  const bool wg = r.shape == KernelShape::WorkGroups;
  constexpr uint32_t kLanes = 256;  // READ_WG
  // CPU shape: 64 chunks of whole float16s. GPU shape: slabs of kLanes float4s per lane-step,
  // at least 8 groups per compute unit (1024 at least) so every unit has loads in flight.
  const size_t items = wg ? std::max<size_t>(1024, size_t(dev.info().compute_units) * 8) : 64;
  const size_t unit = wg ? items * kLanes * 16 : items * 64;  // bytes per step of every item
  const size_t steps = bytes / unit;
  if (steps == 0)
    throw std::invalid_argument("measure_device_read_bandwidth: " + std::to_string(bytes) +
                                " bytes is less than one pass of the probe (" +
                                std::to_string(unit) + " bytes)");
  r.bytes = steps * unit;
  r.step_bytes = unit;
  cl::Mem big = dev.alloc(r.bytes);
  {
    const std::vector<float> ones(r.bytes / 4, fill);
    dev.write(big, ones.data(), r.bytes);
  }
  cl::Mem sums = dev.alloc(items * 4);
  cl::Kernel k = wg ? dev.kernel("bandwidth.cl", "read_sum_wg",
                                 "-DREAD_WG=" + std::to_string(kLanes))
                    : dev.kernel("bandwidth.cl", "read_sum");
  cl::set_args(k, big, uint32_t(steps), sums);
  auto pass = [&] {
    if (wg) {
      const size_t local[3] = {kLanes, 1, 1};
      dev.launch(k, {items * kLanes, 1, 1}, 1, local);
    } else {
      dev.launch(k, {items, 1, 1}, 1);
    }
    dev.finish();
  };
  pass();
  std::vector<double> t;
  for (int i = 0; i < std::max(1, repeats); ++i) {
    const auto t0 = Clock::now();
    pass();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  r.gb_s = double(r.bytes) / t[t.size() / 2] / 1e9;
  std::vector<float> partial(items);
  dev.read(sums, partial.data(), items * 4);
  for (float p : partial) r.sum += p;
  return r;
}

}  // namespace clshard
