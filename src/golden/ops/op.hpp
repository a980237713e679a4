// Internal to the op cases: what an op declares (OpDef, one per file in this folder, listed once in
// registry() in ops.cpp) and what every op shares: its parsed spec, the spec reader, its tensors
// and their values, and the context its forward and backward run in. ops.cpp does everything else
// once for every op: normalising a spec, laying out and drawing the tensors, running, writing a
// case.
#pragma once

#include <algorithm>
#include <any>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "golden/golden_internal.hpp"
#include "teo/config.hpp"
#include "teo/golden_ops.hpp"
#include "teo/precision.hpp"
#include "teo/rounding.hpp"
#include "teo/safetensors.hpp"
#include "teo/tensor.hpp"

namespace teo::golden::ops {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using Dims = std::vector<std::int64_t>;
using safetensors::DType;

struct OpDef;
struct RouterPart;

// How close to a rounding midpoint, relative to the quotient, a quantized value's quotient is a
// near tie (OpDef::alternates): 2^-20, eight float32 ulps.
inline constexpr double kTieTolerance = 0x1p-20;

// Attention stores scores and probs (B, H, S, S) by default up to this many entries each; beyond
// it the case uses the row-blocked path and omits them.
inline constexpr std::int64_t kProbsDefaultLimit = std::int64_t{1} << 22;
// The largest size any one dimension may take.
inline constexpr std::int64_t kMaxDim = std::int64_t{1} << 31;

// The parsed spec of a case. The shared part is what every case has whatever its op: the op, and
// whether the case's fp8 scales are inputs (its precision's). The rest is the op's own spec type
// (`own`), declared, parsed and validated in the op's file.
struct Spec {
  const OpDef* def = nullptr;
  // linear under an fp8 recipe with delayed scales: the operands' scales are inputs
  // (input.fp8_scale.*)
  bool fp8_delayed = false;
  // The case's dtype is float32: what an op whose result is defined in the case's own arithmetic
  // (a quantized KV cache's codes) computes in, in both of a float32 case's runs.
  bool float32 = false;
  // The case has no backward, whatever its op's OpDef::forward_only (W8A8 serves): set by parse.
  bool forward_only = false;
  std::any own;

  // The op's spec, of its own type T; std::logic_error if the op's spec is of another type.
  template <class T>
  const T& as() const {
    const T* o = std::any_cast<T>(&own);
    if (!o) throw std::logic_error("an op's spec read as another op's");
    return *o;
  }
  template <class T>
  T& as() {
    return const_cast<T&>(std::as_const(*this).as<T>());
  }
};

// A lengths key's values: per sequence (B values in [0, seq_len]) or per row. When the key is
// not given, (count, value) until fill() builds them, once the case's size has been accepted.
struct Lengths {
  std::vector<std::int64_t> values;
  std::optional<std::pair<index_t, index_t>> full;
  void fill() {
    if (!full) return;
    values.assign(static_cast<std::size_t>(full->first), full->second);
    full.reset();
  }
};

// Reads a spec object key by key; finish() rejects the keys nobody asked for.
class Reader {
 public:
  explicit Reader(const json& j) : j_(j) {}
  Reader(const ojson&) = delete;
  bool has(const char* key) const { return j_.contains(key); }
  // An integer in [min, 2^31]; ConfigError naming the key otherwise, or when it is missing.
  index_t size(const char* key, index_t min);
  // true or false, `def` when absent.
  bool flag(const char* key, bool def);
  // (n) integers in [0, max], each named in an error. When the key is absent, returns nothing and
  // records the default (n copies of max) in `full`, to be filled in once the case's size has
  // been accepted.
  std::vector<std::int64_t> prefix_lengths(const char* key, index_t n, index_t max,
                                           std::optional<std::pair<index_t, index_t>>& full);
  // A number in (0, 1e4], or nothing when absent or null.
  std::optional<double> number(const char* key);
  // One of `options` (a string), `def` when absent; ConfigError naming them otherwise.
  std::string choice(const char* key, const std::vector<std::string>& options,
                     const std::string& def);
  // The model-config keys among `keys`, read by ModelConfig::from_json (its errors name them)
  // on top of `base`.
  ModelConfig config(const std::vector<const char*>& keys, const json& base);
  // The model-config keys of the op (for_op), on top of its base config.
  ModelConfig op_config();
  // Lengths `key`: (n) values in [0, max], or the default of n copies of max (prefix_lengths).
  Lengths lengths(const char* key, index_t n, index_t max);
  void finish() const;
  void use(const char* key) { used_.insert(key); }
  // The value of a key the caller has checked is present.
  const json& value(const char* key) const { return j_.at(key); }
  // The op the spec is for, whose keys a missing key's suggestion leaves out.
  void for_op(const OpDef* def) { def_ = def; }
  // ConfigError: the spec lacks `key` (naming an unread key of the spec it may be misspelled as).
  [[noreturn]] void missing(const char* key) const;

