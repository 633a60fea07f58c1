#include "runtime/ops_mla.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/ops.h"
#include "runtime/ops_blas.h"
#include "runtime/ops_moe.h"

namespace clshard::ops {

namespace {

std::string dims_option(const MlaShape& s) {
  return "-DLKV=" + std::to_string(s.kv_lora) + " -DDR=" + std::to_string(s.rope) +
         " -DDN=" + std::to_string(s.nope) + " -DDV=" + std::to_string(s.v) +
         cache_type_option(s.cache_dtype);
}

// kv_b_proj as the MLA kernels read it: f32, bf16, or e4m3 with block scales.
std::string kv_b_option(const Weight& w, const Weight* scale) {
  switch (w.dtype) {
    case DType::F32: return " -DWKIND=0";
    case DType::BF16: return " -DWKIND=1";
    case DType::F8_E4M3:
      if (!scale || !*scale)
        throw std::runtime_error("weight '" + w.name + "' is F8_E4M3 but has no block scales");
      return " -DWKIND=2";
    default:
      throw std::runtime_error("weight '" + w.name + "' has dtype " + dtype_name(w.dtype) +
                               "; the MLA kernels take F32, BF16 or F8_E4M3");
  }
}

// Scale arguments for kernels that take them whether or not the weight is fp8: without scales the
// kernel never reads the buffer, so the weight itself stands in.
const cl::Mem& scale_mem(const Weight& w, const Weight* scale) {
  return scale && *scale ? scale->mem : w.mem;
}
uint32_t scale_ld(const Weight* scale) {
  return scale && *scale ? uint32_t(scale->dim(1)) : 0u;
}

bool wg_shape(const Device& dev) { return dev.kernel_shape() == KernelShape::WorkGroups; }

// The build option of mla.cl's GPU-shaped kernels: lanes per work-group.
std::string mla_wg_option(const Device& dev) {
  return " -DMLA_WG=" + std::to_string(dev.tuning().row_wg);
}

// Tokens per work-group of the GPU-shaped per-head GEMMs: one for decode-sized steps.
uint32_t mla_row_tokens(const Device& dev, uint32_t T) {
  return T < 4 ? 1 : std::max<uint32_t>(1, dev.tuning().mla_row_tokens);
}

void check_kv_b(const Weight& kv_b, const MlaShape& s) {
  if (kv_b.shape != std::vector<int64_t>{int64_t(s.n_heads) * (s.nope + s.v), s.kv_lora})
    throw std::invalid_argument("MLA: kv_b_proj '" + kv_b.name + "' is not [heads * (nope + v), " +
                                "kv_lora] = [" + std::to_string(s.n_heads * (s.nope + s.v)) +
                                ", " + std::to_string(s.kv_lora) + "]");
}

}  // namespace

void validate(const MlaShape& s) {
  if (s.n_heads == 0) throw std::invalid_argument("MLA: no heads");
  if (s.kv_lora == 0 || s.kv_lora % 16 != 0 || s.rope == 0 || s.rope % 16 != 0)
    throw std::invalid_argument("MLA: kv_lora_rank " + std::to_string(s.kv_lora) +
                                " and qk_rope_head_dim " + std::to_string(s.rope) +
                                " must be positive multiples of 16 (the kernels' vector width)");
  if (s.nope == 0 || s.nope % 8 != 0 || s.v == 0 || s.v % 8 != 0)
    throw std::invalid_argument("MLA: qk_nope_head_dim " + std::to_string(s.nope) +
                                " and v_head_dim " + std::to_string(s.v) +
                                " must be positive multiples of 8");
}

void act_quant_fp8(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, uint32_t M,
                   uint32_t K, const cl::Mem& y) {
  if (wg_shape(dev)) {  // a work-group of 128 lanes per (row, block)
    cl::Kernel k = dev.kernel("act_quant.cl", "act_quant_fp8_wg");
    cl::set_args(k, x, x_off, ldx, y, K);
    const size_t local[3] = {128, 1, 1};
    dev.launch(k, {size_t(K + 127) / 128 * 128, M, 1}, 2, local);
    return;
  }
  cl::Kernel k = dev.kernel("act_quant.cl", "act_quant_fp8");
  cl::set_args(k, x, x_off, ldx, y, K);
  dev.launch(k, {(K + 127) / 128, M, 1}, 2);
}

// FP8 GEMMs take the bf16 path at compute_dtype bf16 from this many rows (linear_fp8_bf16: each
// work-item dequantizes a column tile's rows into a bf16 panel for its row tiles). Against the
// FP8 tiles in f32, bench_fp8 2048 x 2048 on PoCL's 2 AVX-512 cores: 4 rows 0.5x, 8 rows 0.9x,
// 16 rows 1.25-1.4x, 32 rows 1.4-1.7x, 64 and 512 rows 1.9x (the earlier whole-weight bf16
// copy: about even at 64 rows).
constexpr uint32_t kFp8Bf16GemmRowsFrom = 16;

namespace {
// The GEMM linear_any runs for an FP8 weight over M rows.
enum class Fp8Gemm { ActQuant, Bf16, Blas, Tiles };
Fp8Gemm fp8_gemm(const Device& dev, const Weight& w, uint32_t M, bool quantize_fp8_activations,
                 ComputeDType compute) {
  if (quantize_fp8_activations && M > 0) return Fp8Gemm::ActQuant;
  if (compute == ComputeDType::BF16 && M >= kFp8Bf16GemmRowsFrom &&
      dev.kernel_shape() == KernelShape::Chunks)
    return Fp8Gemm::Bf16;
  if (blas_fp8_applies(dev, M, w)) return Fp8Gemm::Blas;
  return Fp8Gemm::Tiles;
}
}  // namespace

void linear_any(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                const Weight* scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                uint32_t M, float alpha, bool accumulate, bool quantize_fp8_activations,
                ComputeDType compute) {
  if (w.dtype != DType::F8_E4M3) {
    linear(dev, x, x_off, ldx, w, nullptr, y, y_off, ldy, M, alpha, accumulate, compute);
    return;
  }
  if (!scale_inv || !*scale_inv)
    throw std::runtime_error("weight '" + w.name + "' is F8_E4M3 but has no block scales");
  switch (fp8_gemm(dev, w, M, quantize_fp8_activations, compute)) {
    case Fp8Gemm::ActQuant: {
      const uint32_t K = uint32_t(w.dim(1));
      Scratch q(dev, size_t(M) * K * sizeof(float));
      act_quant_fp8(dev, x, x_off, ldx, M, K, q.mem());
      linear_fp8(dev, q.mem(), 0, K, w, *scale_inv, y, y_off, ldy, M, alpha, accumulate);
      return;
    }
    case Fp8Gemm::Bf16:
      // bf16 compute: the bf16 GEMM over the weight dequantized to bf16 (w * scale, nearest
      // even) column tile by column tile (vdpbf16ps where the host has it).
      linear_fp8_bf16(dev, x, x_off, ldx, w, *scale_inv, y, y_off, ldy, M, alpha, accumulate);
      return;
    case Fp8Gemm::Blas:
      blas_linear_fp8(dev, x, x_off, ldx, w, *scale_inv, y, y_off, ldy, M, alpha, accumulate);
      return;
    case Fp8Gemm::Tiles:
      linear_fp8(dev, x, x_off, ldx, w, *scale_inv, y, y_off, ldy, M, alpha, accumulate, compute);
      return;
  }
}

void linear_any_pair(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w0,
                     const Weight* scale0, const Weight& w1, const Weight* scale1, const cl::Mem& y,
                     uint32_t y_off, uint32_t ldy, uint32_t M, bool quantize_fp8_activations,
                     ComputeDType compute) {
  auto tiles = [&](const Weight& w, const Weight* scale) {
    return w.dtype == DType::F8_E4M3 && scale && *scale &&
           fp8_gemm(dev, w, M, quantize_fp8_activations, compute) == Fp8Gemm::Tiles;
  };
  if (tiles(w0, scale0) && tiles(w1, scale1)) {
    linear_fp8_pair(dev, x, x_off, ldx, w0, *scale0, w1, *scale1, y, y_off, ldy, M, 1.0f, false,
                    compute);
    return;
  }
  linear_any(dev, x, x_off, ldx, w0, scale0, y, y_off, ldy, M, 1.0f, false,
             quantize_fp8_activations, compute);
  linear_any(dev, x, x_off, ldx, w1, scale1, y, y_off + uint32_t(w0.dim(0)), ldy, M, 1.0f, false,
             quantize_fp8_activations, compute);
}

MlaPath choose_mla_path(MlaPath requested, uint32_t max_query_len) {
  if (requested != MlaPath::Auto) return requested;
  return max_query_len <= kMlaDecodeMaxQueryLen ? MlaPath::Decode : MlaPath::Prefill;
}

const char* mla_path_name(MlaPath p) {
  switch (p) {
    case MlaPath::Auto: return "auto";
    case MlaPath::Decode: return "decode";
    case MlaPath::Prefill: return "prefill";
  }
  return "?";
}

void mla_rope_store(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                    const cl::Mem& kv, uint32_t kv_off, uint32_t ldkv, const Weight& kv_norm,
                    float eps, const cl::Mem& inv_freq, float rope_factor, bool interleaved,
                    const MlaShape& s, const StepTokens& st, const cl::Mem& cache_layer) {
  validate(s);
  if (kv_norm.dtype != DType::F32 && kv_norm.dtype != DType::BF16)
    throw std::runtime_error("kv_a_layernorm '" + kv_norm.name + "' has dtype " +
                             dtype_name(kv_norm.dtype) + "; expected F32 or BF16");
  const std::string opts = dims_option(s) +
                           " -DNORM_BF16=" + (kv_norm.dtype == DType::BF16 ? "1" : "0") +
                           " -DINTERLEAVED=" + (interleaved ? "1" : "0");
  const bool wg = wg_shape(dev);
  cl::Kernel k = wg ? dev.kernel("mla.cl", "mla_rope_store_wg", opts + mla_wg_option(dev))
                    : dev.kernel("mla.cl", "mla_rope_store", opts);
  cl::set_args(k, q, q_off, ldq, s.n_heads, s.qk(), kv, kv_off, ldkv, kv_norm.mem, eps, inv_freq,
               rope_factor, st.token_row, st.token_pos, st.lookup, st.pages_per_row, st.page_size,
               cache_layer);
  if (wg) {
    const size_t local = dev.tuning().row_wg;
    dev.launch(k, {st.T * local, 1, 1}, 1, &local);
  } else {
    dev.launch(k, {st.T, 1, 1}, 1);
  }
}

void mla_absorb_q(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                  const Weight& kv_b, const Weight* kv_b_scale, const MlaShape& s, uint32_t T,
                  const cl::Mem& qf) {
  validate(s);
  check_kv_b(kv_b, s);
  if (wg_shape(dev)) {
    const uint32_t wg = dev.tuning().row_wg, tm = mla_row_tokens(dev, T);
    cl::Kernel k = dev.kernel("mla.cl", "mla_absorb_q_wg",
                              dims_option(s) + kv_b_option(kv_b, kv_b_scale) + mla_wg_option(dev) +
                                  " -DMLA_TM=" + std::to_string(tm));
    cl::set_args(k, q, q_off, ldq, kv_b.mem, scale_mem(kv_b, kv_b_scale), scale_ld(kv_b_scale), T,
                 s.n_heads, qf);
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {size_t(s.n_heads) * ((s.kv_lora + wg - 1) / wg) * wg, (T + tm - 1) / tm, 1}, 2,
               local);
    return;
  }
  // Up to 4 tokens per work-item (mla.cl's ABS_TM), over a head's whole rows for one token (read
  // front to back), over 128 or 64 columns for more (the sums kept in registers).
  const uint32_t tm = std::min(T, 4u), chunk = tm == 1 ? s.kv_lora : tm == 2 ? 128 : 64;
  std::string opts = dims_option(s) + kv_b_option(kv_b, kv_b_scale) +
                     " -DABS_TM=" + std::to_string(tm) + " -DABS_CHUNK=" + std::to_string(chunk);
  if (kv_b.dtype == DType::F8_E4M3)
    opts += " " + fp8_decode_option(dev, kv_b.fp8_subnormal_share) +
            " -DKV_B_NAN_FREE=" + (kv_b.fp8_nan_free ? "1" : "0");
  cl::Kernel k = dev.kernel("mla.cl", "mla_absorb_q", opts);
  cl::set_args(k, q, q_off, ldq, kv_b.mem, scale_mem(kv_b, kv_b_scale), scale_ld(kv_b_scale), T,
               s.n_heads, qf);
  dev.launch(k, {s.n_heads * ((s.kv_lora + chunk - 1) / chunk), (T + tm - 1) / tm, 1}, 2);
}

