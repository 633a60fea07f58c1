// One thin RAII layer over the OpenCL C API: handles that release themselves, and errors that say
// which call failed, with the error's name and what was being done.
#pragma once

#include <CL/cl.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace clshard::cl {

const char* error_name(cl_int code);

class Error : public std::runtime_error {
 public:
  Error(cl_int code, const std::string& what_was_done);
  cl_int code() const { return code_; }

 private:
  cl_int code_;
};

// Throws Error naming `what` when `code` is not CL_SUCCESS.
inline void check(cl_int code, const char* what) {
  if (code != CL_SUCCESS) throw Error(code, what);
}
inline void check(cl_int code, const std::string& what) {
  if (code != CL_SUCCESS) throw Error(code, what);
}

// A reference-counted OpenCL handle. Traits give the retain/release functions.
template <typename T, cl_int (*Retain)(T), cl_int (*Release)(T)>
class Handle {
 public:
  Handle() = default;
  // Takes ownership of a handle the caller already holds a reference to.
  explicit Handle(T h) : h_(h) {}
  Handle(const Handle& o) : h_(o.h_) {
    if (h_) Retain(h_);
  }
  Handle(Handle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Handle& operator=(Handle o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  ~Handle() {
    if (h_) Release(h_);
  }
  T get() const { return h_; }
  explicit operator bool() const { return h_ != nullptr; }
  // Wraps a handle we do not own yet (retains it).
  static Handle retain(T h) {
    if (h) Retain(h);
    return Handle(h);
  }

 private:
  T h_ = nullptr;
};

using Context = Handle<cl_context, clRetainContext, clReleaseContext>;
using Queue = Handle<cl_command_queue, clRetainCommandQueue, clReleaseCommandQueue>;
using Mem = Handle<cl_mem, clRetainMemObject, clReleaseMemObject>;
using Program = Handle<cl_program, clRetainProgram, clReleaseProgram>;
using Kernel = Handle<cl_kernel, clRetainKernel, clReleaseKernel>;
using Event = Handle<cl_event, clRetainEvent, clReleaseEvent>;

// Device info helpers.
std::string device_string(cl_device_id d, cl_device_info what);
std::string platform_string(cl_platform_id p, cl_platform_info what);
template <typename T>
T device_value(cl_device_id d, cl_device_info what) {
  T v{};
  check(clGetDeviceInfo(d, what, sizeof(T), &v, nullptr), "clGetDeviceInfo");
  return v;
}

// Sets kernel arguments in order: cl::set_args(kernel, buf, 3, 1.0f, ...).
// Mem handles pass their cl_mem; other values pass by value.
namespace detail {
inline void set_one(cl_kernel k, cl_uint i, const Mem& m) {
  cl_mem h = m.get();
  check(clSetKernelArg(k, i, sizeof(cl_mem), &h), "clSetKernelArg(buffer)");
}
template <typename T>
void set_one(cl_kernel k, cl_uint i, const T& v) {
  static_assert(std::is_trivially_copyable_v<T>);
  check(clSetKernelArg(k, i, sizeof(T), &v), "clSetKernelArg");
}
}  // namespace detail

template <typename... Args>
void set_args(const Kernel& k, const Args&... args) {
  cl_uint i = 0;
  (detail::set_one(k.get(), i++, args), ...);
}

}  // namespace clshard::cl
