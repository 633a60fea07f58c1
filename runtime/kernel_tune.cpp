#include "runtime/kernel_tune.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <random>
#include <stdexcept>

#include "runtime/dtype.h"
#include "runtime/kernel_tuning.h"
#include "runtime/ops.h"
#include "runtime/ops_mla.h"
#include "runtime/ops_moe.h"

namespace clshard {

namespace {

// B decode rows, one new token each at position ctx - 1, every row's pages its own and scattered.
struct DecodeRows {
  cl::Mem row, pos, lookup;
  ops::StepTokens st;
};

}  // namespace

struct TuneWorkload::Buffers {
  std::deque<cl::Mem> mems;
  std::deque<Weight> weights;
  std::deque<DecodeRows> steps;
  std::deque<ops::GroupedExperts> experts;
  std::deque<ops::GroupedPlan> plans;
};

namespace {

cl::Mem random_buffer(Device& dev, size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  cl::Mem m = dev.alloc(n * 4);
  dev.write(m, v.data(), n * 4);
  return m;
}

cl::Mem upload_u32(Device& dev, const std::vector<uint32_t>& v) {
  cl::Mem m = dev.alloc(v.size() * 4);
  dev.write(m, v.data(), v.size() * 4);
  return m;
}

Weight bf16_weight(Device& dev, std::vector<int64_t> shape, uint32_t seed) {
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng));
  Weight w;
  w.dtype = DType::BF16;
  w.shape = shape;
  w.name = "tune";
  w.mem = dev.alloc(n * 2);
  dev.write(w.mem, v.data(), n * 2);
  return w;
}

// An FP8 (e4m3fn) weight N x K of random codes (no NaN codes) and its f32 block scales.
std::pair<Weight, Weight> fp8_weight(Device& dev, uint32_t N, uint32_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> code(0, 253);
  std::vector<uint8_t> v(size_t(N) * K);
  for (auto& x : v) {  // 0..254 without 0x7F: the two NaN codes left out
    const int c = code(rng);
    x = uint8_t(c < 0x7F ? c : c + 1);
  }
  const uint32_t NB = (N + 127) / 128, KB = (K + 127) / 128;
  std::vector<float> sc(size_t(NB) * KB, 1.0f / 448.0f);
  Weight w, s;
  w.dtype = DType::F8_E4M3;
  w.shape = {N, K};
  w.name = "tune";
  w.mem = dev.alloc(v.size());
  dev.write(w.mem, v.data(), v.size());
  s.dtype = DType::F32;
  s.shape = {NB, KB};
  s.name = "tune.scale_inv";
  s.mem = dev.alloc(sc.size() * 4);
  dev.write(s.mem, sc.data(), sc.size() * 4);
  return {w, s};
}

// E experts of [gate F x H, up F x H, down H x F] in one buffer (ops::GroupedExperts), BF16 or
// F8_E4M3 (then each matrix followed by its f32 block scales, 1/448), of a checkpoint's
// magnitudes: bf16 from N(0, 0.02), e4m3 codes of random sign and mantissa with exponents 4-10;
// no bf16 denormals (whose products take the CPU's microcode assists; perf/bench_moe.cpp), no
// e4m3 NaNs or subnormals. H and F multiples of 128.
ops::GroupedExperts grouped_experts(Device& dev, DType dt, uint32_t E, uint32_t H, uint32_t F,
                                    uint32_t seed) {
  const bool fp8 = dt == DType::F8_E4M3;
  const size_t es = fp8 ? 1 : 2, per_matrix = size_t(F) * H;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<uint8_t> bytes;
  std::vector<uint64_t> table(size_t(E) * 6, 0);  // element offsets of gate, up, down, scales
  const std::vector<float> scales(per_matrix / (128 * 128), 1.0f / 448);
  for (uint32_t e = 0; e < E; ++e)
    for (uint32_t m = 0; m < 3; ++m) {
      table[size_t(e) * 6 + m] = bytes.size() / es;
      const size_t at = bytes.size();
      bytes.resize(at + per_matrix * es);
      for (size_t i = 0; i < per_matrix; ++i) {
        if (fp8) {
          const uint32_t r = rng();
          bytes[at + i] = uint8_t((r & 0x80) | ((4 + (r >> 8) % 7) << 3) | ((r >> 16) & 7));
        } else {
          const uint16_t b = f32_to_bf16(normal(rng));
          std::memcpy(&bytes[at + 2 * i], &b, 2);
        }
      }
      if (!fp8) continue;
      table[size_t(e) * 6 + 3 + m] = bytes.size() / 4;  // per_matrix is a multiple of 4
      const auto* p = reinterpret_cast<const uint8_t*>(scales.data());
      bytes.insert(bytes.end(), p, p + scales.size() * 4);
    }
  ops::GroupedExperts g;
  g.mem = dev.alloc(bytes.size());
  dev.write(g.mem, bytes.data(), bytes.size());
  g.table = dev.alloc(table.size() * 8);
  dev.write(g.table, table.data(), table.size() * 8);
  g.dtype = dt;
  g.n_experts = E;
  g.hidden = H;
  g.inter = F;
  g.fp8_nan_free = fp8;  // exponents 4-10: no NaN code
  g.pairs_aligned = !fp8 && ops::grouped_rows_aligned(table, H, F);
  return g;
}

