// `teo bench`: time the encoder's forward and forward+backward on a preset, per stage.
#pragma once

#include <ostream>
#include <string>

#include "teo/config.hpp"

namespace teo::cli {

struct BenchOptions {
  std::string preset = "small";  // "bert-base" or "small"
  std::string dtype = "float32";
  int repeats = 5;
  int warmup = 1;
  bool json = false;
};

// The preset's config and batch shape; throws ConfigError naming an unknown preset.
EncoderConfig bench_preset(const std::string& name, index_t& batch, index_t& seq_len);

// Forward FLOPs of the whole stack by the project's convention: per layer
// 8 B S D^2 + 4 B S^2 D + 4 B S D F; forward+backward is 3x that.
double forward_flops(const EncoderConfig& cfg, index_t batch, index_t seq_len);

int run_bench(const BenchOptions& opts, std::ostream& out);

}  // namespace teo::cli
