// `teo shapes`: the table of every stage's shape, forward then backward.
#pragma once

#include <ostream>
#include <string>

#include "teo/errors.hpp"

namespace teo::cli {

struct ShapesOptions {
  std::string config_path;  // empty: the built-in default EncoderConfig
  index_t batch = 2;
  index_t seq_len = 0;  // 0: min(8, max_len)
  std::string dtype = "float64";
};

// Returns the process exit code. Throws teo::Error on an invalid config or shape.
int run_shapes(const ShapesOptions& opts, std::ostream& out);

}  // namespace teo::cli
