// Op cases (teo/golden_ops.hpp): the spec of each op, its tensors, the draw of its inputs, and
// its forward and backward through the same layer functions the model calls.
#include "teo/golden_ops.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

#include "golden_internal.hpp"
#include "kernels/parallel.hpp"
#include "model_internal.hpp"
#include "teo/files.hpp"
#include "teo/golden.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/cross_entropy.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/layer_norm.hpp"
#include "teo/layers/linear.hpp"
#include "teo/layers/pooling.hpp"
#include "teo/layers/positional.hpp"
#include "teo/layers/rope.hpp"
#include "teo/layers/softmax.hpp"
#include "teo/model.hpp"
#include "teo/rng.hpp"
#include "teo/sha256.hpp"

namespace teo::golden {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using safetensors::DType;
using safetensors::File;
using Dims = std::vector<std::int64_t>;

enum class Op {
  linear,
  layer_norm,
  softmax,
  activation,
  attention,
  embedding,
  pooling,
  cross_entropy,
  dropout,
  encoder_layer
};

Op op_of(const std::string& name) {
  const auto& names = op_names();
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    std::string all;
    for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
    throw ConfigError("unknown op \"" + name + "\" (the ops are " + all + ")");
  }
  return static_cast<Op>(it - names.begin());
}

// Attention stores scores and probs (B, H, S, S) by default up to this many entries each; beyond
// it the case uses the row-blocked path and omits them.
constexpr std::int64_t kProbsDefaultLimit = std::int64_t{1} << 22;
// The largest size any one dimension may take.
constexpr std::int64_t kMaxDim = std::int64_t{1} << 31;

// The parsed spec of a case.
struct Spec {
  Op op = Op::linear;
  index_t rows = 0, cols = 0, in_f = 0, out_f = 0;
  index_t batch = 0, heads = 0, seq = 0, d_head = 0, kv_heads = 0;
  std::vector<std::int64_t> lengths;  // attention, pooling, encoder_layer: (B); softmax: visible
  // Lengths not given: (count, value), filled in by fill_defaults once the size is accepted.
  std::optional<std::pair<index_t, index_t>> full_lengths;
  bool bias = true, probs = true;
  std::optional<double> scale;
  index_t vocab = 0, max_len = 0;
  EncoderConfig cfg;  // d_model, num_heads, d_ff and every option spelled as the config spells it
};

// Reads a spec object key by key; finish() rejects the keys nobody asked for.
class Reader {
 public:
  explicit Reader(const json& j) : j_(j) {}
  Reader(const ojson&) = delete;
  bool has(const char* key) const { return j_.contains(key); }
  index_t size(const char* key, index_t min) {
    used_.insert(key);
    if (!j_.contains(key)) throw ConfigError(std::string("the spec needs \"") + key + "\"");
    const json& v = j_.at(key);
    if (!v.is_number_integer()) {
      throw ConfigError(std::string("spec.") + key + " must be an integer, got " + v.dump());
    }
    const auto x = v.get<std::int64_t>();
    if ((v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(kMaxDim)) ||
        x < min || x > kMaxDim) {
      throw ConfigError(std::string("spec.") + key + " must be an integer in [" +
                        std::to_string(min) + ", 2^31], got " + v.dump());
    }
    return x;
  }
  bool flag(const char* key, bool def) {
    used_.insert(key);
    if (!j_.contains(key)) return def;
    if (!j_.at(key).is_boolean()) {
      throw ConfigError(std::string("spec.") + key + " must be true or false, got " +
                        j_.at(key).dump());
    }
    return j_.at(key).get<bool>();
  }
  // (n) integers in [0, max], each named in an error. When the key is absent, returns nothing and
  // records the default (n copies of max) in `full`, to be filled in once the case's size has
  // been accepted.
  std::vector<std::int64_t> prefix_lengths(const char* key, index_t n, index_t max,
                                           std::optional<std::pair<index_t, index_t>>& full) {
    used_.insert(key);
    if (!j_.contains(key)) {
      full = std::pair{n, max};
      return {};
    }
    const json& v = j_.at(key);
    if (!v.is_array()) throw ConfigError(std::string("spec.") + key + " must be an array");
    if (static_cast<index_t>(v.size()) != n) {
      throw ShapeError(std::string("spec.") + key + " has " + std::to_string(v.size()) +
                       " entries for " + std::to_string(n));
    }
    std::vector<std::int64_t> out;
    for (const auto& x : v) {
      if (!x.is_number_integer()) {
        throw ConfigError(std::string("spec.") + key + " must hold integers, got " + x.dump());
      }
      if (x.get<std::int64_t>() < 0 || x.get<std::int64_t>() > max ||
          (x.is_number_unsigned() && x.get<std::uint64_t>() > static_cast<std::uint64_t>(max))) {
        throw ShapeError(std::string("spec.") + key + " has " + x.dump() + ", outside [0, " +
                         std::to_string(max) + "]");
      }
      out.push_back(x.get<std::int64_t>());
    }
    return out;
  }
  std::optional<double> number(const char* key) {
    used_.insert(key);
    if (!j_.contains(key) || j_.at(key).is_null()) return std::nullopt;
    const json& v = j_.at(key);
    // Bounded, so that scale * (q . k) stays finite in float for any Dh the spec allows.
    if (!v.is_number() || !(v.get<double>() > 0) || !(v.get<double>() <= 1e4)) {
      throw ConfigError(std::string("spec.") + key + " must be a number in (0, 1e4], got " +
                        v.dump());
    }
    return v.get<double>();
  }
  // The model-config keys among `keys`, read by EncoderConfig::from_json (its errors name them)
  // on top of `base`.
  EncoderConfig config(const std::vector<const char*>& keys, const json& base) {
    json sub = base;
    for (const char* k : keys) {
      used_.insert(k);
      if (j_.contains(k)) sub[k] = j_.at(k);
    }
    try {
      return EncoderConfig::from_json(sub);
    } catch (const ConfigError& e) {
      throw ConfigError(std::string("spec: ") + e.what());
    }
  }
  void finish() const {
    for (const auto& [key, v] : j_.items()) {
      if (!used_.contains(key)) throw ConfigError("the spec has the unknown key \"" + key + "\"");
    }
  }
  void use(const char* key) { used_.insert(key); }

 private:
  const json& j_;
  std::set<std::string> used_;
};