DecodeRows decode_rows(Device& dev, uint32_t B, uint32_t ctx, uint32_t page_size) {
  const uint32_t ppr = (ctx + page_size - 1) / page_size;
  std::vector<uint32_t> row(B), pos(B, ctx - 1), lut(size_t(B) * ppr);
  for (uint32_t b = 0; b < B; ++b) row[b] = b;
  // Page j of row b is page j * B + b: neighbouring positions of a row are pages apart.
  for (uint32_t b = 0; b < B; ++b)
    for (uint32_t j = 0; j < ppr; ++j) lut[size_t(b) * ppr + j] = j * B + b;
  DecodeRows d;
  d.row = upload_u32(dev, row);
  d.pos = upload_u32(dev, pos);
  d.lookup = upload_u32(dev, lut);
  d.st = ops::StepTokens{d.row, d.pos, d.lookup, B, ppr, page_size};
  return d;
}

// One row of `prefix` cached tokens and T new ones (positions prefix .. prefix + T - 1): a prefill
// step, its pages scattered (page j is page 2j + 1 of the pool).
DecodeRows prefill_row(Device& dev, uint32_t T, uint32_t prefix, uint32_t page_size) {
  const uint32_t ppr = (prefix + T + page_size - 1) / page_size;
  std::vector<uint32_t> row(T, 0), pos(T), lut(ppr);
  for (uint32_t t = 0; t < T; ++t) pos[t] = prefix + t;
  for (uint32_t j = 0; j < ppr; ++j) lut[j] = 2 * j + 1;
  DecodeRows d;
  d.row = upload_u32(dev, row);
  d.pos = upload_u32(dev, pos);
  d.lookup = upload_u32(dev, lut);
  d.st = ops::StepTokens{d.row, d.pos, d.lookup, T, ppr, page_size};
  d.st.max_query_len = T;
  return d;
}

std::string field_list(KernelShape shape) {
  std::string s;
  for (const TuneField& f : tunable_fields())
    if (f.shape == shape) s += (s.empty() ? "" : ", ") + f.field;
  return s;
}

}  // namespace

TuneWorkload::~TuneWorkload() = default;

