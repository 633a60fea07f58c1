// Big checkpoint files are mapped at a 2 MiB boundary for huge pages (runtime/file_mapping.h).
// Whichever pages the kernel gives, and whether or not it drops the file's small page-cache
// folios, the mapping holds the file's bytes to the last one and leaves nothing mapped behind.
// Copies (model.mmap: false) hold the same bytes, read-only, and do not depend on the file; they
// tell their progress piece by piece.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/file_mapping.h"
#include "runtime/safetensors.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

size_t mapped_regions() {
  std::ifstream maps("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(maps, line);) ++n;
  return n;
}

// Writes `size` bytes of a fixed pattern to `file`, in write(2)s of `piece` bytes (0: one), and
// returns them.
std::vector<uint8_t> write_pattern(const std::filesystem::path& file, size_t size,
                                   size_t piece = 0) {
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = uint8_t((i * 2654435761u) >> 11);
  if (piece == 0) piece = size;
  const int out = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EXPECT_GE(out, 0) << file;
  for (size_t at = 0; at < size; at += piece) {
    const size_t n = std::min(piece, size - at);
    EXPECT_EQ(::write(out, bytes.data() + at, n), ssize_t(n)) << file;
  }
  ::close(out);
  return bytes;
}

TEST(FileMapping, BigFilesMapAtA2MiBBoundaryWithTheirBytes) {
  const auto file = test::temp_dir("file_mapping") / "big.bin";
  const size_t size = kHugeMappingMinBytes + 3 * 4096 + 17;  // ends inside a page
  const std::vector<uint8_t> bytes = write_pattern(file, size);
  // The second round finds the page cache as the first left it.
  for (int round = 0; round < 2; ++round) {
    const size_t regions = mapped_regions();
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    void* map = map_checkpoint_file(fd, size);
    ::close(fd);
    ASSERT_NE(map, nullptr) << std::strerror(errno);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(map) % (size_t(2) << 20), 0u) << "round " << round;
    EXPECT_EQ(std::memcmp(map, bytes.data(), size), 0) << "round " << round;
    ASSERT_EQ(::munmap(map, size), 0);
    EXPECT_EQ(mapped_regions(), regions) << "round " << round;
  }
}

constexpr size_t kHuge = size_t(2) << 20;

// KiB of `file`'s first `size` bytes in huge pages through a plain mapping: 2 MiB-aligned, huge
// pages asked for, every page read, but none of map_checkpoint_file's drops.
size_t huge_kib_as_cached(const std::filesystem::path& file, size_t size) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  void* reserved = ::mmap(nullptr, size + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const uintptr_t at = (uintptr_t(reserved) + kHuge - 1) & ~uintptr_t(kHuge - 1);
  auto* map = static_cast<const uint8_t*>(
      ::mmap(reinterpret_cast<void*>(at), size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0));
  ::close(fd);
  ::madvise(const_cast<uint8_t*>(map), size, MADV_HUGEPAGE);
  for (size_t i = 0; i < size; i += 4096) (void)*static_cast<const volatile uint8_t*>(map + i);
  const size_t kib = huge_mapped_kib(map);
  ::munmap(reserved, size + kHuge);
  return kib;
}

// Bytes [at, at + bytes) of `file` dropped from the page cache and read back 4 KiB at a time in
// shuffled order, so that no readahead window forms: the cache then holds them in small folios.
void cache_in_small_folios(const std::filesystem::path& file, size_t at, size_t bytes) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ::fdatasync(fd);  // dirty pages would stay
  ::posix_fadvise(fd, off_t(at), off_t(bytes), POSIX_FADV_DONTNEED);
  ::posix_fadvise(fd, off_t(at), off_t(bytes), POSIX_FADV_RANDOM);
  std::vector<size_t> pages;
  for (size_t o = at; o < at + bytes; o += 4096) pages.push_back(o);
  std::shuffle(pages.begin(), pages.end(), std::mt19937(7));
  char page[4096];
  for (size_t o : pages) EXPECT_EQ(::pread(fd, page, sizeof page, off_t(o)), ssize_t(sizeof page));
  ::close(fd);
}

