// The layer_norm op (docs/golden-format.md, "Op cases"): LayerNorm over the last dimension.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/layer_norm.hpp"

namespace teo::golden::ops {

namespace {

void tensors(const Spec& s, OpTensors& t) {
  t.in.push_back(float_slot("input.x", {s.rows, s.cols}, Role::input, 2, 0.5));
  t.in.push_back(float_slot("param.weight", {s.cols}, Role::param, 0.5, 1));
  t.in.push_back(float_slot("param.bias", {s.cols}, Role::param, 0.5));
  t.out.push_back(float_slot("output.y", {s.rows, s.cols}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max(s.cols, s.rows);
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const auto x = c.in("input.x"), w = c.in("param.weight"), b = c.in("param.bias");
  const auto dy = c.in("grad.output.y");
  Tensor<Real> mean({s.rows}), rstd({s.rows});
  layer_norm_forward(r["output.y"].data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(),
                     s.rows, s.cols, static_cast<Real>(s.cfg.layer_norm_eps));
  c.done("output.y");
  layer_norm_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(),
                      r["grad.param.bias"].data(), dy.data(), x.data(), w.data(), mean.data(),
                      rstd.data(), s.rows, s.cols);
}

}  // namespace

const OpDef& layer_norm_op() {
  static const OpDef def{
      .name = "layer_norm",
      .config_keys = {"layer_norm_eps"},
      .parse = parse_rows_d_model,
      .write_sizes = write_rows_d_model,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 4, "d_model": 7})"},
  };
  return def;
}

}  // namespace teo::golden::ops