// The model-config keys of each op's spec: read, validated and written back as EncoderConfig
// spells them.
std::vector<const char*> config_keys(Op op) {
  switch (op) {
    case Op::layer_norm:
      return {"layer_norm_eps"};
    case Op::activation:
      return {"activation"};
    case Op::dropout:
      return {"dropout"};
    case Op::attention:
      return {"causal",         "positional",         "rope_style",     "rotary_dim",
              "rope_base",      "rope_scaling",       "alibi_max_bias", "position_offset",
              "sliding_window", "attn_logit_softcap", "attn_sinks"};
    case Op::embedding:
      return {"positional", "embed_scale"};
    case Op::pooling:
      return {"pooling"};
    case Op::cross_entropy:
      return {"label_smoothing"};
    case Op::encoder_layer:
      return {"d_model",         "num_heads",      "d_ff",
              "activation",      "norm_first",     "causal",
              "layer_norm_eps",  "dropout",        "num_kv_heads",
              "positional",      "rope_style",     "rotary_dim",
              "rope_base",       "rope_scaling",   "alibi_max_bias",
              "position_offset", "sliding_window", "attn_logit_softcap",
              "attn_sinks"};
    case Op::linear:
    case Op::softmax:
      return {};
  }
  return {};
}

// The spec key of an op's per-row or per-sequence lengths, or null.
const char* lengths_key(Op op) {
  if (op == Op::softmax) return "visible";
  return op == Op::attention || op == Op::pooling || op == Op::encoder_layer ? "lengths" : nullptr;
}

// The attention ops' positions: inside attention only (none, rope or alibi, default none). RoPE
// takes its rotary_dim from d_head, and its scaling's original context from seq_len, unless given;
// both are then spelled out in the normalised spec.
void attention_positions(Spec& s, const char* op) {
  EncoderConfig& c = s.cfg;
  if (c.positional == Positional::sinusoidal || c.positional == Positional::learned) {
    throw ConfigError(std::string("spec.positional of the ") + op +
                      " op is \"none\", \"rope\" or \"alibi\", got \"" + to_string(c.positional) +
                      "\"");
  }
  if (c.positional != Positional::rope) return;
  const index_t r = c.rotary_dim.value_or(s.d_head);
  if (r % 2 != 0 || r > s.d_head) {
    throw ConfigError("spec.rotary_dim must be even and in [0, d_head = " +
                      std::to_string(s.d_head) + "], got " + std::to_string(r));
  }
  if (c.rope_scaling.type == RopeScalingType::ntk && r == 2) {
    throw ConfigError("spec.rope_scaling of type \"ntk\" needs rotary_dim > 2");
  }
  c.rotary_dim = r;
  const auto t = c.rope_scaling.type;
  if ((t == RopeScalingType::ntk || t == RopeScalingType::yarn) && !c.rope_scaling.original_max_len)
    c.rope_scaling.original_max_len = s.seq;
}

Spec parse_spec(Op op, Reader& r) {
  Spec s;
  s.op = op;
  // One layer of a model whose vocabulary and head are as small as they can be (they are unused).
  // The attention op's config only carries its options: one head of a width that admits any
  // rotary_dim the spec's d_head can (checked against d_head below).
  json base = json::object();
  if (op == Op::encoder_layer) {
    base = json{{"num_layers", 1}, {"vocab_size", 1}, {"num_classes", 1}, {"positional", "none"}};
  } else if (op == Op::attention) {
    base = json{{"num_layers", 0}, {"vocab_size", 1}, {"num_classes", 1}, {"d_ff", 1},
                {"max_len", 1},    {"num_heads", 1},  {"d_model", 32768}, {"positional", "none"}};
  }
  s.cfg = r.config(config_keys(op), base);
  switch (op) {
    case Op::linear:
      s.rows = r.size("rows", 0);
      s.in_f = r.size("in_features", 1);
      s.out_f = r.size("out_features", 1);
      s.bias = r.flag("bias", true);
      break;
    case Op::layer_norm:
      s.rows = r.size("rows", 0);
      s.cols = r.size("d_model", 1);
      break;
    case Op::softmax:
    case Op::activation:
    case Op::dropout:
      s.rows = r.size("rows", 0);
      s.cols = r.size("cols", 1);
      break;
    case Op::attention:
      s.batch = r.size("batch", 0);
      s.heads = r.size("num_heads", 1);
      s.seq = r.size("seq_len", 1);
      s.d_head = r.size("d_head", 1);
      s.kv_heads = r.has("num_kv_heads") ? r.size("num_kv_heads", 1) : s.heads;
      if (s.heads % s.kv_heads != 0) {
        throw ConfigError("spec.num_kv_heads must divide num_heads = " + std::to_string(s.heads) +
                          ", got " + std::to_string(s.kv_heads));
      }
      s.scale = r.number("scale");
      attention_positions(s, "attention");
      {
        const std::int64_t ss = checked_mul(
            checked_mul(checked_mul(s.batch, s.heads, "attention scores"), s.seq, "scores"), s.seq,
            "attention scores");
        s.probs = r.flag("probs", ss <= kProbsDefaultLimit);
      }
      break;
    case Op::embedding:
      s.batch = r.size("batch", 0);
      s.seq = r.size("seq_len", 1);
      s.vocab = r.size("vocab_size", 1);
      s.cols = r.size("d_model", 1);
      if (s.cfg.positional != Positional::sinusoidal && s.cfg.positional != Positional::learned) {
        throw ConfigError(
            "spec.positional of the embedding op is \"sinusoidal\" or \"learned\", got \"" +
            std::string(to_string(s.cfg.positional)) + "\"");
      }
      s.max_len = s.cfg.positional == Positional::learned
                      ? (r.has("max_len") ? r.size("max_len", 1) : s.seq)
                      : 0;
      if (s.cfg.positional != Positional::learned && r.has("max_len")) {
        throw ConfigError("spec.max_len is for learned positions only");
      }
      if (s.max_len && s.max_len < s.seq) {
        throw ShapeError("spec.seq_len " + std::to_string(s.seq) + " is above max_len " +
                         std::to_string(s.max_len));
      }
      break;
    case Op::pooling:
      s.batch = r.size("batch", 0);
      s.seq = r.size("seq_len", 1);
      s.cols = r.size("d_model", 1);
      break;
    case Op::cross_entropy:
      s.rows = r.size("batch", 0);
      s.cols = r.size("num_classes", 1);
      break;
    case Op::encoder_layer: {
      s.batch = r.size("batch", 0);
      s.seq = r.size("seq_len", 1);
      s.cols = s.cfg.d_model;
      s.d_head = s.cfg.d_head();
      attention_positions(s, "encoder_layer");
      break;
    }
  }
  if (const char* key = lengths_key(op)) {
    const bool rows = op == Op::softmax;  // visible entries per row, else lengths per sequence
    s.lengths =
        r.prefix_lengths(key, rows ? s.rows : s.batch, rows ? s.cols : s.seq, s.full_lengths);
  }
  return s;
}

void fill_defaults(Spec& s) {
  if (s.full_lengths) {
    s.lengths.assign(static_cast<std::size_t>(s.full_lengths->first), s.full_lengths->second);
    s.full_lengths.reset();
  }
}

