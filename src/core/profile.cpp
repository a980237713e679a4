#include "teo/profile.hpp"

namespace teo::profile {

namespace {
bool g_enabled = false;
std::vector<Timing>& table() {
  static std::vector<Timing> t;
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
const std::vector<Timing>& timings() {
  return table();
}

void add(Stage stage, double seconds) {
  for (Timing& t : table()) {
    if (t.stage == stage) {
      t.seconds += seconds;
      ++t.calls;
      return;
    }
  }
  table().push_back({stage, seconds, 1});
}

}  // namespace teo::profile
