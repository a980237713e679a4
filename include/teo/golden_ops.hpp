// Op cases: golden files for one operator at a time (docs/golden-format.md, "Op cases"). An op
// case holds the op's inputs and parameters drawn from a seed, the upstream gradients of its
// outputs, and the exact forward and backward that the model's own layer code computes; the
// checker judges a candidate's op file by the same rules as a model case.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/fp8.hpp"
#include "teo/precision.hpp"
#include "teo/safetensors.hpp"

namespace teo::golden {

inline constexpr const char* kOpFormat = "teo-op/1";

// The ops, in the order the docs list them: linear, layer_norm, rms_norm, softmax, activation,
// attention, attention_kvcache, attention_merge, embedding, pooling, cross_entropy, dropout,
// encoder_layer.
const std::vector<std::string>& op_names();

// One op case: the op and its spec. The spec holds the shapes, the op's options, dtype
// ("float32" or "float64"), seed and, in a float32 case, an optional precision (tf32, bf16, fp16,
// fp8); an fp8 case also names its recipe with the fp8_* keys (docs/fp8.md).
struct OpCase {
  std::string op;
  // Normalised: every key spelled out, defaults filled in, as written to __metadata__.spec.
  nlohmann::ordered_json spec;
  std::string dtype = "float64";
  std::uint64_t seed = 0;
  std::optional<Precision> precision;
  Fp8Recipe fp8;  // read when precision is fp8
  // fp8 cases: the factor of the activations' outlier channels (spec key fp8_outlier, default 100);
  // every channel also has a magnitude of its own, 2^u with u in [-2, 2) (docs/fp8.md, "Cases").
  double fp8_outlier = 100;

  // Validates `spec` for `op` (or spec["op"] when op is empty; both given must agree) before
  // anything is allocated: an unknown op or key, a missing or mistyped key, or a bad value is a
  // ConfigError naming it; sizes that do not fit together, or a case whose generation would need
  // more than max_bytes, a ShapeError.
  static OpCase from_json(const nlohmann::json& spec, const std::string& op = "",
                          std::uint64_t max_bytes = std::uint64_t{1} << 34);
  // SPEC.json read from `path`: FileError when it cannot be read, and the errors of from_json
  // with the path in front.
  static OpCase from_file(const std::string& path, const std::string& op = "");

  // The bytes generation needs at most: the runs' working tensors when the case is written to a
  // file as it is computed (write_op, the limit from_json applies), plus the file twice when it
  // is built in memory (make_op).
  std::uint64_t bytes_needed(bool in_memory = false) const;
};

// Generates the op case in memory: its inputs from the seed, then the op forward and backward in
// dtype on the current backend; a float32 case also carries ref64.* (the same op in float64 on the
// same float32-valued inputs). A float32 case that is not at rounding level against float64, or a
// precision case whose budget would be vacuous, throws IllConditioned unless allowed (then
// __metadata__.ill_conditioned says why). A non-empty `keep` stores only what keep_only keeps;
// globs matching fp8.* in an fp8 linear case also store the quantized operands of its products
// (docs/golden-format.md, "fp8 operands"), which are stored only when asked for.
safetensors::File make_op(const OpCase& c, bool allow_ill_conditioned = false,
                          const std::string& keep = "");

// Writes the case make_op gives to `path`, byte for byte, without holding the file in memory:
// the header first, then the inputs, then each run's results as soon as they are computed (and
// freed then), through a temporary file renamed into place at the end. With `keep` the case is
// built in memory (make_op) and then written. Returns the file's size. Errors as make_op, and
// FileError (an existing `path` without `overwrite`); on any of them nothing is written.
std::uint64_t write_op(const OpCase& c, const std::string& path, bool overwrite,
                       bool allow_ill_conditioned = false, const std::string& keep = "");

// The op case an op file was made from (__metadata__.op and spec); FormatError when they are
// missing or malformed.
OpCase op_case_of(const safetensors::File& file);

// True when the file is an op case (__metadata__.format is kOpFormat).
bool is_op_file(const safetensors::File& file);

// Runs the op of `file`'s case on the file's own input.*, param.* and grad.output.* tensors, in
// double (p unset or fp64) or in float emulating p, and returns every output.*, grad.input.* and
// grad.param.* tensor the case's contract names. Under a reduced precision the float inputs are
// first rounded to p's storage format. The finite-difference tests perturb the inputs of a file
// and call this; the checker calls it for the emulated run of a budget.
std::map<std::string, std::vector<double>> run_op(const safetensors::File& file,
                                                  std::optional<Precision> p = std::nullopt);

// The tensors a candidate for this case writes: output.* (forward), then grad.input.* and
// grad.param.* (backward), with their shapes. Optional outputs (attention's probs and scores)
// are marked.
struct ContractTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  bool optional = false;
  bool integer = false;  // I32 (the experts a router chose), else the case's float type
  // An output the case gives an upstream gradient for (grad.output.<name>): not optional, not a
  // router's choice, margin or grouped layout, not of a forward-only op.
  bool upstream = false;
  // A float output with one right answer, judged with no tolerance (a quantized weight's exact
  // dequantization, output.weight_dequant).
  bool exact = false;
};
std::vector<ContractTensor> op_contract(const OpCase& c);

// Every key an op's spec may hold (op, dtype, seed, precision, the op's config keys and every key
// its normalised specs spell out), sorted; ConfigError listing the ops for an unknown op.
std::vector<std::string> op_spec_keys(const std::string& op);

// Every optional output an op may write under some spec (attention's scores, probs, lse, q_rot
// and k_rot; attention_kvcache's q_rot and lse), whether or not a given case holds it.
std::vector<std::string> op_optional_outputs(const std::string& op);

// One entry of golden/ops/cases.json: {"cases": [{"name", "description", "op", <spec keys>}]}.
struct OpCorpusEntry {
  std::string name;
  std::string description;
  OpCase spec;
};
std::vector<OpCorpusEntry> read_op_corpus_cases(const std::string& path);

// Writes every case of <dir>/cases.json to <dir>/<name>.safetensors and <dir>/manifest.json, as
// generate_corpus does for model cases.
void generate_op_corpus(const std::string& dir, std::ostream& log, bool overwrite);

}  // namespace teo::golden