// The normalised spec: every key of the op spelled out, as the metadata records it: the sizes,
// the lengths, the config keys, then the op's own options.
ojson spec_json(const Spec& s, const OpCase& c) {
  ojson j;
  j["op"] = c.op;
  switch (s.op) {
    case Op::linear:
      j["rows"] = s.rows;
      j["in_features"] = s.in_f;
      j["out_features"] = s.out_f;
      break;
    case Op::layer_norm:
      j["rows"] = s.rows;
      j["d_model"] = s.cols;
      break;
    case Op::softmax:
    case Op::activation:
    case Op::dropout:
      j["rows"] = s.rows;
      j["cols"] = s.cols;
      break;
    case Op::attention:
      j["batch"] = s.batch;
      j["num_heads"] = s.heads;
      j["seq_len"] = s.seq;
      j["d_head"] = s.d_head;
      if (s.kv_heads != s.heads) j["num_kv_heads"] = s.kv_heads;
      break;
    case Op::embedding:
      j["batch"] = s.batch;
      j["seq_len"] = s.seq;
      j["vocab_size"] = s.vocab;
      j["d_model"] = s.cols;
      break;
    case Op::pooling:
      j["batch"] = s.batch;
      j["seq_len"] = s.seq;
      j["d_model"] = s.cols;
      break;
    case Op::cross_entropy:
      j["batch"] = s.rows;
      j["num_classes"] = s.cols;
      break;
    case Op::encoder_layer:
      j["batch"] = s.batch;
      j["seq_len"] = s.seq;
      break;
  }
  if (const char* key = lengths_key(s.op)) j[key] = s.lengths;
  const json cfg = s.cfg.to_json();
  // The variants' keys are spelled out when in use, as the model config writes them; so is the
  // attention ops' positional, whose default is none.
  const bool in_attention = s.op == Op::attention || s.op == Op::encoder_layer;
  for (const char* key : config_keys(s.op)) {
    if (!cfg.contains(key)) continue;
    if (in_attention && std::string_view(key) == "positional" && cfg.at(key) == "none") continue;
    j[key] = cfg.at(key);
  }
  if (s.op == Op::linear) j["bias"] = s.bias;
  if (s.op == Op::attention) {
    j["scale"] = s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.d_head));
    j["probs"] = s.probs;
  }
  if (s.max_len) j["max_len"] = s.max_len;
  j["dtype"] = c.dtype;
  j["seed"] = c.seed;
  if (c.precision) j["precision"] = to_string(*c.precision);
  return j;
}

Spec spec_of(const OpCase& c) {
  const json j = c.spec;  // Reader keeps a reference: not to a temporary conversion
  Reader r(j);
  for (const char* k : {"op", "dtype", "seed", "precision"}) r.use(k);
  Spec s = parse_spec(op_of(c.op), r);
  fill_defaults(s);
  return s;
}

// ---- the tensors of a case --------------------------------------------------------------------

enum class Role { input, param, output, grad_output, grad_input, grad_param };

struct Slot {
  std::string name;
  DType dtype;  // F64 stands for the case's float dtype
  Dims shape;
  Role role;
  double amp = 1;         // float inputs: values are drawn uniform in [-amp, amp)
  double offset = 0;      // ... plus offset
  bool optional = false;  // an output a fused kernel may omit
};

// Every tensor of the case, in file order: inputs, parameters, outputs, upstream gradients,
// input gradients, parameter gradients.
std::vector<Slot> layout(const Spec& s) {
  std::vector<Slot> in, out;  // the differentiable float tensors and the outputs
  std::vector<Slot> fixed;    // integer inputs and masks
  const auto f = [](std::string n, Dims shape, Role role, double amp = 1, double offset = 0) {
    return Slot{std::move(n), DType::F64, std::move(shape), role, amp, offset};
  };
  const double inv_sqrt_in = 1.0 / std::sqrt(static_cast<double>(std::max<index_t>(s.in_f, 1)));
  switch (s.op) {
    case Op::linear:
      in.push_back(f("input.x", {s.rows, s.in_f}, Role::input));
      in.push_back(f("param.weight", {s.out_f, s.in_f}, Role::param, inv_sqrt_in));
      if (s.bias) in.push_back(f("param.bias", {s.out_f}, Role::param, inv_sqrt_in));
      out.push_back(f("output.y", {s.rows, s.out_f}, Role::output));
      break;
    case Op::layer_norm:
      in.push_back(f("input.x", {s.rows, s.cols}, Role::input, 2, 0.5));
      in.push_back(f("param.weight", {s.cols}, Role::param, 0.5, 1));
      in.push_back(f("param.bias", {s.cols}, Role::param, 0.5));
      out.push_back(f("output.y", {s.rows, s.cols}, Role::output));
      break;
    case Op::softmax:  // masked entries are set to -inf when drawn
    case Op::activation:
      in.push_back(f("input.x", {s.rows, s.cols}, Role::input, 3));
      out.push_back(f("output.y", {s.rows, s.cols}, Role::output));
      break;
    case Op::dropout:
      in.push_back(f("input.x", {s.rows, s.cols}, Role::input));
      fixed.push_back({"input.mask", DType::U8, {s.rows, s.cols}, Role::input});
      out.push_back(f("output.y", {s.rows, s.cols}, Role::output));
      break;
    case Op::attention: {
      const Dims qkv = {s.batch, s.heads, s.seq, s.d_head};
      const Dims kv = {s.batch, s.kv_heads, s.seq, s.d_head};
      in.push_back(f("input.q", qkv, Role::input));
      in.push_back(f("input.k", kv, Role::input));
      in.push_back(f("input.v", kv, Role::input));
      fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
      if (s.cfg.attn_sinks) in.push_back(f("param.sinks", {s.heads}, Role::param));
      // In pipeline order, so that a wrong score is named before the context it spoils. A fused
      // kernel may keep the rotated q and k to itself.
      if (s.cfg.positional == Positional::rope) {
        out.push_back(f("output.q_rot", qkv, Role::output));
        out.back().optional = true;
        out.push_back(f("output.k_rot", kv, Role::output));
        out.back().optional = true;
      }
      if (s.probs) {
        for (const char* n : {"output.scores", "output.probs"}) {
          out.push_back(f(n, {s.batch, s.heads, s.seq, s.seq}, Role::output));
          out.back().optional = true;
        }
      }
      out.push_back(f("output.context", qkv, Role::output));
      break;
    }
    case Op::embedding:
      fixed.push_back({"input.tokens", DType::I64, {s.batch, s.seq}, Role::input});
      in.push_back(f("param.weight", {s.vocab, s.cols}, Role::param));
      if (s.cfg.positional == Positional::learned) {
        in.push_back(f("param.pos_weight", {s.max_len, s.cols}, Role::param, 0.5));
      }
      out.push_back(f("output.x", {s.batch, s.seq, s.cols}, Role::output));
      break;
    case Op::pooling:
      in.push_back(f("input.x", {s.batch, s.seq, s.cols}, Role::input));
      fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
      out.push_back(f("output.pooled", {s.batch, s.cols}, Role::output));
      break;
    case Op::cross_entropy:
      in.push_back(f("input.logits", {s.rows, s.cols}, Role::input, 2));
      fixed.push_back({"input.labels", DType::I64, {s.rows}, Role::input});
      out.push_back(f("output.loss", {}, Role::output));
      break;
    case Op::encoder_layer: {
      const EncoderConfig& c = s.cfg;
      const Dims bsd = {s.batch, s.seq, c.d_model};
      in.push_back(f("input.x", bsd, Role::input));
      fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
      if (c.dropout > 0) {
        fixed.push_back(
            {"input.mask.attn", DType::U8, {s.batch, c.num_heads, s.seq, s.seq}, Role::input});
        fixed.push_back({"input.mask.residual1", DType::U8, bsd, Role::input});
        fixed.push_back({"input.mask.ffn", DType::U8, {s.batch, s.seq, c.d_ff}, Role::input});
        fixed.push_back({"input.mask.residual2", DType::U8, bsd, Role::input});
      }
      // The parameters' values come from the model's initialisation (make_op), not from amp.
      LayerParams<double> shapes;
      shapes.has_sinks = c.attn_sinks;
      shapes.visit([&](const std::string& n, const Tensor<double>&) {
        in.push_back(
            f("param." + n, teo::detail::param_shape(c, "layers.0." + n).dims(), Role::param));
      });
      out.push_back(f("output.y", bsd, Role::output));
      break;
    }
  }
  std::vector<Slot> all;
  for (const auto& t : fixed)
    if (t.name.starts_with("input.tokens")) all.push_back(t);
  for (const auto& t : in)
    if (t.role == Role::input) all.push_back(t);
  for (const auto& t : fixed)
    if (!t.name.starts_with("input.tokens")) all.push_back(t);
  for (const auto& t : in)
    if (t.role == Role::param) all.push_back(t);
  for (const auto& t : out) all.push_back(t);
  for (const auto& t : out) {
    if (t.optional) continue;  // no gradient flows into an optional output
    all.push_back(f("grad." + t.name, t.shape, Role::grad_output));
  }
  for (const auto& t : in) {
    all.push_back(
        f("grad." + t.name, t.shape, t.role == Role::input ? Role::grad_input : Role::grad_param));
  }
  return all;
}