 private:
  const json& j_;
  std::set<std::string> used_;
  const OpDef* def_ = nullptr;
};

// The spec of an op over rows of one width and its config keys: the element-wise ops' (rows of
// `cols`: activation, dropout) and the norms' (rows of `d_model`: layer_norm, rms_norm), each
// read and written under its own key.
struct RowsSpec {
  index_t rows = 0, width = 0;
  ModelConfig cfg;
};
// parse and write_sizes of a RowsSpec whose width is spec key `Key`.
template <const char* Key>
void parse_rows(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<RowsSpec>();
  s.cfg = r.op_config();
  s.rows = r.size("rows", 0);
  s.width = r.size(Key, 1);
}
template <const char* Key>
void write_rows(const Spec& spec, ojson& j) {
  const auto& s = spec.as<RowsSpec>();
  j["rows"] = s.rows;
  j[Key] = s.width;
}
inline constexpr char kCols[] = "cols";
inline constexpr char kDModel[] = "d_model";

// The model config of an op whose spec type T holds it as `cfg` (OpDef::config_of).
template <class T>
const ModelConfig* config_in(const Spec& s) {
  return &s.as<T>().cfg;
}

// The attention ops' model-config keys (the variants of semantics section 14 and causal), and the
// config they are read on top of: one head, no positions, causal as given.
const std::vector<const char*>& attention_config_keys();
json attention_base_config(bool causal);

// The attention ops' positions in c: none, rope or alibi (default none). RoPE takes its rotary_dim
// from d_head, and its scaling's original context from the longest of the op's sequences
// (`longest`), unless given; both are then spelled out in the normalised spec.
void attention_positions(ModelConfig& c, index_t d_head, index_t longest, const char* op);

enum class Role { input, param, output, grad_output, grad_input, grad_param };

// One tensor of a case.
struct Slot {
  std::string name;
  safetensors::DType dtype;  // F64 stands for the case's float dtype
  Dims shape;
  Role role;
  double amp = 1;         // float inputs: values are drawn uniform in [-amp, amp)
  double offset = 0;      // ... plus offset
  bool optional = false;  // an output a fused kernel may omit
  // An output no upstream gradient flows into (a router's choice, its scores and margins). An
  // integer output (I32: the experts chosen) is one always; it has no ref64 twin, since the
  // generator keeps every such choice the same in float32 and float64.
  bool no_grad = false;
  // A quantized weight's part (golden/ops/weight_format.hpp): stored as its checkpoint stores it,
  // bytes of `dtype`, drawn by the op's draw (Values::raw) and read back as those bytes.
  bool packed = false;
  // A float output with one right answer (a weight's exact dequantization): judged equal to the
  // golden's values, with no tolerance.
  bool exact = false;
};

// An integer output of the case (I32), held as exact values of the run's Real.
inline Slot int_output(std::string n, Dims shape) {
  Slot s{std::move(n), safetensors::DType::I32, std::move(shape), Role::output};
  s.no_grad = true;
  return s;
}

// What an op declares of its tensors; ops.cpp adds the upstream and input gradients and orders
// them (layout()).
struct OpTensors {
  std::vector<Slot> in;     // the differentiable float inputs and parameters
  std::vector<Slot> fixed;  // integer inputs, masks and fp8 scales: inputs without a gradient
  std::vector<Slot> out;    // the outputs
};

// A float tensor of the case's dtype, drawn uniform in [offset - amp, offset + amp).
inline Slot float_slot(std::string n, Dims shape, Role role, double amp = 1, double offset = 0) {
  return Slot{std::move(n), safetensors::DType::F64, std::move(shape), role, amp, offset};
}

// A case's values by name: float tensors (exact doubles), integers and masks.
struct Values {
  std::map<std::string, std::vector<double>> f;
  std::map<std::string, std::vector<std::int64_t>> i64;
  std::map<std::string, std::vector<std::uint8_t>> u8;
  std::map<std::string, std::vector<unsigned char>> raw;  // the packed slots' bytes
};

// The integers or mask `name` of n values; FormatError otherwise.
template <class T>
const std::vector<T>& ints_of(const std::map<std::string, std::vector<T>>& m,
                              const std::string& name, std::int64_t n) {
  const auto it = m.find(name);
  if (it == m.end() || static_cast<std::int64_t>(it->second.size()) != n) {
    throw FormatError("the op case has no " + name + " of " + std::to_string(n) + " values");
  }
  return it->second;
}

// The packed slot `name` (its bytes in v.raw, of dtype d) as numbers, as safetensors reads them:
// floats (fp8 widened) or integers. FormatError when the case has no such tensor.
std::vector<double> packed_numbers(const Values& v, const std::string& name, DType d);

// A golden's token ids and labels must lie in [0, hi): FormatError otherwise.
void check_range(const std::vector<std::int64_t>& v, std::int64_t hi, const std::string& what);

// The spec's values of an integer tensor of a case that the spec determines (the op's
// OpDef::spec_ints: its lengths, a KV cache's lengths and block table), or null for any other
// name.
const std::vector<std::int64_t>* spec_ints(const Spec& s, const std::string& name);
// The case's integer tensor `name` that the spec determines, FormatError unless it holds the
// spec's values.
const std::vector<std::int64_t>& spec_ints_of(const Values& v, const Spec& s,
                                              const std::string& name = "input.lengths");

// Rounds a result to p's storage format where a bf16 or fp16 backend stores it; RangeError
// naming it on an fp16 overflow.
template <class Real>
void store(Tensor<Real>& t, std::optional<Precision> p, const std::string& name) {
  if constexpr (std::is_same_v<Real, float>) {
    if (p && stores_reduced(*p) && round_to(*p, t.data(), t.numel()))
      throw RangeError(name + ": " + overflow_message(*p));
  }
}

// Float values as the case's dtype (and precision) store them.
void as_stored(std::vector<double>& x, const OpCase& c);

// std::logic_error unless s's op lists n in its OpDef::taken (what the memory estimate counts).
void check_taken(const Spec& s, const std::string& n);

// Where an op's forward and backward run: the spec, the inputs' values, the seed and the precision
// emulated, and the results, each a zero tensor of its shape to begin with (the backward functions
// accumulate).
template <class Real>
struct RunContext {
  const Spec& s;
  const Values& v;
  std::uint64_t seed;
  std::optional<Precision> p;
  std::map<std::string, Dims> shape;
  std::map<std::string, Tensor<Real>> r;
  // A routed op's routing to replay, (T, k), or null: the golden's own when the checker
  // emulates a precision, so that the emulated error is the experts' arithmetic's alone.
  const std::vector<std::int64_t>* routing = nullptr;
  // The drawn values the run may spend (the last run of a generation), or null: take() frees
  // what it has read.
  Values* spend = nullptr;

