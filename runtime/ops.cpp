#include "runtime/ops.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/device.h"

namespace clshard::ops {

namespace {

// Build option for kernels that read a weight: bf16 is widened in the kernel, f32 read as is.
std::string weight_option(const Weight& w) {
  switch (w.dtype) {
    case DType::F32: return "-DWEIGHT_TYPE=0";
    case DType::BF16: return "-DWEIGHT_TYPE=1";
    case DType::F16: return "-DWEIGHT_TYPE=2";
    default:
      throw std::runtime_error("weight '" + w.name + "' has dtype " + dtype_name(w.dtype) +
                               "; this kernel takes F32, BF16 or F16");
  }
}

}  // namespace

void copy_rows(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem& y,
               uint32_t y_off, uint32_t ldy, uint32_t R, uint32_t width) {
  if (R == 0 || width == 0) return;
  const size_t f = sizeof(float);
  const size_t src_origin[3] = {x_off * f, 0, 0}, dst_origin[3] = {y_off * f, 0, 0};
  const size_t region[3] = {width * f, R, 1};
  cl::check(clEnqueueCopyBufferRect(dev.queue(), x.get(), y.get(), src_origin, dst_origin, region,
                                    ldx * f, 0, ldy * f, 0, 0, nullptr, nullptr),
            "clEnqueueCopyBufferRect (copy_rows)");
}

void linear(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
            const Weight* bias, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M,
            float alpha, bool accumulate) {
  const uint32_t N = uint32_t(w.dim(0)), K = uint32_t(w.dim(1));
  const uint32_t ldw = uint32_t(w.row_stride());
  const int has_bias = bias != nullptr;
  if (dev.kernel_shape() == KernelShape::WorkGroups) {
    constexpr uint32_t wg = 64, rb = 4;  // lanes per output feature, rows per work-group
    cl::Kernel k = dev.kernel("linear_wg.cl", "linear_wg",
                              weight_option(w) + " -DWG=" + std::to_string(wg) +
                                  " -DRB=" + std::to_string(rb));
    cl::set_args(k, x, x_off, ldx, w.mem, uint32_t(w.offset), ldw, has_bias ? bias->mem : w.mem,
                 uint32_t(has_bias ? bias->offset : 0), has_bias, y, y_off, ldy, M, N, K, alpha,
                 int(accumulate));
    const size_t local[3] = {wg, 1, 1};
    dev.launch(k, {size_t(N) * wg, (M + rb - 1) / rb, 1}, 2, local);
    return;
  }
  // Decode-sized batches take a one-row tile (the weights stream once either way); larger ones a
  // 4x4 tile that reuses each loaded x and W vector four times.
  const uint32_t tm = M < 4 ? 1 : 4, tn = 4;
  cl::Kernel k = dev.kernel("linear.cl", "linear",
                            weight_option(w) + " -DTM=" + std::to_string(tm) +
                                " -DTN=" + std::to_string(tn));
  // Work per work-item (see linear.cl): up to 64 rows, and on CPUs enough column tiles that a
  // launch is a few hundred work-items rather than tens of thousands.
  const uint32_t m_rows = std::min<uint32_t>((M + tm - 1) / tm * tm, 64);
  const uint32_t col_tiles = (N + tn - 1) / tn, row_blocks = (M + m_rows - 1) / m_rows;
  uint32_t n_tiles = 1;
  if (dev.kernel_shape() == KernelShape::Chunks)
    while (n_tiles < 16 && uint64_t(col_tiles) * row_blocks / (n_tiles * 2) >= 256) n_tiles *= 2;
  cl::set_args(k, x, x_off, ldx, w.mem, uint32_t(w.offset), ldw, has_bias ? bias->mem : w.mem,
               uint32_t(has_bias ? bias->offset : 0), has_bias, y, y_off, ldy, M, N, K, alpha,
               int(accumulate), n_tiles, m_rows);
  dev.launch(k, {(col_tiles + n_tiles - 1) / n_tiles, row_blocks, 1}, 2);
}

void rmsnorm(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const cl::Mem* rows,
             const Weight& w, const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t R,
             uint32_t H, float eps) {
  cl::Kernel k = dev.kernel("norm.cl", "rmsnorm", weight_option(w));
  const int use_rows = rows != nullptr;
  cl::set_args(k, x, x_off, ldx, use_rows ? *rows : x, use_rows, w.mem, y, y_off, ldy, H, eps);
  dev.launch(k, {R, 1, 1}, 1);
}

void embedding(Device& dev, const cl::Mem& tokens, uint32_t T, const Weight& table,
               const cl::Mem& y, float multiplier, uint32_t vocab_begin) {
  cl::Kernel k = dev.kernel("embedding.cl", "embedding", weight_option(table));
  cl::set_args(k, tokens, table.mem, y, uint32_t(table.dim(1)), vocab_begin,
               uint32_t(table.dim(0)), multiplier);
  dev.launch(k, {T, 1, 1}, 1);
}

void silu_mul(Device& dev, const cl::Mem& gate, uint32_t gate_off, uint32_t ldg, const cl::Mem& up,
              uint32_t up_off, uint32_t ldu, const cl::Mem& y, uint32_t ldy, uint32_t T,
              uint32_t F) {
  constexpr uint32_t chunk = 256;  // CHUNK in activation.cl
  cl::Kernel k = dev.kernel("activation.cl", "silu_mul");
  cl::set_args(k, gate, gate_off, ldg, up, up_off, ldu, y, ldy, F);
  dev.launch(k, {T, (F + chunk - 1) / chunk, 1}, 2);
}

void axpy(Device& dev, const cl::Mem& y, const cl::Mem& x, float alpha, uint32_t n) {
  constexpr uint32_t chunk = 4096;  // CHUNK in elementwise.cl
  cl::Kernel k = dev.kernel("elementwise.cl", "axpy");
  cl::set_args(k, y, x, alpha, n);
  dev.launch(k, {(n + chunk - 1) / chunk, 1, 1}, 1);
}

void rope_store_kv(Device& dev, const cl::Mem& qkv, uint32_t ld, uint32_t n_heads,
                   uint32_t n_kv_heads, uint32_t head_dim, const cl::Mem& inv_freq,
                   const cl::Mem& inv_freq_long, uint32_t long_from, const StepTokens& st,
                   const cl::Mem& cache_layer) {
  cl::Kernel k = dev.kernel("rope.cl", "rope_store_kv");
  cl::set_args(k, qkv, ld, n_heads, n_kv_heads, head_dim, inv_freq, inv_freq_long, long_from,
               st.token_row, st.token_pos, st.lookup, st.pages_per_row, st.page_size,
               cache_layer);
  dev.launch(k, {st.T, 1, 1}, 1);
}

void paged_attention(Device& dev, const cl::Mem& q, uint32_t ldq, const cl::Mem& cache_layer,
                     const StepTokens& st, uint32_t n_heads, uint32_t n_kv_heads,
                     uint32_t head_dim, float scale, const cl::Mem& out, uint32_t ldo) {
  if (head_dim % 8 != 0)
    throw std::runtime_error("paged_attention: head_dim " + std::to_string(head_dim) +
                             " is not a multiple of 8");
  cl::Kernel k = dev.kernel("attention.cl", "paged_attention",
                            "-DHEAD_DIM=" + std::to_string(head_dim));
  cl::set_args(k, q, ldq, cache_layer, st.token_row, st.token_pos, st.lookup, st.pages_per_row,
               st.page_size, n_heads, n_kv_heads, scale, out, ldo);
  dev.launch(k, {st.T, n_heads, 1}, 2);
}

}  // namespace clshard::ops