TuneWorkload::TuneWorkload(Device& dev, bool quick) : buffers_(std::make_unique<Buffers>()) {
  Buffers& b = *buffers_;
  auto keep = [&b](cl::Mem m) { return b.mems.emplace_back(std::move(m)); };

  // RMSNorm: R rows of H (read x, write y, read the bf16 weight once).
  for (auto [R, H] : {std::pair<uint32_t, uint32_t>{1, 8192}, {64, 4096}, {512, 4096}}) {
    if (quick && R > 64) continue;
    cl::Mem x = keep(random_buffer(dev, size_t(R) * H, 1)), y = keep(dev.alloc(size_t(R) * H * 4));
    const Weight& w = b.weights.emplace_back(bf16_weight(dev, {H}, 2));
    ops_.push_back({"rmsnorm", "R=" + std::to_string(R) + " H=" + std::to_string(H),
                    double(R) * H * 8 + H * 2.0,
                    [&dev, x, y, &w, R, H] {
                      ops::rmsnorm(dev, x, 0, H, nullptr, w, y, 0, H, R, H, 1e-5f);
                    },
                    {"norm_wg"},
                    {}});
  }

  // GEMVs, bf16 weight N x K (the weights dominate the bytes). The CPU shape streams the weight
  // rows of a GEMV while K <= gemv_stream_k: K on both sides of its candidates.
  for (uint32_t K : {2048u, 4096u, 8192u}) {
    const uint32_t N = K == 2048 ? (quick ? 4096 : 8192) : (quick ? 1024 : 2048);
    const Weight& w = b.weights.emplace_back(bf16_weight(dev, {N, K}, 3 + K));
    cl::Mem x = keep(random_buffer(dev, K, 4)), y = keep(dev.alloc(N * 4));
    ops_.push_back(
        {"linear M=1 bf16",
         "N=" + std::to_string(N) + " K=" + std::to_string(K),
         double(N) * K * 2,
         [&dev, x, y, &w, N, K] { ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, 1); },
         {"linear_wg", "linear_rows", "linear_vector"},
         {"gemv_stream_k", "gemv_stream_prefetch", "stream_prefetch_l1", "gemv_row_pairs"}});
  }

  // Batched decode, 8 rows of a bf16 N x K weight: the CPU shape's tiles of 4 or 8 rows, with and
  // without the next-tile weight prefetch (linear_tile.cl).
  {
    const uint32_t M = 8, N = quick ? 4096 : 16384, K = 2048;
    const Weight& w = b.weights.emplace_back(bf16_weight(dev, {N, K}, 13));
    cl::Mem x = keep(random_buffer(dev, size_t(M) * K, 14)), y = keep(dev.alloc(size_t(M) * N * 4));
    ops_.push_back(
        {"linear M=8 bf16",
         "N=" + std::to_string(N) + " K=" + std::to_string(K),
         double(N) * K * 2,
         [&dev, x, y, &w, M, N, K] { ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, M); },
         {"linear_wg", "linear_rows", "linear_vector"},
         {"weight_prefetch", "linear_batch_tm"}});
  }

  // The FP8 GEMV (DeepSeek-V3's block-scaled e4m3 weights), one byte per weight: 64 MiB, past a
  // last-level cache, so that it streams from memory as a decode step's weights do (with 8 MiB,
  // which stayed in the 32 MiB L3 of the EPYC here, stream_prefetch's candidates timed 0.26-0.37
  // ms in an order unrelated to the decode's). K on both sides of fp8_stream_k's 4096 (7168:
  // DeepSeek-V3's hidden size).
  for (uint32_t K : {2048u, 7168u}) {
    const uint32_t N = K == 2048 ? (quick ? 4096 : 32768) : (quick ? 1024 : 8192);
    auto [w8, s8] = fp8_weight(dev, N, K, 9 + K);
    const Weight& w = b.weights.emplace_back(std::move(w8));
    const Weight& s = b.weights.emplace_back(std::move(s8));
    cl::Mem x = keep(random_buffer(dev, K, 10)), y = keep(dev.alloc(N * 4));
    ops_.push_back({"linear M=1 fp8",
                    "N=" + std::to_string(N) + " K=" + std::to_string(K),
                    double(N) * K,
                    [&dev, x, y, &w, &s, N, K] { ops::linear_fp8(dev, x, 0, K, w, s, y, 0, N, 1); },
                    {"linear_wg", "linear_rows"},
                    {"fp8_stream_k", "stream_prefetch", "stream_prefetch_l1"}});
  }

  // Prefill GEMM in the bf16 compute dtype (model.compute_dtype: bf16): M rows, bf16 N x K (M at
  // least every gemm_bf16_rows candidate, so the prefill tile runs). On the CPU shape twice: with
  // the packed GEMM off, the tile it leaves to linear_bf16 (bf16 weights below
  // gemm_bf16_packed_rows rows, FP8 weights), and at twice M, where the packed GEMM's fields
  // decide whether it runs and its tile.
  {
    const uint32_t M = 128, N = quick ? 1024 : 2048, K = quick ? 1024 : 2048;
    const Weight& w = b.weights.emplace_back(bf16_weight(dev, {N, K}, 11));
    cl::Mem x = keep(random_buffer(dev, size_t(2 * M) * K, 12)),
            y = keep(dev.alloc(size_t(2 * M) * N * 4));
    ops_.push_back(
        {"linear bf16 compute",
         "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K),
         0.0,
         [&dev, x, y, &w, M, N, K] {
           const KernelTuning own = dev.tuning();
           KernelTuning tiled = own;
           tiled.gemm_bf16_packed_rows = 0;
           dev.set_tuning(tiled);
           ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, M, 1.0f, false, ComputeDType::BF16);
           dev.set_tuning(own);
         },
         {"linear_wg", "linear_rows", "linear_vector"},
         {"gemm_bf16_dot", "gemm_bf16_tm", "gemm_bf16_tn", "gemm_bf16_rows"}});
    ops_.push_back(
        {"linear bf16 compute packed",
         "M=" + std::to_string(2 * M) + " N=" + std::to_string(N) + " K=" + std::to_string(K),
         0.0,
         [&dev, x, y, &w, M, N, K] {
           ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, 2 * M, 1.0f, false, ComputeDType::BF16);
         },
         {},
         {"gemm_bf16_dot", "gemm_bf16_packed_rows", "gemm_bf16_packed_tm", "gemm_bf16_packed_nv",
          "gemm_bf16_packed_kp", "gemm_bf16_packed_wf32"}});
  }
  // The same at a decode batch of 8 rows (the batch tile), over 3 copies of the weight (96 MB,
  // past a 32 MB last-level cache): decode streams its weights from memory, and a tile that
  // wins on cached weights can lose there.
  {
    const uint32_t M = 8, N = quick ? 2048 : 8192, K = 2048, copies = quick ? 1 : 3;
    std::vector<const Weight*> ws;
    for (uint32_t c = 0; c < copies; ++c)
      ws.push_back(&b.weights.emplace_back(bf16_weight(dev, {N, K}, 19 + c)));
    cl::Mem x = keep(random_buffer(dev, size_t(M) * K, 23)), y = keep(dev.alloc(size_t(M) * N * 4));
    // One row (batch-1 decode): where the host has vdpbf16ps, gemm_bf16_dot decides whether the
    // GEMV sums in bf16 with it (ops::bf16_gemv) or runs the f32 GEMV.
    ops_.push_back(
        {"linear M=1 bf16 compute",
         "N=" + std::to_string(N) + " K=" + std::to_string(K) + " x" + std::to_string(copies),
         double(N) * K * 2 * copies,
         [&dev, x, y, ws, N, K] {
           for (const Weight* w : ws)
             ops::linear(dev, x, 0, K, *w, nullptr, y, 0, N, 1, 1.0f, false, ComputeDType::BF16);
         },
         {},
         {"gemm_bf16_dot"}});
    ops_.push_back({"linear bf16 compute batch",
                    "M=" + std::to_string(M) + " N=" + std::to_string(N) +
                        " K=" + std::to_string(K) + " x" + std::to_string(copies),
                    double(N) * K * 2 * copies,
                    [&dev, x, y, ws, M, N, K] {
                      // The tiles: AMX (where the host has it) would take these rows.
                      const KernelTuning own = dev.tuning();
                      KernelTuning tiled = own;
                      tiled.gemm_bf16_amx = 0;
                      dev.set_tuning(tiled);
                      for (const Weight* w : ws)
                        ops::linear(dev, x, 0, K, *w, nullptr, y, 0, N, M, 1.0f, false,
                                    ComputeDType::BF16);
                      dev.set_tuning(own);
                    },
                    {},
                    {"gemm_bf16_dot", "gemm_bf16_batch_tm", "gemm_bf16_batch_tn"}});
    // As the device runs them: with AMX the streaming GEMM (bf16_amx_stream.cl), and its gate/up
    // GLU launch too, whose units pair gate and up rows.
    ops_.push_back({"linear bf16 compute batch AMX",
                    "M=" + std::to_string(M) + " N=" + std::to_string(N) +
                        " K=" + std::to_string(K) + " x" + std::to_string(copies) + ", GLU",
                    double(N) * K * 2 * (copies + copies / 2 * 2),
                    [&dev, x, y, ws, M, N, K] {
                      for (const Weight* w : ws)
                        ops::linear(dev, x, 0, K, *w, nullptr, y, 0, N, M, 1.0f, false,
                                    ComputeDType::BF16);
                      for (size_t c = 0; c + 1 < ws.size(); c += 2)
                        ops::linear_swiglu(dev, x, 0, K, nullptr, 0.0f, *ws[c], *ws[c + 1], y, 0, N,
                                           M, ComputeDType::BF16);
                    },
                    {},
                    {"gemm_bf16_amx_stream_na"}});
  }

  // Prefills' grouped experts in the bf16 compute dtype: T tokens routed to top 8 of E bf16 or FP8
  // experts (H 2048, F 512: dsv3-mini's), 16 and 64 rows per expert on average (what 128- and
  // 512-token prefills give dsv3-mini's 64 experts at top 8), each token's experts a random 8.
  // Experts of moe_bf16_packed_rows (FP8: moe_fp8_packed_rows) rows or more take the packed GEMM,
  // the others the tiles. Not among gemm_bf16_dot's ops: from a start that leaves the experts to
  // the tiles, their time would decide it (on the Xeon without AMX it kept vdpbf16ps so, 121
  // against 187 ms, where the GEMMs and a packed threshold chosen after it run faster without).
  for (const DType dt : {DType::BF16, DType::F8_E4M3}) {
    const bool fp8 = dt == DType::F8_E4M3;
    const uint32_t E = quick ? 16 : 32, H = quick ? 1024 : 2048, F = quick ? 256 : 512, top_k = 8;
    const ops::GroupedExperts& g =
        b.experts.emplace_back(grouped_experts(dev, dt, E, H, F, fp8 ? 34 : 31));
    for (uint32_t rows : {16u, 64u}) {
      const uint32_t T = E * rows / top_k;
      std::mt19937 rng(32 + rows);
      std::vector<uint32_t> ids(size_t(T) * top_k), perm(E);
      for (uint32_t t = 0; t < T; ++t) {
        for (uint32_t e = 0; e < E; ++e) perm[e] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        std::copy(perm.begin(), perm.begin() + top_k, ids.begin() + size_t(t) * top_k);
      }
      cl::Mem idm = keep(upload_u32(dev, ids)), x = keep(random_buffer(dev, size_t(T) * H, 33)),
              act = keep(dev.alloc(size_t(T) * top_k * F * 4)),
              y = keep(dev.alloc(size_t(T) * top_k * H * 4));
      const ops::GroupedPlan& plan = b.plans.emplace_back(ops::plan_experts(dev, idm, T, top_k, E));
      ops_.push_back({fp8 ? "moe experts fp8 bf16 compute" : "moe experts bf16 compute",
                      "T=" + std::to_string(T) + " E=" + std::to_string(E) +
                          " top8 H=" + std::to_string(H) + " F=" + std::to_string(F),
                      0.0,
                      [&dev, &g, &plan, x, act, y, T, H, F] {
                        ops::moe_grouped_swiglu(dev, x, H, &plan.src_token.mem(), g, plan, act, F,
                                                ComputeDType::BF16, T);
                        ops::moe_grouped_linear(dev, act, F, nullptr, g, 2, 1, plan, y, H,
                                                ComputeDType::BF16);
                      },
                      {},
                      {fp8 ? "moe_fp8_packed_rows" : "moe_bf16_packed_rows"}});
    }
  }

  // Prefill GEMMs in f32 (bf16 weight N x K) at M = 128 and 512 rows: in the GPU shape the
  // candidates of blas_gemm_rows hand none, the larger or both to CLBlast (ops_blas.h).
  for (uint32_t M : {128u, 512u}) {
    const uint32_t N = quick ? 512 : 2048, K = quick ? 512 : 2048;
    const Weight& w = b.weights.emplace_back(bf16_weight(dev, {N, K}, 15 + M));
    cl::Mem x = keep(random_buffer(dev, size_t(M) * K, 16)), y = keep(dev.alloc(size_t(M) * N * 4));
    ops_.push_back({"linear prefill bf16",
                    "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" +
                        std::to_string(K),
                    0.0,
                    [&dev, x, y, &w, M, N, K] { ops::linear(dev, x, 0, K, w, nullptr, y, 0, N, M); },
                    {"blas_gemm_rows"},
                    {}});
  }

  // Llama-8B-like attention layer: 32 query heads, 8 KV heads, head_dim 128, 128-token pages.
  const uint32_t nh = 32, nkv = 8, hd = 128, page = 128;
  // RoPE + KV store for T tokens (read and write q, k; read v; write k, v to the cache).
  for (uint32_t T : {1u, 64u}) {
    const uint32_t ld = (nh + 2 * nkv) * hd, ctx = 256;
    const DecodeRows& d = b.steps.emplace_back(decode_rows(dev, T, ctx, page));
    const size_t pages = size_t(T) * d.st.pages_per_row + 1;
    cl::Mem qkv = keep(random_buffer(dev, size_t(T) * ld, 5)),
            cache = keep(dev.alloc(pages * 2 * page * nkv * hd * 4));
    std::vector<float> inv(hd / 2);
    for (uint32_t i = 0; i < hd / 2; ++i) inv[i] = std::pow(500000.0f, -float(2 * i) / hd);
    cl::Mem invm = keep(dev.alloc(inv.size() * 4));
    dev.write(invm, inv.data(), inv.size() * 4);
    ops_.push_back({"rope_store_kv", "T=" + std::to_string(T),
                    double(T) * ((nh + nkv) * hd * 8.0 + nkv * hd * 4.0 + 2 * nkv * hd * 4.0),
                    [&dev, qkv, cache, invm, &d, ld] {
                      ops::rope_store_kv(dev, qkv, ld, nh, nkv, hd, invm, invm, 0xffffffffu, d.st,
                                         cache);
                    },
                    {"rope_wg"},
                    {}});
  }

  // Decode attention: B rows of one new token at context ctx (reads ctx K and V rows of the KV
  // head per row).
  for (auto [B, ctx] : {std::pair<uint32_t, uint32_t>{1, 4096}, {8, 4096}, {32, 1024}}) {
    if (quick && B * ctx > 8192) continue;
    const DecodeRows& d = b.steps.emplace_back(decode_rows(dev, B, ctx, page));
    const size_t pages = size_t(B) * d.st.pages_per_row + 1;
    cl::Mem q = keep(random_buffer(dev, size_t(B) * nh * hd, 6)),
            cache = keep(random_buffer(dev, pages * 2 * page * nkv * hd, 7, 0.5f)),
            out = keep(dev.alloc(size_t(B) * nh * hd * 4));
    ops_.push_back({"paged_attention decode",
                    "B=" + std::to_string(B) + " ctx=" + std::to_string(ctx),
                    double(B) * ctx * 2 * nkv * hd * 4,
                    [&dev, q, cache, out, &d] {
                      ops::paged_attention(dev, q, nh * hd, cache, d.st, nh, nkv, hd, 0.088f, out,
                                           nh * hd);
                    },
                    {"attn_wg", "attn_tile", "attn_heads", "attn_split"},
                    {}});
  }

  // Prefill attention: T new tokens of one row after a cached prefix (reads the row's K and V
  // once per query tile in the GPU shape; no bytes figure, it is compute-bound).
  for (auto [T, prefix] : {std::pair<uint32_t, uint32_t>{64, 0}, {512, 512}}) {
    if (quick && T > 64) continue;
    const DecodeRows& d = b.steps.emplace_back(prefill_row(dev, T, prefix, page));
    const size_t pages = 2 * size_t(d.st.pages_per_row) + 1;
    cl::Mem q = keep(random_buffer(dev, size_t(T) * nh * hd, 13)),
            cache = keep(random_buffer(dev, pages * 2 * page * nkv * hd, 14, 0.5f)),
            out = keep(dev.alloc(size_t(T) * nh * hd * 4));
    ops_.push_back({"paged_attention prefill",
                    "T=" + std::to_string(T) + " prefix=" + std::to_string(prefix),
                    0.0,
                    [&dev, q, cache, out, &d] {
                      ops::paged_attention(dev, q, nh * hd, cache, d.st, nh, nkv, hd, 0.088f, out,
                                           nh * hd);
                    },
                    {"prefill_wg", "prefill_q", "prefill_tile", "prefill_heads"},
                    {}});
  }

  // MLA absorbed decode attention over 576-wide latent rows (DeepSeek-V3: 128 heads; 16 when
  // quick). Every head reads the same rows: bytes are the rows once per request.
  {
    ops::MlaShape s;
    s.n_heads = quick ? 16 : 128;
    s.kv_lora = 512;
    s.rope = 64;
    s.nope = 128;
    s.v = 128;
    for (auto [B, ctx] : {std::pair<uint32_t, uint32_t>{1, 4096}, {16, 2048}}) {
      if (quick && B > 1) continue;
      const uint32_t mpage = 64;
      const DecodeRows& d = b.steps.emplace_back(decode_rows(dev, B, ctx, mpage));
      const size_t pages = size_t(B) * d.st.pages_per_row + 1;
      cl::Mem qf = keep(random_buffer(dev, size_t(B) * s.n_heads * s.row(), 8, 0.1f)),
              cache = keep(random_buffer(dev, pages * mpage * s.row(), 9, 0.5f)),
              out = keep(dev.alloc(size_t(B) * s.n_heads * s.kv_lora * 4));
      ops_.push_back({"mla_decode_attention",
                      "B=" + std::to_string(B) + " ctx=" + std::to_string(ctx) + " heads=" +
                          std::to_string(s.n_heads),
                      double(B) * ctx * s.row() * 4,
                      [&dev, qf, cache, out, &d, s] {
                        ops::mla_decode_attention(dev, qf, cache, d.st, s, 0.07f, out);
                      },
                      {"mla_wg", "mla_tile", "mla_heads", "attn_split"},
                      {}});
    }
  }

  // DeepSeek-V3's router: 256 experts in 8 groups, top 4 groups, top 8 experts, for T tokens.
  for (uint32_t T : {1u, 256u}) {
    ops::RouterConfig rc;
    rc.n_experts = 256;
    rc.top_k = 8;
    rc.n_group = 8;
    rc.topk_group = 4;
    rc.norm_topk_prob = true;
    rc.routed_scaling_factor = 2.5f;
    cl::Mem logits = keep(random_buffer(dev, size_t(T) * rc.n_experts, 10, 3.0f)),
            ids = keep(dev.alloc(size_t(T) * rc.top_k * 4)),
            wts = keep(dev.alloc(size_t(T) * rc.top_k * 4));
    ops_.push_back({"moe_route", "T=" + std::to_string(T) + " E=256 top8", 0.0,
                    [&dev, logits, ids, wts, rc, T] {
                      ops::moe_route(dev, logits, nullptr, T, rc, ids, wts);
                    },
                    {"route_wg"},
                    {}});
  }
}