void mla_decode_attention(Device& dev, const cl::Mem& qf, const cl::Mem& cache_layer,
                          const StepTokens& st, const MlaShape& s, float scale,
                          const cl::Mem& o_lat) {
  validate(s);
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    // Every head reads the same cache row (one latent KV head): attention.cl's split-K kernel
    // with the row as key and its first kv_lora floats as value, mla_heads heads per work-group
    // sharing each tile of rows.
    const KernelTuning& tu = dev.tuning();
    PagedKvLayout lay;
    lay.page_stride = uint64_t(st.page_size) * s.row();
    lay.slot_stride = s.row();
    lay.heads_per_kv = s.n_heads;
    lay.dk = s.row();
    lay.dv = s.kv_lora;
    lay.v_in_k = true;
    lay.wg = tu.mla_wg;
    lay.tile = tu.mla_tile;
    lay.max_heads = tu.mla_heads;
    lay.cache_dtype = s.cache_dtype;
    paged_attention_split_k(dev, qf, s.n_heads * s.row(), s.row(), cache_layer, st, s.n_heads, lay,
                            scale, o_lat, s.n_heads * s.kv_lora, s.kv_lora);
    return;
  }
  // KernelTuning::mla_heads heads per work-item, as per work-group in the GPU shape.
  const uint32_t g = std::max(1u, std::min(s.n_heads, dev.tuning().mla_heads));
  cl::Kernel k = dev.kernel(
      "mla.cl", "mla_decode_attention",
      dims_option(s) + " -DDEC_G=" + std::to_string(g) + ops::weight_prefetch_option(dev));
  cl::set_args(k, qf, cache_layer, st.token_row, st.token_pos, st.lookup, st.pages_per_row,
               st.page_size, s.n_heads, scale, o_lat);
  dev.launch(k, {st.T, (s.n_heads + g - 1) / g, 1}, 2);
}

