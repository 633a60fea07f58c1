#include "runtime/engine/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

namespace clshard {

namespace {
constexpr auto kTerminalInterval = std::chrono::milliseconds(100);
constexpr auto kLineInterval = std::chrono::seconds(5);
constexpr int kBarWidth = 30;

std::string fixed1(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}
}  // namespace

Progress::Progress(size_t total_requests, bool is_terminal, std::ostream& err, Clock clock)
    : total_(total_requests),
      terminal_(is_terminal),
      err_(err),
      clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })),
      start_(clock_()),
      last_draw_(start_) {}

bool Progress::stderr_is_terminal() { return ::isatty(2) == 1; }

std::string Progress::format_duration(double seconds) {
  long s = seconds < 0 ? 0 : long(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(clock_() - start_).count();
}

double Progress::output_rate() const {
  double t = elapsed_s();
  return t > 0 ? double(tokens_out_) / t : 0.0;
}

std::string Progress::eta() const {
  if (done_ >= total_) return "0:00";
  if (done_ == 0) return "?";
  // Requests so far took elapsed/done each on average; the rest will too.
  return format_duration(elapsed_s() * double(total_ - done_) / double(done_));
}

void Progress::update(size_t done, uint64_t tokens_in, uint64_t tokens_out, size_t errors) {
  if (finished_) return;
  done_ = done;
  tokens_in_ = tokens_in;
  tokens_out_ = tokens_out;
  errors_ = errors;
  auto now = clock_();
  if (terminal_) {
    if (!drawn_ || now - last_draw_ >= kTerminalInterval || done_ >= total_) {
      last_draw_ = now;
      draw_bar();
    }
    return;
  }
  size_t tenths = total_ == 0 ? 10 : done_ * 10 / total_;
  if (tenths > tenths_printed_ || now - last_draw_ >= kLineInterval) {
    tenths_printed_ = std::max(tenths_printed_, tenths);
    last_draw_ = now;
    print_line();
  }
}

void Progress::draw_bar() {
  size_t filled = total_ == 0 ? kBarWidth : std::min<size_t>(kBarWidth, done_ * kBarWidth / total_);
  std::string bar(filled, '#');
  bar.append(kBarWidth - filled, '.');
  err_ << "\r[" << bar << "] " << done_ << "/" << total_ << " requests";
  if (errors_) err_ << " (" << errors_ << " errors)";
  err_ << " | " << fixed1(output_rate()) << " tok/s | ETA " << eta() << "\x1b[K" << std::flush;
  drawn_ = true;
}

void Progress::print_line() {
  size_t percent = total_ == 0 ? 100 : done_ * 100 / total_;
  err_ << "progress: " << done_ << "/" << total_ << " requests (" << percent << "%)";
  if (errors_) err_ << ", " << errors_ << " errors";
  err_ << ", " << tokens_in_ << " tokens in, " << tokens_out_ << " tokens out, "
       << fixed1(output_rate()) << " output tok/s, elapsed " << format_duration(elapsed_s())
       << ", ETA " << eta() << "\n" << std::flush;
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (terminal_ && drawn_) {
    draw_bar();
    err_ << "\n";
  }
  double wall = elapsed_s();
  err_ << "done: " << done_ << "/" << total_ << " requests, " << errors_ << " errors, "
       << tokens_in_ << " tokens in, " << tokens_out_ << " tokens out, " << fixed1(wall)
       << " s wall, " << fixed1(wall > 0 ? double(tokens_out_) / wall : 0.0) << " output tok/s\n"
       << std::flush;
}

namespace {

// `bytes` in the unit that suits `scale` (GB from 1 GB on, else MB), two decimals, no unit name.
std::string in_unit(uint64_t bytes, uint64_t scale) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", double(bytes) / (scale >= 1'000'000'000 ? 1e9 : 1e6));
  return buf;
}
const char* unit_name(uint64_t scale) { return scale >= 1'000'000'000 ? "GB" : "MB"; }

// One directory's copy at a time: a report for another directory, or one starting over at 0,
// begins a new one.
struct LoadPrinter {
  std::ostream& err;
  bool terminal;
  Progress::Clock clock;
  std::filesystem::path dir;
  std::chrono::steady_clock::time_point start, last_draw;
  size_t tenths_printed = 0;
  bool drawn = false;

  void report(const std::filesystem::path& d, uint64_t done, uint64_t total) {
    const auto now = clock();
    if (d != dir || done == 0) {
      dir = d;
      start = last_draw = now;
      tenths_printed = 0;
      drawn = false;
    }
    const double elapsed = std::chrono::duration<double>(now - start).count();
    if (done >= total) {
      if (terminal && drawn) err << "\r\x1b[K";
      err << "read " << dir.string() << " into memory: " << in_unit(total, total) << " "
          << unit_name(total) << " in " << fixed1(elapsed) << " s ("
          << (elapsed > 0 ? fixed1(double(total) / elapsed / 1e9) : "-") << " GB/s)\n"
          << std::flush;
      dir.clear();
      return;
    }
    const size_t tenths = size_t(done * 10 / total);
    const bool due = terminal
                         ? !drawn || now - last_draw >= kTerminalInterval
                         : done == 0 || tenths > tenths_printed || now - last_draw >= kLineInterval;
    if (!due) return;
    last_draw = now;
    tenths_printed = std::max(tenths_printed, tenths);
    const std::string eta =
        done == 0 || elapsed <= 0
            ? "?"
            : Progress::format_duration(elapsed * double(total - done) / double(done));
    err << (terminal ? "\r" : "") << "reading " << dir.string()
        << " into memory: " << in_unit(done, total) << " of " << in_unit(total, total) << " "
        << unit_name(total) << " (" << done * 100 / total << "%), ETA " << eta
        << (terminal ? "\x1b[K" : "\n") << std::flush;
    drawn = true;
  }
};

}  // namespace

LoadProgress load_progress_printer(std::ostream& err, bool is_terminal, Progress::Clock clock) {
  auto printer = std::make_shared<LoadPrinter>(LoadPrinter{
      err, is_terminal,
      clock ? std::move(clock) : Progress::Clock([] { return std::chrono::steady_clock::now(); })});
  return [printer](const std::filesystem::path& dir, uint64_t done, uint64_t total) {
    printer->report(dir, done, total);
  };
}

}  // namespace clshard
