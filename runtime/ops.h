// The kernels of kernels_cl/ as plain functions: each sets its kernel's arguments and enqueues it
// on the device's in-order queue (no wait). Buffers are f32 activations unless a Weight.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/cl.h"
#include "runtime/tensor.h"

namespace clshard {
class Device;
}

namespace clshard::ops {

// The linear ops take a ComputeDType (runtime/dtype.h). BF16: in GEMMs of kGemmRowsFrom rows and
// more (prefill, batched decode) with bf16 weights, the activations are rounded to bf16 (nearest
// even) and the products of bf16 pairs summed in f32 (linear_bf16.cl: vdpbf16ps where the CPU has
// it). Smaller batches (GEMVs) do the same where bf16_gemv holds, else run as F32, as do other
// weight dtypes, but for FP8 weights (ops::linear_any: linear_fp8_bf16 from 16 rows; below that
// linear_fp8's tiles in turn, and the grouped FP8 experts' (ops::moe_grouped_linear), summed in
// bf16 at any row count where the host has vdpbf16ps).
constexpr uint32_t kGemmRowsFrom = 4;

// Whether linear_bf16.cl runs vdpbf16ps on this device: PoCL on a host CPU that reports
// AVX-512 BF16, and the device's tuning allows it (gemm_bf16_dot; 0 forces the portable kernel).
bool bf16_dot_product(const Device& dev);
// Whether bf16-compute GEMVs (below kGemmRowsFrom rows: decode) over bf16 weights sum in bf16 too
// on this device: the CPU shape where the tuning allows it (gemm_bf16_gemv), bf16_dot_product
// holds and bf16_amx does not (linear_bf16.cl's one-row tiles, their columns in turn; each row the
// bits the tiles of 4 rows and more give it). Elsewhere they run as F32.
bool bf16_gemv(const Device& dev);
// The columns of linear_bf16.cl's one-row tiles where bf16_gemv holds (ops::linear's bf16 GEMVs
// and the grouped experts' decode tiles, which must agree for an expert's row to get
// ops::linear's bits): `tn` weight rows per tile, with GLU one gate row and its up row, and
// whether the tile reads them in turn (K up to the tuning's gemv_stream_k) or side by side.
struct Bf16OneRowTile {
  uint32_t tn;
  bool columns_in_turn;
};
Bf16OneRowTile bf16_one_row_tile(const Device& dev, bool glu, uint32_t K);
// Whether the packed bf16-compute GEMM (bf16_packed.cl) takes Intel AMX's bf16 tiles: PoCL's CPU
// device on a host whose CPU has AMX-BF16 and whose kernel grants the process the tile state, and
// the device's tuning allows it (gemm_bf16_amx; 0 leaves it to bf16_dot_product's choice).
bool bf16_amx(const Device& dev);
// From how many rows the bf16-compute GEMM over bf16 or FP8 weights takes the packed GEMM on this
// device (0: never): gemm_bf16_packed_rows, or with AMX gemm_bf16_amx_rows where fewer.
uint32_t bf16_packed_rows_from(const Device& dev);
// The same for the grouped experts (moe.cl) of dtype `experts` (BF16 or F8_E4M3), per expert:
// moe_bf16_packed_rows or moe_fp8_packed_rows, or with AMX gemm_bf16_amx_rows where fewer.
uint32_t moe_bf16_packed_rows_from(const Device& dev, DType experts);
// Up to how many rows the bf16-compute GEMM over bf16 weights reads them where they lie as AMX's
// A operand (bf16_amx_stream.cl) on this device, before bf16_packed_rows_from applies: with AMX
// gemm_bf16_amx_stream_rows (at most 32), else 0. Each output gets the packed GEMM's AMX bits.
uint32_t bf16_amx_stream_rows(const Device& dev);

// The packed GEMM's shape on this device for rows of K (bf16_packed.cl), which the dense GEMM and
// the grouped experts share so that a row gets the same sums from either: the tile (tm rows x nv
// vectors of 16 columns, tile_cols output columns; with glu half gate, half up), the pair steps
// of a panel chunk, the rows a work-item may keep between chunks (0 with one chunk), its build
// options, and whether the panel and those rows fit the device's local memory.
struct PackedGemmShape {
  uint32_t tm = 0, nv = 0, tile_cols = 0, chunk_steps = 0, partial_rows = 0;
  bool fits = false;
  std::string options;
};
// The x rows of the packed GEMM: rounded to bf16 (compute_dtype bf16), f32 as they are (f32
// compute over bf16 weights: the portable micro-kernel), or f32 as three bf16 terms each (f32
// compute on AMX: linear_bf16.cl's bf16_terms, KernelTuning's gemm_f32_amx_rows).
enum class PackedRows { Bf16, F32, F32Terms };
// What the load-time scan found in FP8 weights' codes (Weight::fp8_nan_free and
// fp8_subnormal_share; the grouped experts' over all their experts), from which their kernels'
// NaN-code watch (fp8_tile_options) and e4m3 decode (fp8_decode_option) follow.
struct Fp8Codes {
  bool nan_free = false;
  float subnormal_share = 0.0f;
};
inline Fp8Codes fp8_codes(const Weight& w) { return {w.fp8_nan_free, w.fp8_subnormal_share}; }
// fp8: FP8 weights with those codes, dequantized as they are packed (none: bf16 weights).
PackedGemmShape packed_gemm_shape(const Device& dev, PackedRows x, bool glu,
                                  std::optional<Fp8Codes> fp8, bool pairs_aligned, uint32_t K);

// The build option of the CPU-shape GEMM kernels that turns on their next-tile weight prefetch
// (common.cl's PREFETCH_LINE, an x86 instruction): " -DPREFETCH_X86=1" for PoCL's CPU device on
// an x86 host whose tuning has weight_prefetch, else "".
std::string weight_prefetch_option(const Device& dev);
// The options of CPU-shape tiles that read their columns in turn (one-row tiles, linear_tile.cl
// and fp8_tile.cl): " -DCOLUMNS_IN_TURN=1", " -DGEMV_ROW_PAIRS=1" where the tuning's
// gemv_row_pairs is not 0 (linear_tile.cl's rows two at a time), and where weight_prefetch_option
// applies " -DPREFETCH_X86=1" with " -DSTREAM_PREFETCH=<bytes>" (FP8, the tuning's
// stream_prefetch), " -DSTREAM_PREFETCH_L1=<bytes>" (both, stream_prefetch_l1) and
// " -DGEMV_STREAM_PREFETCH=<bytes>" (the others, gemv_stream_prefetch) where they are not 0.
std::string columns_in_turn_option(const Device& dev);
// Rows per tile of linear.cl's CPU-shape tiles (ops::linear, linear_fused, linear_swiglu at
// compute f32) over M rows: 1 below 4 rows, the tuning's linear_batch_tm from that many rows to 64
// (decode batches), else 4.
uint32_t linear_tile_rows(const Device& dev, uint32_t M);
// Rows per work-group of the GPU shape's GEMVs (linear_wg, linear_fused_wg, linear_fp8_wg) over M
// rows: the tuning's linear_rows, or M where fewer. A group's rows past M add nothing, but they
// keep their branches, registers and share of the local-memory tree: on the H200 a bf16 GEMV of
// one row read 8192 x 2048 at 1,806 GB/s with one row per group against 1,277 with four
// (bench_kernel_shapes, 2026-12-04). Each row's sums are the same in either.
uint32_t wg_linear_rows(const Device& dev, uint32_t M);
// The longest K whose one-row tiles read their columns in turn over weights of `dtype`:
// KernelTuning::fp8_stream_k for FP8 (fp8_tile.cl's private x row is that long), gemv_stream_k
// for the others.
uint32_t in_turn_max_k(const Device& dev, DType dtype);

// The fewest work-items a CPU-shape launch bound by its weights' stream is split into: 16 per
// compute unit (at least 32), each taking up to 16 column tiles, so that a work-item's fixed
// costs (its first tile, without prefetched rows; an FP8 tile's scaled x rows) are paid once per
// many tiles (linear_fp8's GEMVs and the bf16 GEMM's batches of up to 16 rows).
uint64_t stream_launch_items(const Device& dev);

// Column tiles per work-item of a CPU-shape launch over `tiles` (column tiles times row blocks):
// doubled from 1, up to max_per_item, while the launch keeps at least min_items work-items.
uint32_t tiles_per_item(uint64_t tiles, uint64_t min_items, uint32_t max_per_item = 16);

// y[M, N] (+)= alpha * (x[M, K] W^T + bias). W is [N, K], f32 or bf16. Offsets and row strides
// are in elements. GPU-shape GEMMs of the device's blas_gemm_rows and more go to CLBlast
// (ops_blas.h).
void linear(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
            const Weight* bias, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M,
            float alpha = 1.0f, bool accumulate = false, ComputeDType compute = ComputeDType::F32);

// One GEMM over weights side by side: y[m, :N] (+)= alpha * (n(x[m]) [W0; W1; ...]^T) with the
// weights' rows as one output of N = their total (q, k, v: up to three), where n(x) =
// rmsnorm(x) * norm (eps) when `norm` is given (a launch of its own, before), else x; with `rows`
// (only with a norm), input row m is x row rows[m]. Weights share K and dtype. The results are
// the bits of ops::rmsnorm, then ops::linear per weight.
void linear_fused(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx,
                  const cl::Mem* rows, const Weight* norm, float eps,
                  const std::vector<const Weight*>& weights, const cl::Mem& y, uint32_t y_off,
                  uint32_t ldy, uint32_t M, float alpha = 1.0f, bool accumulate = false,
                  ComputeDType compute = ComputeDType::F32);

// The SwiGLU MLP's first half in one launch: y[m, :F] = silu(n(x[m]) gate^T) * (n(x[m]) up^T),
// n as in linear_fused. gate and up are [F, K].
void linear_swiglu(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight* norm,
                   float eps, const Weight& gate, const Weight& up, const cl::Mem& y,
                   uint32_t y_off, uint32_t ldy, uint32_t M,
                   ComputeDType compute = ComputeDType::F32);

// x[M, K] rounded to bf16 (nearest even): into xb (ushort, row stride ldxb), or with as_f32 into
// an f32 buffer as the rounded values (row stride ldxb). With x_rows (uint32 [M]) row m is x's
// row x_rows[m].
void round_bf16(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, uint32_t M, uint32_t K,
                const cl::Mem& xb, uint32_t ldxb, bool as_f32 = false,
                const cl::Mem* x_rows = nullptr);
// x[M, K] as three bf16 terms per element whose sum is the element exactly (linear_bf16.cl's
// bf16_terms, compute_dtype f32 on AMX): row m's term t into row 3 m + t of xt (ushort, row stride
// ldxt, zero from K to the next 32 elements). With x_rows row m is x's row x_rows[m].
void bf16_terms(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, uint32_t M, uint32_t K,
                const cl::Mem& xt, uint32_t ldxt, const cl::Mem* x_rows = nullptr);

// The build options of fp8_tile.cl's users (linear_fp8.cl, moe.cl, mla.cl). fp8_decode_option:
// the e4m3 decode of a weight whose codes are `subnormal_share` subnormal (Weight::
// fp8_subnormal_share; common.cl's FP8_DENORM): the short one that makes f32 denormals of the
// subnormal codes where the device keeps denormals, but on CPUs only up to
// kFp8DenormMaxSubnormalShare of them, the f16 one otherwise. On x86 each FMA that takes a
// denormal costs a microcode assist: bench_fp8's 7168 x 2048 GEMV (M = 1) read 12-17 GB/s with the
// short decode against 9-11 with the f16 one on codes without subnormals, 2.3 against 8.2 at 1% of
// them, 0.5 against 8-10 at 11%; the two met near 0.05%. A trained model's weights quantized as
// DeepSeek-V3's (128 x 128 blocks, amax / 448) held 0.012%. fp8_tile_options: the NaN-code watch,
// left out where the load-time scan found no NaN code (Weight::fp8_nan_free); for tiles in turn
// the bound on K of their private scaled x row (KernelTuning::fp8_stream_k); with `panel` the
// decoded weight panel of K columns.
inline constexpr float kFp8DenormMaxSubnormalShare = 1.0f / 2048;
std::string fp8_decode_option(const Device& dev, float subnormal_share);
std::string fp8_tile_options(const Device& dev, bool nan_free, bool in_turn, bool panel = false,
                             uint32_t K = 0);

// The build options of bf16_tile.cl's FP8 panels (FP8 weights under bf16 compute: each column
// tile's rows dequantized to bf16 once per work-item): -DFP8_BF16_PANEL=1, the panel's row length
// for K, and the codes' e4m3 decode and NaN-code watch.
std::string fp8_bf16_panel_options(const Device& dev, uint32_t K, Fp8Codes codes);

// The row stride (elements) of the bf16 rows the bf16-compute GEMMs read (linear_bf16.cl and the
// grouped experts; round_bf16 writes them): whole 32-element steps and one step more.
uint32_t bf16_gemm_row_stride(uint32_t K);

// y[r] = rmsnorm(x[rows ? rows[r] : r]) * w, for R rows of width H.
void rmsnorm(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem* rows,
             const Weight& w, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t R,
             uint32_t H, float eps);

// y[t] = table[tokens[t] - vocab_begin] * multiplier, T tokens; zeros for ids outside the table
// (a vocabulary shard: the shards' sum is the whole lookup).
void embedding(Device& dev, const cl::Mem& tokens, uint32_t T, const Weight& table,
               const cl::Mem& y, float multiplier, uint32_t vocab_begin = 0);

// y[t, :F] = silu(gate[t]) * up[t].
void silu_mul(Device& dev, const cl::Mem& gate, uint32_t gate_off, uint32_t ldg, const cl::Mem& up,
              uint32_t up_off, uint32_t ldu, const cl::Mem& y, uint32_t ldy, uint32_t T,
              uint32_t F);

// y[r, y_off + :width] = x[r, x_off + :width] for R rows (row strides ldx, ldy; elements): hidden
// states copied into a wider buffer (the column block of a captured layer).
void copy_rows(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem& y,
               uint32_t y_off, uint32_t ldy, uint32_t R, uint32_t width);

// y[0, n) += alpha * x[0, n).
void axpy(Device& dev, const cl::Mem& y, const cl::Mem& x, float alpha, uint32_t n);

// Per-token metadata of a step on the device: row index and absolute position of each new token,
// and the page table.
struct StepTokens {
  cl::Mem token_row;  // uint[T]
  cl::Mem token_pos;  // uint[T]
  cl::Mem lookup;     // uint[B, pages_per_row]
  uint32_t T = 0;
  uint32_t pages_per_row = 0;
  uint32_t page_size = 0;
  // The most new tokens of one row in this step (0: not known, taken as decode-sized).
  uint32_t max_query_len = 0;
};

// RoPE (half-split) on the queries and keys of qkv [T, (nh + 2 nkv) * hd] in place, and the store
// of keys and values into one layer's paged cache. Positions >= long_from use inv_freq_long.
// The cache holds cache_dtype elements (kv_cache.dtype: F32, or BF16 rounded to nearest even).
void rope_store_kv(Device& dev, const cl::Mem& qkv, uint32_t ld, uint32_t n_heads,
                   uint32_t n_kv_heads, uint32_t head_dim, const cl::Mem& inv_freq,
                   const cl::Mem& inv_freq_long, uint32_t long_from, const StepTokens& st,
                   const cl::Mem& cache_layer, DType cache_dtype = DType::F32);

// Causal GQA attention of the T new tokens over the paged cache: out[t, h*hd:(h+1)*hd].
// The CPU shape takes attention.cl's tiles for every step (paged_attention_prefill). On the
// WorkGroups shape, steps whose longest row brings more than kPrefillAttentionFrom new tokens take
// the tiled prefill kernel (query tiles share each K/V tile), others split-K.
// compute BF16: the CPU shape's tiles take bf16 dot products where the host has vdpbf16ps
// (attention_bf16); elsewhere f32 as with F32.
constexpr uint32_t kPrefillAttentionFrom = 8;
void paged_attention(Device& dev, const cl::Mem& q, uint32_t ldq, const cl::Mem& cache_layer,
                     const StepTokens& st, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim,
                     float scale, const cl::Mem& out, uint32_t ldo, DType cache_dtype = DType::F32,
                     ComputeDType compute = ComputeDType::F32);

// Whether attention at `compute` runs in bf16 on this device: compute BF16 on the CPU shape where
// linear_bf16.cl's GEMMs take vdpbf16ps (bf16_dot_product). attention.cl's tiles (MHA's every
// step, MLA's decompressed prefill) then round the queries, keys, values and softmax weights to
// bf16 and sum their products in f32 (-DAT_BF16=1), so an MHA token's output keeps its bits in
// any step. MLA's absorbed decode (mla.cl) stays f32.
bool attention_bf16(const Device& dev, ComputeDType compute);

// The build option of kernels that read or write a KV cache of `dtype` elements (common.cl's
// CACHE_TYPE): empty for F32, so f32 caches build the kernels they always did. Throws for a dtype
// the caches do not hold.
std::string cache_type_option(DType dtype);

// Where a position's key and value sit in a paged cache, for the WorkGroups shape's split-K
// attention (attention.cl's paged_attention_wg), which MHA and MLA's absorbed decode share: the
// key of position p for query head h is at paged_slot(p) + k_off + (h / heads_per_kv) *
// kv_head_stride (dk floats), the value dv floats at the same place + v_off - k_off, or the
// key's first dv floats when v_in_k.
struct PagedKvLayout {
  uint64_t page_stride = 0;  // floats between pages
  uint32_t slot_stride = 0;  // floats between positions of a page
  uint32_t k_off = 0, v_off = 0, kv_head_stride = 0, heads_per_kv = 1;
  uint32_t dk = 0, dv = 0;
  bool v_in_k = false;
  DType cache_dtype = DType::F32;  // the elements (strides and offsets count elements)
  // Launch shape (from the device's KernelTuning): lanes, positions per tile, heads per group.
  uint32_t wg = 64, tile = 32, max_heads = 8;
};

// out[t, h] (at out + t * o_ldt + h * o_ldh, dv floats) = causal softmax(scale * q . K) V of the
// T new tokens (q[t, h] at q + t * q_ldt + h * q_ldh, dk floats) over their rows' pages: split-K
// over the positions (split_len from the tuning, fewer splits when the partials would pass
// split_scratch_bytes), then one reduction launch.
void paged_attention_split_k(Device& dev, const cl::Mem& q, uint32_t q_ldt, uint32_t q_ldh,
                             const cl::Mem& cache_layer, const StepTokens& st, uint32_t n_heads,
                             const PagedKvLayout& layout, float scale, const cl::Mem& out,
                             uint32_t o_ldt, uint32_t o_ldh);

// MLA's decompressed prefill keys and values (mla.cl's prefill buffer): row ctx_start[b] + p of
// kv holds position p of row b, per head h at h * head_ld: [K-nope (nope floats) | V (dv floats)];
// the rest of the key (the shared roped part) is read from the cache at layout.k_off.
struct DecompressedKv {
  const cl::Mem* kv = nullptr;
  const cl::Mem* ctx_start = nullptr;  // uint[B]
  uint32_t ldkv = 0, head_ld = 0, nope = 0;
};

// The same causal attention as paged_attention_split_k (q at q + q_off), tiled: on the
// WorkGroups shape for prefill (attention.cl's paged_attention_prefill_wg): a work-group per
// (prefill_q query tokens, up to prefill_heads query heads of one KV head; one head with
// `dense`), each K/V tile of prefill_tile positions loaded once into local memory for all of
// them, no split over positions. On the CPU shape for any step (paged_attention_tiles): a
// work-item per (up to 16 query rows: tokens x heads of one KV head), each block of 16 keys
// loaded and transposed once for all of them; a token's output has the same bits whichever
// tokens share its step. The CPU shape needs each part of the key (the cache's, K-nope) and the
// value in multiples of 8 floats.
// compute: as paged_attention's (MLA's decompressed keys and values rounded as MHA's cache).
void paged_attention_prefill(Device& dev, const cl::Mem& q, uint32_t q_off, uint32_t q_ldt,
                             uint32_t q_ldh, const cl::Mem& cache_layer, const StepTokens& st,
                             uint32_t n_heads, const PagedKvLayout& layout,
                             const DecompressedKv* dense, float scale, const cl::Mem& out,
                             uint32_t o_ldt, uint32_t o_ldh,
                             ComputeDType compute = ComputeDType::F32);

}  // namespace clshard::ops
