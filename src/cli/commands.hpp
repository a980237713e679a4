// The `teo` command's subcommands. Each returns the process exit code: 0 success, 1 a failed
// check; a teo::Error propagates, and main() prints it and exits 2.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "teo/golden.hpp"
#include "teo/train/options.hpp"

namespace CLI {
class App;
}  // namespace CLI

namespace teo::cli {

// `teo shapes`: every stage's shape, forward then backward.
struct ShapesOptions {
  std::string config_path;  // empty: the built-in default ModelConfig
  index_t batch = 2;
  index_t seq_len = 0;  // 0: min(8, max_len)
  std::string dtype = "float64";
  index_t steps = 0;    // a decoder's generation steps after the prompt
  index_t tgt_len = 0;  // an encoder_decoder's target length (0: seq_len)
};
int run_shapes(const ShapesOptions& opts, std::ostream& out);

// `teo bench`: forward and forward+backward on a preset, per stage, with GFLOP/s.
struct BenchOptions {
  std::string preset = "small";  // "bert-base" or "small"
  std::string dtype = "float32";
  int repeats = 5;
  int warmup = 1;
  bool json = false;
  std::string precision;  // "": none; tf32, bf16 or fp16: also time the emulation (float32)
  std::string with;       // a JSON object of config keys over the preset's (attention variants)
};
int run_bench(const BenchOptions& opts, std::ostream& out);

// `teo golden generate` and `teo golden check`.
struct GoldenGenerateOptions {
  std::string config_path;             // one case: CASE.json ...
  std::string out_path;                // ... written here
  std::string corpus_dir;              // or: regenerate <dir>/cases.json into <dir>
  bool force = false;                  // overwrite an existing --out file
  bool allow_ill_conditioned = false;  // write an ill-conditioned float32 case, marked as such
  std::string keep;                    // comma-separated globs of the tensors to store ("": all)
  bool progress = true;                // show the stages on standard error
  // A user's checkpoint: its parameters replace the seed's (--weights, --names), and its
  // config.json may give the config (--hf-config).
  std::string weights, names, hf_config;
};
int run_golden_generate(const GoldenGenerateOptions& opts, std::ostream& out);

struct GoldenCheckOptions {
  std::string golden, candidate;
  std::string only = "all";  // all | forward | backward
  std::string junit_path, json_path;
  bool require_all = false;     // a tensor that is not checked counts as a failure
  bool hide_unchecked = false;  // the text report leaves out the rows of tensors not checked
  std::string precision;        // "" (implied) | fp64 | fp32 | tf32 | bf16 | fp16
  golden::CheckOptions tolerances;
  bool progress = true;  // show the case and tensor being compared on standard error
  std::string names;     // a name map: candidate gradients may use its checkpoint names
};

// `teo golden export`: a golden's parameters under a family's checkpoint names.
struct GoldenExportOptions {
  std::string golden, names, out_path, hf_config_path;
  bool force = false;
};
int run_golden_export(const GoldenExportOptions& opts, std::ostream& out);
int run_golden_check(const GoldenCheckOptions& opts, std::ostream& out);

// `teo golden op`: one op case from a spec; `teo golden list`: what each case holds and what a
// candidate writes.
struct GoldenOpOptions {
  std::string op;  // may also be the spec's "op"
  std::string spec_path, out_path;
  bool force = false;
  bool allow_ill_conditioned = false;
  std::string keep;  // as GoldenGenerateOptions::keep
};
int run_golden_op(const GoldenOpOptions& opts, std::ostream& out);
int run_golden_list(const std::string& path, std::ostream& out);

// `teo gguf inspect | dequantize | quantize` (src/cli/gguf.cpp).
struct GgufOptions {
  std::string command;  // set by the subcommand that ran
  std::string in_path, out_path, type, arch;
  bool json = false, force = false;
};
int run_gguf(const GgufOptions& opts, std::ostream& out);
CLI::App* add_gguf_commands(CLI::App& app, GgufOptions& opts);

// `teo quant dequantize | quantize` (src/cli/quant.cpp).
struct QuantOptions {
  std::string command;  // set by the subcommand that ran
  std::string in_path, out_path, format;
  int zero_offset = 1;
  index_t group_size = 0;  // 0: unset (quantize 128, dequantize from the shapes)
  bool act_order = false, force = false;
  std::uint64_t seed = 0;
};
int run_quant(const QuantOptions& opts, std::ostream& out);
CLI::App* add_quant_commands(CLI::App& app, QuantOptions& opts);

// `teo train` (or resume opts.resume) with progress lines, metrics.csv, checkpoints,
// summary.json and curves.png in opts.out_dir; `teo predict` prints each word's language and
// class probabilities from a checkpoint's evaluated weights.
int run_train(const train::TrainOptions& opts, std::ostream& out);
int run_predict(const std::string& checkpoint, const std::vector<std::string>& words,
                std::ostream& out);

// curves.png from metrics.csv with gnuplot, run without a shell; false when gnuplot is missing or
// fails, and then no partial png is left behind.
bool plot_curves(const std::string& csv, const std::string& png);

}  // namespace teo::cli
