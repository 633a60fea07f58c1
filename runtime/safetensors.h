// Safetensors checkpoints: single files and sharded directories, memory-mapped (or read into
// memory: WeightMemory) and validated. A tensor is a view into the file's bytes; nothing is copied
// when it is read.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/dtype.h"

namespace clshard {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  const std::filesystem::path* file = nullptr;  // owned by the SafetensorsFile

  int64_t numel() const;
  int64_t dim(size_t i) const { return shape.at(i); }
  std::string describe() const;  // "name [a, b] BF16"
};

// What a safetensors file's bytes describe, validated as SafetensorsFile does on open; the views
// point into the bytes (TensorView::file unset). Separate from the mapping so the parser can be
// fuzzed on bytes in memory (tests/fuzz/).
struct SafetensorsHeader {
  std::map<std::string, TensorView> tensors;
  std::map<std::string, std::string> metadata;
};
// A header larger than this is refused (real checkpoints: a few hundred KB for 100k tensors).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;
SafetensorsHeader parse_safetensors(const uint8_t* bytes, size_t size,
                                    const std::filesystem::path& path_for_errors);

// Where a checkpoint's bytes are read from (model.mmap): the file's mapping (the page cache's
// pages; nothing read before a weight is used) or a copy in memory of the process's own, made at
// open (file_mapping.h's copy_checkpoint_file: llama.cpp's --no-mmap).
enum class WeightMemory { Mapped, Copied };

// A copy's progress (WeightMemory::Copied): the checkpoint directory, the bytes of its files read
// so far and their total, told first with done == 0, then after each piece read (64 MiB at most),
// the last time with done == total. A mapped store reads nothing at open and tells nothing.
using LoadProgress =
    std::function<void(const std::filesystem::path& dir, uint64_t done, uint64_t total)>;

// One .safetensors file, mmapped (in huge pages where the kernel can: file_mapping.h) or copied
// into memory. Validation on open: header length inside the file, header JSON, dtype names,
// shape x dtype size == byte span, spans inside the data section and not overlapping.
class SafetensorsFile {
 public:
  // `on_read`: a copy's pieces as they are read (copy_checkpoint_file).
  explicit SafetensorsFile(const std::filesystem::path& path,
                           WeightMemory memory = WeightMemory::Mapped,
                           const std::function<void(size_t bytes)>& on_read = {});
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  WeightMemory memory_ = WeightMemory::Mapped;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The shard file names model.safetensors.index.json's weight_map names, sorted and unique; each
// must be a plain file name. Errors name `index_path`.
std::vector<std::string> safetensors_index_shards(const nlohmann::json& index,
                                                  const std::filesystem::path& index_path);

// All the weights of a checkpoint directory: model.safetensors, or the shards named by
// model.safetensors.index.json, or else every *.safetensors file in the directory.
class WeightStore {
 public:
  explicit WeightStore(const std::filesystem::path& dir, WeightMemory memory = WeightMemory::Mapped,
                       const LoadProgress& progress = {});

  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // Throws "missing tensor NAME in DIR" when absent.
  const TensorView& get(const std::string& name) const;
  // get() plus checks: dtype among `dtypes`, and shape equal to `shape`; errors name the tensor,
  // the file, what was found and what was expected.
  const TensorView& expect(const std::string& name, const std::vector<int64_t>& shape,
                           const std::vector<DType>& dtypes) const;
  std::vector<std::string> names() const;
  const std::filesystem::path& dir() const { return dir_; }
  uint64_t total_bytes() const;

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

// One tensor to write. `data` must hold numel x dtype_size bytes.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Reads a JSON file with errors that name it.
nlohmann::json read_json_file(const std::filesystem::path& path);

}  // namespace clshard
