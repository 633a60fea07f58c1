#include "runtime/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "runtime/bounded_json.h"
#include "runtime/file_mapping.h"
#include "runtime/mapped_file_guard.h"

namespace clshard {

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

[[noreturn]] void fail(const std::filesystem::path& p, const std::string& msg) {
  throw std::runtime_error(p.string() + ": " + msg);
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::describe() const {
  return name + " " + shape_str(shape) + " " + dtype_name(dtype);
}

SafetensorsHeader parse_safetensors(const uint8_t* base, size_t size,
                                    const std::filesystem::path& path) {
  if (size < 8)
    fail(path, "truncated: " + std::to_string(size) + " bytes, not even the 8-byte header length");
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  if (header_len > size - 8 || header_len > kMaxSafetensorsHeaderBytes)
    fail(path, "header length " + std::to_string(header_len) + " does not fit in a file of " +
                   std::to_string(size) + " bytes (truncated or not a safetensors file)");
  nlohmann::json header;
  try {
    header = parse_json_bounded(reinterpret_cast<const char*>(base) + 8, header_len);
  } catch (const std::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");
  const uint8_t* data = base + 8 + header_len;
  const size_t data_size = size - 8 - header_len;

  SafetensorsHeader out;
  std::vector<std::pair<uint64_t, const TensorView*>> spans;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (entry.is_object())
        for (auto& [k, v] : entry.items())
          if (v.is_string()) out.metadata[k] = v.get<std::string>();
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets"))
      fail(path, where + ": expected an object with dtype, shape and data_offsets");
    if (!entry["dtype"].is_string()) fail(path, where + ": dtype is not a string");
    auto dt = dtype_from_name(entry["dtype"].get<std::string>());
    if (!dt) fail(path, where + ": unknown dtype '" + entry["dtype"].get<std::string>() + "'");
    TensorView v;
    v.name = name;
    v.dtype = *dt;
    if (!entry["shape"].is_array()) fail(path, where + ": shape is not an array");
    // The byte count is checked against the span without overflow: a shape whose product wraps
    // around 2^64 must not pass for a small tensor.
    uint64_t expect = dtype_size(v.dtype);
    bool beyond_64_bits = false;
    for (auto& d : entry["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        fail(path, where + ": shape holds a non-integer or negative dimension");
      beyond_64_bits |= __builtin_mul_overflow(expect, d.get<uint64_t>(), &expect);
      v.shape.push_back(d.get<int64_t>());
    }
    auto& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      fail(path, where + ": data_offsets must be two non-negative integers");
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (end < begin || end > data_size)
      fail(path, where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                     "] fall outside the data section of " + std::to_string(data_size) +
                     " bytes (truncated file?)");
    if (beyond_64_bits || end - begin != expect)
      fail(path, where + ": shape " + shape_str(v.shape) + " x " + dtype_name(v.dtype) + " is " +
                     (beyond_64_bits ? std::string("more than 2^64") : std::to_string(expect)) +
                     " bytes but data_offsets span " + std::to_string(end - begin));
    v.data = data + begin;
    v.bytes = end - begin;
    auto [it, inserted] = out.tensors.emplace(name, std::move(v));
    spans.emplace_back(begin, &it->second);
  }
  std::sort(spans.begin(), spans.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < spans.size(); ++i) {
    const TensorView* prev = spans[i - 1].second;
    if (spans[i - 1].first + prev->bytes > spans[i].first)
      fail(path, "tensors '" + prev->name + "' and '" + spans[i].second->name + "' overlap");
  }
  return out;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path, WeightMemory memory,
                                 const std::function<void(size_t)>& on_read)
    : path_(path), memory_(memory) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, "cannot stat");
  }
  map_size_ = size_t(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    fail(path, "truncated: " + std::to_string(map_size_) + " bytes, not even the 8-byte header "
                                                             "length");
  }
  const bool copied = memory == WeightMemory::Copied;
  map_ = copied ? copy_checkpoint_file(fd, map_size_, on_read) : map_checkpoint_file(fd, map_size_);
  const int map_errno = errno;
  ::close(fd);
  if (!map_)
    fail(path, std::string(copied ? "cannot read into memory: " : "cannot mmap: ") +
                   std::strerror(map_errno));
  try {
    auto header = parse_safetensors(static_cast<const uint8_t*>(map_), map_size_, path);
    tensors_ = std::move(header.tensors);
    metadata_ = std::move(header.metadata);
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
  for (auto& [name, view] : tensors_) view.file = &path_;
  // A copy cannot lose its pages to a file truncated under it.
  if (!copied) guard_mapped_file(map_, map_size_, path_);
}

SafetensorsFile::~SafetensorsFile() {
  if (!map_) return;
  if (memory_ == WeightMemory::Mapped) unguard_mapped_file(map_);
  ::munmap(map_, map_size_);
}

nlohmann::json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path.string() + ": cannot open (missing file?)");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return parse_json_bounded(text.str());
  } catch (const std::exception& e) {
    throw std::runtime_error(path.string() + ": not valid JSON: " + e.what());
  }
}

