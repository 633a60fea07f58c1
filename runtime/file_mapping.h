// Read-only mappings of checkpoint files, in 2 MiB pages where the kernel can.
//
// Devices that compute from host memory (the CPU driver) read a checkpoint's weights where it is
// mapped (runtime/device.h, wrap_host), so the mapping's pages are the decode's pages. On this
// machine (a 2-core VM), in 4 KiB pages one llama3-1b decode step in 5-8 took 100-300 ms against
// 54 at times, and a plain two-thread read loop over the same mapping stalled the same way (a
// 2.4 GB pass in 100-240 ms against 41) where over anonymous memory it did not; the first touch
// of the 2.4 GB took 0.7-1 s. Mapped as huge pages the first touch takes 0.05 s and the stalls
// were not seen. A copy into fresh anonymous huge pages would do as well for the steps, but cost
// 2-5 s here, the hypervisor backing each new page.
//
// Linux maps a file in huge pages when the mapping is 2 MiB-aligned and its page cache holds 2 MiB
// folios, which reads through an MADV_HUGEPAGE mapping create (seen here on Linux 6.18, ext4, whose
// page cache has large folios from 6.16; elsewhere the pages stay small, and each load drops and
// re-reads only the first 2 MiB). A file just written sits in small
// folios until they are dropped: a big file whose first 2 MiB come back small is dropped from the
// page cache once (its clean pages that no process maps), so later reads fill it in huge folios.
// Dirty pages cannot be dropped, so a load writes the file back first (fdatasync).
// Parts of a file also come back in small folios over time, spread over it (here, 45 minutes after
// the drop, 1998 of 2356 MB were still huge; right after a second drop, 2308). So where the first
// 2 MiB come back huge, each load also reads again, in huge folios, the 2 MiB regions whose cached
// pages sit in small ones (only those: where some 2 MiB pages cannot be had in one piece, each load
// would drop and read again those regions, not the whole file).
#pragma once

#include <cstddef>
#include <functional>

namespace clshard {

// Files from this size on are mapped for huge pages.
inline constexpr size_t kHugeMappingMinBytes = size_t(64) << 20;

// Maps `size` bytes of `fd` read-only and private; nullptr (errno set) on failure. Unmap with
// munmap(base, size).
void* map_checkpoint_file(int fd, size_t size);

// KiB of the mapping that starts at `base` mapped in huge pages now (/proc/self/smaps'
// FilePmdMapped; 0 where no mapping starts there or smaps cannot be read).
size_t huge_mapped_kib(const void* base);

// Reads `size` bytes of `fd` into fresh anonymous memory (2 MiB-aligned, huge pages asked for) and
// makes it read-only; nullptr (errno set, EIO for a file that ends early) on failure. Free with
// munmap(base, size). model.mmap: false (llama.cpp's --no-mmap): the weights then live in pages
// of their own, however the page cache's pages behave. On this machine (a 2-core KVM guest) the
// page-cache pages of some checkpoint files read slower than fresh anonymous pages: after a
// clflush, one thread read 2 MiB pages of dsv3-mini's file at 12-16 GB/s where anonymous pages
// and llama3-1b's file read 17 (the same guest-physical ranges; presumably the hypervisor backs
// them differently), and a copy of its lm_head fed the GEMV at 23.9 GB/s against 17.1 mapped; the
// gap, and the copy's gain at decode, moved within the hour (perf/README.md, "Memory"). `on_read`,
// when set, is told the bytes of each piece read (64 MiB at most), for a load's progress.
void* copy_checkpoint_file(int fd, size_t size,
                           const std::function<void(size_t bytes)>& on_read = {});

}  // namespace clshard
