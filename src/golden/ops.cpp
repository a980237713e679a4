// Op cases (teo/golden_ops.hpp): the spec of each op, its tensors, the draw of its inputs, and
// its forward and backward through the same layer functions the model calls.
#include "teo/golden_ops.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

#include "golden/ops/op.hpp"
#include "golden_internal.hpp"
#include "kernels/parallel.hpp"
#include "model/model_internal.hpp"
#include "teo/files.hpp"
#include "teo/golden.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/model.hpp"
#include "teo/rng.hpp"
#include "teo/suggest.hpp"

namespace teo::golden {

namespace ops {

using safetensors::DType;
using safetensors::File;

// ---- the registry -----------------------------------------------------------------------------

const std::vector<const OpDef*>& registry() {
  // The ops, in the order the docs list them. A new op is one file in this folder and one line
  // here.
  static const std::vector<const OpDef*> ops = {&linear_op(),
                                                &layer_norm_op(),
                                                &rms_norm_op(),
                                                &softmax_op(),
                                                &activation_op(),
                                                &ffn_op(),
                                                &attention_op(),
                                                &attention_kvcache_op(),
                                                &attention_merge_op(),
                                                &embedding_op(),
                                                &patch_embedding_op(),
                                                &pooling_op(),
                                                &cross_entropy_op(),
                                                &lm_head_op(),
                                                &dropout_op(),
                                                &encoder_layer_op(),
                                                &decoder_layer_op(),
                                                &moe_router_op(),
                                                &moe_op()};
  return ops;
}

const OpDef& op_named(const std::string& name) {
  for (const OpDef* d : registry())
    if (name == d->name) return *d;
  std::string all;
  for (const OpDef* d : registry()) all += (all.empty() ? "" : ", ") + std::string(d->name);
  std::vector<std::string> names;
  for (const OpDef* d : registry()) names.emplace_back(d->name);
  throw ConfigError("unknown op \"" + name + "\"" + did_you_mean(name, names) + " (the ops are " +
                    all + ")");
}

void attention_positions(ModelConfig& c, index_t d_head, index_t longest, const char* op) {
  if (c.embeddings.positional == Positional::sinusoidal ||
      c.embeddings.positional == Positional::learned) {
    throw ConfigError(std::string("spec.positional of the ") + op +
                      " op is \"none\", \"rope\" or \"alibi\", got \"" +
                      to_string(c.embeddings.positional) + "\"");
  }
  if (c.embeddings.positional != Positional::rope) return;
  const index_t r = c.attention.rotary_dim.value_or(d_head);
  if (r % 2 != 0 || r > d_head) {
    throw ConfigError("spec.rotary_dim must be even and in [0, d_head = " + std::to_string(d_head) +
                      "], got " + std::to_string(r));
  }
  if (c.attention.rope_scaling.type == RopeScalingType::ntk && r == 2) {
    throw ConfigError("spec.rope_scaling of type \"ntk\" needs rotary_dim > 2");
  }
  c.attention.rotary_dim = r;
  const auto t = c.attention.rope_scaling.type;
  if ((t == RopeScalingType::ntk || t == RopeScalingType::yarn) &&
      !c.attention.rope_scaling.original_max_len)
    c.attention.rope_scaling.original_max_len = longest;
}

namespace {

Spec parse_spec(const OpDef& def, Reader& r) {
  Spec s;
  s.def = &def;
  r.for_op(&def);
  def.parse(s, r);
  return s;
}

void fill_defaults(Spec& s) {
  if (s.def->fill) s.def->fill(s);
}

// The normalised spec: every key of the op spelled out, as the metadata records it: the sizes,
// the lengths, the config keys, then the op's own options.
ojson spec_json(const Spec& s, const OpCase& c) {
  const OpDef& def = *s.def;
  ojson j;
  j["op"] = c.op;
  def.write_sizes(s, j);
  const json cfg = def.config_of ? def.config_of(s)->to_json() : json::object();
  // The variants' keys are spelled out when in use, as the model config writes them; so is the
  // positional of the ops whose default is none.
  const bool none_default = def.base_config.value("positional", "") == "none";
  for (const char* key : def.config_keys) {
    if (!cfg.contains(key)) continue;
    if (none_default && std::string_view(key) == "positional" && cfg.at(key) == "none") continue;
    j[key] = cfg.at(key);
  }
  if (def.write_options) def.write_options(s, j);
  j["dtype"] = c.dtype;
  j["seed"] = c.seed;
  if (c.precision) j["precision"] = to_string(*c.precision);
  if (c.precision == Precision::fp8) {
    detail::write_fp8_keys(j, c.fp8);
    j["fp8_outlier"] = c.fp8_outlier;
  }
  return j;
}

// Whether c's operands take delayed scales: ConfigError unless the op's fp8 operands are all
// inputs (the linear op).
bool fp8_delayed(const OpDef& def, const OpCase& c) {
  if (c.precision != Precision::fp8 || !c.fp8.delayed) return false;
  if (!def.fp8_operands) {
    throw ConfigError(std::string("spec.fp8_scales: delayed scales are inputs of the linear op "
                                  "case only, not of ") +
                      def.name + ", which computes some of its fp8 operands");
  }
  return true;
}

}  // namespace

Spec spec_of(const OpCase& c) {
  const json j = c.spec;  // Reader keeps a reference: not to a temporary conversion
  Reader r(j);
  for (const char* k : {"op", "dtype", "seed", "precision"}) r.use(k);
  for (const auto& k : detail::fp8_keys()) r.use(k.c_str());
  r.use("fp8_outlier");
  Spec s = parse_spec(op_named(c.op), r);
  s.fp8_delayed = fp8_delayed(*s.def, c);
  s.float32 = c.dtype == "float32";
  fill_defaults(s);
  return s;
}

// ---- the tensors of a case --------------------------------------------------------------------

// Every tensor of the case, in file order: inputs, parameters, outputs, upstream gradients,
// input gradients, parameter gradients.
std::vector<Slot> layout(const Spec& s) {
  OpTensors t;
  s.def->tensors(s, t);
  const auto& [in, fixed, out] = t;
  std::vector<Slot> all;
  for (const auto& x : fixed)
    if (x.name.starts_with("input.tokens")) all.push_back(x);
  for (const auto& x : in)
    if (x.role == Role::input) all.push_back(x);
  for (const auto& x : fixed)
    if (!x.name.starts_with("input.tokens")) all.push_back(x);
  for (const auto& x : in)
    if (x.role == Role::param) all.push_back(x);
  for (const auto& x : out) all.push_back(x);
  if (s.def->forward_only || s.forward_only) return all;
  for (const auto& x : out) {
    if (x.optional || x.no_grad) continue;  // no gradient flows into these
    all.push_back(float_slot("grad." + x.name, x.shape, Role::grad_output));
  }
  for (const auto& x : in) {
    all.push_back(float_slot("grad." + x.name, x.shape,
                             x.role == Role::input ? Role::grad_input : Role::grad_param));
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

namespace {

// Whether def's op reads n with RunContext::take (OpDef::taken).
bool takes(const OpDef& def, const std::string& n) {
  return std::any_of(def.taken.begin(), def.taken.end(), [&](const char* x) { return n == x; });
}

// The bytes generating a case of spec s needs at most (OpCase::bytes_needed): written to a file
// as it is computed, or, in_memory, built whole and serialized. s's lengths may still be
// unfilled.
std::uint64_t bytes_of(const Spec& s, bool f32, bool precision, bool in_memory) {
  // In double: an estimate for a limit, which must not wrap around for absurd sizes.
  const double real = f32 ? 4 : 8;
  double file = 0, given = 0, results = 0, ints = 0, taken = 0, largest_taken = 0;
  for (const auto& t : layout(s)) {
    const auto n = static_cast<double>(numel(t.shape));
    if (t.dtype == DType::F64) {
      file += n * (real + (real == 4 && is_result(t.role) ? 8 : 0));
      (is_result(t.role) ? results : given) += n;
      if (takes(*s.def, t.name)) {
        taken += n;
        largest_taken = std::max(largest_taken, n);
      }
    } else {
      file += n * static_cast<double>(safetensors::dtype_size(t.dtype));
      ints += n;
    }
  }
  // The float64 run holds the most of the runs (a float32 case's float32 run holds the drawn
  // doubles, float copies and float results): the drawn values and the op's copies of them,
  // except that a tensor it takes (OpDef::taken) is held about once (the largest twice while it
  // is copied); its results; what the op holds beyond them. A run's results are written and freed
  // before the next run.
  const double run64 = (2 * given - taken + largest_taken + results) * 8;
  // A float32 case's conditioning then reads the file, mapped; a precision case's also runs the
  // op again in float: the inputs as doubles and floats, its results as floats and doubles.
  const double conditioning = f32 ? file + (precision ? (given + results) * (8 + 4) : 0) : 0;
  double work = std::max(run64, conditioning);
  // integers and masks: held as int64 in the spec and the drawn values, and as stored
  work += ints * (8 + 8 + 8);
  if (s.def->working_bytes) work += s.def->working_bytes(s);
  // In memory the file is held too, and twice once it is serialized.
  const double total = in_memory ? std::max(file + work, 2 * file) : work;
  return total >= 0x1p64 ? ~std::uint64_t{0} : static_cast<std::uint64_t>(total);
}

}  // namespace

// ---- running an op ----------------------------------------------------------------------------

std::vector<double> packed_numbers(const Values& v, const std::string& name, DType d) {
  const auto it = v.raw.find(name);
  if (it == v.raw.end()) throw FormatError("the op case has no " + name);
  const auto n = static_cast<std::int64_t>(it->second.size() / safetensors::dtype_size(d));
  const safetensors::Tensor t{name, d, {n}, it->second};
  if (safetensors::is_float(d)) return t.float_values();
  const auto i = t.int_values();
  return {i.begin(), i.end()};
}

void check_range(const std::vector<std::int64_t>& v, std::int64_t hi, const std::string& what) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] >= hi) {
      throw FormatError("the op case's " + what + "[" + std::to_string(i) + "] is " +
                        std::to_string(v[i]) + ", outside [0, " + std::to_string(hi) + ")");
    }
  }
}

