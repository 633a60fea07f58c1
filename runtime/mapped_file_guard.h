// Checkpoints are memory-mapped (runtime/safetensors.h). When such a file is truncated or
// replaced while a job runs, reading a page past its new end raises SIGBUS, in our thread or in
// the OpenCL driver's. We do not copy the weights to avoid that (a 700 GB checkpoint); instead
// a SIGBUS handler looks the faulting address up among the mappings and, when it falls in one,
// ends the process with a message naming the file rather than a bare "Bus error":
//   clshard: checkpoint file /m/model.safetensors changed while in use (truncated or replaced?);
//   restore it and rerun (a batch job resumes where it stopped)
// and exit status 3. Other SIGBUS faults keep the default behaviour.
#pragma once

#include <cstddef>
#include <filesystem>

namespace clshard {

// Registers [base, base + size) as a mapping of `path` (installs the handler on first use).
void guard_mapped_file(const void* base, size_t size, const std::filesystem::path& path);
void unguard_mapped_file(const void* base);

// The exit status of a process ended by a changed checkpoint.
inline constexpr int kExitCheckpointChanged = 3;

}  // namespace clshard
