// Launches of one kernel on several queues of PoCL's CPU driver, ordered where PoCL needs it.
//
// PoCL 3.1's CPU driver keeps one process-wide cache of loaded work-group functions, keyed by
// (program build, kernel name, local size), and makes one more entry of a key each time a kernel
// runs on a wider grid than every entry of that key covers. A finished launch gives its reference
// back to the newest entry of its key, not to the entry it took (pocl_release_dlhandle_cache,
// lib/CL/devices/common.c). So when a kernel runs on two queues at once and one of its launches
// makes a new entry meanwhile, the counts go wrong, and a later launch aborts the process:
// "Assertion `found->ref_count > 0' failed". Sub-devices of one CPU (devices.split), as the data-
// and expert-parallel replicas use them, did exactly that, about once in 75 runs of the 3-replica
// FP8 DeepSeek test.
//
// So while more than one queue of a PoCL CPU device is live, a launch on a grid wider than every
// earlier launch of its build's kernel and local size runs alone among the launches of that
// kernel name and local size: the host first waits for the other queues to finish what they
// hold, and their later launches of it wait (on the host) until it has run. Other launches run
// side by side as before: once the grids stop growing (a decode step at a batch size seen
// before), nothing is ordered. Ordering every launch instead roughly halved the 2-replica
// DeepSeek decode (bench_deepseek_parallel, batch 16: 80 against 150 tok/s).
//
// Past 128 entries PoCL reuses the least recently used entry that no launch holds, and a kernel
// whose entry went that way makes a new one on a grid that may be narrower than those launched
// before. So a launch counts as known only while its key's entry cannot have gone: while fewer
// than kEvictableAfter entries may have been used or made since the key's last launch (the
// distinct keys launched since, the launches ordered since, and every kernel of the programs
// built since, which PoCL may have compiled). Past that, the launch is ordered as widening and
// its width is what is known. The models' decode and prefill make far fewer entries than 128
// (36-40 in the 3-replica DeepSeek test and in bench_deepseek_parallel, counted as PoCL's dlopen
// calls of kernel binaries), so a steady decode never reaches it.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/cl.h"

namespace clshard {

class PoclKernelOrder {
 public:
  static PoclKernelOrder& instance();

  // A queue of a PoCL CPU device comes and goes. When a second one comes, the first is finished:
  // the grids it ran before are not known here.
  void add(cl_command_queue q);
  void remove(cl_command_queue q);

  // Names a program by what decides its build in PoCL (kernel file, build options, device), so
  // that the devices sharing a build share what is known of its grids. Unnamed programs are
  // known each on its own.
  void name_program(cl_program program, const std::string& build);

  // clEnqueueNDRangeKernel on q (added before), after `wait`, ordered as above. `event` may be
  // null.
  cl_int enqueue(cl_command_queue q, cl_kernel k, cl_uint dims, const size_t* global,
                 const size_t* local, const std::vector<cl_event>& wait, cl_event* event);

  // Launches ordered as widening a grid since the second queue came (tests).
  uint64_t ordered_launches() const;

  // Entries used or made since a key's last launch from which its own may have been reused:
  // PoCL 3.1 keeps 128, and at most one per queue is held by a running launch.
  static constexpr uint64_t kEvictableAfter = 64;

 private:
  // The launches of one kernel name and local size on every queue (all PoCL's key can share).
  struct Launches {
    cl::Event widening;  // the latest ordered one, while it may run
    cl_command_queue widening_queue = nullptr;
  };

  void start_over();

  mutable std::mutex mu_;
  std::vector<cl_command_queue> queues_;
  std::unordered_map<std::string, Launches> launches_;
  // A build's kernel and local size (never more than PoCL's key holds).
  struct Known {
    size_t widest = 0;                          // at most the widest grid PoCL has an entry for
    uint64_t last = 0;                          // launch_clock_ at its last launch
    uint64_t ordered_then = 0, built_then = 0;  // ordered_ and built_kernels_ then
  };
  // Entries PoCL may have used or made since `k`'s last launch (see the header comment).
  uint64_t entries_since(const Known& k) const;

  std::unordered_map<std::string, Known> known_;
  uint64_t launch_clock_ = 0;   // launches while ordering
  uint64_t built_kernels_ = 0;  // kernels of the programs named
  std::unordered_map<cl_program, std::string> builds_;
  uint64_t ordered_ = 0;
};

}  // namespace clshard