bool is_result(Role r) {
  return r == Role::output || r == Role::grad_input || r == Role::grad_param;
}

std::int64_t numel(const Dims& d) {
  std::int64_t n = 1;
  for (auto x : d) n = checked_mul(n, x, "op case tensor");
  return n;
}

// The longest sum behind any one result: the float32 conditioning test's L.
index_t longest_reduction(const Spec& s) {
  switch (s.op) {
    case Op::linear:
      return std::max({s.in_f, s.out_f, s.rows});
    case Op::layer_norm:
    case Op::softmax:
    case Op::cross_entropy:
      return std::max(s.cols, s.rows);
    case Op::attention:
      return std::max(s.seq, s.d_head);
    case Op::embedding:
      return std::max<index_t>(s.batch * s.seq, s.batch);
    case Op::pooling:
      return std::max<index_t>(s.seq, s.batch);
    case Op::encoder_layer:
      return std::max({s.cfg.d_model, s.cfg.d_ff, s.seq, s.batch * s.seq});
    case Op::activation:
    case Op::dropout:
      return 1;
  }
  return 1;
}

// The bytes generating a case of spec s needs at most (OpCase::bytes_needed); s's lengths may
// still be unfilled.
std::uint64_t bytes_of(const Spec& s, bool f32) {
  // In double: an estimate for a limit, which must not wrap around for absurd sizes.
  const double real = f32 ? 4 : 8;
  double file = 0, floats = 0;
  for (const auto& t : layout(s)) {
    const auto n = static_cast<double>(numel(t.shape));
    if (t.dtype == DType::F64) {
      file += n * (real + (real == 4 && is_result(t.role) ? 8 : 0));
      floats += n;
    } else {
      file += n * static_cast<double>(safetensors::dtype_size(t.dtype));
    }
  }
  // The run's working tensors: the values as doubles, the results in Real and in double, plus
  // for attention the materialised gradients of scores and probs, and for a layer its kept
  // activations and their gradients.
  const auto d = [](index_t x) { return static_cast<double>(x); };
  double work = floats * 8 * 3;
  if (s.op == Op::attention && s.probs)
    work += 2 * d(s.batch) * d(s.heads) * d(s.seq) * d(s.seq) * 8;
  if (s.op == Op::encoder_layer) {
    const double bs = d(s.batch) * d(s.seq);
    work += (4 * bs * d(s.cfg.num_heads) * d(s.seq) + 16 * bs * d(s.cfg.d_model) +
             4 * bs * d(s.cfg.d_ff)) *
            8 * 2;
  }
  const double total = file + work;
  return total >= 0x1p64 ? ~std::uint64_t{0} : static_cast<std::uint64_t>(total);
}

// ---- running an op ----------------------------------------------------------------------------

// A case's values by name: float tensors (exact doubles), integers and masks.
struct Values {
  std::map<std::string, std::vector<double>> f;
  std::map<std::string, std::vector<std::int64_t>> i64;
  std::map<std::string, std::vector<std::uint8_t>> u8;
};

template <class Real>
Tensor<Real> tensor_of(const Values& v, const std::string& name, const Dims& shape) {
  const auto it = v.f.find(name);
  if (it == v.f.end()) throw FormatError("the op case has no float " + name);
  Tensor<Real> t = Tensor<Real>::for_overwrite(Shape(std::vector<index_t>(shape)));
  if (static_cast<index_t>(it->second.size()) != t.numel()) {
    throw FormatError("the op case's " + name + " has " + std::to_string(it->second.size()) +
                      " values, expected " + std::to_string(t.numel()));
  }
  for (index_t i = 0; i < t.numel(); ++i) t[i] = static_cast<Real>(it->second[i]);
  return t;
}

template <class T>
const std::vector<T>& ints_of(const std::map<std::string, std::vector<T>>& m,
                              const std::string& name, std::int64_t n) {
  const auto it = m.find(name);
  if (it == m.end() || static_cast<std::int64_t>(it->second.size()) != n) {
    throw FormatError("the op case has no " + name + " of " + std::to_string(n) + " values");
  }
  return it->second;
}

// A golden's token ids and labels must lie in [0, hi): FormatError otherwise.
void check_range(const std::vector<std::int64_t>& v, std::int64_t hi, const std::string& what) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] >= hi) {
      throw FormatError("the op case's " + what + "[" + std::to_string(i) + "] is " +
                        std::to_string(v[i]) + ", outside [0, " + std::to_string(hi) + ")");
    }
  }
}

