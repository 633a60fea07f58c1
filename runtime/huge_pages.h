// Anonymous memory on a 2 MiB boundary, for mappings and buffers that want transparent huge pages
// (runtime/file_mapping.cpp's checkpoint mappings and copies, runtime/device.cpp's buffers).
#pragma once

#include <cstddef>

namespace clshard {

inline constexpr size_t kHugePage = size_t(2) << 20;

// `size` bytes (rounded up to 4 KiB pages) of anonymous memory with protection `prot`, starting at
// a 2 MiB boundary: 2 MiB more reserved, the slack on either side given back. nullptr on failure.
// Free with munmap(base, size).
void* reserve_huge_aligned(size_t size, int prot);

}  // namespace clshard
