// The encoder_layer op (docs/golden-format.md, "Op cases"): one whole encoder layer, as the model
// runs it.
#include <cmath>

#include "golden/ops/op.hpp"
#include "model/model_internal.hpp"
#include "teo/model.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch sequences of seq_len rows, each's real tokens (lengths), and the layer the
// config describes.
struct EncoderLayerSpec {
  index_t batch = 0, seq = 0;
  Lengths lengths;
  ModelConfig cfg;
};

const EncoderLayerSpec& own(const Spec& s) {
  return s.as<EncoderLayerSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<EncoderLayerSpec>();
  s.cfg = r.op_config();
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  attention_positions(s.cfg, s.cfg.d_head(), s.seq, "encoder_layer");
  s.lengths = r.lengths("lengths", s.batch, s.seq);
}

void fill(Spec& spec) {
  spec.as<EncoderLayerSpec>().lengths.fill();
}

const std::vector<std::int64_t>* given_ints(const Spec& spec, const std::string& name) {
  return name == "input.lengths" ? &own(spec).lengths.values : nullptr;
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["lengths"] = s.lengths.values;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const ModelConfig& c = s.cfg;
  const Dims bsd = {s.batch, s.seq, c.d_model};
  t.in.push_back(float_slot("input.x", bsd, Role::input));
  t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  if (c.dropout > 0) {
    t.fixed.push_back({"input.mask.attn",
                       DType::U8,
                       {s.batch, c.attention.num_heads, s.seq, s.seq},
                       Role::input});
    t.fixed.push_back({"input.mask.residual1", DType::U8, bsd, Role::input});
    t.fixed.push_back({"input.mask.ffn", DType::U8, {s.batch, s.seq, c.ffn.d_ff}, Role::input});
    t.fixed.push_back({"input.mask.residual2", DType::U8, bsd, Role::input});
  }
  // The parameters' values come from the model's initialisation (make_op), not from amp.
  LayerParams<double> shapes;
  shapes.configure(c, 0);
  shapes.visit([&](const std::string& n, const Tensor<double>&) {
    t.in.push_back(
        float_slot("param." + n, teo::detail::param_shape(c, "layers.0." + n).dims(), Role::param));
  });
  t.out.push_back(float_slot("output.y", bsd, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max({s.cfg.d_model, s.cfg.ffn.d_ff, s.seq, s.batch * s.seq});
}

double working_bytes(const Spec& spec) {
  const auto& s = own(spec);
  // the layer's kept activations and their gradients
  const auto d = [](index_t x) { return static_cast<double>(x); };
  const double bs = d(s.batch) * d(s.seq);
  return (4 * bs * d(s.cfg.attention.num_heads) * d(s.seq) + 16 * bs * d(s.cfg.d_model) +
          4 * bs * d(s.cfg.ffn.d_ff)) *
         8 * 2;
}

void draw(const Spec& spec, const OpCase& c, Values& v) {
  const auto& s = own(spec);
  // The parameters are the model's initialisation of layer 0, as stored.
  const auto layer = std::move(Params<double>::init(s.cfg, c.seed).layers.at(0));
  layer.visit([&](const std::string& n, const Tensor<double>& t) {
    auto& x = v.f.at("param." + n);
    x.assign(t.begin(), t.end());
    as_stored(x, c);
  });
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const Values& v = c.v;
  const auto p = c.p;
  const std::uint64_t seed = c.seed;
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  const auto& len = spec_ints_of(v, c.s);
  LayerParams<Real> P, G;
  P.configure(s.cfg, 0);
  P.visit([&](const std::string& n, Tensor<Real>& t) { t = c.in("param." + n); });
  LayerActs<Real> L, dL;
  const bool drop = s.cfg.dropout > 0;
  encoder_layer_forward(s.cfg, P, x, len, L, {.train = drop, .dropout_seed = seed, .precision = p});
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
}

}  // namespace

const OpDef& encoder_layer_op() {
  // One layer of a model whose vocabulary and head are as small as they can be (unused).
  static const OpDef def{
      .name = "encoder_layer",
      .config_keys = {"d_model",         "num_heads",      "d_ff",
                      "activation",      "norm_first",     "causal",
                      "layer_norm_eps",  "dropout",        "num_kv_heads",
                      "positional",      "rope_style",     "rotary_dim",
                      "rope_base",       "rope_scaling",   "alibi_max_bias",
                      "position_offset", "sliding_window", "attn_logit_softcap",
                      "attn_sinks",      "norm",           "ffn",
                      "ffn_bias",        "attn_bias",      "attn_out_bias"},
      .base_config =
          json{{"num_layers", 1}, {"vocab_size", 1}, {"num_classes", 1}, {"positional", "none"}},
      .parse = parse,
      .fill = fill,
      .write_sizes = write_sizes,
      .config_of = config_in<EncoderLayerSpec>,
      .spec_ints = given_ints,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .working_bytes = working_bytes,
      .draw = draw,
      .run_float = run<float>,
      .run_double = run<double>,
      .has_attention = true,
      .samples =
          {R"({"batch": 2, "seq_len": 3, "lengths": [3, 2], "d_model": 4, "num_heads": 2, "d_ff": 6, "norm_first": false, "dropout": 0.0})",
           R"({"batch": 2, "seq_len": 3, "lengths": [3, 2], "d_model": 4, "num_heads": 2, "d_ff": 6, "norm_first": true, "dropout": 0.2})"},
  };
  return def;
}

}  // namespace teo::golden::ops
