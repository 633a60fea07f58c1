// The device side of one step's inputs: token ids, each token's row and position, the page table
// and the rows that get logits, uploaded once per step into pooled buffers.
#pragma once

#include <vector>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/step.h"

namespace clshard {

struct DeviceStep {
  Scratch tokens_buf, row_buf, pos_buf, lookup_buf, logit_rows_buf;
  ops::StepTokens tokens;             // views of the buffers above, for the kernels
  cl::Mem token_ids;                  // int[T]
  cl::Mem logit_rows;                 // uint[R]: token indexes whose logits are returned
  std::vector<uint32_t> logit_token_indices;
  std::vector<uint32_t> logit_offsets;  // [B+1]
};

// The host fields of a step (logit_token_indices, logit_offsets), no buffers: what a rank in
// another process knows of a replica it does not run.
DeviceStep host_step(const StepInputs& in);

// Validates the step against the cache (page_size, num_pages) and the vocabulary, then uploads it.
DeviceStep upload_step(Device& dev, const StepInputs& in, uint32_t page_size, uint32_t num_pages,
                       uint32_t vocab);

}  // namespace clshard
