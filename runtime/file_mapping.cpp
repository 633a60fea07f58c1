#include "runtime/file_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "runtime/huge_pages.h"

namespace clshard {
namespace {

// Whether the mapping's first 2 MiB are mapped as one huge page once read.
bool first_huge_page_is_huge(const uint8_t* base) {
  volatile uint8_t first = base[0];  // the fault reads the folio and maps it
  (void)first;
  return huge_mapped_kib(base) >= kHugePage / 1024;
}

// Whether the mapping's 4 KiB page at `page` is mapped now (/proc/self/pagemap's present bit,
// readable without privileges); false where pagemap cannot be read.
bool page_mapped(int pagemap, const uint8_t* page) {
  uint64_t entry = 0;
  const off_t at = off_t(reinterpret_cast<uintptr_t>(page) / 4096 * sizeof entry);
  return ::pread(pagemap, &entry, sizeof entry, at) == ssize_t(sizeof entry) && (entry >> 63) != 0;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

// Reads again, in 2 MiB folios, the whole 2 MiB regions of the huge-page mapping `base` whose
// pages the page cache holds in small folios (Parts of a file come back small over time: above).
// Only regions with pages in the cache (mincore) are looked at, so a cold file, or a rank's shard
// of one it never reads, costs nothing here. Each is touched once (a region of one 2 MiB folio is
// then mapped whole, its last page too; a fault in small folios maps at most the fault-around
// window of 64 KiB), and the small ones dropped from this mapping and from the page cache
// (pages other processes map stay) and faulted in again through the mapping, as a cold file's
// first read would. Here, 500 MB of llama3-1b's 2.4 GB file read back through 4 KiB reads in
// random order left its native read loop at 0.90x of anonymous memory's (28.1 against
// 31.2 GB/s); 40 regions found small after a morning's use were read again in 0.1 s.
void refill_small_folios(int fd, uint8_t* base, size_t size) {
  const size_t regions = size / kHugePage, pages = kHugePage / 4096;
  if (regions == 0) return;
  const int pagemap = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (pagemap < 0) return;
  std::vector<bool> small(regions, false);
  // mincore's answer a GiB at a time (a byte per 4 KiB page: 256 KiB).
  constexpr size_t kChunk = 512;
  std::vector<unsigned char> cached(kChunk * pages);
  for (size_t r0 = 0; r0 < regions; r0 += kChunk) {
    const size_t n = std::min(kChunk, regions - r0);
    if (::mincore(base + r0 * kHugePage, n * kHugePage, cached.data()) != 0) break;
    for (size_t r = r0; r < r0 + n; ++r) {
      const unsigned char* c = &cached[(r - r0) * pages];
      if (std::none_of(c, c + pages, [](unsigned char v) { return (v & 1) != 0; })) continue;
      const uint8_t* region = base + r * kHugePage;
      volatile uint8_t first = region[0];
      (void)first;
      small[r] = !page_mapped(pagemap, region + kHugePage - 4096);
    }
  }
  ::close(pagemap);
  for (size_t r = 0; r < regions;) {
    if (!small[r]) {
      ++r;
      continue;
    }
    size_t end = r;
    while (end < regions && small[end]) ++end;
    const size_t at = r * kHugePage, bytes = (end - r) * kHugePage;
    ::madvise(base + at, bytes, MADV_DONTNEED);
    ::posix_fadvise(fd, off_t(at), off_t(bytes), POSIX_FADV_DONTNEED);
    ::madvise(base + at, bytes, MADV_POPULATE_READ);  // where it fails, the first reads fault
    r = end;
  }
}

}  // namespace

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
  // The drops below leave dirty pages in the cache (and their small folios): a file written just
  // before (make-model, then run) is written back first. Where nothing is dirty this costs a
  // system call.
  ::fdatasync(fd);
  auto* bytes = static_cast<uint8_t*>(map);
  if (first_huge_page_is_huge(bytes)) {
    refill_small_folios(fd, bytes, size);
    return map;
  }
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
