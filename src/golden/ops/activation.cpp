// The activation op (docs/golden-format.md, "Op cases"): relu, gelu, tanh-gelu or silu,
// element-wise.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/feed_forward.hpp"

namespace teo::golden::ops {

namespace {

const RowsSpec& own(const Spec& s) {
  return s.as<RowsSpec>();
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.x", {s.rows, s.width}, Role::input, 3));
  t.out.push_back(float_slot("output.y", {s.rows, s.width}, Role::output));
}

// element-wise: no sums
index_t longest_reduction(const Spec&) {
  return 1;
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  activation_forward(r["output.y"].data(), x.data(), x.numel(), s.cfg.ffn.activation);
  c.done("output.y");
  activation_backward(r["grad.input.x"].data(), dy.data(), x.data(), x.numel(),
                      s.cfg.ffn.activation);
}

}  // namespace

const OpDef& activation_op() {
  static const OpDef def{
      .name = "activation",
      .config_keys = {"activation"},
      .parse = parse_rows<kCols>,
      .write_sizes = write_rows<kCols>,
      .config_of = config_in<RowsSpec>,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 3, "cols": 5, "activation": "relu"})",
                  R"({"rows": 3, "cols": 5, "activation": "gelu"})",
                  R"({"rows": 3, "cols": 5, "activation": "gelu_tanh"})",
                  R"({"rows": 3, "cols": 5, "activation": "silu"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
