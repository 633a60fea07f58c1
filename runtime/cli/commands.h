#pragma once

#include "runtime/safetensors.h"

namespace clshard::cli {
// Parses the command line and runs one subcommand; returns the process exit code.
int run(int argc, char** argv);

// What the subcommands pass Deployment::open: a copy of the weights (model.mmap: false) shown on
// stderr (progress.h's load_progress_printer).
LoadProgress stderr_load_progress();
}  // namespace clshard::cli
