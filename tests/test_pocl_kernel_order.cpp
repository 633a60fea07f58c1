// PoclKernelOrder (runtime/pocl_kernel_order.h): one kernel on 4 sub-devices of PoCL's CPU device,
// its grid growing from launch to launch, all queues busy at once: the pattern that made PoCL 3.1
// abort in pocl_release_dlhandle_cache. Through Device::launch the launches all run and every
// element holds its count, and once the grids stop growing no launch is ordered any more; the
// same launches straight through clEnqueueNDRangeKernel end the process on that assertion (a
// death test: what the order is there for, on this machine's PoCL). A kernel whose PoCL entry may
// have been reused since its last launch (PoclKernelOrder::kEvictableAfter entries used or made
// since) is ordered again, and only then.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/device_manager.h"
#include "runtime/pocl_kernel_order.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

constexpr size_t kLocal = 8;
constexpr int kRounds = 400;
constexpr int kDeathRounds = 2000;  // at most: the assertion usually ends it within a few dozen
constexpr size_t kMaxElems = 1 << 16;
constexpr uint32_t kSpin = 64;  // work per item, so that the launches of the four queues overlap

const char* kSource =
    "kernel void bump(global uint* x, global uint* spun, uint n, uint spin) {\n"
    "  size_t i = get_global_id(0);\n"
    "  uint h = (uint)i;\n"
    "  for (uint k = 0; k < spin; ++k) h = h * 1664525u + 1013904223u;\n"
    "  spun[i] = h;\n"
    "  if (i < n) x[i] += 1u;\n"
    "}\n";

// The element count of round r on device d: growing, different on every device; in the ordered
// test, from round kRounds on the same in every round (each device its own).
uint32_t elems(int r, size_t d, int last = kRounds) {
  r = std::min(r, last);
  return uint32_t((r * 37 + d * 11) % 1024 + 1 + r * 29);
}

struct Launches {
  std::vector<cl::Kernel> kernels;
  std::vector<cl::Mem> bufs;
  std::vector<cl::Mem> spun;
};

Launches prepare(DeviceManager& mgr) {
  Launches l;
  cl_int err = CL_SUCCESS;
  cl::Program prog(clCreateProgramWithSource(mgr[0].context(), 1, &kSource, nullptr, &err));
  cl::check(err, "creating the test program");
  std::vector<cl_device_id> ids;
  for (size_t d = 0; d < mgr.size(); ++d) ids.push_back(mgr[d].id());
  cl::check(clBuildProgram(prog.get(), cl_uint(ids.size()), ids.data(), "", nullptr, nullptr),
            "building the test program");
  for (size_t d = 0; d < mgr.size(); ++d) {
    l.kernels.emplace_back(clCreateKernel(prog.get(), "bump", &err));
    cl::check(err, "creating kernel bump");
    l.bufs.push_back(mgr[d].alloc(kMaxElems * sizeof(uint32_t)));
    mgr[d].fill_zero(l.bufs.back(), kMaxElems * sizeof(uint32_t));
    l.spun.push_back(mgr[d].alloc(kMaxElems * sizeof(uint32_t)));
  }
  return l;
}

// Every round launches on every device and waits for all four: the queues run the kernel at once,
// each on its own grid. (Queues hundreds of launches deep, never waited for in between, did not
// end in the assertion in 5 runs; waiting after every round did in 8 of 8.)
template <typename Launch>
void run_rounds(DeviceManager& mgr, Launches& l, int first, int end, int last, Launch launch) {
  for (int r = first; r < end; ++r) {
    for (size_t d = 0; d < mgr.size(); ++d) {
      const cl_uint n = elems(r, d, last);
      cl::set_args(l.kernels[d], l.bufs[d], l.spun[d], n, cl_uint(kSpin));
      launch(d, (n + kLocal - 1) / kLocal * kLocal);
    }
    for (size_t d = 0; d < mgr.size(); ++d) mgr[d].finish();
  }
}

TEST(PoclKernelOrder, OneKernelOnFourSubDevicesWithGrowingGridsRunsEveryLaunch) {
  DeviceManager mgr(test::cpu_devices("4"));
  ASSERT_EQ(mgr.size(), 4u);
  Launches l = prepare(mgr);
  auto launch = [&](size_t d, size_t global) {
    mgr[d].launch(l.kernels[d], {global, 1, 1}, 1, &kLocal);
  };
  const auto& order = PoclKernelOrder::instance();
  const uint64_t before = order.ordered_launches();
  run_rounds(mgr, l, 0, kRounds, kRounds, launch);
  const uint64_t growing = order.ordered_launches() - before;
  std::cout << "[ pocl order ] " << growing << " of " << 4 * kRounds
            << " launches ordered while the grids grew\n";
  // Grids wider than every earlier one of the program (which the four devices share): about
  // one launch in two. Each of those is ordered.
  EXPECT_GE(growing, uint64_t(kRounds)) << "launches ordered while the grids grew";
  // Rounds on the last grids, none wider than one before: nothing is ordered.
  const uint64_t settled = order.ordered_launches();
  run_rounds(mgr, l, kRounds, kRounds + 50, kRounds, launch);
  EXPECT_EQ(order.ordered_launches(), settled) << "launches ordered on grids seen before";
  for (size_t d = 0; d < mgr.size(); ++d) {
    std::vector<uint32_t> got(kMaxElems);
    mgr[d].read(l.bufs[d], got.data(), got.size() * sizeof(uint32_t));
    std::vector<uint32_t> want(kMaxElems, 0);
    for (int r = 0; r < kRounds + 50; ++r)
      for (uint32_t i = 0; i < elems(r, d); ++i) ++want[i];
    EXPECT_EQ(got, want) << "device " << d;
  }
}

