// The linear op (docs/golden-format.md, "Op cases"): y = x W^T + b.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/linear.hpp"

namespace teo::golden::ops {

namespace {

void parse(Spec& s, Reader& r) {
  s.rows = r.size("rows", 0);
  s.in_f = r.size("in_features", 1);
  s.out_f = r.size("out_features", 1);
  s.bias = r.flag("bias", true);
}

void write_sizes(const Spec& s, ojson& j) {
  j["rows"] = s.rows;
  j["in_features"] = s.in_f;
  j["out_features"] = s.out_f;
}

void write_options(const Spec& s, ojson& j) {
  j["bias"] = s.bias;
}

void tensors(const Spec& s, OpTensors& t) {
  const double inv_sqrt_in = 1.0 / std::sqrt(static_cast<double>(std::max<index_t>(s.in_f, 1)));
  t.in.push_back(float_slot("input.x", {s.rows, s.in_f}, Role::input));
  t.in.push_back(float_slot("param.weight", {s.out_f, s.in_f}, Role::param, inv_sqrt_in));
  if (s.bias) t.in.push_back(float_slot("param.bias", {s.out_f}, Role::param, inv_sqrt_in));
  t.out.push_back(float_slot("output.y", {s.rows, s.out_f}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max({s.in_f, s.out_f, s.rows});
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const auto x = c.in("input.x"), w = c.in("param.weight"), dy = c.in("grad.output.y");
  const Tensor<Real> b = s.bias ? c.in("param.bias") : Tensor<Real>();
  linear_forward(r["output.y"].data(), x.data(), w.data(), s.bias ? b.data() : nullptr, s.rows,
                 s.in_f, s.out_f);
  c.done("output.y");
  linear_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(),
                  s.bias ? r["grad.param.bias"].data() : nullptr, dy.data(), x.data(), w.data(),
                  s.rows, s.in_f, s.out_f);
}

}  // namespace

const OpDef& linear_op() {
  static const OpDef def{
      .name = "linear",
      .config_keys = {},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 5, "in_features": 4, "out_features": 3})",
                  R"({"rows": 3, "in_features": 2, "out_features": 4, "bias": false})"},
  };
  return def;
}

}  // namespace teo::golden::ops
