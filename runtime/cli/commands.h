#pragma once

namespace clshard::cli {
// Parses the command line and runs one subcommand; returns the process exit code.
int run(int argc, char** argv);
}  // namespace clshard::cli
