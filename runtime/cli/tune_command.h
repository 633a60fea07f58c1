#pragma once

#include <CLI/CLI.hpp>

namespace clshard::cli {
// Adds `clshard tune` (runtime/kernel_tune.h) to the program's subcommands.
void add_tune_command(CLI::App& app);
}  // namespace clshard::cli
