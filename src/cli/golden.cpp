#include "cli/commands.hpp"

#include <iostream>

#include <nlohmann/json.hpp>

#include "teo/files.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"

namespace teo::cli {

int run_golden_generate(const GoldenGenerateOptions& opts, std::ostream& out) {
  const bool one = !opts.config_path.empty() || !opts.out_path.empty();
  if (one == !opts.corpus_dir.empty()) {
    throw ConfigError("golden generate needs either --config and --out, or --corpus");
  }
  if (!opts.corpus_dir.empty()) {
    golden::generate_corpus(opts.corpus_dir, out, opts.force);
    return 0;
  }
  if (opts.config_path.empty() || opts.out_path.empty()) {
    throw ConfigError("golden generate needs both --config CASE.json and --out FILE");
  }
  const golden::Case c = golden::Case::from_file(opts.config_path);
  const std::string bytes = safetensors::serialize(golden::make(c, opts.allow_ill_conditioned));
  write_file_atomic(opts.out_path, bytes, opts.force);
  out << "wrote " << opts.out_path << " (" << bytes.size() << " bytes)\n";
  return 0;
}

int run_golden_check(const GoldenCheckOptions& opts, std::ostream& out) {
  golden::CheckOptions co = opts.tolerances;
  if (opts.only == "forward")
    co.only = golden::Only::forward;
  else if (opts.only == "backward")
    co.only = golden::Only::backward;
  else if (opts.only == "all")
    co.only = golden::Only::all;
  else
    throw ConfigError("--only must be forward or backward, got \"" + opts.only + "\"");
  if (!opts.precision.empty()) co.precision = parse_precision(opts.precision, "--precision");
  const auto reports = golden::check_paths(opts.golden, opts.candidate, co);
  golden::print_text(reports, out);
  // A report that cannot be written is an error on stderr, but the verdict stands: the exit code
  // says whether the candidate passed (docs/golden-format.md).
  for (const auto& [path, text] : {std::pair{opts.junit_path, golden::junit_xml(reports)},
                                   std::pair{opts.json_path, golden::json_report(reports)}}) {
    try {
      if (!path.empty()) write_file_atomic(path, text, true);
    } catch (const FileError& e) {
      std::cerr << "teo: error: report not written: " << e.what() << "\n";
    }
  }
  const golden::Verdict v = golden::verdict(reports, opts.require_all);
  if (!v.reason.empty()) out << v.reason << "\n";
  return v.exit_code;
}

}  // namespace teo::cli
