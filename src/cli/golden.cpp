#include "cli/golden.hpp"

#include <fstream>

#include <nlohmann/json.hpp>

#include "teo/files.hpp"
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
  std::ifstream in(opts.config_path, std::ios::binary);
  if (!in) throw FileError(opts.config_path + ": cannot open for reading");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(opts.config_path + ": not valid JSON: " + e.what());
  }
  golden::Case c;
  try {
    c = golden::Case::from_json(j);
  } catch (const ConfigError& e) {
    throw ConfigError(opts.config_path + ": " + e.what());
  } catch (const ShapeError& e) {
    throw ShapeError(opts.config_path + ": " + e.what());
  }
  const std::string bytes = safetensors::serialize(golden::make(c));
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
  const auto reports = golden::check_paths(opts.golden, opts.candidate, co);
  golden::print_text(reports, out);
  if (!opts.junit_path.empty()) {
    write_file_atomic(opts.junit_path, golden::junit_xml(reports), true);
  }
  if (!opts.json_path.empty()) {
    write_file_atomic(opts.json_path, golden::json_report(reports), true);
  }
  int failed = 0, passed = 0, not_checked = 0;
  for (const auto& r : reports) {
    failed += r.failed;
    passed += r.passed;
    not_checked += r.not_checked;
  }
  if (failed > 0) return 1;
  if (passed == 0) {
    out << "nothing was checked: the candidate holds none of the golden's tensors\n";
    return 1;
  }
  if (opts.require_all && not_checked > 0) {
    out << not_checked << " tensor(s) not checked, and --require-all was given\n";
    return 1;
  }
  return 0;
}

}  // namespace teo::cli