const std::vector<std::int64_t>* spec_ints(const Spec& s, const std::string& name) {
  return s.def->spec_ints ? s.def->spec_ints(s, name) : nullptr;
}

// The bound of the drawn integer input `name`: std::logic_error if its op gives none.
OpDef::IntBound int_bound(const Spec& s, const std::string& name) {
  const OpDef::IntBound b = s.def->int_bound ? s.def->int_bound(s, name) : OpDef::IntBound{};
  if (b.hi <= 0)
    throw std::logic_error(std::string("the ") + s.def->name + " op has no bound of " + name);
  return b;
}

const std::vector<std::int64_t>& spec_ints_of(const Values& v, const Spec& s,
                                              const std::string& name) {
  const auto* want = spec_ints(s, name);
  const auto& got = ints_of(v.i64, name, static_cast<std::int64_t>(want->size()));
  if (got != *want) {
    throw FormatError("the op case's " + name + " are not its spec's " + name.substr(6));
  }
  return got;
}

void check_taken(const Spec& s, const std::string& n) {
  if (!takes(*s.def, n))
    throw std::logic_error("the " + std::string(s.def->name) + " op takes " + n +
                           ", which its OpDef::taken does not list");
}

void as_stored(std::vector<double>& x, const OpCase& c) {
  if (c.dtype == "float64") return;
  for (auto& e : x) {
    float f = static_cast<float>(e);
    if (c.precision)
      f = round_to(*c.precision == Precision::tf32 ? Precision::fp32 : *c.precision, f);
    e = f;
  }
}

