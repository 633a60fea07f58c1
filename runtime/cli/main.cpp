#include <csignal>

#include "runtime/cli/commands.h"

int main(int argc, char** argv) {
  // Past a file size limit (ulimit -f) a write then fails with EFBIG, which the batch job reports
  // naming its output, instead of the process dying of SIGXFSZ half way through a record.
  std::signal(SIGXFSZ, SIG_IGN);
  return clshard::cli::run(argc, argv);
}
