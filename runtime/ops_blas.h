// GEMMs handed to CLBlast (its tuned SGEMM) where a device's tuning row says it beats our kernels:
// the GPU shape's prefill GEMMs on NVIDIA (KernelTuning::blas_gemm_rows). linear() routes them
// here; the results differ from linear_wg's in f32 rounding only (another summation order).
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/cl.h"
#include "runtime/tensor.h"

namespace clshard {
class Device;
}

namespace clshard::ops {

// Bytes of f32 weight rows widened from bf16 at a time (the scratch of one SGEMM call): larger
// weights (an lm_head of 128k rows) run as several calls over consecutive output columns.
constexpr size_t kBlasWidenedWeightBytes = size_t(64) << 20;

// Whether linear() hands y = x W^T (+ bias) to blas_linear on this device: the GPU shape, the
// row's blas_gemm_rows set and reached by M, an f32 or bf16 weight, and no bias.
bool blas_linear_applies(const Device& dev, uint32_t M, const Weight& w, const Weight* bias);

// y[M, N] (+)= alpha * x[M, K] W^T by CLBlast's SGEMM on the device's queue. A bf16 W is widened
// to f32 rows first, at most `widened_bytes` of them per SGEMM. Throws with CLBlast's status.
void blas_linear(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                 const cl::Mem& y, uint32_t y_off, uint32_t ldy, uint32_t M, float alpha,
                 bool accumulate, size_t widened_bytes = kBlasWidenedWeightBytes);

// FP8 weights (e4m3 with 128x128 block scales) go the same way when their f32 form fits this:
// dequantized whole (dequantize_fp8), then SGEMM; larger ones stay in linear_fp8.
constexpr size_t kBlasFp8WeightBytes = size_t(256) << 20;

// Whether linear_any hands an FP8 GEMM (activations not quantized) to blas_linear_fp8: as
// blas_linear_applies, for a weight whose f32 form fits kBlasFp8WeightBytes.
bool blas_fp8_applies(const Device& dev, uint32_t M, const Weight& w);

// y[M, N] (+)= alpha * x[M, K] dequant(W)^T: W dequantized to f32 scratch, then blas_linear.
void blas_linear_fp8(Device& dev, const cl::Mem& x, uint32_t x_off, uint32_t ldx, const Weight& w,
                     const Weight& scale_inv, const cl::Mem& y, uint32_t y_off, uint32_t ldy,
                     uint32_t M, float alpha, bool accumulate);

}  // namespace clshard::ops
