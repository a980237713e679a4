// `teo golden generate` and `teo golden check`.
#pragma once

#include <ostream>
#include <string>

#include "teo/golden.hpp"

namespace teo::cli {

struct GoldenGenerateOptions {
  std::string config_path;  // one case: CASE.json ...
  std::string out_path;     // ... written here
  std::string corpus_dir;   // or: regenerate <dir>/cases.json into <dir>
  bool force = false;       // overwrite an existing --out file
};

struct GoldenCheckOptions {
  std::string golden, candidate;
  std::string only = "all";  // all | forward | backward
  std::string junit_path, json_path;
  bool require_all = false;  // a tensor that is not checked counts as a failure
  golden::CheckOptions tolerances;
};

// Each returns the exit code: 0 success, 1 a failed check; teo::Error propagates (exit 2).
int run_golden_generate(const GoldenGenerateOptions& opts, std::ostream& out);
int run_golden_check(const GoldenCheckOptions& opts, std::ostream& out);

}  // namespace teo::cli
