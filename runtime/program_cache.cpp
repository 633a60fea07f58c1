#include "runtime/program_cache.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "runtime/device.h"

namespace clshard {

namespace {

uint64_t fnv1a(std::string_view s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

void build(cl_program p, cl_device_id d, const std::string& options, const std::string& what) {
  cl_int err = clBuildProgram(p, 1, &d, options.c_str(), nullptr, nullptr);
  if (err != CL_SUCCESS) {
    throw cl::Error(err, "building " + what + " with options '" + options + "':\n" +
                             build_log(p, d));
  }
}

}  // namespace

namespace {

// Appends kernels_cl/`file` (text) to src, each line `#include "name.cl"` replaced by that
// embedded file, expanded the same way (its own includes too, at most kMaxIncludeDepth deep: a
// file that includes itself stops there with its chain), so that files share helpers without
// either program compiling the other's kernels. An included file guards itself against a second
// inclusion (#ifndef), as a C header does.
constexpr int kMaxIncludeDepth = 4;
void append_expanded(const std::map<std::string, std::string_view>& all, const std::string& file,
                     std::string_view text, const std::string& chain, int depth, std::string& src) {
  src.append("\n#line 1 \"" + file + "\"\n");
  size_t line_no = 1;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    const std::string_view line = text.substr(0, eol == std::string_view::npos ? text.size() : eol + 1);
    text.remove_prefix(line.size());
    constexpr std::string_view kInclude = "#include \"";
    if (line.starts_with(kInclude)) {
      const size_t close = line.find('"', kInclude.size());
      const std::string where = "kernels_cl/" + file + ":" + std::to_string(line_no);
      const std::string name(line.substr(kInclude.size(), close - kInclude.size()));
      auto inc = all.find(name);
      if (close == std::string_view::npos || inc == all.end())
        throw std::runtime_error(where + ": no embedded kernel file kernels_cl/" + name +
                                 " to include");
      if (depth + 1 > kMaxIncludeDepth)
        throw std::runtime_error(where + ": includes nest deeper than " +
                                 std::to_string(kMaxIncludeDepth) + " (" + chain + " -> " + name +
                                 ")");
      append_expanded(all, name, inc->second, chain + " -> " + name, depth + 1, src);
      src.append("\n#line " + std::to_string(line_no + 1) + " \"" + file + "\"\n");
    } else {
      src.append(line);
    }
    ++line_no;
  }
}

}  // namespace

std::string build_log(cl_program p, cl_device_id d) {
  size_t n = 0;
  clGetProgramBuildInfo(p, d, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
  std::string log(n, '\0');
  clGetProgramBuildInfo(p, d, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr);
  return log;
}

namespace {

// src with every kernel but `keep` left out. A kernel runs from its line that starts "kernel " to
// the next line that is "}" alone (clang-format ends a function there, and nothing else); its
// preprocessor lines but #pragma stay (a #define in one body may serve the kernels after it) and
// the rest become empty lines, so that the compiler's line numbers still point into kernels_cl/.
std::string one_kernel(const std::string& src, const std::string& keep, const std::string& file) {
  static const std::regex kName(R"(\bvoid\s+(\w+)\s*\()");
  std::vector<std::string_view> lines;
  for (std::string_view rest = src; !rest.empty();) {
    const size_t eol = rest.find('\n');
    lines.push_back(rest.substr(0, eol == std::string_view::npos ? rest.size() : eol + 1));
    rest.remove_prefix(lines.back().size());
  }
  std::string out;
  out.reserve(src.size());
  bool found = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (!lines[i].starts_with("kernel ")) {
      out.append(lines[i]);
      continue;
    }
    // The name follows "void", on this line or the next (after an __attribute__ line).
    std::string head(lines[i]);
    if (i + 1 < lines.size()) head.append(lines[i + 1]);
    std::smatch m;
    if (!std::regex_search(head, m, kName))
      throw std::runtime_error("kernels_cl/" + file +
                               ": a kernel line without \"void name(\": " + std::string(lines[i]));
    if (m[1] == keep) {
      found = true;
      out.append(lines[i]);
      continue;
    }
    size_t end = i;
    while (end < lines.size() && lines[end] != "}\n" && lines[end] != "}") ++end;
    if (end == lines.size())
      throw std::runtime_error("kernels_cl/" + file + ": kernel " + m[1].str() +
                               " has no closing \"}\" line");
    bool continued = false;  // the directive kept last ends in a backslash
    for (; i <= end; ++i) {
      const std::string_view l = lines[i];
      const size_t first = l.find_first_not_of(" \t");
      // A #pragma (unroll) belongs to a loop of the body, which goes.
      const bool directive =
          continued || (first != std::string_view::npos && l[first] == '#' &&
                        l.find("pragma", first) == std::string_view::npos);
      out.append(directive ? l : std::string_view("\n"));
      const size_t last = l.find_last_not_of("\r\n");
      continued = directive && last != std::string_view::npos && l[last] == '\\';
    }
    --i;
  }
  if (!found) throw std::runtime_error("kernels_cl/" + file + " has no kernel " + keep);
  return out;
}

}  // namespace

std::string kernel_source(const std::string& file, const std::string& kernel) {
  const auto& all = embedded_kernels();
  auto common = all.find("common.cl");
  auto it = all.find(file);
  if (it == all.end()) throw std::runtime_error("no embedded kernel file kernels_cl/" + file);
  std::string src;
  if (common != all.end() && file != "common.cl") src.append(common->second);
  append_expanded(all, file, it->second, file, 0, src);
  return kernel.empty() ? src : one_kernel(src, kernel, file);
}

std::filesystem::path kernel_cache_dir() {
  if (const char* d = std::getenv("CLSHARD_KERNEL_CACHE"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    return std::filesystem::path(x) / "clshard" / "kernels";
  if (const char* h = std::getenv("HOME"); h && *h)
    return std::filesystem::path(h) / ".cache" / "clshard" / "kernels";
  return std::filesystem::temp_directory_path() / "clshard-kernels";
}

std::string program_cache_key(const DeviceInfo& info, std::string_view source,
                              const std::string& options) {
  std::string id = info.platform + "|" + info.platform_version + "|" + info.name + "|" +
                   info.driver_version + "|" + options;
  return hex(fnv1a(id)) + "-" + hex(fnv1a(source));
}

cl::Program build_program(cl_context ctx, cl_device_id dev, const DeviceInfo& info,
                          const std::string& file, const std::string& kernel,
                          const std::string& options) {
  const std::string src = kernel_source(file, kernel);
  const std::string what = "kernels_cl/" + file + " (kernel " + kernel + ") for " + info.name;
  const auto dir = kernel_cache_dir();
  const auto path =
      dir / (file + "-" + kernel + "-" + program_cache_key(info, src, options) + ".bin");

  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    std::ifstream in(path, std::ios::binary);
    std::string bin((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const unsigned char* bp = reinterpret_cast<const unsigned char*>(bin.data());
    size_t bn = bin.size();
    cl_int status = CL_SUCCESS, err = CL_SUCCESS;
    cl_program p = clCreateProgramWithBinary(ctx, 1, &dev, &bn, &bp, &status, &err);
    if (err == CL_SUCCESS && status == CL_SUCCESS) {
      cl::Program prog(p);
      if (clBuildProgram(p, 1, &dev, options.c_str(), nullptr, nullptr) == CL_SUCCESS) return prog;
    }
    // A stale or corrupt binary: fall through and rebuild from source.
  }

  // The first build from source in a process says so: a first run compiles every kernel it uses
  // (the default job, configs/dsv3-mtp-cpu.yaml, 13 s on the 2-core PoCL CPU against 0.3 s with
  // the caches warm) and would otherwise print nothing until its first step ends.
  static std::once_flag told;
  std::call_once(told, [&] {
    std::fprintf(stderr, "clshard: compiling OpenCL kernels for %s; they are kept in %s\n",
                 info.name.c_str(), dir.string().c_str());
  });
  const char* s = src.c_str();
  size_t n = src.size();
  cl_int err = CL_SUCCESS;
  cl::Program prog(clCreateProgramWithSource(ctx, 1, &s, &n, &err));
  cl::check(err, "creating program " + what);
  build(prog.get(), dev, options, what);

  size_t bin_size = 0;
  if (clGetProgramInfo(prog.get(), CL_PROGRAM_BINARY_SIZES, sizeof bin_size, &bin_size, nullptr) ==
          CL_SUCCESS &&
      bin_size > 0) {
    std::string bin(bin_size, '\0');
    unsigned char* bp = reinterpret_cast<unsigned char*>(bin.data());
    if (clGetProgramInfo(prog.get(), CL_PROGRAM_BINARIES, sizeof bp, &bp, nullptr) ==
        CL_SUCCESS) {
      std::filesystem::create_directories(dir, ec);
      // Write then rename, so a concurrent reader never sees half a file.
      auto tmp = path;
      tmp += ".tmp" + std::to_string(::getpid());
      {
        std::ofstream out(tmp, std::ios::binary);
        out.write(bin.data(), static_cast<std::streamsize>(bin.size()));
      }
      std::filesystem::rename(tmp, path, ec);
      if (ec) std::filesystem::remove(tmp, ec);
    }
  }
  return prog;
}

}  // namespace clshard
