// The per-device parameter table of the WorkGroups-shaped kernels (KernelTuning, device.h), kept
// as data: a device gets its row from the built-in table below or from the tuning file a tuning
// run wrote (kernel_tuning.h), without touching the ops or the kernels, which take every value
// from the row (host launch sizes, and -D build options for the kernel constants).
#include "runtime/kernel_tuning.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <stdexcept>
#include <utility>

#include "runtime/program_cache.h"

namespace clshard {

namespace {

struct TuningRow {
  DeviceKind kind;     // the device type the row is for
  const char* vendor;  // a substring of CL_DEVICE_VENDOR; "" matches any
  const char* name;    // a substring of CL_DEVICE_NAME; "" matches any
  KernelTuning tuning;
};

KernelTuning cpu_forced() {
  // The GPU shape forced on a CPU driver (tests, `kernel_shape: gpu` on PoCL): PoCL runs a
  // work-group's lanes as loops between barriers, so fewer lanes per group cost less there.
  KernelTuning t;
  t.norm_wg = 64;
  t.mla_wg = 64;
  // FP8 decode GEMVs prefetch 8 KiB ahead in their weight stream (x86 hosts only,
  // ops::columns_in_turn_option). dsv3-mini fp8's whole decode step (bench_deepseek --tuning-ab,
  // 9 rounds in turn): on the Zen 5 EPYC (2026-11-28) 1.26x [1.00, 1.44] at 8192 bytes, 1.22x at
  // 4096, 1.20x at 16384; on a Xeon with AMX (2026-11-29) 1.29x [1.19, 1.44] at 8192, and against
  // 8192 0.97x at 4096 and 1.01x at 16384; bench_fp8's M = 1 GEMVs 1.4-2.1x at 8192 (Zen 5, one
  // run).
  t.stream_prefetch = 8192;
  // And 1 KiB ahead into L1 (prefetcht0) beside it, a small gain: on the Xeon with AMX
  // (2026-11-29, against none, in turn in one process) linear_fp8 at M = 1 over a 512 MB ring of
  // weight copies (15 rounds, two runs) 512 x 2048 1.01x and 1.01x, 2048 x 2048 1.05x and 1.07x,
  // 7168 x 2048 1.02x and 1.04x, 2048 x 512 1.05x and 1.02x (2048 bytes: 1.01-1.04x);
  // dsv3-mini fp8's whole decode step (bench_deepseek --tuning-ab, 25 rounds) 1.03x and 1.05x,
  // its bf16 one 1.02x, llama3-1b's (bench_llama, 15 rounds) 1.01x. A native loop of the FP8
  // GEMV's instructions (2 threads, 400 MB) read 17.1-20.1 GB/s with both prefetches against
  // 14.8-17.8 with the L2 one alone (medians of 5, three runs). (The EPYC row leaves it off: on
  // Zen 4, 2026-11-30, dsv3-mini fp8's decode step 0.97x [0.94, 1.00] with it, 15 rounds.)
  t.stream_prefetch_l1 = 1024;
  // The f32 / bf16 / f16 decode GEMVs the same (linear_tile.cl's one-row tiles in turn): on the
  // Xeon with AMX (2026-11-29, bench_deepseek / bench_llama --tuning-ab, 9 rounds in turn, against
  // none) dsv3-mini bf16's whole decode step 1.45x [1.34, 1.64] and 1.47x [1.33, 1.60] (two
  // runs), dsv3-mini fp8's 1.18x [0.96, 1.34] (its lm_head and the bf16 parts), llama3-1b bf16's
  // 1.16x [0.87, 1.32]. (The EPYC row turns it off: on Zen 4, 2026-11-30, dsv3-mini bf16's step
  // 0.96x [0.92, 1.34] with it, 15 rounds.)
  t.gemv_stream_prefetch = 8192;
  // Those tiles read their rows in pairs: one row's FMA chain had bounded the stream. On the Xeon
  // with AMX (2026-11-29, bench_decode_breakdown --batch 1 --tuning-ab gemv_row_pairs=0, 15 rounds
  // in turn) llama3-1b bf16's decode step 1.05x (gate/up 1.18x, lm_head 1.15x, o_proj 1.13x, q/k/v
  // 1.06x, down 1.03x); a first form 1.06x either way round; dsv3-mini bf16 1.01-1.04x, within the
  // noise. A native loop of the same shape read 25.1-27.2 GB/s in pairs against 19.8-22.0 one row
  // at a time, both with the 8 KiB prefetch. (The EPYC row keeps one row at a time: on Zen 4,
  // 2026-11-30, pairs without that prefetch made dsv3-mini bf16's step 0.66x [0.54, 0.69].)
  t.gemv_row_pairs = 1;
  // Those tiles read their rows in turn up to K = 8192 (the default 4096 reads a longer row's
  // tiles side by side): on a 2-core Xeon without AMX or AVX-512 BF16 (family 6 model 207, 48 KiB
  // L1D, 2026-12-01, bench_decode_breakdown --batch 1 --tuning-ab gemv_stream_k=8192, 11 and 15
  // rounds in turn) llama3-1b bf16's down_proj (2048 x 8192) 1.11x and 1.12x, its whole step
  // 1.03x and 1.01x; dsv3-mini bf16 and fp8 (bench_deepseek --tuning-ab, 11 rounds) 1.00x at
  // batch 1 and 0.99x at batch 8. (The EPYC row keeps 4096: on Zen 4, 2026-11-30, 0.99-1.00x.)
  t.gemv_stream_k = 8192;
  // Decode batches of 8 to 64 rows in tiles of 8 rows (linear.cl; the default 4 reads and widens
  // each weight vector once per 4 rows): on that Xeon (2026-12-01, bench_step_breakdown, llama3-1b
  // bf16 at compute f32, two runs each way through a throwaway switch) a step of 8 rows 146-153 ->
  // 123 ms, 16 rows 247-248 -> 213-219 ms, 32 rows 459-463 -> 420-425 ms.
  t.linear_batch_tm = 8;
  return t;
}

KernelTuning nvidia() {
  // NVIDIA GPUs: 32-lane warps, 48 KB of shared memory per work-group without opt-in (the tiles
  // stay under it). Wider attention groups keep more loads in flight per SM. Starting values
  // until a tuning run writes measured ones (kernel_tuning.h).
  KernelTuning t;
  t.attn_wg = 128;
  t.mla_wg = 256;
  t.mla_heads = 16;
  t.prefill_wg = 128;
  // CLBlast's SGEMM on f32 weights against linear_wg at llama3-1b's prefill GEMMs, M = 512, on an
  // H100 (`bench_kernels --clblast`, 2026-11-26): 11.6-23.5 TFLOP/s against 2.9-3.7. Widening a
  // bf16 weight first reads 2 and writes 4 bytes per element (gate|up: ~0.07 ms at 2.7 TB/s
  // against its ~1.5 ms SGEMM). linear_wg ran 3.2 TFLOP/s at 64 rows (N = K = 2048); 128 rows is
  // a starting value between the measured sizes until a tuning run times it.
  t.blas_gemm_rows = 128;
  return t;
}

KernelTuning nvidia_hopper() {
  // Measured: `bench_kernel_shapes --tune` through NVIDIA's OpenCL 3.0 (CUDA 13.0, driver
  // 580.159.04) on an H200 and, 2026-11-26, an H100 80GB HBM3; both chose these values (the
  // prefill fields were timed on the H100 only: prefill_wg 256 took 2.05 ms against 128's 2.72 over
  // T=64 and T=512 after 512). Their choice of linear_rows (1 on the H200, 2 on the H100, 5% apart
  // from 4) is left out: prefill GEMMs of hundreds of rows were not among the timed ops, and they
  // want the default 4. What made 1 win was the one-row GEMVs, which since 2026-12-04 run one row
  // per group whatever the field (ops::wg_linear_rows): on the H200 that day they read 1,806, 1,121
  // and 1,999 GB/s with one row per group against 1,277, 873 and 1,373 with four, while the 8-row
  // GEMV read 509 GB/s against 830.
  KernelTuning t = nvidia();
  t.norm_wg = 256;
  t.rope_wg = 256;
  t.attn_wg = 256;
  t.attn_tile = 32;
  t.attn_heads = 8;
  t.attn_split = 256;
  t.prefill_wg = 256;
  t.mla_wg = 256;
  t.mla_tile = 16;
  t.mla_heads = 16;
  // Four weights per lane and step (wg_dots.cl), timed on the H200 on 2026-11-26 over the bf16
  // GEMVs (M = 1 and 8) and the bf16-compute GEMM: 1: 0.391 ms, 2: 0.338, 4: 0.323, 8: 0.367;
  // llama3-1b's batch-1 decode went from 259 to 304 tok/s (`clshard bench`, one run each). The
  // tuner also chose linear_rows 2 there (0.420 ms against 4's 0.455) over the same ops, none of
  // them a 64-row batched decode, which wants the 4 rows' reuse of each weight load.
  t.linear_vector = 4;
  return t;
}

KernelTuning amd_epyc_avx512() {
  // PoCL on an AMD EPYC with AVX-512 BF16 that its LLVM names skylake-avx512 (Zen 5 here), 2
  // cores: the vdpbf16ps GEMM at llama3-1b's prefill shapes (M = 512, bench_kernels --gemm-bf16
  // --tiles, 2026-11-26) ran 4x6 tiles at 63/70/67/48% of the dot-product peak against 4x4's
  // 60/60/61/41% (q/k/v, o, gate|up, down), and `clshard tune` kept 4x6.
  // At decode batches the weights stream from memory: one 8-row tile over the whole batch reads
  // each weight row once, 4 side by side (in-process A/B at M = 8, 2026-11-27, 8x4 against 4x6:
  // the GLU launch 2 x 8192 x 2048 1.28x, 2048 x 2048 1.05x, 2048 x 8192 1.04x; 16384 x 2048 at
  // M = 16 1.16x, at M = 32 1.03x), and `clshard tune` keeps 8x4.
  // The packed GEMM (prefill) in tiles of 4 rows x 4 vectors of 16 columns: on Zen 5 here
  // (2026-11-28, bench_kernels --gemm-bf16, 2 runs, each against the dot-product tiles of the same
  // run) 1.07-1.31x 4x3's speed on q/k/v, o, gate|up and down, the GLU launch (4x4 in both)
  // unchanged; 8x3 between the two; llama3-1b's 512-token bf16 prefill 1.07-1.09x (3 interleaved
  // pairs). On Zen 4 (2026-11-27) tiles of 8x2 to 6x4 had been within 2-4% of 4x3.
  // FP8 tiles read their columns in turn up to K = 8192 (bf16 ones to 4096): in-process A/B on
  // linear_fp8 at M = 1, weights streamed from a 96 MB ring (2026-11-28), 2048 x 4608 (dsv3-mini's
  // dense down_proj) 1.70-1.80x, 1536 x 7168 1.61x, 576 x 7168 1.45x, K <= 4096 unchanged, 2048 x
  // 16384 0.99x at 8192 and 0.77x at 16384 (a 64 KiB x row is past L1); bf16 GEMVs in turn at
  // 1536 x 7168 and 576 x 7168 0.82x and 0.89x, hence the two fields.
  KernelTuning t = cpu_forced();
  // The bf16 one-row tiles' stream prefetch gained nothing on Zen 5 here (dsv3-mini bf16
  // 0.95-1.00x, llama3-1b 0.98-1.02x, 2026-11-28; llama3-1b 0.98x [0.79, 1.07] again on
  // 2026-12-02). Reading their rows in pairs splits the two models on Zen 5 (2026-12-02,
  // --tuning-ab in turn at batch 1): with the prefetch llama3-1b bf16's step 1.09x [1.06, 1.11] (15
  // rounds) and 1.10x (9), dsv3-mini bf16's 0.89x [0.86, 0.94] and 1.00x (11 rounds, two runs),
  // fp8's 0.96x; pairs alone llama3-1b 0.87x [0.86, 0.90] (9 rounds). One row at a time stays.
  t.gemv_stream_prefetch = 0;
  t.gemv_row_pairs = 0;
  t.gemv_stream_k = 4096;
  // 8-row tiles gain nothing on Zen 5 (2026-12-02, bench_llama --tuning-ab linear_batch_tm=8, 5
  // rounds in turn): llama3-1b bf16's batch-8 step 0.99x [0.98, 1.02], prefill 0.99x. Not
  // measured on Zen 4.
  t.linear_batch_tm = 4;
  t.stream_prefetch_l1 = 0;
  t.fp8_stream_k = 8192;
  t.gemm_bf16_tn = 6;
  t.gemm_bf16_packed_nv = 4;
  // The widened panel (gemm_bf16_packed_wf32, the Xeon's) loses a little on Zen 5, where the
  // steps' shifts and masks seem not to compete with the FMAs (not profiled). 2026-12-04,
  // bench_llama --prefill-only at f32 compute, 3 pairs in turn through tuning.json:
  // 179.6/189.1/193.5 against 187.5/194.8/195.9 tokens/s; with gemm_bf16_packed_kp 512, so that
  // down_proj's panel fits widened too, 177-182 against 179-189. So it stays off.
  // The grouped experts take the packed GEMM from 32 rows (gemm_bf16_packed_rows keeps 128):
  // dsv3-mini bf16's 512-token prefill at bf16 compute on Zen 4 (bench_step_breakdown --prefill
  // 512, 2026-11-30, 2 pairs in turn through tuning.json) took its experts in 404-409 ms against
  // 486 (all of them packed: ~48 rows each), the whole step 726-739 ms against 812-826 (1.10x);
  // from 16 rows 416 ms, from 64 431 ms; FP8 experts 446-455 ms from 16 or 32. The same 32 for
  // the dense GEMMs made llama3-1b's 32-stream decode (clshard bench --batch 32, 2 pairs) run
  // 107-108 tok/s against 116.
  t.moe_bf16_packed_rows = 32;
  t.moe_fp8_packed_rows = 32;
  t.gemm_bf16_batch_tm = 8;
  t.gemm_bf16_batch_tn = 4;
  return t;
}

KernelTuning intel_xeon() {
  // PoCL on the Xeons of this workplace (KVM guests named "Intel(R) Xeon(R) Processor"; one with
  // AMX, one of family 6 model 207 without; other Xeons take the row unmeasured): their vdpbf16ps
  // runs at half the f32 FMA's rate (register-only loops: 0.49-0.60x on one with AMX, 2026-11-29;
  // 0.49-0.54x on one with AVX-512 BF16 and no AMX, 2026-12-03), so bf16 compute sums its
  // bf16-rounded products with the portable FMA micro-kernel and attends and runs its GEMVs in f32
  // (gemm_bf16_dot 0; AMX's tiles, where the host has them, are apart from it: gemm_bf16_amx). On
  // the one without AMX (2026-12-03, bench_llama --compute-dtype bf16 --tuning-ab gemm_bf16_dot=0,
  // 9 rounds in turn; the prefill's 3) llama3-1b bf16's decode 1.31x [1.18, 1.45] (144 -> 113 ms
  // per token), its batch-8 step 1.12x [1.00, 1.38], its 512-token prefill 1.34x [1.26, 1.34]
  // and 1.27x [1.19, 1.28] (two runs; 6.8 -> 5.1 s); bench_kernels --gemm-bf16 at M = 512: the
  // packed GEMM's FMA micro-kernel 159-216 GFLOP/s on llama3-1b's shapes against 84-158 with
  // vdpbf16ps. dsv3-mini at bf16 compute (bench_deepseek --tuning-ab, 9 rounds) decode 1.37x
  // [1.27, 1.44] (bf16) and 1.19x [0.89, 1.61] (fp8), its bf16 512-token prefill 1.01x
  // (bench_step_breakdown, 2 pairs: 2137-2240 ms against 2154-2271). Not measured on the Xeon with
  // AMX, whose FP8 experts and attention at bf16 compute it moves to the FMA kernels too.
  KernelTuning t = cpu_forced();
  t.gemm_bf16_dot = 0;
  // The grouped experts take the packed GEMM from 32 rows, as on the EPYC: dsv3-mini's 512-token
  // prefill at bf16 compute on the Xeon without AMX (2026-12-03, bench_step_breakdown --prefill
  // 512, 4 pairs in turn through tuning.json, gemm_bf16_dot 0 in both) took its experts in
  // 994-1274 ms against 1250-1445 (bf16 weights; the whole step 1707-2149 ms against 1996-2397)
  // and 1050-1225 against 1256-1302 (FP8); from 16 rows 947-1190 and 1034-1160 (2 runs).
  // Shorter prefills, whose experts have fewer rows, part the two dtypes: at 128 tokens
  // (2026-12-03, 2 pairs in turn) bf16 experts took 290-302 ms from 8 rows against 361-391 from
  // 32 (the whole step 452-480 ms against 588-787; again with this row, 2 pairs: experts 294-307
  // against 407-445, the timed steps 485-511 against 646-681), FP8 experts 432 ms from 8 against
  // 380-423. clshard tune chose 8 for bf16 experts in 5 dry runs (by 2.5-5%) and in a sixth with
  // this row's FP8 field (100.7 ms against 102.9 from 16 and 105.9 from 32, by 5.2%), where it
  // kept 32 for FP8 experts (124.5 ms against 128.2 from 16 and 129.2 from 8).
  t.moe_bf16_packed_rows = 8;
  t.moe_fp8_packed_rows = 32;
  // The packed GEMM's portable micro-kernel (f32 compute over bf16 weights, and bf16 compute
  // here) reads its weights widened to f32 at the pack: each step's shift and mask had shared the
  // two ports of the FMAs. On the Xeon without AMX (2026-12-03, bench_llama --prefill-only, pairs
  // in turn through tuning.json) llama3-1b bf16's 512-token prefill at f32 compute 1.21x, 1.12x and
  // 1.30x (3.59-4.48 s against 4.32-5.03), at bf16 compute 1.12x and 1.17x.
  t.gemm_bf16_packed_wf32 = 1;
  return t;
}

const std::vector<TuningRow>& table() {
  // The first row that matches wins: specific names before their vendor's default.
  static const std::vector<TuningRow> rows = {
      {DeviceKind::Gpu, "NVIDIA", "H100", nvidia_hopper()},
      {DeviceKind::Gpu, "NVIDIA", "H200", nvidia_hopper()},
      {DeviceKind::Gpu, "NVIDIA", "", nvidia()},
      {DeviceKind::Cpu, "AuthenticAMD", "skylake-avx512-AMD EPYC", amd_epyc_avx512()},
      {DeviceKind::Cpu, "GenuineIntel", "Intel(R) Xeon(R)", intel_xeon()},
      {DeviceKind::Cpu, "", "", cpu_forced()},
  };
  return rows;
}

bool contains(const std::string& s, const char* part) {
  return *part == '\0' || s.find(part) != std::string::npos;
}

using U32Field = uint32_t KernelTuning::*;
const std::vector<std::pair<std::string, U32Field>>& u32_fields() {
  static const std::vector<std::pair<std::string, U32Field>> f = {
      {"norm_wg", &KernelTuning::norm_wg},
      {"rope_wg", &KernelTuning::rope_wg},
      {"linear_wg", &KernelTuning::linear_wg},
      {"linear_rows", &KernelTuning::linear_rows},
      {"linear_vector", &KernelTuning::linear_vector},
      {"attn_wg", &KernelTuning::attn_wg},
      {"attn_tile", &KernelTuning::attn_tile},
      {"attn_heads", &KernelTuning::attn_heads},
      {"attn_split", &KernelTuning::attn_split},
      {"prefill_wg", &KernelTuning::prefill_wg},
      {"prefill_q", &KernelTuning::prefill_q},
      {"prefill_tile", &KernelTuning::prefill_tile},
      {"prefill_heads", &KernelTuning::prefill_heads},
      {"mla_wg", &KernelTuning::mla_wg},
      {"mla_tile", &KernelTuning::mla_tile},
      {"mla_heads", &KernelTuning::mla_heads},
      {"route_wg", &KernelTuning::route_wg},
      {"row_wg", &KernelTuning::row_wg},
      {"mla_row_tokens", &KernelTuning::mla_row_tokens},
      {"gemv_stream_k", &KernelTuning::gemv_stream_k},
      {"fp8_stream_k", &KernelTuning::fp8_stream_k},
      {"weight_prefetch", &KernelTuning::weight_prefetch},
      {"stream_prefetch", &KernelTuning::stream_prefetch},
      {"stream_prefetch_l1", &KernelTuning::stream_prefetch_l1},
      {"gemv_stream_prefetch", &KernelTuning::gemv_stream_prefetch},
      {"gemv_row_pairs", &KernelTuning::gemv_row_pairs},
      {"linear_batch_tm", &KernelTuning::linear_batch_tm},
      {"gemm_bf16_tm", &KernelTuning::gemm_bf16_tm},
      {"gemm_bf16_tn", &KernelTuning::gemm_bf16_tn},
      {"gemm_bf16_batch_tm", &KernelTuning::gemm_bf16_batch_tm},
      {"gemm_bf16_batch_tn", &KernelTuning::gemm_bf16_batch_tn},
      {"gemm_bf16_rows", &KernelTuning::gemm_bf16_rows},
      {"gemm_bf16_dot", &KernelTuning::gemm_bf16_dot},
      {"gemm_bf16_gemv", &KernelTuning::gemm_bf16_gemv},
      {"gemm_bf16_amx", &KernelTuning::gemm_bf16_amx},
      {"gemm_bf16_amx_rows", &KernelTuning::gemm_bf16_amx_rows},
      {"gemm_bf16_amx_stream_rows", &KernelTuning::gemm_bf16_amx_stream_rows},
      {"gemm_bf16_amx_stream_na", &KernelTuning::gemm_bf16_amx_stream_na},
      {"gemm_f32_amx_rows", &KernelTuning::gemm_f32_amx_rows},
      {"gemm_bf16_packed_rows", &KernelTuning::gemm_bf16_packed_rows},
      {"moe_bf16_packed_rows", &KernelTuning::moe_bf16_packed_rows},
      {"moe_fp8_packed_rows", &KernelTuning::moe_fp8_packed_rows},
      {"gemm_bf16_packed_tm", &KernelTuning::gemm_bf16_packed_tm},
      {"gemm_bf16_packed_nv", &KernelTuning::gemm_bf16_packed_nv},
      {"gemm_bf16_packed_kp", &KernelTuning::gemm_bf16_packed_kp},
      {"gemm_bf16_packed_wf32", &KernelTuning::gemm_bf16_packed_wf32},
      {"blas_gemm_rows", &KernelTuning::blas_gemm_rows}};
  return f;
}

nlohmann::json read_file(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) return nlohmann::json::object();
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error(file.string() + ": not JSON (" + e.what() + ")");
  }
}

