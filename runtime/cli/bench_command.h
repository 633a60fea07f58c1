#pragma once

#include <CLI/CLI.hpp>

namespace clshard::cli {
// Adds `clshard bench` (runtime/engine/bench.h) to the program's subcommands.
void add_bench_command(CLI::App& app);
}  // namespace clshard::cli