void mla_up_project(Device& dev, const cl::Mem& o_lat, const Weight& kv_b,
                    const Weight* kv_b_scale, const MlaShape& s, uint32_t T, const cl::Mem& out,
                    uint32_t out_off, uint32_t ldo) {
  validate(s);
  check_kv_b(kv_b, s);
  if (wg_shape(dev)) {
    const uint32_t wg = dev.tuning().row_wg, tm = mla_row_tokens(dev, T);
    cl::Kernel k = dev.kernel("mla.cl", "mla_head_linear_wg",
                              dims_option(s) + kv_b_option(kv_b, kv_b_scale) + mla_wg_option(dev) +
                                  " -DMLA_TM=" + std::to_string(tm));
    cl::set_args(k, o_lat, kv_b.mem, scale_mem(kv_b, kv_b_scale), scale_ld(kv_b_scale),
                 s.nope /*row0: V rows follow the K-nope rows*/, s.v, s.n_heads, T, out, out_off,
                 ldo);
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {size_t(s.n_heads) * s.v * wg, (T + tm - 1) / tm, 1}, 2, local);
    return;
  }
  // Per head ops::linear's GEMM over the V rows, with its tiles and split: one-row tiles (fp8:
  // one tile of up to 3 tokens, as linear_fp8's) reading their columns in turn, 4 x 4 from 4
  // tokens on (linear_fp8 takes tiles in turn up to 15 rows; here, 1.7 ms of dsv3-mini fp8's
  // 82 ms batch-8 step, they are not measured); a work-item takes up to 64 tokens and enough tiles
  // of one head that a launch is a few dozen work-items.
  const bool fp8 = kv_b.dtype == DType::F8_E4M3;
  const uint32_t tn = 4, tm = T < 4 ? (fp8 ? T : 1) : 4;
  const bool in_turn = tm < 4 && s.kv_lora <= ops::in_turn_max_k(dev, kv_b.dtype);
  std::string opts = dims_option(s) + kv_b_option(kv_b, kv_b_scale) +
                     " -DTM=" + std::to_string(tm) + " -DTN=" + std::to_string(tn) +
                     (in_turn ? ops::columns_in_turn_option(dev) : "");
  if (fp8)
    opts += " " + fp8_decode_option(dev, kv_b.fp8_subnormal_share) +
            fp8_tile_options(dev, kv_b.fp8_nan_free, in_turn);
  cl::Kernel k = dev.kernel("mla.cl", "mla_head_linear", opts);
  const uint32_t m_rows = std::min((T + tm - 1) / tm * tm, 64u);
  const uint32_t row_blocks = (T + m_rows - 1) / m_rows, head_tiles = (s.v + tn - 1) / tn;
  const uint64_t min_items = in_turn ? stream_launch_items(dev) : 256;
  const uint32_t n_tiles = tiles_per_item(uint64_t(s.n_heads) * head_tiles * row_blocks, min_items,
                                          std::min(head_tiles, 16u));
  cl::set_args(k, o_lat, kv_b.mem, scale_mem(kv_b, kv_b_scale), scale_ld(kv_b_scale),
               s.nope /*row0: V rows follow the K-nope rows*/, s.v, s.n_heads, T, out, out_off, ldo,
               n_tiles, m_rows);
  dev.launch(k, {s.n_heads * ((head_tiles + n_tiles - 1) / n_tiles), row_blocks, 1}, 2);
}

