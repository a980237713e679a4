// The decoder_layer op (docs/golden-format.md, "Op cases"): one decoder layer, masked
// self-attention, cross-attention to input.memory when the spec gives memory_len, and the FFN, each
// with its residual and norm (docs/semantics.md, section 17.4).
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/decoder_layer.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch sequences of seq_len rows, each's real tokens (lengths); with memory, cross-
// attention over input.memory (batch, memory_len, d_model) with each's memory_lengths; and the
// layer the config describes.
struct DecoderLayerSpec {
  index_t batch = 0, seq = 0;
  Lengths lengths;
  bool memory = false;
  index_t memory_len = 0;
  Lengths memory_lengths;
  ModelConfig cfg;
};

const DecoderLayerSpec& own(const Spec& s) {
  return s.as<DecoderLayerSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<DecoderLayerSpec>();
  s.cfg = r.op_config();
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  s.memory = r.has("memory_len");
  if (s.memory) {
    s.memory_len = r.size("memory_len", 0);
    s.memory_lengths = r.lengths("memory_lengths", s.batch, s.memory_len);
  } else if (r.has("memory_lengths")) {
    throw ConfigError("spec.memory_lengths goes with memory_len (the memory's rows)");
  }
  s.lengths = r.lengths("lengths", s.batch, s.seq);
}

void fill(Spec& spec) {
  auto& s = spec.as<DecoderLayerSpec>();
  s.lengths.fill();
  s.memory_lengths.fill();
}

const std::vector<std::int64_t>* given_ints(const Spec& spec, const std::string& name) {
  const auto& s = own(spec);
  if (name == "input.lengths") return &s.lengths.values;
  if (name == "input.memory_lengths") return &s.memory_lengths.values;
  return nullptr;
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["lengths"] = s.lengths.values;
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  if (!s.memory) return;
  j["memory_len"] = s.memory_len;
  j["memory_lengths"] = s.memory_lengths.values;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const ModelConfig& c = s.cfg;
  const index_t D = c.d_model;
  t.in.push_back(float_slot("input.x", {s.batch, s.seq, D}, Role::input));
  t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  if (s.memory) {
    t.in.push_back(float_slot("input.memory", {s.batch, s.memory_len, D}, Role::input));
    t.fixed.push_back({"input.memory_lengths", DType::I64, {s.batch}, Role::input});
  }
  // Weights uniform in +-1/sqrt(fan_in), biases +-0.1, norm weights around 1.
  const auto params = DecoderLayerParams<double>::zeros(c, s.memory);
  params.visit(c.norms.norm_first, [&](const std::string& n, const Tensor<double>& p) {
    const auto dims = p.shape().dims();
    const bool norm = n.starts_with("norm");
    const bool weight = n.ends_with(".weight");
    const double amp = norm     ? 0.2
                       : weight ? 1.0 / std::sqrt(static_cast<double>(dims.back()))
                                : 0.1;
    t.in.push_back(float_slot("param." + n, dims, Role::param, amp, norm && weight ? 1.0 : 0.0));
  });
  t.out.push_back(float_slot("output.y", {s.batch, s.seq, D}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max({s.cfg.d_model, s.cfg.ffn.d_ff, s.seq, s.memory_len, s.batch * s.seq,
                   s.batch * s.memory_len});
}

double working_bytes(const Spec& spec) {
  const auto& s = own(spec);
  const auto d = [](index_t x) { return static_cast<double>(x); };
  const double bt = d(s.batch) * d(s.seq);
  return (4 * bt * d(s.cfg.attention.num_heads) * (d(s.seq) + d(s.memory_len)) +
          24 * bt * d(s.cfg.d_model) + 4 * bt * d(s.cfg.ffn.d_ff) +
          8 * d(s.batch) * d(s.memory_len) * d(s.cfg.d_model)) *
         8;
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  const auto& len = spec_ints_of(c.v, c.s);
  const Tensor<Real> memory = s.memory ? c.in("input.memory") : Tensor<Real>();
  const std::vector<std::int64_t> none;
  const auto& mem_len = s.memory ? spec_ints_of(c.v, c.s, "input.memory_lengths") : none;
  auto P = DecoderLayerParams<Real>::zeros(s.cfg, s.memory);
  P.visit(s.cfg.norms.norm_first,
          [&](const std::string& n, Tensor<Real>& t) { t = c.in("param." + n); });
  DecoderLayerActs<Real> A;
  decoder_layer_forward(s.cfg, P, x, len, memory, mem_len, A);
  r["output.y"] = A.output;
  c.done("output.y");
  Tensor<Real> dx, dmemory;
  DecoderLayerParams<Real> G;
  decoder_layer_backward(s.cfg, P, x, len, memory, mem_len, A, dy, dx, dmemory, G);
  r["grad.input.x"] = std::move(dx);
  if (s.memory) r["grad.input.memory"] = std::move(dmemory);
  G.visit(s.cfg.norms.norm_first,
          [&](const std::string& n, Tensor<Real>& t) { r["grad.param." + n] = std::move(t); });
}

}  // namespace

const OpDef& decoder_layer_op() {
  static const OpDef def{
      .name = "decoder_layer",
      .config_keys = {"d_model", "num_heads", "num_kv_heads", "d_ff", "activation", "norm_first",
                      "layer_norm_eps", "norm", "ffn", "ffn_bias", "attn_bias", "attn_out_bias"},
      .base_config = json{{"num_layers", 1},
                          {"vocab_size", 1},
                          {"num_classes", 1},
                          {"positional", "none"},
                          {"causal", true},
                          {"dropout", 0.0}},
      .parse = parse,
      .fill = fill,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .config_of = config_in<DecoderLayerSpec>,
      .spec_ints = given_ints,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .working_bytes = working_bytes,
      .run_float = run<float>,
      .run_double = run<double>,
      .has_attention = true,
      .emulates_precision = false,
      .samples =
          {R"({"batch": 2, "seq_len": 3, "lengths": [3, 2], "memory_len": 4, "memory_lengths": [4, 1], "d_model": 4, "num_heads": 2, "d_ff": 6, "norm_first": false})",
           R"({"batch": 2, "seq_len": 3, "lengths": [3, 1], "memory_len": 2, "memory_lengths": [2, 0], "d_model": 4, "num_heads": 2, "num_kv_heads": 1, "d_ff": 6, "norm_first": true, "norm": "rmsnorm", "ffn": "swiglu", "ffn_bias": false, "attn_bias": false})",
           R"({"batch": 2, "seq_len": 3, "lengths": [3, 2], "d_model": 4, "num_heads": 2, "d_ff": 6, "norm_first": true})"},
  };
  return def;
}

}  // namespace teo::golden::ops
