// Golden files: one safetensors file per case holding the inputs, parameters, every stage's
// activation, the gradients and the dropout masks (docs/golden-format.md), a generator that
// reproduces the committed corpus bit for bit, and a checker that compares a candidate backend's
// file with a golden tensor by tensor and names the first stage that diverges.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "teo/config.hpp"
#include "teo/contract.hpp"
#include "teo/fp8.hpp"
#include "teo/model.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"

namespace teo::names {
struct NameMap;
}  // namespace teo::names

namespace teo::golden {

inline constexpr const char* kFormat = "teo-golden/1";

// One case: a model config plus the batch to run it on.
struct Case {
  ModelConfig config;
  index_t batch = 2;
  index_t seq_len = 8;
  std::vector<std::int64_t> lengths;  // empty: every sequence is full
  std::string dtype = "float64";      // "float32" or "float64"
  std::uint64_t seed = 0;
  // A precision case (float32 only): tf32, bf16, fp16 or fp8. Its parameters are rounded to the
  // storage format (bf16, fp16; bf16 for fp8) before the run, so that a backend holding them in
  // the format holds them exactly, and generation refuses the case when that precision's budget
  // would be vacuous on it.
  std::optional<Precision> precision;
  // The recipe of an fp8 case: the case's fp8_* keys (docs/fp8.md, "Emulated passes").
  Fp8Recipe fp8;
  // A generation case (a decoder's, "generate": {"steps": T}): after the forward and backward, T
  // greedy steps through the KV cache, prompted by each sequence's first lengths[b] tokens
  // (docs/golden-format.md, "Generation"). 0: none.
  index_t steps = 0;
  // An encoder_decoder's target: tgt_len tokens per sequence, tgt_lengths (empty: all full). Its
  // source is batch x seq_len with `lengths`.
  index_t tgt_len = 0;
  std::vector<std::int64_t> tgt_lengths;
  // A router replay case (ffn "moe" only, "replay_routing": true): each MoE layer's routing is
  // also an input, input.layers.{i}.moe.topk_ids, which a backend is fed to judge its experts
  // alone (docs/golden-format.md, "Routing").
  bool replay_routing = false;
  // Drawn norm parameters ("drawn_norms": true): every norm's weight is 1 + U(-1/2, 1/2) and its
  // bias U(-1/2, 1/2), in place of PyTorch's 1 and 0, so that a backend which ignores a norm's
  // weight or bias, or reads one norm's weight for another's, fails in the forward pass.
  bool drawn_norms = false;