const std::vector<TuneField>& tunable_fields() {
  // gemm_bf16_dot first among bf16 compute's fields, so that the tiles are timed with the
  // micro-kernel it chose: vdpbf16ps ran at half the FMA's rate on this workplace's Xeons and at
  // about twice it on the EPYC (kernel_tuning.cpp). gemm_bf16_gemv and gemm_bf16_amx are no timing
  // choices: 1 uses vdpbf16ps / AMX where the host has it. split_scratch_bytes is a memory cap.
  using S = KernelShape;
  static const std::vector<TuneField> f = {
      {"norm_wg", S::WorkGroups, {32, 64, 128, 256}},
      {"rope_wg", S::WorkGroups, {32, 64, 128, 256}},
      {"linear_wg", S::WorkGroups, {32, 64, 128, 256}},
      {"linear_rows", S::WorkGroups, {1, 2, 4, 8}},
      {"linear_vector", S::WorkGroups, {1, 2, 4, 8}},
      {"attn_wg", S::WorkGroups, {32, 64, 128, 256}},
      {"attn_tile", S::WorkGroups, {8, 16, 32}},
      {"attn_heads", S::WorkGroups, {1, 2, 4, 8}},
      {"attn_split", S::WorkGroups, {256, 512, 1024, 2048}},
      {"prefill_wg", S::WorkGroups, {32, 64, 128, 256}},
      {"prefill_q", S::WorkGroups, {4, 8, 16}},
      {"prefill_tile", S::WorkGroups, {8, 16, 32}},
      {"prefill_heads", S::WorkGroups, {1, 2, 4}},
      {"mla_wg", S::WorkGroups, {64, 128, 256}},
      {"mla_tile", S::WorkGroups, {4, 8, 16}},
      {"mla_heads", S::WorkGroups, {4, 8, 16, 32}},
      {"route_wg", S::WorkGroups, {32, 64, 128, 256}},
      {"blas_gemm_rows", S::WorkGroups, {0, 128, 512}},  // 0: never (the linear prefill ops' M)
      {"gemv_stream_k", S::Chunks, {1024, 2048, 4096, 8192, 16384}},
      {"fp8_stream_k", S::Chunks, {2048, 4096, 8192, 16384}},
      {"weight_prefetch", S::Chunks, {0, 1}},
      {"stream_prefetch", S::Chunks, {0, 2048, 4096, 8192, 16384}},
      {"stream_prefetch_l1", S::Chunks, {0, 512, 1024, 2048}},
      {"gemv_stream_prefetch", S::Chunks, {0, 4096, 8192, 16384}},
      {"gemv_row_pairs", S::Chunks, {0, 1}},
      {"linear_batch_tm", S::Chunks, {4, 8}},
      {"gemm_bf16_dot", S::Chunks, {0, 1}},
      {"gemm_bf16_tm", S::Chunks, {2, 4, 6}},
      {"gemm_bf16_tn", S::Chunks, {2, 4, 6}},
      {"gemm_bf16_batch_tm", S::Chunks, {2, 4, 8}},
      {"gemm_bf16_batch_tn", S::Chunks, {2, 4, 6}},
      {"gemm_bf16_rows", S::Chunks, {32, 64, 128}},
      {"gemm_bf16_packed_rows", S::Chunks, {0, 128, 256}},
      {"gemm_bf16_packed_tm", S::Chunks, {4, 6, 8}},
      {"gemm_bf16_packed_nv", S::Chunks, {2, 3, 4}},
      {"gemm_bf16_packed_kp", S::Chunks, {256, 512, 1024}},
      {"gemm_bf16_packed_wf32", S::Chunks, {0, 1}},
      {"moe_bf16_packed_rows", S::Chunks, {0, 8, 16, 32, 64, 128}},
      {"moe_fp8_packed_rows", S::Chunks, {0, 8, 16, 32, 64, 128}},
      {"gemm_bf16_amx_stream_na", S::Chunks, {1, 2, 4}},
  };
  return f;
}

