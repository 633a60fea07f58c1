#include "runtime/ops_blas.h"

#include <clblast.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/ops_moe.h"

namespace clshard::ops {

namespace {

bool blas_rows(const Device& dev, uint32_t M) {
  const uint32_t from = dev.tuning().blas_gemm_rows;
  return dev.kernel_shape() == KernelShape::WorkGroups && from > 0 && M >= from;
}

}  // namespace

bool blas_linear_applies(const Device& dev, uint32_t M, const Weight& w, const Weight* bias) {
  return blas_rows(dev, M) && !bias && (w.dtype == DType::F32 || w.dtype == DType::BF16);
}

bool blas_fp8_applies(const Device& dev, uint32_t M, const Weight& w) {
  return blas_rows(dev, M) && w.dtype == DType::F8_E4M3 && w.shape.size() == 2 &&
         size_t(w.dim(0)) * size_t(w.dim(1)) * 4 <= kBlasFp8WeightBytes;
}

namespace {

// C[M, N] = alpha * A[M, K] B[N, K]^T + beta * C, row-major, offsets and strides in elements.
void sgemm_nt(Device& dev, uint32_t M, uint32_t N, uint32_t K, float alpha, const cl::Mem& a,
              size_t a_off, size_t lda, const cl::Mem& b, size_t b_off, size_t ldb, float beta,
              const cl::Mem& c, size_t c_off, size_t ldc, const std::string& what) {
  cl_command_queue queue = dev.queue();
  const clblast::StatusCode status = clblast::Gemm<float>(
      clblast::Layout::kRowMajor, clblast::Transpose::kNo, clblast::Transpose::kYes, M, N, K,
      alpha, a.get(), a_off, lda, b.get(), b_off, ldb, beta, c.get(), c_off, ldc, &queue);
  if (status != clblast::StatusCode::kSuccess)
    throw std::runtime_error("CLBlast SGEMM for '" + what + "' (M=" + std::to_string(M) +
                             " N=" + std::to_string(N) + " K=" + std::to_string(K) + ") on " +
                             dev.label() + " failed with status " +
                             std::to_string(int(status)));
}

}  // namespace

void blas_linear(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                 const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M, float alpha,
                 bool accumulate, size_t widened_bytes) {
  const uint32_t N = uint32_t(w.dim(0)), K = uint32_t(w.dim(1));
  if (M == 0 || N == 0) return;
  if (w.dtype != DType::F32 && w.dtype != DType::BF16)
    throw std::invalid_argument("blas_linear: weight '" + w.name + "' is " +
                                dtype_name(w.dtype) + ", expected F32 or BF16");
  const uint32_t ldw = uint32_t(w.row_stride());
  // Output columns per SGEMM: all of them for f32 weights (read in place); for bf16 as many
  // weight rows as `widened_bytes` holds in f32.
  const uint32_t cols = w.dtype == DType::F32
                            ? N
                            : uint32_t(std::clamp<size_t>(widened_bytes / (size_t(K) * 4), 1, N));
  Scratch wf(dev, w.dtype == DType::F32 ? 4 : size_t(cols) * K * 4);
  // Without accumulate the product goes to zeroed rows first (beta 0 would still multiply
  // whatever y holds, NaN included), then into y.
  Scratch c(dev, accumulate ? 4 : size_t(M) * cols * 4);
  for (uint32_t n0 = 0; n0 < N; n0 += cols) {
    const uint32_t n = std::min(cols, N - n0);
    const cl::Mem* b = &w.mem;
    size_t b_off = w.offset + size_t(n0) * ldw, ldb = ldw;
    if (w.dtype == DType::BF16) {
      cl::Kernel k = dev.kernel("linear_bf16.cl", "widen_bf16_rows");
      cl::set_args(k, w.mem, uint32_t(b_off), ldw, wf.mem(), K);
      const size_t local[3] = {64, 1, 1};
      dev.launch(k, {(size_t(K) + 63) / 64 * 64, n, 1}, 2, local);
      b = &wf.mem();
      b_off = 0;
      ldb = K;
    }
    if (accumulate) {
      sgemm_nt(dev, M, n, K, alpha, x, x_off, ldx, *b, b_off, ldb, 1.0f, y, y_off + size_t(n0),
               ldy, w.name);
    } else {
      dev.fill_zero(c.mem(), size_t(M) * n * 4);
      sgemm_nt(dev, M, n, K, alpha, x, x_off, ldx, *b, b_off, ldb, 0.0f, c.mem(), 0, n, w.name);
      copy_rows(dev, c.mem(), 0, n, y, y_off + n0, ldy, M, n);
    }
  }
}

void blas_linear_fp8(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                     const Weight& scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                     uint32_t M, float alpha, bool accumulate) {
  const uint32_t N = uint32_t(w.dim(0)), K = uint32_t(w.dim(1));
  Scratch wf(dev, size_t(N) * K * 4);
  dequantize_fp8(dev, w, scale_inv, wf.mem());  // checks the weight and its scales
  Weight f;
  f.mem = wf.mem();
  f.dtype = DType::F32;
  f.shape = {N, K};
  f.name = w.name;
  blas_linear(dev, x, x_off, ldx, f, y, y_off, ldy, M, alpha, accumulate);
}

}  // namespace clshard::ops
