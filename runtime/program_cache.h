// Builds OpenCL programs from the embedded kernels_cl/ sources, once per device, and keeps the
// compiled binaries on disk so that later runs skip the compiler.
#pragma once

#include <CL/cl.h>

#include <filesystem>
#include <string>
#include <string_view>

#include "runtime/cl.h"

namespace clshard {

struct DeviceInfo;

// The source of one kernels_cl/ file, with kernels_cl/common.cl prepended and its #include "x.cl"
// lines replaced by those embedded files.
std::string kernel_source(const std::string& file);

// The compiler's log of `p`'s last build for device `d` (empty where there was none).
std::string build_log(cl_program p, cl_device_id d);

// Where compiled binaries live: $CLSHARD_KERNEL_CACHE, else $XDG_CACHE_HOME/clshard/kernels,
// else ~/.cache/clshard/kernels.
std::filesystem::path kernel_cache_dir();

// The cache key: device name, driver and platform versions, source hash and build options.
std::string program_cache_key(const DeviceInfo& info, std::string_view source,
                              const std::string& options);

// Builds `file` for one device with `options`, loading the binary from the cache when present.
// Build failures throw with the compiler's log.
cl::Program build_program(cl_context ctx, cl_device_id dev, const DeviceInfo& info,
                          const std::string& file, const std::string& options);

}  // namespace clshard