  // Input `n` as a tensor of its shape, in Real.
  Tensor<Real> in(const std::string& n) const {
    const auto it = v.f.find(n);
    if (it == v.f.end()) throw FormatError("the op case has no float " + n);
    Tensor<Real> t = Tensor<Real>::for_overwrite(Shape(std::vector<index_t>(shape.at(n))));
    if (static_cast<index_t>(it->second.size()) != t.numel()) {
      throw FormatError("the op case's " + n + " has " + std::to_string(it->second.size()) +
                        " values, expected " + std::to_string(t.numel()));
    }
    for (index_t i = 0; i < t.numel(); ++i) t[i] = static_cast<Real>(it->second[i]);
    return t;
  }
  // Input `n` as in(), for an op that reads it once: its drawn values are freed where the run
  // may spend them, so that the largest cases hold their parameters about once.
  Tensor<Real> take(const std::string& n) const {
    check_taken(s, n);
    Tensor<Real> t = in(n);
    if (spend) spend->f.erase(n);
    return t;
  }
  Tensor<Real> zeros(const std::string& n) const {
    return Tensor<Real>(Shape(std::vector<index_t>(shape.at(n))));
  }
  // Result `n` is complete: rounded to the storage format the precision implies.
  void done(const std::string& n) { store(r.at(n), p, n); }
};

// One operand of an op's fp8 product as fp8_product quantizes it: op(X) of (rows, k), k the
// contraction; `name` is its Fp8Side::kept, `gradient` and `weight` its Fp8Side's. A case stores
// it as fp8.<name> with fp8.<name>.scale (docs/golden-format.md, "fp8 operands").
struct Fp8OperandSlot {
  const char* name = "";
  index_t rows = 0, k = 0;
  bool gradient = false, weight = false;
};

// One op: everything that differs from one op to another. ops.cpp's generic code reads nothing
// else, so an op is one file defining one of these, listed once in registry() (ops.cpp).
struct OpDef {
  const char* name = "";
  // The model-config keys the spec takes (read, validated and written back as ModelConfig spells
  // them), and the config they are read on top of (Reader::op_config).
  std::vector<const char*> config_keys{};
  json base_config = json::object();
  // Reads the op's spec into s.own: its config keys first (Reader::op_config), its sizes, lengths
  // and options.
  void (*parse)(Spec& s, Reader& r) = nullptr;
  // Completes the spec once its size has been accepted (default lengths, what is too big to build
  // before), or null.
  void (*fill)(Spec& s) = nullptr;
  // Writes the op's sizes and lengths, then (after the config keys) its options, normalised.
  void (*write_sizes)(const Spec& s, ojson& j) = nullptr;
  void (*write_options)(const Spec& s, ojson& j) = nullptr;
  // The op's model config (config_in<T>), where config_keys is not empty: its keys are written
  // back, its dropout draws the masks and its type_vocab_size bounds the token types.
  const ModelConfig* (*config_of)(const Spec& s) = nullptr;
  // The values of the integer tensors the spec determines (its lengths, a KV cache's lengths and
  // block table), or null for any other name; null when it has none.
  const std::vector<std::int64_t>* (*spec_ints)(const Spec& s, const std::string& name) = nullptr;
  // Integer inputs drawn uniform in [0, hi) (token ids, labels) are checked against hi, which the
  // spec key `key` sets: the bound of `name`, or hi 0 when the op has no such input.
  struct IntBound {
    index_t hi = 0;
    const char* key = "";
  };
  IntBound (*int_bound)(const Spec& s, const std::string& name) = nullptr;
  // An op that routes tokens to experts: its router part (the checker judges output.topk_ids
  // exactly, tells an ambiguous routing from a wrong one, and leaves out what an ambiguous token
  // contaminates, as `routing_dependence` says), or null.
  const RouterPart* (*router_of)(const Spec& s) = nullptr;
  detail::RoutingDependence (*routing_dependence)(const Spec& s, const std::string& name) = nullptr;
  // Its tensors.
  void (*tensors)(const Spec& s, OpTensors& t) = nullptr;
  // ConfigError for a case the op refuses whole (a precision its spec cannot take), or null.
  void (*check_case)(const Spec& s, const OpCase& c) = nullptr;
  // Where element i of the exact output `name` lies in what it was computed from (a quantized
  // weight's block), for the checker's message; null when the op has no exact output.
  std::string (*locate)(const Spec& s, const std::string& name, std::int64_t i) = nullptr;
  // For an exact output whose values are roundings of quotients (a quantized cache's codes): per
  // element, the other value a faithful kernel may give where its quotient lies within
  // kTieTolerance of a rounding midpoint (a kernel that multiplies by a reciprocal, or divides in
  // another precision, may round it the other way), NaN elsewhere; empty when no element has two.
  std::vector<double> (*alternates)(const Spec& s, const Values& v,
                                    const std::string& name) = nullptr;
  // The longest sum behind any one result: the float32 conditioning test's L.
  index_t (*longest_reduction)(const Spec& s) = nullptr;
  // The bytes of the run's working tensors beyond the generic estimate (the values as doubles,
  // the results in Real and double), or null.
  double (*working_bytes)(const Spec& s) = nullptr;
  // The drawn tensors the op reads once, with RunContext::take: the last run frees each as it
  // reads it, and the memory estimate counts them once.
  std::vector<const char*> taken{};
  // Changes the drawn inputs (already as stored) where the op draws them otherwise, or null.
  void (*draw)(const Spec& s, const OpCase& c, Values& v) = nullptr;
  // Forward, then backward, into c.r.
  void (*run_float)(RunContext<float>& c) = nullptr;
  void (*run_double)(RunContext<double>& c) = nullptr;
  // Forward only (serving has no backward): the case has no upstream or input gradients.
  bool forward_only = false;
  // Non-null when each of the op's fp8 products multiplies inputs, parameters or the upstream
  // gradient only: the operands of those products. Its fp8 cases then take delayed scales
  // (fp8_scales), can store the quantized operands (--keep fp8.*), and the checker's recipe rule
  // decides on them (docs/fp8.md, "Judging").
  std::vector<Fp8OperandSlot> (*fp8_operands)(const Spec& s) = nullptr;
  // The op runs attention: its fp8 cases may ask for fp8_attention.
  bool has_attention = false;
  // Whether run_float emulates a reduced precision (stores every stage rounded as semantics
  // "Reduced precision" says). An op that does not (the decoder layer, semantics 17.4) refuses a
  // precision case and a reduced-precision run by name.
  bool emulates_precision = true;
  // Small specs of the op (its keys without op, dtype and seed), as JSON, that the generic tests
  // run through every op: finite differences of the backward, the bad-spec table. Together they
  // reach every branch of the op's run (each option, each path).
  std::vector<const char*> samples{};
};

// The spec of a case, parsed and with its defaults filled in.
Spec spec_of(const OpCase& c);

// ---- the generic machinery of a case (ops.cpp), which op_file.cpp writes out ----------------

// Every tensor of the case, in file order: inputs, parameters, outputs, upstream gradients,
// input gradients, parameter gradients.
std::vector<Slot> layout(const Spec& s);
// Whether a tensor of this role is computed (an output or a gradient) rather than drawn.
bool is_result(Role r);
// Whether a float32 case stores a float64 twin (ref64.) of slot t: each float result (a packed
// one's values are the same in both runs), not an integer one.
inline bool has_ref64(const Slot& t) {
  return is_result(t.role) &&
         (t.dtype == DType::F64 || (t.packed && safetensors::is_float(t.dtype)));
}
// The elements of a tensor of these dims, ShapeError on overflow.
std::int64_t numel(const Dims& d);

template <class Real>
using Results = std::map<std::string, Tensor<Real>>;

// The op forward and backward on v, in Real, emulating p when Real is float; with `routing`, that
// routing replayed; with `spend` (v itself), the values the op takes are freed as it reads them.
template <class Real>
Results<Real> run(const Spec& s, const Values& v, std::uint64_t seed, std::optional<Precision> p,
                  const Fp8Recipe& fp8 = {}, const std::vector<std::int64_t>* routing = nullptr,
                  Values* spend = nullptr);
// The case's drawn inputs, parameters and upstream gradients, as the dtype stores them.
Values draw_inputs(const Spec& s, const OpCase& c);
// The same tensors read from an op file (FormatError for a missing or misshapen one).
Values values_of(const safetensors::File& f, const Spec& s);

// The fp8 operands a case can store (--keep fp8.*; docs/golden-format.md, "fp8 operands"): for
// each operand of its op's fp8 products, fp8.<name> (rows, k) in its format's F8 dtype, then
// fp8.<name>.scale (float32, one per block), both optional; none unless the case is fp8 and its
// op lists fp8_operands.
std::vector<detail::ExpectedTensor> fp8_operand_tensors(const OpCase& c, const Spec& s);
// FormatError unless each fp8 operand of `operands` that f holds comes with its scales (and they
// with it), every scale finite and positive.
void check_fp8_operands(const safetensors::File& f,
                        const std::vector<detail::ExpectedTensor>& operands);
// Adds to the op case f the operands of `operands` (as fp8_operand_tensors lists them) whose values
// are `wanted` (index by index), with their scales, as the case's emulated fp8 run quantizes them.
void add_fp8_operands(safetensors::File& f, const std::vector<detail::ExpectedTensor>& operands,
                      const std::vector<bool>& wanted);

// The ops, in the order the docs list them.
const std::vector<const OpDef*>& registry();
// The op named `name`; ConfigError listing the ops otherwise.
const OpDef& op_named(const std::string& name);

// Each op's definition, one per file.
const OpDef& linear_op();
const OpDef& layer_norm_op();
const OpDef& rms_norm_op();
const OpDef& softmax_op();
const OpDef& activation_op();
const OpDef& ffn_op();
const OpDef& attention_op();
const OpDef& attention_kvcache_op();
const OpDef& attention_merge_op();
const OpDef& embedding_op();
const OpDef& patch_embedding_op();
const OpDef& pooling_op();
const OpDef& cross_entropy_op();
const OpDef& lm_head_op();
const OpDef& dropout_op();
const OpDef& encoder_layer_op();
const OpDef& decoder_layer_op();
const OpDef& moe_router_op();
const OpDef& moe_op();

}  // namespace teo::golden::ops
