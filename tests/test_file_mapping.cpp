// Big checkpoint files are mapped at a 2 MiB boundary for huge pages (runtime/file_mapping.h).
// Whichever pages the kernel gives, and whether or not it drops the file's small page-cache
// folios, the mapping holds the file's bytes to the last one and leaves nothing mapped behind.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "runtime/file_mapping.h"
#include "tests/test_util.h"

namespace clshard {
namespace {

size_t mapped_regions() {
  std::ifstream maps("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(maps, line);) ++n;
  return n;
}

TEST(FileMapping, BigFilesMapAtA2MiBBoundaryWithTheirBytes) {
  const auto file = test::temp_dir("file_mapping") / "big.bin";
  const size_t size = kHugeMappingMinBytes + 3 * 4096 + 17;  // ends inside a page
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = uint8_t((i * 2654435761u) >> 13);
  {
    std::ofstream out(file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(size));
  }
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

}  // namespace
}  // namespace clshard
