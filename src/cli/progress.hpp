// The progress display of `teo golden generate` and `teo golden check`, on standard error so that
// standard output stays the command's result: on a terminal one line, rewritten in place; otherwise
// plain lines for the steps worth a line (as `teo train` does).
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

namespace teo::cli {

class ProgressLine {
 public:
  explicit ProgressLine(bool enabled)
      : enabled_(enabled), tty_(enabled && ::isatty(STDERR_FILENO)) {}
  ~ProgressLine() { clear(); }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Shows `what` with the seconds since the start; `plain` also prints it off a terminal.
  void show(const std::string& what, bool plain) {
    if (!enabled_ || (!tty_ && !plain)) return;
    std::ostringstream line;
    line << "[" << std::fixed << std::setprecision(1) << seconds() << " s] " << what;
    std::string s = line.str();
    if (!tty_) {
      std::cerr << s << "\n";
      return;
    }
    if (s.size() > 100) s = s.substr(0, 97) + "...";
    std::cerr << "\r" << s << std::string(shown_ > s.size() ? shown_ - s.size() : 0, ' ')
              << std::flush;
    shown_ = s.size();
  }

  // Erases the line on a terminal (before the result is printed).
  void clear() {
    if (tty_ && shown_) std::cerr << "\r" << std::string(shown_, ' ') << "\r" << std::flush;
    shown_ = 0;
  }

  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  bool enabled_, tty_;
  std::size_t shown_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace teo::cli
