// Per-stage wall-clock accounting for `teo bench`. Off by default; when off a Scope costs one
// branch. Stages are timed on the calling thread around whole (parallel) stage calls.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace teo::profile {

struct Stage {
  std::string name;
  double seconds = 0;
  long calls = 0;
};

void set_enabled(bool on);
bool enabled();
void reset();
// Stages in the order they were first entered.
const std::vector<Stage>& stages();
void add(const char* name, double seconds);

class Scope {
 public:
  explicit Scope(const char* name) : name_(name) {
    if (enabled()) start_ = std::chrono::steady_clock::now();
  }
  ~Scope() {
    if (enabled())
      add(name_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  std::chrono::steady_clock::time_point start_{};
};

}  // namespace teo::profile
