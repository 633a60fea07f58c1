// The device side of one step's inputs: token ids, each token's row and position, the page table
// and the rows that get logits, uploaded once per step into pooled buffers.
#pragma once

#include <vector>

#include "runtime/device.h"
#include "runtime/ops.h"
#include "runtime/step.h"

namespace clshard {

// Host memory that a non-blocking write reads from, kept until the write has completed: the
// destructor, and a move onto it, wait for `written` first.
struct PendingUpload {
  std::vector<uint32_t> data;
  cl::Event written;

  PendingUpload() = default;
  PendingUpload(PendingUpload&& o) noexcept = default;
  PendingUpload& operator=(PendingUpload&& o) noexcept;
  ~PendingUpload() { wait(); }
  void wait() noexcept;
};

struct DeviceStep {
  // One pooled buffer holding the five arrays below, each at the device's base-address alignment
  // (CL_DEVICE_MEM_BASE_ADDR_ALIGN) so that each is a sub-buffer of it, and the host copy its one
  // write reads from (declared after the buffer, so that a step's end waits for the write before
  // the buffer goes back to the pool; a pooled buffer is only reused behind it in the same queue).
  Scratch inputs_buf;
  PendingUpload inputs;
  ops::StepTokens tokens;             // views of the buffer above, for the kernels
  cl::Mem token_ids;                  // int[T]
  cl::Mem logit_rows;                 // uint[R]: token indexes whose logits are returned
  std::vector<uint32_t> logit_token_indices;
  std::vector<uint32_t> logit_offsets;  // [B+1]
};

// The host fields of a step (logit_token_indices, logit_offsets), no buffers: what a rank in
// another process knows of a replica it does not run.
DeviceStep host_step(const StepInputs& in);

// Validates the step against the cache (page_size, num_pages) and the vocabulary, then uploads it
// with one non-blocking write: the device's (in-order) queue runs it before anything queued after,
// and the host goes on to queue the step's kernels. Five writes and a wait for them had cost
// dsv3-mini fp8's decode step (2-core Zen 5 VM) about 120 us of host time before its first kernel,
// each write a wake-up of PoCL's sleeping threads.
DeviceStep upload_step(Device& dev, const StepInputs& in, uint32_t page_size, uint32_t num_pages,
                       uint32_t vocab);

}  // namespace clshard
