// The dropout op (docs/golden-format.md, "Op cases"): a replayed dropout mask.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/dropout.hpp"

namespace teo::golden::ops {

namespace {

const RowsSpec& own(const Spec& s) {
  return s.as<RowsSpec>();
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.x", {s.rows, s.width}, Role::input));
  t.fixed.push_back({"input.mask", DType::U8, {s.rows, s.width}, Role::input});
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
  const Values& v = c.v;
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  const auto& m = ints_of(v.u8, "input.mask", x.numel());
  const Real scale = dropout_scale<Real>(s.cfg.dropout);
  dropout_forward(r["output.y"].data(), x.data(), m.data(), x.numel(), scale);
  c.done("output.y");
  dropout_backward(r["grad.input.x"].data(), dy.data(), m.data(), x.numel(), scale);
}

}  // namespace

const OpDef& dropout_op() {
  static const OpDef def{
      .name = "dropout",
      .config_keys = {"dropout"},
      .parse = parse_rows<kCols>,
      .write_sizes = write_rows<kCols>,
      .config_of = config_in<RowsSpec>,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 3, "cols": 5, "dropout": 0.3})"},
  };
  return def;
}

}  // namespace teo::golden::ops