// The case's input.lengths, which must be the spec's (FormatError otherwise).
const std::vector<std::int64_t>& lengths_of(const Values& v, const Spec& s) {
  const auto& len = ints_of(v.i64, "input.lengths", s.batch);
  if (len != s.lengths) throw FormatError("the op case's input.lengths are not its spec's lengths");
  return len;
}

// Rounds a result to p's storage format where a bf16 or fp16 backend stores it; RangeError
// naming it on an fp16 overflow.
template <class Real>
void store(Tensor<Real>& t, std::optional<Precision> p, const std::string& name) {
  if constexpr (std::is_same_v<Real, float>) {
    if (p && (*p == Precision::bf16 || *p == Precision::fp16) && round_to(*p, t.data(), t.numel()))
      throw RangeError(name + ": " + overflow_message(*p));
  }
}

template <class Real>
using Results = std::map<std::string, Tensor<Real>>;

// The op forward and backward on v, in Real, emulating p when Real is float.
template <class Real>
Results<Real> run(const Spec& s, const Values& v, std::uint64_t seed, std::optional<Precision> p) {
  const teo::detail::EmulationScope scope(std::is_same_v<Real, float> && p ? *p : Precision::fp32);
  const auto slots = layout(s);
  std::map<std::string, Dims> shape;
  for (const auto& t : slots) shape[t.name] = t.shape;
  const auto in = [&](const std::string& n) { return tensor_of<Real>(v, n, shape.at(n)); };
  const auto zeros = [&](const std::string& n) {
    return Tensor<Real>(Shape(std::vector<index_t>(shape.at(n))));
  };
  Results<Real> r;
  // Every result starts as zeros of its shape (the backward functions accumulate).
  for (const auto& t : slots) {
    if (is_result(t.role)) r[t.name] = zeros(t.name);
  }
  const auto done = [&](const std::string& n) { store(r.at(n), p, n); };
  switch (s.op) {
    case Op::linear: {
      const auto x = in("input.x"), w = in("param.weight"), dy = in("grad.output.y");
      const Tensor<Real> b = s.bias ? in("param.bias") : Tensor<Real>();
      linear_forward(r["output.y"].data(), x.data(), w.data(), s.bias ? b.data() : nullptr, s.rows,
                     s.in_f, s.out_f);
      done("output.y");
      linear_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(),
                      s.bias ? r["grad.param.bias"].data() : nullptr, dy.data(), x.data(), w.data(),
                      s.rows, s.in_f, s.out_f);
      break;
    }
    case Op::layer_norm: {
      const auto x = in("input.x"), w = in("param.weight"), b = in("param.bias");
      const auto dy = in("grad.output.y");
      Tensor<Real> mean({s.rows}), rstd({s.rows});
      layer_norm_forward(r["output.y"].data(), mean.data(), rstd.data(), x.data(), w.data(),
                         b.data(), s.rows, s.cols, static_cast<Real>(s.cfg.layer_norm_eps));
      done("output.y");
      layer_norm_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(),
                          r["grad.param.bias"].data(), dy.data(), x.data(), w.data(), mean.data(),
                          rstd.data(), s.rows, s.cols);
      break;
    }
    case Op::softmax: {
      const auto x = in("input.x"), dy = in("grad.output.y");
      softmax_forward(r["output.y"].data(), x.data(), s.lengths.data(), s.rows, s.cols);
      done("output.y");
      softmax_backward(r["grad.input.x"].data(), dy.data(), r["output.y"].data(), s.rows, s.cols);
      break;
    }
    case Op::activation: {
      const auto x = in("input.x"), dy = in("grad.output.y");
      activation_forward(r["output.y"].data(), x.data(), x.numel(), s.cfg.activation);
      done("output.y");
      activation_backward(r["grad.input.x"].data(), dy.data(), x.data(), x.numel(),
                          s.cfg.activation);
      break;
    }
    case Op::dropout: {
      const auto x = in("input.x"), dy = in("grad.output.y");
      const auto& m = ints_of(v.u8, "input.mask", x.numel());
      const Real scale = dropout_scale<Real>(s.cfg.dropout);
      dropout_forward(r["output.y"].data(), x.data(), m.data(), x.numel(), scale);
      done("output.y");
      dropout_backward(r["grad.input.x"].data(), dy.data(), m.data(), x.numel(), scale);
      break;
    }
    case Op::attention: {
      const auto q = in("input.q"), k = in("input.k"), vv = in("input.v");
      const auto dc = in("grad.output.context");
      const auto& len = lengths_of(v, s);
      const bool rope = s.cfg.positional == Positional::rope;
      const Tensor<Real> sinks = s.cfg.attn_sinks ? in("param.sinks") : Tensor<Real>();
      // The op's config has one head: its sizes and K/V heads come from the spec.
      AttentionArgs<Real> args =
          teo::detail::attention_args(s.cfg, s.batch, s.seq, len.data(), sinks.data(),
                                      s.cfg.attn_sinks ? r["grad.param.sinks"].data() : nullptr);
      args.heads = s.heads;
      args.d_head = s.d_head;
      args.scale = s.scale;
      args.variant.kv_heads = s.kv_heads;
      // With RoPE, attention reads q_rot and k_rot, and its q and k gradients are rotated back.
      Tensor<Real> qr, kr, dqr, dkr, cs, sn;
      const index_t rd = s.cfg.rotary();
      if (rope) {
        cs = Tensor<Real>({s.seq, rd / 2});
        sn = Tensor<Real>({s.seq, rd / 2});
        rope_table(cs.data(), sn.data(), s.cfg, s.seq);
        qr = zeros("output.q_rot");
        kr = zeros("output.k_rot");
        rope_forward(qr.data(), q.data(), cs.data(), sn.data(), s.batch * s.heads, s.seq, s.d_head,
                     rd, s.cfg.rope_style);
        rope_forward(kr.data(), k.data(), cs.data(), sn.data(), s.batch * s.kv_heads, s.seq,
                     s.d_head, rd, s.cfg.rope_style);
        r["output.q_rot"] = qr;
        r["output.k_rot"] = kr;
        done("output.q_rot");
        done("output.k_rot");
        qr = r["output.q_rot"];
        kr = r["output.k_rot"];
        dqr = zeros("output.q_rot");
        dkr = zeros("output.k_rot");
      }
      const Real* qa = rope ? qr.data() : q.data();
      const Real* ka = rope ? kr.data() : k.data();
      Real* dq = rope ? dqr.data() : r["grad.input.q"].data();
      Real* dk = rope ? dkr.data() : r["grad.input.k"].data();
      Real* dv = r["grad.input.v"].data();
      const AttentionBackward<Real> grads{
          .dq = dq, .dk = dk, .dv = dv, .dcontext = dc.data(), .q = qa, .k = ka, .v = vv.data()};
      if (s.probs) {
        attention_forward(args, {.context = r["output.context"].data(),
                                 .scores = r["output.scores"].data(),
                                 .probs = r["output.probs"].data(),
                                 .q = qa,
                                 .k = ka,
                                 .v = vv.data()});
        done("output.context");
        auto dprobs = zeros("output.probs"), dscores = zeros("output.scores");
        AttentionBackward<Real> g = grads;
        g.dprobs = dprobs.data();
        g.dscores = dscores.data();
        g.probs = r["output.probs"].data();
        attention_backward(args, g);
      } else {
        attention_forward_rows(
            args, {.context = r["output.context"].data(), .q = qa, .k = ka, .v = vv.data()});
        done("output.context");
        attention_backward_rows(args, grads);
      }
      if (rope) {
        // in the forward pass this was: q_rot, k_rot = RoPE(q), RoPE(k)
        store(dqr, p, "the gradient of output.q_rot");
        store(dkr, p, "the gradient of output.k_rot");
        rope_backward(r["grad.input.q"].data(), dqr.data(), cs.data(), sn.data(), s.batch * s.heads,
                      s.seq, s.d_head, rd, s.cfg.rope_style);
        rope_backward(r["grad.input.k"].data(), dkr.data(), cs.data(), sn.data(),
                      s.batch * s.kv_heads, s.seq, s.d_head, rd, s.cfg.rope_style);
      }
      break;
    }
    case Op::embedding: {
      const auto& tokens = ints_of(v.i64, "input.tokens", s.batch * s.seq);
      check_range(tokens, s.vocab, "input.tokens");
      const auto w = in("param.weight"), dy = in("grad.output.x");
      const index_t n = s.batch * s.seq, D = s.cols;
      const Real scale =
          s.cfg.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(D))) : Real(1);
      // As the model: embedding and positional are each stored, then their sum.
      Tensor<Real> emb({s.batch, s.seq, D}), pos({s.seq, D});
      embedding_forward(emb.data(), tokens.data(), w.data(), n, D, scale);
      store(emb, p, "embedding");
      Tensor<Real> pw;
      if (s.cfg.positional == Positional::learned) {
        pw = in("param.pos_weight");
        std::copy(pw.data(), pw.data() + s.seq * D, pos.data());
      } else {
        sinusoidal_table(pos.data(), s.seq, D);
      }
      store(pos, p, "positional");
      add_positional_forward(r["output.x"].data(), emb.data(), pos.data(), s.batch, s.seq, D);
      done("output.x");
      // in the forward pass this was: x = scale * weight[tokens] + pos
      embedding_backward(r["grad.param.weight"].data(), dy.data(), tokens.data(), n, D, scale);
      if (s.cfg.positional == Positional::learned) {
        add_positional_backward(r["grad.param.pos_weight"].data(), dy.data(), s.batch, s.seq, D);
      }
      break;
    }
    case Op::pooling: {
      const auto x = in("input.x"), dy = in("grad.output.pooled");
      const auto& len = lengths_of(v, s);
      std::vector<std::int64_t> argmax(static_cast<std::size_t>(s.batch * s.cols), -1);
      pooling_forward(r["output.pooled"].data(), argmax.data(), x.data(), len.data(), s.batch,
                      s.seq, s.cols, s.cfg.pooling);
      done("output.pooled");
      pooling_backward(r["grad.input.x"].data(), dy.data(), argmax.data(), len.data(), s.batch,
                       s.seq, s.cols, s.cfg.pooling);
      break;
    }
    case Op::cross_entropy: {
      const auto x = in("input.logits"), dy = in("grad.output.loss");
      const auto& labels = ints_of(v.i64, "input.labels", s.rows);
      check_range(labels, s.cols, "input.labels");
      Tensor<Real> probs({s.rows, s.cols});
      const Real smoothing = static_cast<Real>(s.cfg.label_smoothing);
      r["output.loss"][0] =
          cross_entropy_forward(probs.data(), x.data(), labels.data(), s.rows, s.cols, smoothing);
      done("output.loss");
      cross_entropy_backward(r["grad.input.logits"].data(), probs.data(), labels.data(), s.rows,
                             s.cols, smoothing, dy[0]);
      break;
    }
    case Op::encoder_layer: {
      const auto x = in("input.x"), dy = in("grad.output.y");
      const auto& len = lengths_of(v, s);
      LayerParams<Real> P, G;
      P.has_sinks = s.cfg.attn_sinks;
      P.visit([&](const std::string& n, Tensor<Real>& t) { t = in("param." + n); });
      LayerActs<Real> L, dL;
      const bool drop = s.cfg.dropout > 0;
      encoder_layer_forward(s.cfg, P, x, len, L,
                            {.train = drop, .dropout_seed = seed, .precision = p});
      if (drop) {
        for (const auto& [n, m] : {std::pair{"input.mask.attn", &L.masks.attn},
                                   std::pair{"input.mask.residual1", &L.masks.residual1},
                                   std::pair{"input.mask.ffn", &L.masks.ffn},
                                   std::pair{"input.mask.residual2", &L.masks.residual2}}) {
          if (ints_of(v.u8, n, static_cast<std::int64_t>(m->size())) != *m) {
            throw FormatError(std::string("the op case's ") + n + " is not the mask its seed " +
                              std::to_string(seed) + " gives");
          }
        }
      }
      r["output.y"] = L.output;
      Tensor<Real> dx;
      encoder_layer_backward(s.cfg, P, x, len, L, dy, dx, G, dL, {.precision = p});
      r["grad.input.x"] = std::move(dx);
      G.visit([&](const std::string& n, Tensor<Real>& t) { r["grad.param." + n] = std::move(t); });
      break;
    }
  }
  for (auto& [n, t] : r) {
    if (n.starts_with("grad.")) store(t, p, "the gradient " + n);
  }
  return r;
}

