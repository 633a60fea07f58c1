#include "runtime/cli/commands.h"

int main(int argc, char** argv) { return clshard::cli::run(argc, argv); }
