// The tuning table's data side (KernelTuning in device.h): the fields by name, and the per-device
// entries a tuning run writes into the kernel cache directory, which lookup_kernel_tuning reads
// before the built-in rows of runtime/kernel_tuning.cpp.
//
// The file, tuning.json in kernel_cache_dir() (program_cache.h):
//   {"entries": [{"vendor": "NVIDIA Corporation", "name": "NVIDIA H200",
//                 "tuning": {"attn_wg": 128, "mla_heads": 16}}]}
// An entry applies to the device whose CL_DEVICE_VENDOR and CL_DEVICE_NAME equal its own; the
// fields it names override the built-in row, the others keep it. Unknown fields, values that are
// not positive integers and unreadable JSON are errors naming the file and the field.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/device.h"

namespace clshard {

// The built-in row for a device (no file consulted).
KernelTuning builtin_kernel_tuning(const DeviceInfo& info);

// Every field's name, in KernelTuning's order; reading and setting one by name. set returns false
// for an unknown name.
const std::vector<std::string>& kernel_tuning_fields();
uint64_t kernel_tuning_field(const KernelTuning& t, const std::string& field);
bool set_kernel_tuning_field(KernelTuning& t, const std::string& field, uint64_t value);
// Every field is a count or size, positive, but those whose 0 is a value: the row thresholds
// (0: never) and the switches (0: off), kernel_tuning.cpp's zero_fields.
bool kernel_tuning_zero_allowed(const std::string& field);

// kernel_cache_dir() / "tuning.json".
std::filesystem::path kernel_tuning_file();

// Writes (or replaces) this device's entry in kernel_tuning_file() with every field of `t`.
void save_kernel_tuning(const DeviceInfo& info, const KernelTuning& t);

}  // namespace clshard
