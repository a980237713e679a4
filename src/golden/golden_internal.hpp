// Internal to src/golden: the rules the generator and the checker share.
#pragma once

#include <cstddef>
#include <functional>
#include <iomanip>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/contract.hpp"
#include "teo/files.hpp"
#include "teo/fp8.hpp"
#include "teo/golden.hpp"
#include "teo/layers/moe_router.hpp"

namespace teo::golden {
struct OpCase;
}

namespace teo::golden::detail {

// The fp8 recipe's keys (fp8_format, fp8_scaling, ...), as an op spec or a model case spells them.
const std::vector<std::string>& fp8_keys();
// Reads the fp8 keys j holds into r, each error naming where.key; returns whether j held any.
bool read_fp8_keys(const nlohmann::json& j, Fp8Recipe& r, const std::string& where);
// Writes every fp8 key of r (into a json or an ordered_json).
template <class Json>
void write_fp8_keys(Json& j, const Fp8Recipe& r);
// Whether every fp8 operand of the op named `op` is one of its case's inputs (the linear op): the
// recipe rule decides there, and delayed scales apply.
bool fp8_operands_are_inputs(const std::string& op);

// v with every digit a double has ("0.10000000000000001"), as the checker's messages write numbers.
inline std::string full_digits(double v) {
  std::ostringstream os;
  os << std::setprecision(17) << v;
  return os.str();
}

// How a routed case's result depends on its tokens' routing: not at all (the logits, the scores
// before the choice), row by row (its first dimension is the token: the chosen weights, y), or
// as a whole (the grouped layout, the gradients of the experts and the gate, the aux loss).
enum class RoutingDependence { none, token_rows, whole };
// A routed op case (moe_router, moe): what the checker needs to judge its routing
// (docs/golden-format.md, "Routing").
struct RoutedCase {
  RouterSpec router;
  index_t tokens = 0, d_model = 0;
  bool replayed = false;  // the case gives input.moe.topk_ids
  std::function<RoutingDependence(const std::string& name)> dependence;
};
// The routing of an op case whose op routes, or nothing.
std::optional<RoutedCase> routed_case(const safetensors::File& golden);

// A float32 golden's tolerance for its own error against float64: at most
// kIllConditioned * FLT_EPSILON * sqrt(L) relative to each tensor's scale, where L is the case's
// longest reduction: max(d_model, d_ff, seq_len, batch * seq_len).
inline constexpr double kIllConditioned = 16.0;
// An emulated error above this fraction of a tensor's scale makes its budget vacuous.
inline constexpr double kVacuous = 0.1;
// Under fp8 the limit is 0.5 where the recipe rule decides (CheckOptions::fp8_recipe_k), which
// still judges a tensor whose budget is loose, as gradients through two or three fp8 products are;
// elsewhere it is bf16's. Generation refuses an fp8 case only above 0.5 (`recipe_rule` true): its
// tensors between 0.1 and 0.5 are checked as vacuous where the rule does not decide.
inline double vacuous_limit(Precision p, bool recipe_rule = true) {
  return p == Precision::fp8 && recipe_rule ? 0.5 : kVacuous;
}

// The float64 truth of golden tensor g: ref64.<name> in a float32 golden (FormatError when it is
// missing or misshapen), g itself in a float64 one.
std::vector<double> truth_of(const safetensors::File& golden, const safetensors::Tensor& g,
                             bool f32);

// The scale errors are measured against: max |truth| over finite entries; for a bias gradient at
// least the largest of its weight gradient's truth (see check.cpp).
double scale_of(const safetensors::File& golden, const std::string& name,
                const std::vector<double>& truth, bool f32);

// The largest finite magnitude of what a case's computed tensors are formed from: an op case's
// float inputs, parameters and upstream gradients, a model case's parameters. The scale of a
// tensor whose truth is exactly 0.
double inputs_scale(const safetensors::File& golden);

// For a tensor that is 0 in exact arithmetic and holds nothing but the rounding noise of a sum
// (contract::noise_only: the key bias gradients, without RoPE, sinks or a soft-cap), the number of
// terms of that sum (B * S rows); 0 for every other tensor.
std::int64_t noise_terms(const safetensors::File& golden, const std::string& name);

// The bound of a noise-only tensor of n terms is at least n * u * scale, u the unit roundoff of
// the accumulation (float32 for every float format, float64 for fp64): what any order of
// summation may leave of terms no larger than the scale; at most kNoiseCap * scale, so that a
// wrong gradient, of the order of the scale, fails however many terms there are.
inline constexpr double kNoiseCap = 0.01;
double noise_bound(std::int64_t n, bool fp64, double scale);

// Gives back the memory of a mapped golden tensor and of what truth_of and scale_of read with it
// (its ref64 twin, a bias gradient's weight gradient): safetensors::release on each.
void release_judged(const safetensors::File& golden, const safetensors::Tensor& g);

// max |x - truth| over the entries where the truth is finite; infinite when x is not finite at
// one of them.
double max_abs_diff(const std::vector<double>& x, const std::vector<double>& truth);

// The name of the activation max pooling reads: act.final_norm (pre-norm), the last layer's
// output, or act.input without layers.
std::string pooled_input_name(const ModelConfig& cfg);

// Whether a contract tensor's value depends on which position max pooling picked: every gradient
// upstream of the pooling (not loss, logits, pooled or the head's).
bool behind_pooling_argmax(const std::string& name);

// Under max pooling: "" when in every (sequence, feature) column the two largest values of the
// pooled activation's truth (over the real positions) are further apart than twice the sum of
// the emulated run's errors at those two positions (a run twice as noisy there could swap them),
// else the first column where they are not, as "column (b, d): values x and y".
std::string ambiguous_pooling(const safetensors::File& golden, const ModelConfig& cfg,
                              const std::vector<double>& top_truth,
                              const std::vector<double>& top_emulated);

// The cause of a float32 error that is not at rounding level, from the golden's float32 and
// float64 activations: a max-pooling argmax that differs, a ReLU input whose sign differs, or
// neither.
std::string ill_conditioning_cause(const safetensors::File& golden, const ModelConfig& cfg);

// Whether a tensor of a golden is judged by the checker: act.* and grad.* in a model case;
// output.*, grad.input.* and grad.param.* in an op case (grad.output.* is an op's input).
bool is_judged(const std::string& name, bool op_case);

// The case's longest reduction L, which the float32 conditioning limit
// kIllConditioned * FLT_EPSILON * sqrt(L) grows with: a model case's max(d_model, d_ff, seq_len,
// batch * seq_len, ...), an op case's own (OpDef::longest_reduction).
index_t longest_reduction(const Case& c);
index_t longest_reduction(const OpCase& c);
// Where element i of an op case's exact output `name` lies in what it was computed from (a
// quantized weight's row and block), or "" when its op says nothing of it.
std::string locate_exact(const OpCase& c, const std::string& name, std::int64_t i);
// Per element of the op case's exact output `name`, the other value a faithful kernel may give
// at a near tie of its rounding (OpDef::alternates), NaN elsewhere; empty when there is none.
std::vector<double> exact_alternates(const safetensors::File& golden, const std::string& name);
// "[i,j,k]": the index of flat element `flat` of a tensor of `shape`.
std::string index_str(std::int64_t flat, const std::vector<std::int64_t>& shape);
// An op case's exact output (ContractTensor::exact) judged against its one right answer, with
// no tolerance: the golden's values (for a float64 candidate of a float32 case, its ref64 twin:
// the exact values); under a precision budget, `emu` (the emulated run's values: the float32
// value as the precision stores it) is right too, value by value. Values compare as numbers (-0
// equals 0). At a near tie of its rounding (exact_alternates) the other rounding is right too.
// The message locates the first difference (locate_exact).
TensorResult judge_exact(const safetensors::File& golden, const safetensors::Tensor& g,
                         const safetensors::Tensor* c, bool f32, const std::vector<double>* emu);
// That limit for the golden `f` (a model or an op case).
double conditioning_limit(const safetensors::File& f);

// Refuses (IllConditioned) a float32 golden (model or op case) whose own error against ref64 is
// beyond kIllConditioned * FLT_EPSILON * sqrt(L) of some judged tensor's scale; with `allow`,
// returns the refusal's message instead ("" when the case is well conditioned). `cause` explains
// an excess.
std::string float32_conditioning(const safetensors::File& f, index_t L,
                                 const std::function<std::string()>& cause, bool allow);

// Refuses (IllConditioned) a precision case on which that precision's budget would be vacuous:
// an emulated error (emu, by tensor name) above kVacuous of a judged tensor's scale, or, for a
// model case (cfg not null) under max pooling, an argmax the budget does not resolve.
void precision_conditioning(const safetensors::File& f,
                            const std::map<std::string, std::vector<double>>& emu, Precision p,
                            const ModelConfig* cfg);

// How a contract dtype rule is stored in a case of dtype float32 (f32) or float64.
inline safetensors::DType stored_dtype(contract::DTypeRule rule, bool f32) {
  switch (rule) {
    case contract::DTypeRule::i64:
      return safetensors::DType::I64;
    case contract::DTypeRule::u8:
      return safetensors::DType::U8;
    case contract::DTypeRule::real:
      return f32 ? safetensors::DType::F32 : safetensors::DType::F64;
    case contract::DTypeRule::f64:
      return safetensors::DType::F64;
    case contract::DTypeRule::i32:
      return safetensors::DType::I32;
    case contract::DTypeRule::i8:
      return safetensors::DType::I8;
    case contract::DTypeRule::f16:
      return safetensors::DType::F16;
    case contract::DTypeRule::f32:
      return safetensors::DType::F32;
    case contract::DTypeRule::f8_e4m3:
      return safetensors::DType::F8_E4M3;
  }
  return safetensors::DType::F64;
}

// One tensor a golden file must hold: its name, dtype, shape, and the shape as the contract
// writes it ("[B, H, S, S]"), for the error.
struct ExpectedTensor {
  std::string name;
  safetensors::DType dtype;
  std::vector<std::int64_t> shape;
  std::string symbolic;
  bool optional = false;  // may be absent (an fp8 operand, stored only when --keep asks)
};

// FormatError naming the tensor unless f holds exactly `want`: each of them with its dtype and
// shape (a file written with --keep may leave out judged tensors, with their ref64 twins), and
// nothing else. `op` for an op case's names and messages.
void expect_tensors(const safetensors::File& f, const std::vector<ExpectedTensor>& want, bool op);

// FormatError unless every value of the I64 tensor `name` of f (when present) lies in [0, hi)
// (or [0, hi] when inclusive); `bound` names hi in the message.
void expect_in_range(const safetensors::File& f, const std::string& name, std::int64_t hi,
                     bool inclusive, const std::string& bound);

// validate() for an op case (ops.cpp). With inputs_only, the file holds what run_op reads: every
// input, parameter and upstream gradient of the spec with its shape (float ones in any float
// dtype), the results not required; others are not checked.
void validate_op_file(const safetensors::File& f, bool inputs_only = false);

// Every name of a validated golden's contract, ref64 twins included (what the file holds, and
// what --keep left out of it); op_contract_names for an op case.
std::set<std::string> contract_names(const safetensors::File& golden);
std::set<std::string> op_contract_names(const safetensors::File& op_case);

// The corpus files (cases.json): an entry's plain file name, and its optional description (erased
// from `entry`). ConfigError naming `path` otherwise.
std::string corpus_entry_name(const nlohmann::json& entry, const std::string& path);
std::string corpus_entry_description(nlohmann::json& entry, const std::string& path,
                                     const std::string& name);

// A corpus's cases.json, {"cases": [{"name", "description" (optional), <spec keys>}, ...]}: one
// Entry {name, description, spec = parse(the entry without name and description)} per case.
// Names must be plain file names and distinct; parse's ConfigError and ShapeError get
// "<path>: case <name>: " in front.
template <class Entry, class Parse>
std::vector<Entry> read_corpus(const std::string& path, Parse&& parse) {
  const nlohmann::json j = read_json_file(path);
  if (!j.is_object() || !j.contains("cases") || !j["cases"].is_array()) {
    throw ConfigError(path + ": needs an object with a \"cases\" array");
  }
  std::vector<Entry> out;
  for (const auto& e : j["cases"]) {
    Entry ce;
    ce.name = corpus_entry_name(e, path);
    for (const auto& prev : out) {
      if (prev.name == ce.name) throw ConfigError(path + ": case name \"" + ce.name + "\" repeats");
    }
    nlohmann::json spec = e;
    spec.erase("name");
    ce.description = corpus_entry_description(spec, path, ce.name);
    try {
      ce.spec = parse(spec);
    } catch (const ConfigError& err) {
      throw ConfigError(path + ": case " + ce.name + ": " + err.what());
    } catch (const ShapeError& err) {
      throw ShapeError(path + ": case " + ce.name + ": " + err.what());
    }
    out.push_back(std::move(ce));
  }
  return out;
}

// The names of a corpus's entries (CorpusEntry or OpCorpusEntry), in order.
template <class Entries>
std::vector<std::string> names_of(const Entries& entries) {
  std::vector<std::string> names;
  names.reserve(entries.size());
  for (const auto& e : entries) names.push_back(e.name);
  return names;
}

// FileError when <dir>/manifest.json or any <dir>/<name>.safetensors exists.
void refuse_existing(const std::string& dir, const std::vector<std::string>& names);

// A corpus written whole or not at all: stage() writes each case of a directory to a temporary
// file beside its final name; commit() renames every staged case into place and then writes each
// directory's manifest.json (sha256, size and description per file). Until commit, nothing under
// a final name changes: a case that throws (an IllConditioned seed, an interruption), in the model
// corpus or in its op corpus, leaves every committed file and manifest as it was, and the
// destructor removes the temporary files.
class CorpusWriter {
 public:
  CorpusWriter() = default;
  CorpusWriter(const CorpusWriter&) = delete;
  CorpusWriter& operator=(const CorpusWriter&) = delete;
  ~CorpusWriter();
  // Writes <dir>/<names[i]>.safetensors's bytes from make(i) = {bytes, description}, staged.
  void stage(const std::string& dir, const std::vector<std::string>& names, std::ostream& log,
             const std::function<std::pair<std::string, std::string>(std::size_t)>& make);
  void commit(std::ostream& log);

 private:
  struct File {
    int fd = -1;
    std::string tmp, path;
  };
  struct Dir {
    std::string dir;
    nlohmann::ordered_json files;  // the manifest's entries
    std::uint64_t total = 0;
  };
  std::vector<File> files_;
  std::vector<Dir> dirs_;
};

// Stages every case of the op corpus <dir>/cases.json into `writer`.
void stage_op_corpus(const std::string& dir, std::ostream& log, CorpusWriter& writer);

}  // namespace teo::golden::detail