// ---- drawing the inputs -------------------------------------------------------------------------

double draw(std::uint64_t seed, const std::string& name, std::int64_t i) {
  return 2.0 * rng::uniform01(seed, rng::stream_id(name), static_cast<std::uint64_t>(i)) - 1.0;
}

// Float values as the case's dtype (and precision) store them.
void as_stored(std::vector<double>& x, const OpCase& c) {
  if (c.dtype == "float64") return;
  for (auto& e : x) {
    float f = static_cast<float>(e);
    if (c.precision)
      f = round_to(*c.precision == Precision::tf32 ? Precision::fp32 : *c.precision, f);
    e = f;
  }
}

Values draw_inputs(const Spec& s, const OpCase& c) {
  Values v;
  const std::uint64_t seed = c.seed;
  std::optional<LayerParams<double>> layer;
  if (s.op == Op::encoder_layer) {
    EncoderConfig cfg = s.cfg;
    layer = std::move(Params<double>::init(cfg, seed).layers.at(0));
  }
  for (const auto& t : layout(s)) {
    const std::int64_t n = numel(t.shape);
    if (t.dtype == DType::I64) {
      std::vector<std::int64_t> x(static_cast<std::size_t>(n));
      if (t.name == "input.lengths") {
        x = s.lengths;
      } else {
        const index_t hi = t.name == "input.tokens" ? s.vocab : s.cols;  // tokens, labels
        for (std::int64_t i = 0; i < n; ++i) {
          x[static_cast<std::size_t>(i)] = std::min<std::int64_t>(
              hi - 1, static_cast<std::int64_t>(rng::uniform01(seed, rng::stream_id(t.name),
                                                               static_cast<std::uint64_t>(i)) *
                                                static_cast<double>(hi)));
        }
      }
      v.i64[t.name] = std::move(x);
      continue;
    }
    if (t.dtype == DType::U8) {
      std::vector<std::uint8_t> m(static_cast<std::size_t>(n));
      // The dropout op's mask at site "input.mask"; the layer's at the sites its forward uses.
      const std::string site =
          t.name == "input.mask" ? t.name : "dropout.layers.0." + t.name.substr(11);
      dropout_mask(m.data(), n, seed, site, s.cfg.dropout);
      v.u8[t.name] = std::move(m);
      continue;
    }
    if (t.role != Role::input && t.role != Role::param && t.role != Role::grad_output) continue;
    std::vector<double> x(static_cast<std::size_t>(n));
    if (layer && t.role == Role::param) {
      layer->visit([&](const std::string& pn, const Tensor<double>& p) {
        if ("param." + pn == t.name) x.assign(p.begin(), p.end());
      });
    } else {
      for (std::int64_t i = 0; i < n; ++i)
        x[static_cast<std::size_t>(i)] = t.offset + t.amp * draw(seed, t.name, i);
    }
    if (s.op == Op::softmax && t.name == "input.x") {
      for (index_t r = 0; r < s.rows; ++r)
        for (index_t j = s.lengths[static_cast<std::size_t>(r)]; j < s.cols; ++j)
          x[static_cast<std::size_t>(r * s.cols + j)] = -INFINITY;
    }
    as_stored(x, c);
    v.f[t.name] = std::move(x);
  }
  return v;
}