// Loads `file` as a checkpoint file is loaded, checks that the mapping holds `bytes`, and returns
// the KiB of it mapped in huge pages after every byte was read.
size_t load_huge_kib(const std::filesystem::path& file, const std::vector<uint8_t>& bytes,
                     const char* when) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  void* map = map_checkpoint_file(fd, bytes.size());
  ::close(fd);
  EXPECT_NE(map, nullptr) << std::strerror(errno);
  if (!map) return 0;
  EXPECT_EQ(std::memcmp(map, bytes.data(), bytes.size()), 0) << when;
  const size_t kib = huge_mapped_kib(map);
  ::munmap(map, bytes.size());
  return kib;
}

// Parts of a file's page cache that sit in small folios (as they come back over time here) are
// read again in huge ones at the next load, where the kernel gives the file huge pages at all
// (Linux 6.16 on ext4 and later): 10 of the file's 40 whole 2 MiB regions cached in small folios,
// the mapping has all 40 in huge pages again. Elsewhere (Debian 12's Linux 6.1 on ext4) the
// file's pages stay small, and the mapping holds the file's bytes all the same.
TEST(FileMapping, RegionsCachedInSmallFoliosComeBackInHugeOnes) {
  const auto file = test::temp_dir("file_mapping_refill") / "big.bin";
  const size_t size = kHugeMappingMinBytes + 8 * kHuge + 3 * 4096 + 17;  // 40 whole regions
  const size_t whole_kib = size / kHuge * kHuge / 1024;
  const std::vector<uint8_t> bytes = write_pattern(file, size);
  auto load = [&](const char* when) { return load_huge_kib(file, bytes, when); };
  // The first load drops the small folios the write left.
  const size_t first_kib = load("first load");
  cache_in_small_folios(file, 10 * kHuge, 10 * kHuge);
  if (first_kib == 0) {
    EXPECT_EQ(load("small pages only"), 0u);
    return;
  }
  EXPECT_EQ(first_kib, whole_kib);
  EXPECT_EQ(huge_kib_as_cached(file, size), whole_kib - 10 * kHuge / 1024)
      << "the 10 regions read back in 4 KiB pages should sit in small folios";
  EXPECT_EQ(load("after the small folios"), whole_kib);
}

// A checkpoint loaded right after it was written (make-model, then run) has its page cache dirty
// and in small folios; the drop that lets huge folios replace them leaves dirty pages, so the first
// load writes the file back first. 256 MiB here stay dirty for the load: Linux starts writing back
// on its own only past 10% of memory or after 30 s. Without the write-back this machine mapped
// none of it huge, and dsv3-mini fp8's first decode after make-model ran 1.35x slower.
TEST(FileMapping, AFileJustWrittenIsMappedInHugePagesAtItsFirstLoad) {
  const auto file = test::temp_dir("file_mapping_dirty") / "big.bin";
  const size_t size = size_t(256) << 20;
  // In 1 MiB writes, as checkpoint writers write (one write(2) of the whole file left huge folios
  // here; writes of 1 MiB, as dd's and make-model's, small ones).
  const std::vector<uint8_t> bytes = write_pattern(file, size, size_t(1) << 20);
  auto load = [&](const char* when) { return load_huge_kib(file, bytes, when); };
  const size_t first_kib = load("first load");
  // Whether this kernel gives the file huge pages at all: written back, dropped, loaded again.
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_EQ(::fdatasync(fd), 0);
  ::posix_fadvise(fd, 0, off_t(size), POSIX_FADV_DONTNEED);
  ::close(fd);
  if (load("after a write-back and a drop") == 0) {
    EXPECT_EQ(first_kib, 0u);  // small pages only (Debian 12's Linux 6.1 on ext4)
    return;
  }
  EXPECT_EQ(first_kib, size / 1024) << "the first load left small folios of the dirty file";
}

TEST(FileMapping, SmallFilesMapWithTheirBytes) {
  const auto file = test::temp_dir("file_mapping_small") / "small.bin";
  const std::string text = "a checkpoint below the huge-page size";
  {
    std::ofstream out(file, std::ios::binary);
    out << text;
  }
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* map = map_checkpoint_file(fd, text.size());
  ::close(fd);
  ASSERT_NE(map, nullptr);
  EXPECT_EQ(std::string(static_cast<const char*>(map), text.size()), text);
  ::munmap(map, text.size());
}

// The permissions /proc/self/maps lists for the region starting at `base` ("" when none does).
std::string region_permissions(const void* base) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (std::stoull(line.substr(0, line.find('-')), nullptr, 16) == uintptr_t(base))
      return line.substr(line.find(' ') + 1, 4);
  return "";
}

