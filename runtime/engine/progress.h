// Progress of a batch job on stderr: a bar redrawn in place when stderr is a terminal, plain
// periodic lines when it is a file or a pipe (logs should not fill with carriage returns), and a
// closing summary either way.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>

#include "runtime/safetensors.h"

namespace clshard {

class Progress {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  // `clock` is injectable for tests; empty: std::chrono::steady_clock::now. The wall time starts
  // here.
  Progress(size_t total_requests, bool is_terminal, std::ostream& err, Clock clock = {});

  // The job's counters so far: records done (errors included), of which `errors` are errors, and
  // the prompt and completion tokens of the finished requests. Draws when due: at most ~10 times a
  // second on a terminal; otherwise a line every 5 s or each time another 10% is done.
  void update(size_t done, uint64_t tokens_in, uint64_t tokens_out, size_t errors = 0);

  // Ends the bar and prints the summary line. Once; later calls do nothing.
  void finish();

  // Whether stderr is a terminal (isatty(2)), for the constructor.
  static bool stderr_is_terminal();
  // "0:07", "12:34", "1:02:03".
  static std::string format_duration(double seconds);

 private:
  double elapsed_s() const;
  std::string eta() const;
  double output_rate() const;
  void draw_bar();
  void print_line();

  size_t total_;
  bool terminal_;
  std::ostream& err_;
  Clock clock_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  size_t done_ = 0;
  size_t errors_ = 0;
  uint64_t tokens_in_ = 0;
  uint64_t tokens_out_ = 0;
  bool drawn_ = false;       // the terminal bar is on screen
  size_t tenths_printed_ = 0;  // the last 10% step that got a line
  bool finished_ = false;
};

// A LoadProgress that shows a copy of the weights (model.mmap: false) on `err`: "reading DIR into
// memory: 1.25 of 2.50 GB (50%), ETA 0:02" (MB below 1 GB), redrawn in place on a terminal (~10
// times a second), otherwise a line at the start, each 10% and every 5 s; then "read DIR into
// memory: 2.50 GB in 3.1 s (0.81 GB/s)". A DeepSeek-V3-sized checkpoint reads for minutes.
// `clock` as Progress's.
LoadProgress load_progress_printer(std::ostream& err, bool is_terminal, Progress::Clock clock = {});

}  // namespace clshard