TuneResult tune_kernel_fields(Device& dev, const TuneOptions& options, std::FILE* log) {
  const KernelShape shape = dev.kernel_shape();
  const std::string shape_name = kernel_shape_name(shape);
  // The fields to run, in tunable_fields() order; names checked first, before any timing.
  std::vector<const TuneField*> run;
  for (const std::string& name : options.fields) {
    const auto& all = kernel_tuning_fields();
    if (std::find(all.begin(), all.end(), name) == all.end())
      throw std::invalid_argument("tune: unknown field '" + name + "' (tunable in the " +
                                  shape_name + " kernel shape: " + field_list(shape) + ")");
    const auto it = std::find_if(tunable_fields().begin(), tunable_fields().end(),
                                 [&](const TuneField& f) { return f.field == name; });
    if (it == tunable_fields().end())
      throw std::invalid_argument("tune: field '" + name + "' has no candidate values to time "
                                  "(tunable in the " + shape_name + " kernel shape: " +
                                  field_list(shape) + ")");
    if (it->shape != shape)
      throw std::invalid_argument("tune: field '" + name + "' is read by the " +
                                  kernel_shape_name(it->shape) + " kernel shape only, and this "
                                  "run tunes the " + shape_name + " shape (--kernel-shape " +
                                  kernel_shape_name(it->shape) + ")");
  }
  for (const TuneField& f : tunable_fields())
    if (f.shape == shape &&
        (options.fields.empty() ||
         std::find(options.fields.begin(), options.fields.end(), f.field) != options.fields.end()))
      run.push_back(&f);

  const int reps = options.quick ? 3 : 7;
  if (log)
    std::fprintf(log, "tuning %zu field(s) of the %s kernel shape on %s (%s); %d timed runs per "
                 "op, medians summed over the ops that read the field\n",
                 run.size(), shape_name.c_str(), dev.info().name.c_str(),
                 dev.info().vendor.c_str(), reps);
  TuneWorkload workload(dev, options.quick);
  TuneResult result;
  for (const TuneField* f : run) {
    std::vector<const TuneOp*> users;
    for (const TuneOp& op : workload.ops()) {
      const auto& fields = shape == KernelShape::WorkGroups ? op.gpu_fields : op.cpu_fields;
      if (std::find(fields.begin(), fields.end(), f->field) != fields.end()) users.push_back(&op);
    }
    TunedField tf;
    tf.field = f->field;
    const KernelTuning start = dev.tuning();
    tf.start = kernel_tuning_field(start, f->field);
    if (log) {
      std::string names;
      for (const TuneOp* op : users) names += (names.empty() ? "" : ", ") + op->op + " " + op->size;
      std::fprintf(log, "  %s (%s):", f->field.c_str(), names.c_str());
      std::fflush(log);
    }
    // The start value first, then the candidates. Each is built and run once untimed (a device
    // that cannot build or launch one drops it), then the runs go round the candidates rep by
    // rep, so that a machine whose speed drifts over seconds weighs on all of them alike.
    std::vector<uint64_t> values = {tf.start};
    for (uint64_t v : f->candidates)
      if (v != tf.start) values.push_back(v);
    std::vector<KernelTuning> tunings;
    std::vector<bool> usable;
    for (uint64_t v : values) {
      KernelTuning t = start;
      set_kernel_tuning_field(t, f->field, v);
      bool ok = true;
      try {
        dev.set_tuning(t);
        for (const TuneOp* op : users) op->run();
        dev.finish();
      } catch (const std::exception&) {
        if (tunings.empty()) throw;  // the start value itself: the device's own tuning fails
        ok = false;  // the device cannot build or launch it (local memory, work-group size)
      }
      tunings.push_back(t);
      usable.push_back(ok);
    }
    // times[c][o]: op o's timed runs under candidate c.
    std::vector<std::vector<std::vector<double>>> times(
        values.size(), std::vector<std::vector<double>>(users.size()));
    for (int rep = 0; rep < reps; ++rep)
      for (size_t c = 0; c < values.size(); ++c) {
        if (!usable[c]) continue;
        dev.set_tuning(tunings[c]);
        for (size_t o = 0; o < users.size(); ++o) {
          const auto t0 = std::chrono::steady_clock::now();
          users[o]->run();
          dev.finish();
          times[c][o].push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
      }
    // Medians summed over the ops; a candidate replaces the start value only 2% faster.
    KernelTuning best = start;
    double start_s = 0, best_s = 0;
    for (size_t c = 0; c < values.size(); ++c) {
      double s = -1;
      if (usable[c]) {
        s = 0;
        for (std::vector<double>& t : times[c]) {
          std::sort(t.begin(), t.end());
          s += t[t.size() / 2];
        }
      }
      tf.seconds.emplace_back(values[c], s);
      if (log) {
        if (s < 0)
          std::fprintf(log, "%s %llu: failed", c ? " |" : "", (unsigned long long)values[c]);
        else
          std::fprintf(log, "%s %llu: %.3f ms", c ? " |" : "", (unsigned long long)values[c],
                       s * 1e3);
      }
      if (c == 0) {
        start_s = best_s = s;
      } else if (s >= 0 && s < start_s * 0.98 && s < best_s) {
        best = tunings[c];
        best_s = s;
      }
    }
    dev.set_tuning(best);
    tf.chosen = kernel_tuning_field(best, f->field);
    if (log) {
      std::fprintf(log, " -> %llu\n", (unsigned long long)tf.chosen);
      std::fflush(log);
    }
    result.fields.push_back(std::move(tf));
  }
  result.tuning = dev.tuning();
  return result;
}

}  // namespace clshard
