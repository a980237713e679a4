// The ffn op (docs/golden-format.md, "Op cases"): the feed-forward network of a layer, plain
// (fc2(act(fc1(x)))) or gated (fc2(act(gate(x)) * fc1(x)): SwiGLU, GeGLU), with or without biases.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: rows of the config's d_model, and the FFN the config describes.
struct FfnSpec {
  index_t rows = 0;
  ModelConfig cfg;
};

const FfnSpec& own(const Spec& s) {
  return s.as<FfnSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<FfnSpec>();
  s.cfg = r.op_config();
  s.rows = r.size("rows", 0);
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["rows"] = s.rows;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const ModelConfig& c = s.cfg;
  const index_t D = c.d_model, F = c.ffn.d_ff;
  const double in_d = 1.0 / std::sqrt(static_cast<double>(D));
  const double in_f = 1.0 / std::sqrt(static_cast<double>(F));
  t.in.push_back(float_slot("input.x", {s.rows, D}, Role::input, 2));
  // In the order the layer uses them: the gate, fc1 (the up projection of a gated FFN), fc2.
  for (const char* n : {"gate", "fc1"}) {
    if (std::string(n) == "gate" && !c.gated()) continue;
    t.in.push_back(float_slot(std::string("param.") + n + ".weight", {F, D}, Role::param, in_d));
    if (c.ffn.ffn_bias)
      t.in.push_back(float_slot(std::string("param.") + n + ".bias", {F}, Role::param, in_d));
  }
  t.in.push_back(float_slot("param.fc2.weight", {D, F}, Role::param, in_f));
  if (c.ffn.ffn_bias) t.in.push_back(float_slot("param.fc2.bias", {D}, Role::param, in_f));
  Slot hidden = float_slot("output.hidden", {s.rows, F}, Role::output);
  hidden.optional = true;
  t.out.push_back(hidden);
  t.out.push_back(float_slot("output.y", {s.rows, D}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max({s.cfg.d_model, s.cfg.ffn.d_ff, s.rows});
}

template <class Real>
void run(RunContext<Real>& c) {
  const ModelConfig& cfg = own(c.s).cfg;
  auto& r = c.r;
  const index_t N = own(c.s).rows, D = cfg.d_model, F = cfg.ffn.d_ff;
  const Activation act = cfg.ffn_activation();
  const bool gated = cfg.gated(), bias = cfg.ffn.ffn_bias;
  const auto param = [&](const char* n) { return c.in(std::string("param.") + n); };
  const auto none = Tensor<Real>();
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  const auto w1 = param("fc1.weight"), w2 = param("fc2.weight");
  const auto b1 = bias ? param("fc1.bias") : none, b2 = bias ? param("fc2.bias") : none;
  const auto wg = gated ? param("gate.weight") : none;
  const auto bg = gated && bias ? param("gate.bias") : none;
  // forward: pre = fc1(x) (the up projection), gate = gate(x); hidden = act(pre) or act(gate) *
  // pre; y = fc2(hidden)
  Tensor<Real> pre({N, F}), gate = gated ? Tensor<Real>({N, F}) : Tensor<Real>();
  linear_forward(pre.data(), x.data(), w1.data(), bias ? b1.data() : nullptr, N, D, F);
  Tensor<Real>& hidden = r["output.hidden"];
  if (gated) {
    linear_forward(gate.data(), x.data(), wg.data(), bias ? bg.data() : nullptr, N, D, F);
    gated_forward(hidden.data(), gate.data(), pre.data(), N * F, act);
  } else {
    activation_forward(hidden.data(), pre.data(), N * F, act);
  }
  c.done("output.hidden");
  linear_forward(r["output.y"].data(), hidden.data(), w2.data(), bias ? b2.data() : nullptr, N, F,
                 D);
  c.done("output.y");
  // backward
  Tensor<Real> dhidden({N, F}), dpre({N, F}), dgate = gated ? Tensor<Real>({N, F}) : Tensor<Real>();
  linear_backward(dhidden.data(), r["grad.param.fc2.weight"].data(),
                  bias ? r["grad.param.fc2.bias"].data() : nullptr, dy.data(), hidden.data(),
                  w2.data(), N, F, D, GradWrite::overwrite);
  if (gated) {
    gated_backward(dgate.data(), dpre.data(), dhidden.data(), gate.data(), pre.data(), N * F, act);
    linear_backward(r["grad.input.x"].data(), r["grad.param.gate.weight"].data(),
                    bias ? r["grad.param.gate.bias"].data() : nullptr, dgate.data(), x.data(),
                    wg.data(), N, D, F, GradWrite::overwrite);
  } else {
    activation_backward(dpre.data(), dhidden.data(), pre.data(), N * F, act, GradWrite::overwrite);
  }
  linear_backward(r["grad.input.x"].data(), r["grad.param.fc1.weight"].data(),
                  bias ? r["grad.param.fc1.bias"].data() : nullptr, dpre.data(), x.data(),
                  w1.data(), N, D, F, gated ? GradWrite::accumulate : GradWrite::overwrite);
}

}  // namespace

const OpDef& ffn_op() {
  static const OpDef def{
      .name = "ffn",
      .config_keys = {"d_model", "d_ff", "ffn", "ffn_bias", "activation"},
      .base_config = json{{"num_heads", 1}},
      .parse = parse,
      .write_sizes = write_sizes,
      .config_of = config_in<FfnSpec>,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 4, "d_model": 3, "d_ff": 5})",
                  R"({"rows": 3, "d_model": 4, "d_ff": 6, "ffn": "swiglu", "ffn_bias": false})",
                  R"({"rows": 3, "d_model": 2, "d_ff": 4, "ffn": "geglu"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