template <class Real>
Results<Real> run(const Spec& s, const Values& v, std::uint64_t seed, std::optional<Precision> p,
                  const Fp8Recipe& fp8, const std::vector<std::int64_t>* routing, Values* spend) {
  const teo::detail::EmulationScope scope(std::is_same_v<Real, float> && p ? *p : Precision::fp32,
                                          fp8);
  const auto slots = layout(s);
  RunContext<Real> c{s, v, seed, p, {}, {}, routing, spend};
  for (const auto& t : slots) c.shape[t.name] = t.shape;
  // Every result starts as zeros of its shape (the backward functions accumulate).
  for (const auto& t : slots) {
    if (is_result(t.role)) c.r[t.name] = c.zeros(t.name);
  }
  if constexpr (std::is_same_v<Real, float>)
    s.def->run_float(c);
  else
    s.def->run_double(c);
  for (auto& [n, t] : c.r) {
    if (n.starts_with("grad.")) store(t, p, "the gradient " + n);
  }
  return std::move(c.r);
}

template Results<float> run<float>(const Spec&, const Values&, std::uint64_t,
                                   std::optional<Precision>, const Fp8Recipe&,
                                   const std::vector<std::int64_t>*, Values*);
template Results<double> run<double>(const Spec&, const Values&, std::uint64_t,
                                     std::optional<Precision>, const Fp8Recipe&,
                                     const std::vector<std::int64_t>*, Values*);

