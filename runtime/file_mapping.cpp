#include "runtime/file_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>

namespace clshard {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;

// KiB of the mapping that starts at `base` mapped in huge pages now (smaps' FilePmdMapped).
size_t huge_mapped_kib(const void* base) {
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return 0;
  char line[512];
  bool in_vma = false;
  size_t kib = 0;
  const auto want = uintptr_t(base);
  while (std::fgets(line, sizeof line, f)) {
    uintptr_t start = 0, end = 0;
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " ", &start, &end) == 2) {  // a VMA's first line
      if (in_vma) break;
      in_vma = start == want;
      continue;
    }
    if (in_vma && std::sscanf(line, "FilePmdMapped: %zu kB", &kib) == 1) break;
  }
  std::fclose(f);
  return in_vma ? kib : 0;
}

// Whether the mapping's first 2 MiB are mapped as one huge page once read.
bool first_huge_page_is_huge(const uint8_t* base) {
  volatile uint8_t first = base[0];  // the fault reads the folio and maps it
  (void)first;
  return huge_mapped_kib(base) >= kHugePage / 1024;
}

// `size` bytes (rounded up to pages) of anonymous memory with protection `prot`, starting at a
// 2 MiB boundary: 2 MiB more reserved, the slack on either side given back. nullptr on failure.
void* reserve_huge_aligned(size_t size, int prot) {
  const size_t bytes = (size + 4095) & ~size_t(4095);
  void* reserved = ::mmap(nullptr, bytes + kHugePage, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (reserved == MAP_FAILED) return nullptr;
  const auto lo = reinterpret_cast<uintptr_t>(reserved);
  const uintptr_t at = (lo + kHugePage - 1) & ~uintptr_t(kHugePage - 1);
  if (at > lo) ::munmap(reserved, at - lo);
  if (lo + kHugePage > at) ::munmap(reinterpret_cast<void*>(at + bytes), lo + kHugePage - at);
  return reinterpret_cast<void*>(at);
}

}  // namespace

void* map_checkpoint_file(int fd, size_t size) {
  if (size < kHugeMappingMinBytes) {
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    return map == MAP_FAILED ? nullptr : map;
  }
  // The file mapped over a 2 MiB-aligned reservation.
  void* reserved = reserve_huge_aligned(size, PROT_NONE);
  if (!reserved) return nullptr;
  void* map = ::mmap(reserved, size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
  if (map == MAP_FAILED) {
    const int err = errno;
    ::munmap(reserved, size);
    errno = err;
    return nullptr;
  }
  if (::madvise(map, size, MADV_HUGEPAGE) != 0) return map;  // no THP here: small pages
  const auto* bytes = static_cast<const uint8_t*>(map);
  if (first_huge_page_is_huge(bytes)) return map;
  // Small folios: read the first 2 MiB again. Still small: this kernel or filesystem keeps small
  // pages, and the rest of the cache stays. Huge now: the file sat in the small folios it was
  // written in; drop the rest, so the reads to come fill it in huge ones.
  ::madvise(map, kHugePage, MADV_DONTNEED);
  ::posix_fadvise(fd, 0, off_t(kHugePage), POSIX_FADV_DONTNEED);
  if (first_huge_page_is_huge(bytes))
    ::posix_fadvise(fd, off_t(kHugePage), off_t(size - kHugePage), POSIX_FADV_DONTNEED);
  return map;
}

void* copy_checkpoint_file(int fd, size_t size, const std::function<void(size_t)>& on_read) {
  // A 2 MiB-aligned start, as map_checkpoint_file's, so that huge pages can back it from the first.
  auto* base = static_cast<uint8_t*>(reserve_huge_aligned(size, PROT_READ | PROT_WRITE));
  if (!base) return nullptr;
  const size_t bytes = (size + 4095) & ~size_t(4095);
  ::madvise(base, bytes, MADV_HUGEPAGE);
  for (size_t done = 0; done < size;) {
    const ssize_t n =
        ::pread(fd, base + done, std::min<size_t>(size - done, size_t(64) << 20), off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n == 0 ? EIO : errno;
      ::munmap(base, bytes);
      errno = err;
      return nullptr;
    }
    done += size_t(n);
    if (on_read) on_read(size_t(n));
  }
  ::mprotect(base, bytes, PROT_READ);
  return base;
}

}  // namespace clshard