void mla_attention_decode(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                          const cl::Mem& cache_layer, const StepTokens& st, const Weight& kv_b,
                          const Weight* kv_b_scale, const MlaShape& s, float scale,
                          const cl::Mem& out, uint32_t ldo) {
  const uint32_t T = st.T;
  if (T == 0) return;
  Scratch qf(dev, size_t(T) * s.n_heads * s.row() * 4);
  Scratch o_lat(dev, size_t(T) * s.n_heads * s.kv_lora * 4);
  mla_absorb_q(dev, q, q_off, ldq, kv_b, kv_b_scale, s, T, qf.mem());
  mla_decode_attention(dev, qf.mem(), cache_layer, st, s, scale, o_lat.mem());
  mla_up_project(dev, o_lat.mem(), kv_b, kv_b_scale, s, T, out, 0, ldo);
}

MlaPrefillRows mla_prefill_rows(const StepInputs& in, uint32_t page_size) {
  MlaPrefillRows r;
  for (size_t b = 0; b < in.num_rows(); ++b) {
    r.ctx_start.push_back(uint32_t(r.src_rows.size()));
    if (in.row_length(b) == 0) continue;  // no query token reads this row's context
    const uint32_t ctx = in.cache_lengths[b] + in.row_length(b);
    const uint32_t* lut = in.lookup_table.data() + b * in.pages_per_row;
    for (uint32_t p = 0; p < ctx; ++p)
      r.src_rows.push_back(lut[p / page_size] * page_size + p % page_size);
  }
  return r;
}

