#include "teo/profile.hpp"

#include <cstring>

namespace teo::profile {

namespace {
bool g_enabled = false;
std::vector<Stage>& table() {
  static std::vector<Stage> t;
  return t;
}
}  // namespace

void set_enabled(bool on) {
  g_enabled = on;
}
bool enabled() {
  return g_enabled;
}
void reset() {
  table().clear();
}
const std::vector<Stage>& stages() {
  return table();
}

void add(const char* name, double seconds) {
  for (Stage& s : table()) {
    if (s.name == name) {
      s.seconds += seconds;
      ++s.calls;
      return;
    }
  }
  table().push_back({name, seconds, 1});
}

}  // namespace teo::profile
