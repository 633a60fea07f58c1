// Device buffers on PoCL's CPU device (runtime/device.h's create_buffer): one of 2 MiB or more
// lies in memory of its own on a 2 MiB boundary, in transparent huge pages where the kernel gives
// anonymous memory huge pages at all, holds what is written to it, and is unmapped when released;
// smaller ones, and every buffer on other devices, are the driver's own. Without create_buffer the
// KV cache sat in 4 KiB pages and llama3-1b's decode attention at 1024 cached positions took
// 2.7-3.3x as long (device.h).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

using test::default_device;

constexpr size_t kMiB = size_t(1) << 20;

bool pocl_cpu(const Device& dev) {
  return dev.is_cpu() &&
         dev.info().platform.find("Portable Computing Language") != std::string::npos;
}

void* host_ptr(const cl::Mem& m) {
  void* p = nullptr;
  EXPECT_EQ(clGetMemObjectInfo(m.get(), CL_MEM_HOST_PTR, sizeof p, &p, nullptr), CL_SUCCESS);
  return p;
}

// Whether the kernel gives anonymous memory huge pages where advised: THP "always" or "madvise".
bool thp_advisable() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s.find("[always]") != std::string::npos || s.find("[madvise]") != std::string::npos;
}

// AnonHugePages (KiB) of the mapping that holds [p, p + bytes), or -1 where no one mapping does.
long anon_huge_kib(const void* p, size_t bytes) {
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return -1;
  char line[512];
  bool in_vma = false;
  long kib = -1;
  const auto at = uintptr_t(p);
  while (std::fgets(line, sizeof line, f)) {
    uintptr_t start = 0, end = 0;
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " ", &start, &end) == 2) {
      if (in_vma) break;
      in_vma = start <= at && at + bytes <= end;
      continue;
    }
    long v = 0;
    if (in_vma && std::sscanf(line, "AnonHugePages: %ld kB", &v) == 1) {
      kib = v;
      break;
    }
  }
  std::fclose(f);
  return kib;
}

bool mapped(const void* p) {
  unsigned char v = 0;
  return ::mincore(const_cast<void*>(p), size_t(::sysconf(_SC_PAGESIZE)), &v) == 0 ||
         errno != ENOMEM;
}

// Writes a pattern through the device and reads it back; the bytes must be the pattern.
void expect_holds_what_is_written(Device& dev, const cl::Mem& m, size_t bytes) {
  std::vector<uint32_t> pattern(bytes / 4), back(bytes / 4);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = uint32_t(i * 2654435761u);
  dev.write(m, pattern.data(), bytes);
  dev.read(m, back.data(), bytes);
  EXPECT_EQ(std::memcmp(pattern.data(), back.data(), bytes), 0);
}

TEST(DeviceBuffers, OfTwoMiBAndMoreLieInHugePagesOfTheirOwnOnPoclsCpuDevice) {
  Device& dev = default_device();
  const size_t bytes = 8 * kMiB + 4096;  // not whole pages: the mapping is rounded up
  const void* at = nullptr;
  {
    cl::Mem m = dev.alloc(bytes);
    void* p = host_ptr(m);
    if (!pocl_cpu(dev)) {
      EXPECT_EQ(p, nullptr) << dev.label();
      expect_holds_what_is_written(dev, m, bytes);
      return;
    }
    ASSERT_NE(p, nullptr) << "an 8 MiB buffer on " << dev.label() << " is the driver's own";
    EXPECT_EQ(uintptr_t(p) % (2 * kMiB), 0u);
    dev.fill_zero(m, bytes);  // the first touch, by the device's threads
    dev.finish();
    const long kib = anon_huge_kib(p, 10 * kMiB);
    ASSERT_GE(kib, 0) << "no one mapping holds the buffer's 10 MiB (8 MiB + 4 KiB rounded up)";
    if (thp_advisable())
      EXPECT_GE(kib, 10 * 1024) << "of the buffer's 10 MiB, this many KiB lie in huge pages";
    else
      EXPECT_EQ(kib, 0);
    expect_holds_what_is_written(dev, m, bytes);
    at = p;
  }
  dev.finish();
  EXPECT_FALSE(mapped(at)) << "the released buffer's memory is still mapped";
}

TEST(DeviceBuffers, BelowTwoMiBAndWithHostPointersAreTheDriversOwn) {
  Device& dev = default_device();
  cl::Mem small = dev.alloc(2 * kMiB - 4);
  EXPECT_EQ(host_ptr(small), nullptr);
  expect_holds_what_is_written(dev, small, 2 * kMiB - 4);
  std::vector<float> host(1 << 20, 1.5f);
  cl::Mem wrapped = dev.wrap_host(host.data(), host.size() * sizeof(float));
  if (dev.info().host_unified_memory) {
    EXPECT_EQ(host_ptr(wrapped), host.data()) << "a wrapped buffer keeps the caller's memory";
  }
}

TEST(DeviceBuffers, ScratchOfTwoMiBAndMoreLiesInHugePagesOnPoclsCpuDevice) {
  Device& dev = default_device();
  Scratch s(dev, 3 * kMiB);  // the pool's size class: 4 MiB
  void* p = host_ptr(s.mem());
  if (!pocl_cpu(dev)) {
    EXPECT_EQ(p, nullptr);
    return;
  }
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(uintptr_t(p) % (2 * kMiB), 0u);
  dev.fill_zero(s.mem(), 4 * kMiB);
  dev.finish();
  if (thp_advisable())
    EXPECT_GE(anon_huge_kib(p, 4 * kMiB), 4 * 1024);
  else
    EXPECT_EQ(anon_huge_kib(p, 4 * kMiB), 0);
  expect_holds_what_is_written(dev, s.mem(), 3 * kMiB);
}

}  // namespace
}  // namespace clshard