  // CASE.json: the config keys plus "case": {batch, seq_len, lengths?, dtype, seed, precision?,
  // fp8_*?, generate?, replay_routing?, drawn_norms?}. Throws ConfigError naming the bad key,
  // ShapeError for sizes the config cannot take.
  static Case from_json(const nlohmann::json& j);
  // CASE.json read from `path`: FileError when it cannot be read, and the errors of from_json
  // with the path in front.
  static Case from_file(const std::string& path);
  nlohmann::json case_json() const;  // the "case" object, lengths always spelled out
  contract::Sizes sizes() const { return {batch, seq_len, steps, tgt_len, replay_routing}; }
  // The case's batch: Batch::random, or an encoder_decoder's Batch::random_seq2seq.
  Batch make_batch() const;
};

// Runs the case (forward in train mode, so dropout applies when the config has it, with
// dropout_seed = seed; then backward) on the current backend and returns the golden file.
// A float32 case whose float32 error against float64 is not at rounding level (section
// "Ill-conditioned cases" of docs/golden-format.md) throws IllConditioned naming the stage and the
// cause, unless allow_ill_conditioned, which writes it with __metadata__.ill_conditioned set.
safetensors::File make(const Case& c, bool allow_ill_conditioned = false);

// How generate_file writes a case.
struct GenerateOptions {
  bool allow_ill_conditioned = false;
  std::string keep;  // --keep patterns (keep_only); empty keeps everything
  bool overwrite = false;
  // Called as each stage starts ("float32 forward and backward", "writing 210 tensors", ...).
  // It may throw (Interrupted) to stop: the temporary file is removed and `path` is untouched.
  std::function<void(const std::string& stage)> progress;
  // Called before each tensor is written; may throw to stop, as progress may.
  std::function<void()> poll;
  // A user's checkpoint under a family's names (`--weights`, `--names`): its parameters replace
  // the seed's (names::params_from_checkpoint; optional ones it lacks keep the seed's), and
  // `weights_source` is recorded as __metadata__.weights.
  const safetensors::File* checkpoint = nullptr;
  std::shared_ptr<const names::NameMap> names;
  std::string weights_source;
};

// Writes case c to `path` as make() (then keep_only() with opts.keep) gives it, byte for byte,
// without holding the file in memory: the header first, from the known names and shapes, then
// each run's tensors as soon as they are final, through a temporary file renamed into place at the
// end. A float32 case's float32 run and its float64 reference run one after the other. With
// --keep, the conditioning check judges the tensors kept. Returns the file's size in bytes.
// Errors as make() and keep_only(), and FileError; on any of them nothing is written.
std::uint64_t generate_file(const Case& c, const std::string& path, const GenerateOptions& opts);

// Selective storage (`teo golden generate --keep`): keeps, of the computed tensors (act.*, grad.*
// of a model case; output.*, grad.input.*, grad.param.* of an op case), only those whose name
// matches one of `patterns`, comma-separated globs (`*` any run of characters, dots included;
// `?` one character), with their ref64.* twins; inputs, parameters, upstream gradients and masks
// are always kept. An op case's fp8 operands (fp8.*, make_op) are kept only when a glob matches
// them, each with its .scale. The patterns are recorded as __metadata__.kept. ConfigError naming
// the pattern when one matches no tensor, or when there is none.
void keep_only(safetensors::File& f, const std::string& patterns);
// Which of `names` keep_only keeps (the same rules and errors); `op` for an op case's names.
std::vector<bool> kept_names(const std::vector<std::string>& names, const std::string& patterns,
                             bool op);

// One run of the model as golden tensors: every act.* of the contract, every grad.* when
// `backward` (from the mean loss), and the dropout.* masks when train mode applies dropout, in the
// order and with the bits make() writes them. The Python module's teo.run is this.
struct RunOptions {
  bool train = true;
  std::uint64_t dropout_seed = 0;
  std::optional<Precision> precision;
  bool backward = true;
  const std::map<std::string, std::vector<std::uint8_t>>* masks = nullptr;  // replayed masks
  std::optional<Fp8Recipe> fp8;  // the recipe under fp8 (ForwardOptions::fp8)
  const std::map<index_t, std::vector<std::int32_t>>* routing = nullptr;  // router replay
};
template <class Real>
safetensors::File run_tensors(const Params<Real>& params, const Batch& batch,
                              const RunOptions& opts);

// Checks a golden file, model or op case, against its contract before any of its values is read:
// its metadata; every tensor the contract of its config (or spec) requires, present with the
// contract's dtype and shape (a file written with --keep may leave out computed tensors); no
// tensor the contract does not name; input.lengths equal to the case's and within seq_len, token
// ids within the vocabulary, labels within the classes. FormatError naming the first tensor at
// fault. check(), emulate(), run_op() and the Python module's load() call it first.
void validate(const safetensors::File& golden);

// The case a golden file was made from (its __metadata__ config and case); FormatError when they
// are missing or malformed.
Case case_of(const safetensors::File& golden);

// The golden's case run again in float, emulating precision p (docs/semantics.md, "Reduced
// precision"), from the golden's config, parameters (rounded to p's storage format) and inputs:
// every act.* and grad.* tensor of the contract, as doubles. The dropout masks are regenerated
// from the case's seed and must equal the golden's (FormatError otherwise); an fp16 overflow is a
// RangeError naming the tensor.
std::map<std::string, std::vector<double>> emulate(const safetensors::File& golden, Precision p);

// One entry of golden/cases.json.
struct CorpusEntry {
  std::string name;  // the file is <name>.safetensors
  std::string description;
  Case spec;
};
// golden/cases.json: {"cases": [{"name", "description", <config keys>, "case": {...}}, ...]}.
std::vector<CorpusEntry> read_corpus_cases(const std::string& path);

// Writes every case of <dir>/cases.json to <dir>/<name>.safetensors and <dir>/manifest.json
// (each file's sha256, size and description), each through a temporary file and a rename.
// Without `overwrite`, an existing case file is a FileError and nothing is written.
void generate_corpus(const std::string& dir, std::ostream& log, bool overwrite);

// ---- checking ----------------------------------------------------------------------------------

enum class Only { all, forward, backward };

struct CheckOptions {
  // float64 goldens: pass when max|c - g| <= rtol * scale + atol, scale = max|g|.
  double rtol = 1e-9;
  double atol = 1e-12;
  // float32 goldens: pass when max|c - ref64| <= k * max|g - ref64| + floor,
  // floor = floor_eps * FLT_EPSILON * scale, scale = max|ref64|.
  // A bias gradient's scale is its own maximum too; the key bias gradient's (pure noise) its
  // weight gradient's. In every rule a bound at least max |truth| makes the tensor vacuous.
  double k = 4.0;
  double floor_eps = 8.0;
  Only only = Only::all;
  // The precision the candidate computed in (docs/golden-format.md, "Low-precision backends").
  // Unset: a precision case's own precision, unless the candidate's BF16, F16 or F8 tensors imply
  // another (then that one, and CaseReport::notes says so); else what they imply; else the
  // golden's own dtype. Under
  // tf32, bf16 or fp16 (or fp32 against a float64 golden) a tensor passes when
  //   err(candidate) <= budget_k * err(emulated) + budget_floor * u * scale,
  // err(x) = max |x - truth|, truth the float64 value, emulated = emulate(golden, precision),
  // u = unit_roundoff(storage_format(precision)) (bf16's for fp8), scale as for float32.
  // Under fp8 a tensor of a linear op case must also follow the case's recipe (docs/fp8.md,
  // "Judging"):
  //   max (|candidate - emulated| - one bf16 step) <= fp8_recipe_k * err(emulated)
  //                                                   + 16 * 2^-24 * scale,
  // since a backend that quantizes as the recipe says reproduces the emulated run's fp8 values, and
  // so its error, up to float32 accumulation and the odd rounding flip; another format, scale or
  // block gives an error of its own, as large as the emulated one.
  std::optional<Precision> precision;
  double budget_k = 8.0;
  double budget_floor = 4.0;
  double fp8_recipe_k = 0.5;
  // A candidate tensor whose name is in neither the golden nor its contract fails (a misspelled
  // name must not pass unseen), and so, in directory mode, does a candidate file with no golden of
  // its name; with allow_extra both are listed but accepted.
  bool allow_extra = false;
  // A model case's candidate may name its parameter gradients (and parameters) by a checkpoint
  // family's names (`teo golden check --names hf-bert`): they are read as teo's first
  // (names::candidate_in_teo_names).
  std::shared_ptr<const names::NameMap> names;
  // For a progress display: called as check_paths starts each case ("checking NAME (i/N, SIZE)",
  // detail unless the golden file is 100 MB or more) and as check starts each tensor ("NAME
  // (i/N)", detail). A detail is worth showing on a terminal only.
  std::function<void(const std::string& what, bool detail)> progress;
};

// ambiguous: a routed case's tensor that depends, as a whole, on the routing of a token the
// candidate routed otherwise within the tolerance of its precision (docs/golden-format.md,
// "Routing"), and output.topk_ids when only such tokens differ: neither passed nor failed.
enum class Status { pass, fail, not_checked, vacuous, ambiguous };

struct TensorResult {
  std::string name;  // "act.layers.0.probs", "grad.head.weight", ...
  Status status = Status::not_checked;
  double max_abs = 0;  // max |c - ref| over finite entries (ref = g, or ref64 for float32)
  double max_rel = 0;  // max_abs / max |ref| (reduced precision: / scale); 0 when both are 0
  double bound = 0;    // the allowed max_abs
  double ratio = 0;    // max_abs / bound: the error in units of the allowed bound
  // Under a reduced precision: the emulated run's error relative to scale. A budget is vacuous
  // (status vacuous, never a pass) when that is above 10% (50% under fp8), or when the tensor lies
  // behind a max-pooling argmax that is not resolved: the two largest values of a column within
  // twice the emulated run's errors at them of each other.
  double emulated_err = 0;
  // Under fp8: max (|candidate - emulated| - one bf16 step at the element) / err(emulated), 0 when
  // the emulated error is 0 or when step 1 failed (then it is not computed).
  double recipe_distance = 0;
  std::string message;  // why it failed or was not checked; where the worst error is
  // Whether the values were compared: false for a missing tensor, a dtype or shape mismatch, and a
  // candidate tensor that is not in the golden (max_abs, max_rel, bound and ratio are then
  // meaningless).
  bool compared = false;
  // When not compared: what differs, for the report's numeric columns ("shape [2, 4] vs [2, 3]").
  std::string mismatch;
  // A candidate name not in the golden: the closest golden name, or "".
  std::string suggestion;
  // A routed case's tensor judged without the rows of its ambiguous tokens: which ("" when none
  // was left out).
  std::string excluded;
};

// A token a routed case's candidate routed otherwise than the golden, within the tolerance of the
// judged precision: a disagreement of rounding, not a wrong expert.
struct AmbiguousToken {
  std::string layer;  // "" in an op case
  std::int64_t token = 0;
  double margin = 0;                            // the golden's selection margin
  double tolerance = 0;                         // what the judged precision can move it by
  std::vector<std::int64_t> golden, candidate;  // the experts chosen, in slot order
};

struct CaseReport {
  std::string name;  // file name
  std::string golden_path, candidate_path;
  std::vector<TensorResult> tensors;  // pipeline order: forward, then backward
  std::string first_divergence;       // "" when nothing failed
  std::string precision;              // what the candidate was judged as: fp64, fp32, bf16, ...
  bool budget = false;                // judged against the emulated run's error
  // What the reader must know before the rows, printed first: why the precision is not the
  // golden's own (the candidate's dtypes implied another), that the golden is ill-conditioned.
  std::vector<std::string> notes;
  // Under fp8: whether the recipe rule decides (CheckOptions::fp8_recipe_k). Only where every fp8
  // operand is a golden input (the linear op); elsewhere recipe_distance is reported, not judged.
  bool recipe_rule = false;
  std::uint64_t emulated_bytes = 0;  // the memory the emulated run's tensors took (budget only)
  int passed = 0, failed = 0, not_checked = 0, vacuous = 0, ambiguous = 0;
  // Routed cases: the tokens routed otherwise within the tolerance (each tensor they
  // contaminate is ambiguous as a whole, or judged without their rows).
  std::vector<AmbiguousToken> ambiguous_tokens;
  // Op cases: optional outputs (attention's scores and probs) the candidate does not hold. They
  // are not in `tensors` and never count against it.
  std::vector<std::string> optional_missing;
  // A golden written with --keep: the candidate's computed tensors the golden did not keep.
  // Neither passed nor failed, and never required.
  std::vector<std::string> not_in_golden;
  // Candidate tensors in neither the golden nor its contract. Each is a failed entry of `tensors`
  // ("not in the golden", with the closest golden name) unless allow_extra accepted it here.
  int unknown = 0;
  std::vector<std::string> extra;
  // Directory mode: a candidate file with no golden of its name (golden_path empty; `suggestion`
  // the closest golden's name, or ""). It fails the check unless allow_extra accepted it.
  bool no_golden = false;
  bool accepted = false;
  // Directory mode: a golden with no candidate file of its name (every tensor not checked).
  bool no_candidate = false;
  std::string suggestion;
};

// Compares one candidate with one golden. The golden must be a teo golden (FormatError naming the
// problem otherwise). Missing candidate tensors are not_checked; one the golden's contract does
// not name fails unless opts.allow_extra (see CaseReport::unknown); a shape
// mismatch fails that tensor, and so does a dtype other than the golden's unless a reduced
// precision is judged (then any float dtype is read). A precision the candidate's dtypes
// contradict is a ConfigError.
CaseReport check(const safetensors::File& golden, const safetensors::File& candidate,
                 const CheckOptions& opts);

// `golden` and `candidate` are both files or both directories. A golden directory is searched with
// its subdirectories (every *.safetensors under it), each golden matched by its relative path in
// the candidate directory (golden/ops/x.safetensors by candidate/ops/x.safetensors) and reported
// under that path. A golden with no candidate file is reported with every tensor not_checked; a
// candidate file with no golden as a CaseReport with no_golden set.
std::vector<CaseReport> check_paths(const std::string& golden, const std::string& candidate,
                                    const CheckOptions& opts);

struct TextOptions {
  bool hide_unchecked = false;  // leave out the rows of tensors not checked (counted still)
};
void print_text(const std::vector<CaseReport>& reports, std::ostream& out,
                const TextOptions& text = {});
std::string junit_xml(const std::vector<CaseReport>& reports);
std::string json_report(const std::vector<CaseReport>& reports);

// The stage a tensor name belongs to, as printed in "first divergence": "layers.0.probs" for
// "act.layers.0.probs", "grad.head.weight" for a gradient.
std::string stage_name(const std::string& tensor_name);

// The symbolic shape of a contract name, as a student writes it: "(B, H, S, S)" for
// "act.layers.0.probs" or "grad.act.layers.0.probs", "(F, D)" for "layers.0.fc1.weight" or
// "grad.layers.0.fc1.weight".
std::string symbolic_shape(const std::string& tensor_name);

// The verdict over a check's reports: exit 0 when every checked tensor passed and at least one
// was checked (and, with require_all, none was left unchecked or judged vacuous), else 1.
struct Verdict {
  int exit_code = 0;
  std::string reason;  // why it fails when no tensor failed ("" otherwise: the report says)
};
Verdict verdict(const std::vector<CaseReport>& reports, bool require_all);

}  // namespace teo::golden