std::vector<std::string> safetensors_index_shards(const nlohmann::json& j,
                                                  const std::filesystem::path& index) {
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw std::runtime_error(index.string() + ": expected a weight_map object");
  std::set<std::string> names;
  for (auto& [tensor, file] : j["weight_map"].items()) {
    if (!file.is_string())
      throw std::runtime_error(index.string() + ": weight_map['" + tensor + "'] is not a string");
    const auto& name = file.get_ref<const std::string&>();
    // A shard is a file beside the index: no folder may be named, so a hostile index cannot make
    // us open files elsewhere.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
        name.find('\0') != std::string::npos)
      throw std::runtime_error(index.string() + ": weight_map['" + tensor + "'] names '" + name +
                               "', not a file name in the checkpoint's folder");
    names.insert(name);
  }
  return {names.begin(), names.end()};
}

WeightStore::WeightStore(const std::filesystem::path& dir, WeightMemory memory,
                         const LoadProgress& progress)
    : dir_(dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw std::runtime_error(dir.string() + ": not a directory");
  std::vector<fs::path> shards;
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(dir / "model.safetensors")) {
    shards.push_back(dir / "model.safetensors");
  } else if (fs::exists(index)) {
    for (const auto& n : safetensors_index_shards(read_json_file(index), index))
      shards.push_back(dir / n);
    for (const auto& s : shards)
      if (!fs::exists(s))
        throw std::runtime_error(index.string() + " names shard " + s.filename().string() +
                                 ", which is missing");
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") shards.push_back(e.path());
    std::sort(shards.begin(), shards.end());
  }
  if (shards.empty())
    throw std::runtime_error(dir.string() + ": no model.safetensors, no "
                                            "model.safetensors.index.json and no *.safetensors");
  uint64_t total = 0, done = 0;
  std::function<void(size_t)> on_read;
  if (memory == WeightMemory::Copied && progress) {
    for (const auto& s : shards) total += fs::file_size(s);
    on_read = [&](size_t bytes) { progress(dir_, done += bytes, total); };
    progress(dir_, 0, total);
  }
  for (const auto& s : shards) {
    files_.push_back(std::make_unique<SafetensorsFile>(s, memory, on_read));
    for (const auto& [name, view] : files_.back()->tensors()) {
      if (index_.count(name))
        throw std::runtime_error(dir.string() + ": tensor '" + name + "' appears in " +
                                 index_[name]->file->filename().string() + " and " +
                                 s.filename().string());
      index_[name] = &view;
    }
  }
}

const TensorView& WeightStore::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end())
    throw std::runtime_error("missing tensor '" + name + "' in " + dir_.string());
  return *it->second;
}

const TensorView& WeightStore::expect(const std::string& name, const std::vector<int64_t>& shape,
                                      const std::vector<DType>& dtypes) const {
  const TensorView& v = get(name);
  if (std::find(dtypes.begin(), dtypes.end(), v.dtype) == dtypes.end()) {
    std::string want;
    for (size_t i = 0; i < dtypes.size(); ++i) want += (i ? " or " : "") + std::string(dtype_name(dtypes[i]));
    throw std::runtime_error(v.file->string() + ": tensor '" + name + "' has dtype " +
                             dtype_name(v.dtype) + ", expected " + want);
  }
  if (v.shape != shape)
    throw std::runtime_error(v.file->string() + ": tensor '" + name + "' has shape " +
                             shape_str(v.shape) + ", expected " + shape_str(shape));
  return v;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : index_) n.push_back(k);
  return n;
}

uint64_t WeightStore::total_bytes() const {
  uint64_t b = 0;
  for (const auto& [k, v] : index_) b += v->bytes;
  return b;
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (uint64_t(n) * dtype_size(t.dtype) != t.data.size())
      throw std::logic_error("write_safetensors: " + t.name + " has the wrong byte count");
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8) h.push_back(' ');  // keep the data section 8-byte aligned
  std::ofstream out(path, std::ios::binary);
  if (!out) throw std::runtime_error(path.string() + ": cannot write");
  uint64_t len = h.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(h.data(), std::streamsize(h.size()));
  for (const auto& t : tensors)
    out.write(reinterpret_cast<const char*>(t.data.data()), std::streamsize(t.data.size()));
  if (!out) throw std::runtime_error(path.string() + ": write failed (disk full?)");
}

}  // namespace clshard