MlaPrefillPlan upload_mla_prefill_plan(Device& dev, const StepInputs& in, uint32_t page_size) {
  const MlaPrefillRows rows = mla_prefill_rows(in, page_size);
  MlaPrefillPlan plan;
  plan.total_rows = uint32_t(rows.src_rows.size());
  plan.src_rows = Scratch(dev, std::max<size_t>(rows.src_rows.size(), 1) * 4);
  plan.ctx_start = Scratch(dev, std::max<size_t>(rows.ctx_start.size(), 1) * 4);
  WriteBatch batch(dev);  // one wait for both
  batch.write(plan.src_rows.mem(), rows.src_rows.data(), rows.src_rows.size() * 4);
  batch.write(plan.ctx_start.mem(), rows.ctx_start.data(), rows.ctx_start.size() * 4);
  batch.wait();
  return plan;
}

void mla_attention_prefill(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t ldq,
                           const cl::Mem& cache_layer, const StepTokens& st,
                           const MlaPrefillPlan& plan, const Weight& kv_b,
                           const Weight* kv_b_scale, const MlaShape& s, float scale,
                           const cl::Mem& out, uint32_t ldo, ComputeDType compute) {
  validate(s);
  check_kv_b(kv_b, s);
  if (st.T == 0 || plan.total_rows == 0) return;
  const uint32_t L = plan.total_rows, ldkv = s.n_heads * (s.nope + s.v);
  Scratch latent(dev, size_t(L) * s.kv_lora * 4), kv(dev, size_t(L) * ldkv * 4);
  const std::string opts = dims_option(s);
  const bool wg = wg_shape(dev);
  cl::Kernel g = wg ? dev.kernel("mla.cl", "mla_gather_latent_wg", opts + mla_wg_option(dev))
                    : dev.kernel("mla.cl", "mla_gather_latent", opts);
  cl::set_args(g, cache_layer, plan.src_rows.mem(), latent.mem());
  if (wg) {
    const size_t local = dev.tuning().row_wg;
    dev.launch(g, {L * local, 1, 1}, 1, &local);
  } else {
    dev.launch(g, {L, 1, 1}, 1);
  }
  // In the model's compute dtype: with bf16, dsv3-mini's 512-token MLA prefill (gather,
  // decompression, attention) ran 1.29x faster than with this GEMM in f32 (in-process A/B).
  linear_any(dev, latent.mem(), 0, s.kv_lora, kv_b, kv_b_scale, kv.mem(), 0, ldkv, L, 1.0f, false,
             false, compute);
  // attention.cl's attention over the decompressed keys and values (the CPU shape's tiles or the
  // GPU shape's tiled prefill): K-nope and V from kv, the roped key from the cache rows, one head
  // per work-item or work-group.
  PagedKvLayout lay;
  lay.page_stride = uint64_t(st.page_size) * s.row();
  lay.slot_stride = s.row();
  lay.k_off = s.kv_lora;
  lay.heads_per_kv = 1;
  lay.dk = s.qk();
  lay.dv = s.v;
  lay.cache_dtype = s.cache_dtype;
  DecompressedKv dense;
  dense.kv = &kv.mem();
  dense.ctx_start = &plan.ctx_start.mem();
  dense.ldkv = ldkv;
  dense.head_ld = s.nope + s.v;
  dense.nope = s.nope;
  paged_attention_prefill(dev, q, q_off, ldq, s.qk(), cache_layer, st, s.n_heads, lay, &dense,
                          scale, out, ldo, s.v, compute);
}

}  // namespace clshard::ops
