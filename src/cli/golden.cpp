#include "cli/commands.hpp"

#include <algorithm>
#include <filesystem>
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/progress.hpp"
#include "teo/files.hpp"
#include "teo/golden_ops.hpp"
#include "teo/names.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"
#include "teo/train/session.hpp"

namespace teo::cli {

int run_golden_generate(const GoldenGenerateOptions& opts, std::ostream& out) {
  const bool one = !opts.config_path.empty() || !opts.out_path.empty();
  if (one == !opts.corpus_dir.empty()) {
    throw ConfigError("golden generate needs either --config and --out, or --corpus");
  }
  const bool user_weights = !opts.weights.empty() || !opts.names.empty() || !opts.hf_config.empty();
  if (!opts.corpus_dir.empty()) {
    if (!opts.keep.empty()) throw ConfigError("--keep applies to one case (--config, --out)");
    if (user_weights) {
      throw ConfigError("--weights, --names and --hf-config apply to one case (--config, --out)");
    }
    golden::generate_corpus(opts.corpus_dir, out, opts.force);
    return 0;
  }
  if (opts.config_path.empty() || opts.out_path.empty()) {
    throw ConfigError("golden generate needs both --config CASE.json and --out FILE");
  }
  if (user_weights && (opts.weights.empty() || opts.names.empty()))
    throw ConfigError("--weights and --names go together (and --hf-config needs both)");
  std::shared_ptr<const names::NameMap> map;
  if (!opts.names.empty()) map = std::make_shared<names::NameMap>(names::NameMap::load(opts.names));
  golden::Case c;
  if (opts.hf_config.empty()) {
    c = golden::Case::from_file(opts.config_path);
  } else {
    // the checkpoint's config.json gives the model; CASE.json its "case" and any key over it
    nlohmann::json j = names::config_from_hf(read_json_file(opts.hf_config), *map);
    const nlohmann::json spec = read_json_file(opts.config_path);
    if (!spec.is_object()) throw ConfigError(opts.config_path + ": not a JSON object");
    for (const auto& [k, v] : spec.items()) j[k] = v;
    if (!opts.weights.empty())
      j = names::with_checkpoint_targets(safetensors::map(opts.weights), *map, std::move(j));
    try {
      c = golden::Case::from_json(j);
    } catch (const ConfigError& e) {
      throw ConfigError(opts.config_path + " over " + opts.hf_config + ": " + e.what());
    }
  }
  std::optional<safetensors::File> checkpoint;
  if (!opts.weights.empty()) checkpoint = safetensors::map(opts.weights);
  ProgressLine progress(opts.progress);
  // SIGINT and SIGTERM stop at the next stage or tensor written; the temporary file goes, and
  // `--out` is untouched.
  train::StopSignals signals;
  golden::GenerateOptions g;
  g.allow_ill_conditioned = opts.allow_ill_conditioned;
  g.keep = opts.keep;
  g.overwrite = opts.force;
  const auto stop = [&](const std::string& when) {
    if (train::StopSignals::requested()) {
      throw Interrupted("interrupted " + when + "; " + opts.out_path + " was not written");
    }
  };
  g.progress = [&](const std::string& stage) {
    stop("before " + stage);
    progress.show(stage, true);
  };
  g.poll = [&] { stop("while writing"); };
  if (checkpoint) {
    g.checkpoint = &*checkpoint;
    g.names = map;
    g.weights_source = map->family + ": " + std::filesystem::path(opts.weights).filename().string();
  }
  const std::uint64_t size = golden::generate_file(c, opts.out_path, g);
  progress.clear();
  out << "wrote " << opts.out_path << " (" << size << " bytes)\n";
  return 0;
}

int run_golden_export(const GoldenExportOptions& opts, std::ostream& out) {
  const safetensors::File g = safetensors::map(opts.golden);
  golden::validate(g);
  if (golden::is_op_file(g)) {
    throw ConfigError(opts.golden + " is an op case: export takes a model case's parameters");
  }
  const names::NameMap map = names::NameMap::load(opts.names);
  // both made, and both places checked, before either is written: a config the family cannot
  // express, or a config.json that exists, writes nothing
  namespace fs = std::filesystem;
  if (!opts.hf_config_path.empty() &&
      fs::weakly_canonical(opts.hf_config_path) == fs::weakly_canonical(opts.out_path)) {
    throw ConfigError("--out and --hf-config are the same file: " + opts.out_path);
  }
  for (const std::string& path : {opts.out_path, opts.hf_config_path}) {
    if (!path.empty() && !opts.force && fs::exists(path))
      throw FileError(path + ": already exists (pass --force to overwrite it)");
  }
  const std::string weights = safetensors::serialize(names::checkpoint_of(g, map));
  std::string config;
  if (!opts.hf_config_path.empty())
    config = names::hf_config_of(golden::case_of(g).config, map).dump(2) + "\n";
  write_file_atomic(opts.out_path, weights, opts.force);
  out << "wrote " << opts.out_path << " (" << weights.size() << " bytes, " << map.family
      << " names)\n";
  if (!config.empty()) {
    write_file_atomic(opts.hf_config_path, config, opts.force);
    out << "wrote " << opts.hf_config_path << "\n";
  }
  return 0;
}

int run_golden_op(const GoldenOpOptions& opts, std::ostream& out) {
  const golden::OpCase c = golden::OpCase::from_file(opts.spec_path, opts.op);
  const std::uint64_t size =
      golden::write_op(c, opts.out_path, opts.force, opts.allow_ill_conditioned, opts.keep);
  out << "wrote " << opts.out_path << " (" << size << " bytes)\n";
  return 0;
}

namespace {

std::string dims_str(const std::vector<std::int64_t>& d) {
  std::string s = "(";
  for (std::size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

// One case of `golden list`: its name, format or op, dtype, and the tensors a candidate writes.
void list_one(const std::string& path, std::ostream& out) {
  const safetensors::File f = safetensors::read(path);
  try {
    golden::validate(f);  // what it lists is then its contract's
  } catch (const FormatError& e) {
    throw FormatError(path + ": " + e.what());
  }
  const std::string name = std::filesystem::path(path).filename().string();
  if (golden::is_op_file(f)) {
    const golden::OpCase c = golden::op_case_of(f);
    out << name << "  op " << c.op << "  " << c.dtype
        << (c.precision ? std::string(" ") + to_string(*c.precision) : "") << "\n";
    out << "  spec " << c.spec.dump() << "\n";
    for (const auto& t : f.tensors) {
      // fp8.*: the stored fp8 operands a backend may be fed instead of quantizing its own
      if (t.name.starts_with("input.") || t.name.starts_with("param.") ||
          t.name.starts_with("grad.output.") || t.name.starts_with("fp8.")) {
        out << "  reads  " << t.name << " " << dims_str(t.shape) << " "
            << safetensors::dtype_name(t.dtype) << "\n";
      }
    }
    for (const auto& t : golden::op_contract(c)) {
      out << "  writes " << t.name << " " << dims_str(t.shape) << (t.optional ? "  (optional)" : "")
          << "\n";
    }
    return;
  }
  const golden::Case c = golden::case_of(f);
  out << name << "  model  " << c.dtype
      << (c.precision ? std::string(" ") + to_string(*c.precision) : "") << "  "
      << c.config.num_layers << " layer(s), batch " << c.batch << ", seq_len " << c.seq_len
      << ", d_model " << c.config.d_model << ", heads " << c.config.attention.num_heads << "\n";
  out << "  config " << c.config.to_json().dump() << "\n";
  out << "  case " << c.case_json().dump() << "\n";
  for (const auto& t : f.tensors) {
    if (t.name.starts_with("input.") || t.name.starts_with("param.") ||
        t.name.starts_with("dropout.")) {
      out << "  reads  " << t.name << " " << dims_str(t.shape) << " "
          << safetensors::dtype_name(t.dtype) << "\n";
    }
  }
  for (const auto& t : f.tensors) {
    if (t.name.starts_with("act.") || t.name.starts_with("grad.")) {
      out << "  writes " << t.name << " " << dims_str(t.shape) << "\n";
    }
  }
}

}  // namespace

int run_golden_list(const std::string& path, std::ostream& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw FileError(path + ": no such file or directory");
  if (!fs::is_directory(path, ec)) {
    list_one(path, out);
    return 0;
  }
  std::vector<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(path, ec)) {
    if (e.is_regular_file() && e.path().extension() == ".safetensors") {
      files.push_back(e.path().string());
    }
  }
  if (ec) throw FileError(path + ": cannot list the directory: " + ec.message());
  if (files.empty()) throw FileError(path + ": holds no .safetensors files");
  std::sort(files.begin(), files.end());
  for (const auto& f : files) list_one(f, out);
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
  if (!opts.names.empty())
    co.names = std::make_shared<names::NameMap>(names::NameMap::load(opts.names));
  ProgressLine progress(opts.progress);
  co.progress = [&](const std::string& what, bool detail) { progress.show(what, !detail); };
  const auto reports = golden::check_paths(opts.golden, opts.candidate, co);
  progress.clear();
  golden::print_text(reports, out, {.hide_unchecked = opts.hide_unchecked});
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