// The "entries" array of a tuning file (empty when the file has none).
nlohmann::json& entries_of(nlohmann::json& doc, const std::filesystem::path& file) {
  if (!doc.is_object()) throw std::runtime_error(file.string() + ": expected a JSON object");
  if (!doc.contains("entries")) doc["entries"] = nlohmann::json::array();
  if (!doc["entries"].is_array())
    throw std::runtime_error(file.string() + ": entries: expected an array");
  return doc["entries"];
}

// Applies the file's entry for `info`, if any, over `t`.
// The fields whose 0 is a value, and what it means: a row threshold that is never reached, or a
// switch that is off.
const std::vector<std::pair<std::string, std::string>>& zero_fields() {
  static const std::vector<std::pair<std::string, std::string>> fields = {
      {"blas_gemm_rows", "never"},
      {"gemm_bf16_packed_rows", "never"},
      {"moe_bf16_packed_rows", "never"},
      {"moe_fp8_packed_rows", "never"},
      {"gemm_bf16_amx_stream_rows", "never"},
      {"gemm_f32_amx_rows", "never"},
      {"weight_prefetch", "off"},
      {"stream_prefetch", "off"},
      {"stream_prefetch_l1", "off"},
      {"gemv_stream_prefetch", "off"},
      {"gemv_row_pairs", "off"},
      {"gemm_bf16_dot", "off"},
      {"gemm_bf16_gemv", "off"},
      {"gemm_bf16_amx", "off"},
      {"gemm_bf16_packed_wf32", "off"}};
  return fields;
}

