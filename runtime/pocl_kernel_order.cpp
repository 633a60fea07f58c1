#include "runtime/pocl_kernel_order.h"

#include <algorithm>
#include <array>

namespace clshard {

namespace {

bool still_running(cl_event e) {
  cl_int status = CL_COMPLETE;
  if (clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, nullptr) !=
      CL_SUCCESS)
    return false;
  return status > CL_COMPLETE;  // a failed launch (status < 0) holds nothing any more
}

size_t groups_times_local(size_t global, size_t local) {
  return (global + local - 1) / local * local;
}

}  // namespace

PoclKernelOrder& PoclKernelOrder::instance() {
  static PoclKernelOrder order;
  return order;
}

void PoclKernelOrder::start_over() {
  launches_.clear();
  known_.clear();
}

void PoclKernelOrder::add(cl_command_queue q) {
  std::lock_guard lock(mu_);
  if (queues_.size() == 1) {
    clFinish(queues_[0]);
    start_over();
  }
  queues_.push_back(q);
}

void PoclKernelOrder::remove(cl_command_queue q) {
  std::lock_guard lock(mu_);
  // Finished, so that a queue made later at the same address finds nothing of this one running.
  clFinish(q);
  queues_.erase(std::remove(queues_.begin(), queues_.end(), q), queues_.end());
  for (auto& [key, l] : launches_) {
    if (l.widening_queue == q) {
      l.widening = cl::Event();
      l.widening_queue = nullptr;
    }
  }
  // Its programs go with it, and a program made later at the same address may be another build.
  builds_.clear();
  known_.clear();
  if (queues_.size() < 2) start_over();
}

void PoclKernelOrder::name_program(cl_program program, const std::string& build) {
  size_t kernels = 0;
  if (clGetProgramInfo(program, CL_PROGRAM_NUM_KERNELS, sizeof kernels, &kernels, nullptr) !=
      CL_SUCCESS)
    kernels = kEvictableAfter;  // unknown: as many as could push any entry out
  std::lock_guard lock(mu_);
  builds_[program] = build;
  built_kernels_ += kernels;
}

uint64_t PoclKernelOrder::entries_since(const Known& k) const {
  const uint64_t made = (ordered_ - k.ordered_then) + (built_kernels_ - k.built_then);
  // Fewer launches than the bound since: fewer keys too, no need to count them.
  if (made + (launch_clock_ - k.last) < kEvictableAfter) return made + (launch_clock_ - k.last);
  uint64_t keys = 0;
  for (const auto& [key, other] : known_) keys += other.last > k.last;
  return made + keys;
}

uint64_t PoclKernelOrder::ordered_launches() const {
  std::lock_guard lock(mu_);
  return ordered_;
}

cl_int PoclKernelOrder::enqueue(cl_command_queue q, cl_kernel k, cl_uint dims, const size_t* global,
                                const size_t* local, const std::vector<cl_event>& wait,
                                cl_event* event) {
  std::lock_guard lock(mu_);
  if (queues_.size() < 2) {
    return clEnqueueNDRangeKernel(q, k, dims, nullptr, global, local, cl_uint(wait.size()),
                                  wait.empty() ? nullptr : wait.data(), event);
  }
  char name[256] = {0};
  clGetKernelInfo(k, CL_KERNEL_FUNCTION_NAME, sizeof name - 1, name, nullptr);
  cl_program program = nullptr;
  clGetKernelInfo(k, CL_KERNEL_PROGRAM, sizeof program, &program, nullptr);
  std::string key = name;
  for (cl_uint i = 0; i < dims; ++i) key += local ? "/" + std::to_string(local[i]) : "/auto";
  Launches& launches = launches_[key];
  const auto build = builds_.find(program);
  Known& known =
      known_[key + "@" +
             (build != builds_.end() ? build->second
                                     : std::to_string(reinterpret_cast<uintptr_t>(program)))];

  // The grid width PoCL keys entries by: the widest dimension, local size times groups; its
  // third term is the local size squared (as written in PoCL 3.1). `wide` is at least and
  // `narrow` at most what PoCL computes, whichever the third term is.
  size_t wide = 0, narrow = 0;
  if (local) {
    std::array<size_t, 3> g = {1, 1, 1}, l = {1, 1, 1};
    for (cl_uint i = 0; i < dims && i < 3; ++i) {
      g[i] = groups_times_local(global[i], local[i]);
      l[i] = local[i];
    }
    wide = std::max({g[0], g[1], g[2], l[2] * l[2]});
    narrow = std::max({g[0], g[1], std::min(g[2], l[2] * l[2])});
  }

  // A key launched before whose entry may have been reused: what was known of it is not.
  if (known.last != 0 && entries_since(known) >= kEvictableAfter) known.widest = 0;
  const bool may_make = !local || wide > known.widest;
  // The host waits, rather than the queue through an event: PoCL's basic device deadlocks on
  // events between its queue and another device's, and another context's events cannot be waited
  // for by this queue. What it waits for was enqueued before and waits only on commands enqueued
  // before it, so it finishes without anything this thread has still to do.
  if (may_make) {
    for (cl_command_queue other : queues_)
      if (other != q) clFinish(other);
  } else if (launches.widening) {
    cl_event e = launches.widening.get();
    if (!still_running(e)) {
      launches.widening = cl::Event();
    } else if (launches.widening_queue != q) {
      clWaitForEvents(1, &e);
      launches.widening = cl::Event();
    }
  }

  cl_event done = nullptr;
  const bool keep = may_make || event;
  const cl_int err =
      clEnqueueNDRangeKernel(q, k, dims, nullptr, global, local, cl_uint(wait.size()),
                             wait.empty() ? nullptr : wait.data(), keep ? &done : nullptr);
  if (err != CL_SUCCESS) return err;
  cl::Event launched(done);
  if (may_make) {
    launches.widening = launched;
    launches.widening_queue = q;
    ++ordered_;
    known.widest = narrow;
  }
  known.last = ++launch_clock_;
  known.ordered_then = ordered_;
  known.built_then = built_kernels_;
  if (event) {
    clRetainEvent(done);
    *event = done;
  }
  return CL_SUCCESS;
}

}  // namespace clshard
