// The layer_norm op (docs/golden-format.md, "Op cases"): LayerNorm over the last dimension.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/layer_norm.hpp"

namespace teo::golden::ops {

namespace {

const RowsSpec& own(const Spec& s) {
  return s.as<RowsSpec>();
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.x", {s.rows, s.width}, Role::input, 2, 0.5));
  t.in.push_back(float_slot("param.weight", {s.width}, Role::param, 0.5, 1));
  t.in.push_back(float_slot("param.bias", {s.width}, Role::param, 0.5));
  t.out.push_back(float_slot("output.y", {s.rows, s.width}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max(s.width, s.rows);
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const auto x = c.in("input.x"), w = c.in("param.weight"), b = c.in("param.bias");
  const auto dy = c.in("grad.output.y");
  Tensor<Real> mean({s.rows}), rstd({s.rows});
  layer_norm_forward(r["output.y"].data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(),
                     s.rows, s.width, static_cast<Real>(s.cfg.norms.layer_norm_eps));
  c.done("output.y");
  layer_norm_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(),
                      r["grad.param.bias"].data(), dy.data(), x.data(), w.data(), mean.data(),
                      rstd.data(), s.rows, s.width);
}

}  // namespace

const OpDef& layer_norm_op() {
  static const OpDef def{
      .name = "layer_norm",
      .config_keys = {"layer_norm_eps"},
      .parse = parse_rows<kDModel>,
      .write_sizes = write_rows<kDModel>,
      .config_of = config_in<RowsSpec>,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 4, "d_model": 7})"},
  };
  return def;
}

}  // namespace teo::golden::ops