// "a, b: 0 for never; c, d: 0 for off", in the table's order.
std::string zero_fields_text() {
  std::string text, names;
  const auto& fields = zero_fields();
  for (size_t i = 0; i < fields.size(); ++i) {
    names += (names.empty() ? "" : ", ") + fields[i].first;
    if (i + 1 == fields.size() || fields[i + 1].second != fields[i].second) {
      text += (text.empty() ? "" : "; ") + names + ": 0 for " + fields[i].second;
      names.clear();
    }
  }
  return text;
}

void apply_file(const DeviceInfo& info, KernelTuning& t) {
  const std::filesystem::path file = kernel_tuning_file();
  nlohmann::json doc = read_file(file);
  const nlohmann::json& entries = entries_of(doc, file);
  for (size_t i = 0; i < entries.size(); ++i) {
    const nlohmann::json& e = entries[i];
    const std::string where = file.string() + ": entries[" + std::to_string(i) + "]";
    if (!e.is_object() || !e.contains("vendor") || !e.contains("name") ||
        !e["vendor"].is_string() || !e["name"].is_string() || !e.contains("tuning") ||
        !e["tuning"].is_object())
      throw std::runtime_error(where + ": expected {\"vendor\": string, \"name\": string, "
                               "\"tuning\": {field: positive integer}}");
    if (e["vendor"].get<std::string>() != info.vendor || e["name"].get<std::string>() != info.name)
      continue;
    for (const auto& [field, value] : e["tuning"].items()) {
      if (!value.is_number_unsigned() ||
          (value.get<uint64_t>() == 0 && !kernel_tuning_zero_allowed(field)) ||
          !set_kernel_tuning_field(t, field, value.get<uint64_t>())) {
        std::string names;
        for (const std::string& n : kernel_tuning_fields()) names += (names.empty() ? "" : ", ") + n;
        throw std::runtime_error(where + ".tuning." + field + ": expected one of the fields (" +
                                 names + ") with a positive integer (" + zero_fields_text() +
                                 "), got " + value.dump());
      }
    }
  }
}

}  // namespace

