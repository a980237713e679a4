// Per-stage wall-clock accounting for `teo bench`. Off by default; when off a Scope costs one
// branch. Stages are timed on the calling thread around whole (parallel) stage calls.
#pragma once

#include <array>
#include <chrono>
#include <vector>

namespace teo::profile {

// Every timed stage of forward() and backward(), in pipeline order. The names below are what
// `teo bench` prints.
enum class Stage {
  embedding,
  layer_norm,
  qkv_proj,
  attention,
  out_proj,
  residual,
  ffn_fc1,
  activation,
  ffn_fc2,
  head,
  bwd_zero_fill,
  bwd_head,
  bwd_layer_norm,
  bwd_residual,
  bwd_ffn_fc2,
  bwd_activation,
  bwd_ffn_fc1,
  bwd_out_proj,
  bwd_attention,
  bwd_qkv_proj,
  bwd_embedding,
};
inline constexpr std::size_t kNumStages = static_cast<std::size_t>(Stage::bwd_embedding) + 1;
inline constexpr std::array<const char*, kNumStages> kStageNames = {
    "embedding",      "layer_norm",  "qkv_proj",       "attention",     "out_proj",
    "residual",       "ffn_fc1",     "activation",     "ffn_fc2",       "head",
    "bwd.zero_fill",  "bwd.head",    "bwd.layer_norm", "bwd.residual",  "bwd.ffn_fc2",
    "bwd.activation", "bwd.ffn_fc1", "bwd.out_proj",   "bwd.attention", "bwd.qkv_proj",
    "bwd.embedding"};
constexpr const char* name(Stage s) {
  return kStageNames[static_cast<std::size_t>(s)];
}

struct Timing {
  Stage stage;
  double seconds = 0;
  long calls = 0;
};

void set_enabled(bool on);
bool enabled();
void reset();
// The stages timed since reset(), in the order they were first entered.
const std::vector<Timing>& timings();
void add(Stage stage, double seconds);

// Times its own lifetime as `stage` when profiling is on.
class Scope {
 public:
  explicit Scope(Stage stage) : stage_(stage) {
    if (enabled()) start_ = std::chrono::steady_clock::now();
  }
  ~Scope() {
    if (enabled())
      add(stage_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Stage stage_;
  std::chrono::steady_clock::time_point start_{};
};

}  // namespace teo::profile
