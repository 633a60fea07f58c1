// What the host side of kernels_cl/sampling.cl (and sampling_wg.cl) shares between sampling.cpp (sample_rows) and
// acceptance.cpp (accept_rows): the per-row argument block, the scratch size and the program's
// build options. Internal to the runtime; callers use sampling.h and acceptance.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/cl.h"
#include "runtime/engine/sampling.h"

namespace clshard {

class Device;

namespace sampling_kernel {

// Mirrors SamplingRowArgs in kernels_cl/sampling.cl (4-byte fields only, so layouts agree).
struct RowArgs {
  float inv_temperature;
  uint32_t top_k;
  float top_p;
  float min_p;
  uint32_t seed_lo;
  uint32_t seed_hi;
  uint32_t greedy;
  uint32_t pad;
};
static_assert(sizeof(RowArgs) == 32);

// Temperature 0 or top_k 1: the argmax, no randomness and no scratch.
bool is_greedy(const SamplingParams& p);

// The kernel's arguments for a row drawing with `step_seed`. Throws std::invalid_argument
// prefixed with `where` (e.g. "sample_tokens: row 3: ") for bad parameters.
RowArgs row_args(const SamplingParams& p, uint64_t step_seed, const std::string& where);

// Floats of scratch per row that draws at random (work_stride() in the kernel).
size_t work_floats(uint32_t vocab);

// A kernel of kernels_cl/sampling.cl, built with the options both callers share (one program).
cl::Kernel kernel(Device& dev, const char* name);

// A kernel of kernels_cl/sampling_wg.cl (the GPU shape: a work-group per row), and the launch of
// a per-row kernel of either file in the device's shape (dev.kernel_shape()).
cl::Kernel wg_kernel(Device& dev, const char* name);
void launch_rows(Device& dev, const cl::Kernel& k, size_t rows);

// Throws std::invalid_argument "<where>the <name> buffer holds fewer than <rows> x <per_row>
// <unit>" unless `m` holds at least rows * per_row 4-byte elements.
void require_buffer(const cl::Mem& m, const std::string& where, const char* name, size_t rows,
                    size_t per_row, const char* unit);

}  // namespace sampling_kernel
}  // namespace clshard