namespace {

// ---- drawing the inputs -------------------------------------------------------------------------

double draw(std::uint64_t seed, const std::string& name, std::int64_t i) {
  return 2.0 * rng::uniform01(seed, rng::stream_id(name), static_cast<std::uint64_t>(i)) - 1.0;
}

// An fp8 case's activations have channels of their own magnitudes, as LLM activations do: each
// channel (the last dimension) is scaled by 2^u, u uniform in [-2, 2), and one channel in 16 (at
// least one) by `outlier` more, so that blocks and tensors have amaxes of their own.
void fp8_channel_magnitudes(std::vector<double>& x, std::int64_t channels, std::uint64_t seed,
                            const std::string& name, double outlier) {
  if (channels <= 0) return;
  const std::uint64_t stream = rng::stream_id(name + ".fp8_channels");
  std::vector<double> mag(static_cast<std::size_t>(channels));
  const auto pick = static_cast<std::int64_t>(
      rng::uniform01(seed, stream, static_cast<std::uint64_t>(2 * channels)) *
      static_cast<double>(channels));
  for (std::int64_t j = 0; j < channels; ++j) {
    const auto u = static_cast<std::uint64_t>(j);
    const double e = 4 * rng::uniform01(seed, stream, 2 * u) - 2;
    const bool out = j == pick || rng::uniform01(seed, stream, 2 * u + 1) < 1.0 / 16;
    mag[static_cast<std::size_t>(j)] = std::exp2(e) * (out ? outlier : 1.0);
  }
  for (std::size_t i = 0; i < x.size(); ++i) x[i] *= mag[i % mag.size()];
}

}  // namespace