KernelTuning builtin_kernel_tuning(const DeviceInfo& info) {
  for (const TuningRow& r : table())
    if (r.kind == info.kind && contains(info.vendor, r.vendor) && contains(info.name, r.name))
      return r.tuning;
  return KernelTuning{};
}

KernelTuning lookup_kernel_tuning(const DeviceInfo& info) {
  KernelTuning t = builtin_kernel_tuning(info);
  apply_file(info, t);
  return t;
}

bool kernel_tuning_zero_allowed(const std::string& field) {
  for (const auto& [name, zero_means] : zero_fields())
    if (name == field) return true;
  return false;
}

const std::vector<std::string>& kernel_tuning_fields() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& f : u32_fields()) n.push_back(f.first);
    n.push_back("split_scratch_bytes");
    return n;
  }();
  return names;
}

uint64_t kernel_tuning_field(const KernelTuning& t, const std::string& field) {
  for (const auto& [name, member] : u32_fields())
    if (name == field) return t.*member;
  if (field == "split_scratch_bytes") return t.split_scratch_bytes;
  throw std::invalid_argument("no kernel tuning field '" + field + "'");
}

bool set_kernel_tuning_field(KernelTuning& t, const std::string& field, uint64_t value) {
  for (const auto& [name, member] : u32_fields())
    if (name == field) {
      if (value > UINT32_MAX) return false;
      t.*member = uint32_t(value);
      return true;
    }
  if (field == "split_scratch_bytes") {
    t.split_scratch_bytes = value;
    return true;
  }
  return false;
}

std::filesystem::path kernel_tuning_file() { return kernel_cache_dir() / "tuning.json"; }

void save_kernel_tuning(const DeviceInfo& info, const KernelTuning& t) {
  const std::filesystem::path file = kernel_tuning_file();
  nlohmann::json doc = read_file(file);
  nlohmann::json& entries = entries_of(doc, file);
  nlohmann::json fields = nlohmann::json::object();
  for (const std::string& f : kernel_tuning_fields()) fields[f] = kernel_tuning_field(t, f);
  nlohmann::json entry = {{"vendor", info.vendor}, {"name", info.name}, {"tuning", fields}};
  bool replaced = false;
  for (auto& e : entries)
    if (e.is_object() && e.value("vendor", "") == info.vendor && e.value("name", "") == info.name) {
      e = entry;
      replaced = true;
    }
  if (!replaced) entries.push_back(entry);
  std::filesystem::create_directories(file.parent_path());
  const std::filesystem::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << doc.dump(2) << "\n";
    if (!out) throw std::runtime_error("writing " + tmp.string() + " failed");
  }
  std::filesystem::rename(tmp, file);
}

}  // namespace clshard
