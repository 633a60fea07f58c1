#include "runtime/step_device.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace clshard {

PendingUpload& PendingUpload::operator=(PendingUpload&& o) noexcept {
  wait();
  data = std::move(o.data);
  written = std::move(o.written);
  return *this;
}

void PendingUpload::wait() noexcept {
  if (!written) return;
  cl_event e = written.get();
  clWaitForEvents(1, &e);  // no throw: the data goes next, whatever the status
  written = cl::Event();
}

DeviceStep host_step(const StepInputs& in) {
  DeviceStep s;
  s.logit_token_indices = in.logit_token_indices();
  s.logit_offsets.assign(1, 0);
  for (size_t b = 0, r = 0; b < in.num_rows(); ++b) {
    while (r < s.logit_token_indices.size() && s.logit_token_indices[r] < in.input_row_offsets[b + 1])
      ++r;
    s.logit_offsets.push_back(uint32_t(r));
  }
  return s;
}

DeviceStep upload_step(Device& dev, const StepInputs& in, uint32_t page_size, uint32_t num_pages,
                       uint32_t vocab) {
  in.validate(page_size, num_pages);
  for (size_t i = 0; i < in.tokens.size(); ++i)
    if (in.tokens[i] < 0 || uint32_t(in.tokens[i]) >= vocab)
      throw std::invalid_argument("step: token " + std::to_string(in.tokens[i]) + " at index " +
                                  std::to_string(i) + " is outside the vocabulary of " +
                                  std::to_string(vocab));
  const size_t T = in.num_tokens(), B = in.num_rows();
  DeviceStep s = host_step(in);
  // The arrays' places in the buffer, in uint32 elements (token ids, rows, positions, the page
  // table, the logit rows), each from a multiple of the alignment.
  const size_t align =
      std::max<size_t>(cl::device_value<cl_uint>(dev.id(), CL_DEVICE_MEM_BASE_ADDR_ALIGN) / 32, 1);
  const size_t counts[5] = {T, T, T, in.lookup_table.size(), s.logit_token_indices.size()};
  size_t at[6] = {0};
  for (int i = 0; i < 5; ++i)
    at[i + 1] = at[i] + (std::max<size_t>(counts[i], 1) + align - 1) / align * align;
  std::vector<uint32_t>& data = s.inputs.data;
  data.assign(at[5], 0);
  std::copy(in.tokens.begin(), in.tokens.end(), data.begin() + at[0]);
  for (size_t b = 0; b < B; ++b)
    for (uint32_t i = in.input_row_offsets[b]; i < in.input_row_offsets[b + 1]; ++i) {
      data[at[1] + i] = uint32_t(b);
      data[at[2] + i] = in.cache_lengths[b] + (i - in.input_row_offsets[b]);
    }
  std::copy(in.lookup_table.begin(), in.lookup_table.end(), data.begin() + at[3]);
  std::copy(s.logit_token_indices.begin(), s.logit_token_indices.end(), data.begin() + at[4]);
  s.inputs_buf = Scratch(dev, at[5] * 4);
  cl_event written = nullptr;
  cl::check(clEnqueueWriteBuffer(dev.queue(), s.inputs_buf.mem().get(), CL_FALSE, 0, at[5] * 4,
                                 data.data(), 0, nullptr, &written),
            "writing a step's inputs on " + dev.label());
  s.inputs.written = cl::Event(written);
  cl::Mem* views[5] = {&s.token_ids, &s.tokens.token_row, &s.tokens.token_pos, &s.tokens.lookup,
                       &s.logit_rows};
  for (int i = 0; i < 5; ++i) {
    const cl_buffer_region region{at[i] * 4, (at[i + 1] - at[i]) * 4};
    cl_int err = CL_SUCCESS;
    *views[i] = cl::Mem(clCreateSubBuffer(s.inputs_buf.mem().get(), CL_MEM_READ_WRITE,
                                          CL_BUFFER_CREATE_TYPE_REGION, &region, &err));
    cl::check(err, "a sub-buffer of a step's inputs on " + dev.label());
  }
  s.tokens.T = uint32_t(T);
  s.tokens.pages_per_row = in.pages_per_row;
  s.tokens.page_size = page_size;
  for (size_t b = 0; b < B; ++b)
    s.tokens.max_query_len = std::max(s.tokens.max_query_len, in.row_length(b));
  return s;
}

}  // namespace clshard