// Launches on device 0 of two sub-devices (the second makes the order active); each kernel key is
// the kernel and its local size.
TEST(PoclKernelOrder, AKernelIsOrderedAgainOnlyWhenItsEntryMayHaveBeenReused) {
  DeviceManager mgr(test::cpu_devices("2"));
  ASSERT_EQ(mgr.size(), 2u);
  Launches l = prepare(mgr);
  Device& dev = mgr[0];
  cl::set_args(l.kernels[0], l.bufs[0], l.spun[0], cl_uint(0), cl_uint(1));
  const auto& order = PoclKernelOrder::instance();
  // Launches kernel `bump` with local size `local` on `groups` groups; returns whether it was
  // ordered.
  auto ordered = [&](size_t local, size_t groups) {
    const uint64_t before = order.ordered_launches();
    dev.launch(l.kernels[0], {local * groups, 1, 1}, 1, &local);
    return order.ordered_launches() - before;
  };
  const uint64_t other_local0 = 9;  // other keys: local sizes 9, 10, ...
  auto others = [&](size_t from, size_t count) {
    uint64_t n = 0;
    for (size_t i = from; i < from + count; ++i) n += ordered(other_local0 + i, 1);
    return n;
  };
  const size_t R = 8;
  EXPECT_EQ(ordered(R, 8), 1u) << "its first launch";
  EXPECT_EQ(ordered(R, 4), 0u) << "a narrower grid";
  // 20 new keys (each ordered, so each may have made an entry), then a known grid: 40 < 64.
  EXPECT_EQ(others(0, 20), 20u);
  EXPECT_EQ(ordered(R, 4), 0u) << "after 20 new keys";
  // The same 20 keys over and over: 200 launches, but 20 distinct keys and no new entry since.
  for (int round = 0; round < 10; ++round) EXPECT_EQ(others(0, 20), 0u) << "round " << round;
  EXPECT_EQ(ordered(R, 4), 0u) << "after 200 launches of 20 keys seen before";
  // 50 more new keys: 20 + 50 entries used or made since R's last launch.
  EXPECT_EQ(others(20, 50), 50u);
  EXPECT_EQ(ordered(R, 4), 1u) << "after 50 new keys: its entry may have gone";
  EXPECT_EQ(ordered(R, 6), 1u) << "wider than that launch, narrower than the first";
  EXPECT_EQ(ordered(R, 6), 0u) << "the same grid again";
  // Programs built since count with their kernels: 64 of them, then a known grid again.
  const char* one = "kernel void k(global uint* x) { x[0] = 1u; }\n";
  cl_int err = CL_SUCCESS;
  cl::Program built(clCreateProgramWithSource(dev.context(), 1, &one, nullptr, &err));
  cl::check(err, "creating a one-kernel program");
  const cl_device_id id = dev.id();
  cl::check(clBuildProgram(built.get(), 1, &id, "", nullptr, nullptr), "building it");
  EXPECT_EQ(ordered(R, 6), 0u);
  for (uint64_t i = 0; i < PoclKernelOrder::kEvictableAfter; ++i)
    PoclKernelOrder::instance().name_program(built.get(), "a one-kernel program");
  EXPECT_EQ(ordered(R, 6), 1u) << "after 64 kernels built";
  dev.finish();
}

TEST(PoclKernelOrderDeathTest, TheSameLaunchesUnorderedAbortPocl) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        DeviceManager mgr(test::cpu_devices("4"));
        Launches l = prepare(mgr);
        run_rounds(mgr, l, 0, kDeathRounds, kDeathRounds, [&](size_t d, size_t global) {
          cl::check(clEnqueueNDRangeKernel(mgr[d].queue(), l.kernels[d].get(), 1, nullptr, &global,
                                           &kLocal, 0, nullptr, nullptr),
                    "launching bump");
        });
      },
      "pocl_release_dlhandle_cache: Assertion `found->ref_count > 0' failed");
}

}  // namespace
}  // namespace clshard