Values values_of(const File& f, const Spec& s) {
  Values v;
  for (const auto& t : layout(s)) {
    if (is_result(t.role)) continue;
    const auto* g = f.find(t.name);
    if (!g) throw FormatError("the op case has no " + t.name);
    if (g->shape != t.shape) {
      throw FormatError("the op case's " + t.name + " is " + g->shape_str() + ", expected " +
                        safetensors::Tensor{t.name, t.dtype, t.shape, {}}.shape_str());
    }
    if (t.dtype == DType::I64) {
      v.i64[t.name] = g->values<std::int64_t>();
    } else if (t.dtype == DType::U8) {
      v.u8[t.name] = g->values<std::uint8_t>();
    } else {
      if (!safetensors::is_float(g->dtype)) throw FormatError(t.name + " is not a float tensor");
      v.f[t.name] = g->float_values();
    }
  }
  return v;
}

template <class Real>
void add_results(File& f, const std::vector<Slot>& slots, const Results<Real>& r,
                 const std::string& prefix) {
  for (const auto& t : slots) {
    if (!is_result(t.role)) continue;
    const Tensor<Real>& x = r.at(t.name);
    f.add<Real>(prefix + t.name, t.shape, x.data(), static_cast<std::size_t>(x.numel()));
  }
}

template <class Real>
File make_typed(const OpCase& c, const Spec& s) {
  const Values v = draw_inputs(s, c);
  const auto slots = layout(s);
  File f;
  f.metadata.emplace_back("format", kOpFormat);
  f.metadata.emplace_back("op", c.op);
  f.metadata.emplace_back("spec", c.spec.dump());
  f.metadata.emplace_back("teo_version", TEO_VERSION);
  for (const auto& t : slots) {
    if (is_result(t.role)) continue;
    if (t.dtype == DType::I64) {
      const auto& x = v.i64.at(t.name);
      f.add<std::int64_t>(t.name, t.shape, x.data(), x.size());
    } else if (t.dtype == DType::U8) {
      const auto& x = v.u8.at(t.name);
      f.add<std::uint8_t>(t.name, t.shape, x.data(), x.size());
    } else {
      const auto& x = v.f.at(t.name);
      std::vector<Real> y(x.begin(), x.end());
      f.add<Real>(t.name, t.shape, y.data(), y.size());
    }
  }
  {
    const auto r = run<Real>(s, v, c.seed, std::nullopt);
    add_results(f, slots, r, "");
  }
  if constexpr (std::is_same_v<Real, float>) {
    const auto r64 = run<double>(s, v, c.seed, std::nullopt);
    add_results(f, slots, r64, "ref64.");
  }
  return f;
}

}  // namespace

const std::vector<std::string>& op_names() {
  static const std::vector<std::string> names = {
      "linear",    "layer_norm", "softmax",       "activation", "attention",
      "embedding", "pooling",    "cross_entropy", "dropout",    "encoder_layer"};
  return names;
}

OpCase OpCase::from_json(const json& j, const std::string& op, std::uint64_t max_bytes) {
  if (!j.is_object()) throw ConfigError("an op spec must be a JSON object");
  OpCase c;
  if (j.contains("op")) {
    if (!j["op"].is_string()) throw ConfigError("spec.op must be a string, got " + j["op"].dump());
    c.op = j["op"].get<std::string>();
    if (!op.empty() && c.op != op) {
      throw ConfigError("the spec is for op \"" + c.op + "\", not \"" + op + "\"");
    }
  } else {
    c.op = op;
  }
  if (c.op.empty()) throw ConfigError("the spec names no op (give --op NAME or \"op\")");
  const Op o = op_of(c.op);
  Reader r(j);
  r.use("op");
  if (!j.contains("dtype") || !j["dtype"].is_string() ||
      (j["dtype"] != "float32" && j["dtype"] != "float64")) {
    throw ConfigError("spec.dtype must be \"float32\" or \"float64\", got " +
                      (j.contains("dtype") ? j["dtype"].dump() : std::string("nothing")));
  }
  c.dtype = j["dtype"].get<std::string>();
  r.use("dtype");
  if (!j.contains("seed") || !j["seed"].is_number_integer() ||
      (!j["seed"].is_number_unsigned() && j["seed"].get<std::int64_t>() < 0)) {
    throw ConfigError("spec.seed must be a non-negative integer, got " +
                      (j.contains("seed") ? j["seed"].dump() : std::string("nothing")));
  }
  c.seed = j["seed"].get<std::uint64_t>();
  r.use("seed");
  if (j.contains("precision")) {
    r.use("precision");
    if (!j["precision"].is_string()) {
      throw ConfigError("spec.precision must be a string, got " + j["precision"].dump());
    }
    c.precision = parse_precision(j["precision"].get<std::string>(), "spec.precision");
    if (c.dtype != "float32" || *c.precision == Precision::fp32 ||
        *c.precision == Precision::fp64) {
      throw ConfigError("spec.precision must be tf32, bf16 or fp16, in a float32 case");
    }
  }
  Spec s = parse_spec(o, r);
  r.finish();
  const std::uint64_t need = bytes_of(s, c.dtype == "float32");
  if (need > max_bytes) {
    throw ShapeError("the " + c.op + " case needs about " + std::to_string(need >> 20) +
                     " MiB, above the limit of " + std::to_string(max_bytes >> 20) + " MiB");
  }
  fill_defaults(s);
  c.spec = spec_json(s, c);
  return c;
}