Values draw_inputs(const Spec& s, const OpCase& c) {
  Values v;
  const std::uint64_t seed = c.seed;
  for (const auto& t : layout(s)) {
    if (is_result(t.role) || t.packed) continue;  // the op's draw packs its weights
    const std::int64_t n = numel(t.shape);
    if (t.dtype == DType::I64 || t.dtype == DType::I32) {
      std::vector<std::int64_t> x(static_cast<std::size_t>(n));
      if (const auto* given = spec_ints(s, t.name)) {
        x = *given;
      } else {
        // tokens, token types, labels
        const index_t hi = int_bound(s, t.name).hi;
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
      dropout_mask(m.data(), n, seed, site, s.def->config_of(s)->dropout);
      v.u8[t.name] = std::move(m);
      continue;
    }
    if (t.role != Role::input && t.role != Role::param && t.role != Role::grad_output) continue;
    std::vector<double> x(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      x[static_cast<std::size_t>(i)] = t.offset + t.amp * draw(seed, t.name, i);
    if (c.precision == Precision::fp8 && t.role == Role::input && t.shape.size() >= 2) {
      fp8_channel_magnitudes(x, t.shape.back(), seed, t.name, c.fp8_outlier);
    }
    as_stored(x, c);
    v.f[t.name] = std::move(x);
  }
  if (s.def->draw) s.def->draw(s, c, v);
  for (const auto& t : layout(s)) {
    if (!t.packed || is_result(t.role)) continue;
    const auto it = v.raw.find(t.name);
    if (it == v.raw.end() || it->second.size() != static_cast<std::size_t>(numel(t.shape)) *
                                                      safetensors::dtype_size(t.dtype))
      throw std::logic_error("the " + std::string(s.def->name) + " op drew no " + t.name);
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
    if (t.packed) {
      if (g->dtype != t.dtype) {
        throw FormatError("the op case's " + t.name + " is " + safetensors::dtype_name(g->dtype) +
                          ", expected " + safetensors::dtype_name(t.dtype));
      }
      const auto d = g->data();
      v.raw[t.name].assign(d.begin(), d.end());
    } else if (t.dtype == DType::I64 || t.dtype == DType::I32) {
      v.i64[t.name] = g->int_values();
    } else if (t.dtype == DType::U8) {
      v.u8[t.name] = g->values<std::uint8_t>();
    } else {
      if (!safetensors::is_float(g->dtype)) throw FormatError(t.name + " is not a float tensor");
      v.f[t.name] = g->float_values();
    }
  }
  return v;
}

}  // namespace ops

using namespace ops;  // NOLINT(google-build-using-namespace): this file is the registry's face

const std::vector<std::string>& op_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const OpDef* d : registry()) n.emplace_back(d->name);
    return n;
  }();
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
  const OpDef& o = op_named(c.op);
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
      throw ConfigError("spec.precision must be tf32, bf16, fp16 or fp8, in a float32 case");
    }
    if (!o.emulates_precision) {
      throw ConfigError("spec.precision: the " + c.op +
                        " op emulates no reduced precision (docs/semantics.md, 17.4): its cases "
                        "are float32 and float64 only");
    }
  }
  for (const auto& k : detail::fp8_keys()) {
    if (!j.contains(k)) continue;
    r.use(k.c_str());
    if (c.precision != Precision::fp8) {
      throw ConfigError("spec." + k + " applies to an fp8 case only (give \"precision\": \"fp8\")");
    }
  }
  if (c.precision == Precision::fp8) detail::read_fp8_keys(j, c.fp8, "spec");
  if (j.contains("fp8_outlier")) {
    r.use("fp8_outlier");
    const json& factor = j["fp8_outlier"];
    if (c.precision != Precision::fp8) {
      throw ConfigError("spec.fp8_outlier applies to an fp8 case only");
    }
    if (!factor.is_number() || !(factor.get<double>() >= 1) || !(factor.get<double>() <= 1e4)) {
      throw ConfigError("spec.fp8_outlier must be a number from 1 to 1e4, got " + factor.dump());
    }
    c.fp8_outlier = factor.get<double>();
  }
  Spec s = parse_spec(o, r);
  r.finish();
  s.fp8_delayed = fp8_delayed(o, c);
  s.float32 = c.dtype == "float32";
  if (o.check_case) o.check_case(s, c);
  if (c.precision == Precision::fp8 && c.fp8.attention && !o.has_attention) {
    throw ConfigError("spec.fp8_attention: the " + c.op + " op has no attention to run in fp8");
  }
  const std::uint64_t need = bytes_of(s, c.dtype == "float32", c.precision.has_value(),
                                      /*in_memory=*/false);
  if (need > max_bytes) {
    throw ShapeError("the " + c.op + " case needs about " + std::to_string(need >> 20) +
                     " MiB, above the limit of " + std::to_string(max_bytes >> 20) + " MiB");
  }
  fill_defaults(s);
  c.spec = spec_json(s, c);
  return c;
}

OpCase OpCase::from_file(const std::string& path, const std::string& op) {
  if (!op.empty()) op_named(op);  // a bad --op is the flag's fault, not the file's
  const json j = read_json_file(path);
  try {
    return from_json(j, op);
  } catch (const ConfigError& e) {
    throw ConfigError(path + ": " + e.what());
  } catch (const ShapeError& e) {
    throw ShapeError(path + ": " + e.what());
  }
}

std::uint64_t OpCase::bytes_needed(bool in_memory) const {
  return bytes_of(spec_of(*this), dtype == "float32", precision.has_value(), in_memory);
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

bool fp8_operands_are_inputs(const std::string& op) {
  return ops::op_named(op).fp8_operands != nullptr;
}

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
    if (f32 && has_ref64(t)) want.push_back({"ref64." + t.name, DType::F64, t.shape, sym});
  }
  if (!inputs_only) {
    const auto operands = fp8_operand_tensors(c, s);
    want.insert(want.end(), operands.begin(), operands.end());
    expect_tensors(f, want, /*op=*/true);
    check_fp8_operands(f, operands);
  }
  // the integer inputs an op may have: those its spec determines (lengths and block tables),
  // and those drawn below a bound (token ids, labels)
  std::set<std::string> ints;
  for (const auto& t : layout(s))
    if ((t.dtype == DType::I64 || t.dtype == DType::I32) && !is_result(t.role) && !t.packed)
      ints.insert(t.name);
  for (const auto& name : ints) {
    const auto* expected = spec_ints(s, name);
    if (!expected) {
      const auto b = int_bound(s, name);
      expect_in_range(f, name, b.hi, false, b.key);
      continue;
    }
    const auto* t = f.find(name);
    if (!t) continue;
    if (t->int_values() != *expected)
      throw FormatError("the op case's " + name + " are not its spec's " + name.substr(6));
  }
}