TEST(FileMapping, CopiesHoldTheFileBytesReadOnlyAndOutliveTheFile) {
  const auto file = test::temp_dir("file_copy") / "ckpt.bin";
  const size_t size = (size_t(5) << 20) + 17;  // past two 2 MiB pages, ends inside a page
  const std::vector<uint8_t> bytes = write_pattern(file, size);
  const size_t regions = mapped_regions();
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* copy = copy_checkpoint_file(fd, size);
  ::close(fd);
  ASSERT_NE(copy, nullptr) << std::strerror(errno);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(copy) % (size_t(2) << 20), 0u);
  EXPECT_EQ(region_permissions(copy), "r--p");
  // Emptied on disk, the file no longer backs anything: the copy keeps every byte.
  std::filesystem::resize_file(file, 0);
  EXPECT_EQ(std::memcmp(copy, bytes.data(), size), 0);
  ASSERT_EQ(::munmap(copy, size), 0);
  EXPECT_EQ(mapped_regions(), regions) << "the copy left memory mapped behind";
}

TEST(FileMapping, CopyOfAFileShorterThanAskedFailsWithEio) {
  const auto file = test::temp_dir("file_copy_short") / "short.bin";
  {
    std::ofstream out(file, std::ios::binary);
    out << std::string(10000, 'x');
  }
  const size_t regions = mapped_regions();
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  errno = 0;
  EXPECT_EQ(copy_checkpoint_file(fd, 20000), nullptr);
  EXPECT_EQ(errno, EIO);
  ::close(fd);
  EXPECT_EQ(mapped_regions(), regions) << "the failed copy left memory mapped behind";
}

// A copy tells each piece it reads: 64 MiB at most, in order, adding up to the file.
TEST(FileMapping, CopyTellsEachPieceItReads) {
  const auto file = test::temp_dir("file_copy_pieces") / "ckpt.bin";
  const size_t size = (size_t(67) << 20) + 5;  // one whole 64 MiB piece and a part
  const std::vector<uint8_t> bytes = write_pattern(file, size);
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<size_t> pieces;
  void* copy = copy_checkpoint_file(fd, size, [&](size_t n) { pieces.push_back(n); });
  ::close(fd);
  ASSERT_NE(copy, nullptr) << std::strerror(errno);
  EXPECT_EQ(pieces, (std::vector<size_t>{size_t(64) << 20, (size_t(3) << 20) + 5}));
  EXPECT_EQ(std::memcmp(copy, bytes.data(), size), 0);
  ASSERT_EQ(::munmap(copy, size), 0);
  std::filesystem::remove(file);
}

// A copied store tells its progress over all its shards: first 0 of the total (the files' sizes
// added), then after each piece (one per small file here), the last at the total. A mapped store
// reads nothing at open and tells nothing.
TEST(WeightStoreCopy, TellsItsProgressOverEveryShard) {
  const auto dir = test::temp_dir("store_copy_progress");
  const std::vector<float> values(1000, 0.5f);
  std::vector<uint8_t> data(values.size() * 4);
  std::memcpy(data.data(), values.data(), data.size());
  write_safetensors(dir / "a.safetensors", {{"a", DType::F32, {1000}, data}});
  write_safetensors(dir / "b.safetensors", {{"b", DType::F32, {10, 100}, data},
                                            {"c", DType::F32, {500}, std::vector<uint8_t>(2000)}});
  const uint64_t size_a = std::filesystem::file_size(dir / "a.safetensors");
  const uint64_t size_b = std::filesystem::file_size(dir / "b.safetensors");
  using Report = std::tuple<std::filesystem::path, uint64_t, uint64_t>;
  std::vector<Report> reports;
  const LoadProgress record = [&](const std::filesystem::path& d, uint64_t done, uint64_t total) {
    reports.emplace_back(d, done, total);
  };
  WeightStore copied(dir, WeightMemory::Copied, record);
  EXPECT_EQ(copied.get("c").bytes, 2000u);
  const uint64_t total = size_a + size_b;
  EXPECT_EQ(reports,
            (std::vector<Report>{{dir, 0, total}, {dir, size_a, total}, {dir, total, total}}));
  reports.clear();
  WeightStore mapped(dir, WeightMemory::Mapped, record);
  EXPECT_TRUE(reports.empty());
}

}  // namespace
}  // namespace clshard