OpCase OpCase::from_file(const std::string& path, const std::string& op) {
  const json j = read_json_file(path);
  try {
    return from_json(j, op);
  } catch (const ConfigError& e) {
    throw ConfigError(path + ": " + e.what());
  } catch (const ShapeError& e) {
    throw ShapeError(path + ": " + e.what());
  }
}

std::uint64_t OpCase::bytes_needed() const {
  return bytes_of(spec_of(*this), dtype == "float32");
}

bool is_op_file(const File& file) {
  const std::string* fmt = file.meta("format");
  return fmt && *fmt == kOpFormat;
}

OpCase op_case_of(const File& file) {
  const std::string* op = file.meta("op");
  const std::string* spec = file.meta("spec");
  if (!op || !spec) throw FormatError("the op case has no __metadata__.op and spec");
  try {
    return OpCase::from_json(json::parse(*spec), *op);
  } catch (const json::exception&) {
    throw FormatError("the op case's __metadata__.spec is not valid JSON");
  } catch (const ConfigError& e) {
    throw FormatError(std::string("the op case's __metadata__ holds a bad spec: ") + e.what());
  } catch (const ShapeError& e) {
    throw FormatError(std::string("the op case's __metadata__ holds a bad spec: ") + e.what());
  }
}

namespace detail {

void validate_op_file(const File& f, bool inputs_only) {
  const OpCase c = op_case_of(f);
  const Spec s = spec_of(c);
  const bool f32 = c.dtype == "float32";
  std::vector<ExpectedTensor> want;
  for (const auto& t : layout(s)) {
    const DType d = t.dtype == DType::F64 ? (f32 ? DType::F32 : DType::F64) : t.dtype;
    const std::string sym = safetensors::Tensor{t.name, d, t.shape, {}}.shape_str();
    if (inputs_only) {
      if (is_result(t.role)) continue;
      const auto* g = f.find(t.name);
      if (!g) throw FormatError("the op case has no " + t.name + " " + sym);
      if (g->shape != t.shape)
        throw FormatError("the op case's " + t.name + " has shape " + g->shape_str() +
                          ", its spec's is " + sym);
      if (t.dtype == DType::F64 ? !safetensors::is_float(g->dtype) : g->dtype != t.dtype) {
        throw FormatError("the op case's " + t.name + " is " + safetensors::dtype_name(g->dtype) +
                          ", expected " +
                          (t.dtype == DType::F64 ? std::string("a float type")
                                                 : safetensors::dtype_name(t.dtype)));
      }
      continue;
    }
    want.push_back({t.name, d, t.shape, sym});
    if (f32 && is_result(t.role)) want.push_back({"ref64." + t.name, DType::F64, t.shape, sym});
  }
  if (!inputs_only) expect_tensors(f, want, /*op=*/true);
  if (s.op == Op::embedding) expect_in_range(f, "input.tokens", s.vocab, false, "vocab_size");
  if (s.op == Op::cross_entropy) expect_in_range(f, "input.labels", s.cols, false, "num_classes");
  const char* lkey = lengths_key(s.op);
  if (const auto* t = f.find("input.lengths"); t && lkey && s.op != Op::softmax) {
    if (t->values<std::int64_t>() != s.lengths)
      throw FormatError("the op case's input.lengths are not its spec's lengths");
  }
}

}  // namespace detail

std::map<std::string, std::vector<double>> run_op(const File& file, std::optional<Precision> p) {
  detail::validate_op_file(file, /*inputs_only=*/true);
  const OpCase c = op_case_of(file);
  const Spec s = spec_of(c);
  Values v = values_of(file, s);
  std::map<std::string, std::vector<double>> out;
  const auto collect = [&](auto&& r) {
    for (auto& [n, t] : r) out[n] = std::vector<double>(t.begin(), t.end());
  };
  if (!p || *p == Precision::fp64) {
    collect(run<double>(s, v, c.seed, std::nullopt));
  } else {
    for (auto& [n, x] : v.f) {
      for (auto& e : x) {
        float f = static_cast<float>(e);
        if (*p == Precision::bf16 || *p == Precision::fp16) f = round_to(*p, f);
        e = f;
      }
    }
    collect(run<float>(s, v, c.seed, p));
  }
  return out;
}

std::vector<ContractTensor> op_contract(const OpCase& c) {
  std::vector<ContractTensor> out;
  for (const auto& t : layout(spec_of(c))) {
    if (is_result(t.role)) out.push_back({t.name, t.shape, t.optional});
  }
  return out;
}

safetensors::File make_op(const OpCase& c, bool allow_ill_conditioned) {
  const Spec s = spec_of(c);
  File f = c.dtype == "float32" ? make_typed<float>(c, s) : make_typed<double>(c, s);
  if (c.dtype == "float32") {
    std::string why = detail::float32_conditioning(
        f, longest_reduction(s), [] { return std::string("none found in a single op"); },
        allow_ill_conditioned);
    if (c.precision && why.empty()) {
      try {
        detail::precision_conditioning(f, run_op(f, c.precision), *c.precision, nullptr);
      } catch (const IllConditioned& e) {
        if (!allow_ill_conditioned) throw;
        why = e.what();
      }
    }
    if (!why.empty()) f.metadata.emplace_back("ill_conditioned", why);
  }
  return f;
}

std::vector<OpCorpusEntry> read_op_corpus_cases(const std::string& path) {
  return detail::read_corpus<OpCorpusEntry>(
      path, [](const json& spec) { return OpCase::from_json(spec); });
}

void generate_op_corpus(const std::string& dir, std::ostream& log, bool overwrite) {
  namespace fs = std::filesystem;
  const auto entries = read_op_corpus_cases((fs::path(dir) / "cases.json").string());
  const auto names = detail::names_of(entries);
  if (!overwrite) detail::refuse_existing(dir, names);
  detail::write_corpus(dir, names, log, [&](std::size_t i) {
    return std::pair{safetensors::serialize(make_op(entries[i].spec)), entries[i].description};
  });
}

}  // namespace teo::golden