std::set<std::string> op_contract_names(const File& f) {
  const OpCase c = op_case_of(f);
  const Spec s = spec_of(c);
  std::set<std::string> out;
  for (const auto& t : layout(s)) {
    out.insert(t.name);
    if (c.dtype == "float32" && has_ref64(t)) out.insert("ref64." + t.name);
  }
  for (const auto& t : fp8_operand_tensors(c, s)) out.insert(t.name);
  return out;
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
  if (p && *p != Precision::fp32 && *p != Precision::fp64 && !s.def->emulates_precision) {
    throw ConfigError("the " + c.op + " op emulates no reduced precision (docs/semantics.md, " +
                      "17.4): it is judged in fp32 or fp64 only, not " + to_string(*p));
  }
  // A routed op judged in a precision runs on the golden's own routing.
  std::vector<std::int64_t> routing;
  const auto* ids = s.def->router_of ? file.find("output.topk_ids") : nullptr;
  if (p && ids) routing = ids->int_values();
  const auto* given = p && ids ? &routing : nullptr;
  if (!p || *p == Precision::fp64) {
    collect(run<double>(s, v, c.seed, std::nullopt, {}, given));
  } else {
    for (auto& [n, x] : v.f) {
      for (auto& e : x) {
        float f = static_cast<float>(e);
        if (stores_reduced(*p)) f = round_to(*p, f);
        e = f;
      }
    }
    collect(run<float>(s, v, c.seed, p, c.fp8, given));
  }
  return out;
}

namespace {

// The op's sample specs, normalised (dtype float64, seed 0).
std::vector<OpCase> samples_of(const std::string& op) {
  std::vector<OpCase> out;
  for (const char* sample : op_named(op).samples) {
    json j = json::parse(sample);
    j["dtype"] = "float64";
    j["seed"] = 0;
    out.push_back(OpCase::from_json(j, op));
  }
  return out;
}

}  // namespace

std::vector<std::string> op_spec_keys(const std::string& op) {
  const OpDef& def = op_named(op);
  std::set<std::string> keys = {"op", "dtype", "seed", "precision"};
  keys.insert(detail::fp8_keys().begin(), detail::fp8_keys().end());
  keys.insert("fp8_outlier");
  keys.insert(def.config_keys.begin(), def.config_keys.end());
  for (const auto& c : samples_of(op))
    for (const auto& item : c.spec.items()) keys.insert(item.key());
  return {keys.begin(), keys.end()};
}

std::vector<std::string> op_optional_outputs(const std::string& op) {
  std::set<std::string> names;
  for (const auto& c : samples_of(op))
    for (const auto& t : op_contract(c))
      if (t.optional) names.insert(t.name);
  return {names.begin(), names.end()};
}

std::vector<ContractTensor> op_contract(const OpCase& c) {
  std::vector<ContractTensor> out;
  const Spec s = spec_of(c);
  for (const auto& t : layout(s)) {
    if (!is_result(t.role)) continue;
    const bool upstream = t.role == Role::output && !t.optional && !t.no_grad &&
                          !s.def->forward_only && !s.forward_only;
    out.push_back({t.name, t.shape, t.optional, t.dtype == DType::I32, upstream, t.exact});
  }
  return out;
}

namespace detail {
std::vector<double> exact_alternates(const File& golden, const std::string& name) {
  const Spec s = spec_of(op_case_of(golden));
  if (!s.def->alternates) return {};
  // only quantized codes (packed results) round a quotient: no other output reads the inputs here
  const auto slots = layout(s);
  if (std::none_of(slots.begin(), slots.end(),
                   [&](const Slot& t) { return t.name == name && t.packed; }))
    return {};
  return s.def->alternates(s, values_of(golden, s), name);
}

std::string locate_exact(const OpCase& c, const std::string& name, std::int64_t i) {
  const Spec s = spec_of(c);
  return s.def->locate ? s.def->locate(s, name, i) : "";
}

index_t longest_reduction(const OpCase& c) {
  const Spec s = spec_of(c);
  return s.def->longest_reduction(s);
}
}  // namespace detail

std::vector<OpCorpusEntry> read_op_corpus_cases(const std::string& path) {
  return detail::read_corpus<OpCorpusEntry>(
      path, [](const json& spec) { return OpCase::from_json(spec); });
}

}  // namespace teo::golden
