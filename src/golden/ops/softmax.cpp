// The softmax op (docs/golden-format.md, "Op cases"): softmax over each row's first `visible`
// entries, 0 beyond.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/softmax.hpp"

namespace teo::golden::ops {

namespace {

void tensors(const Spec& s, OpTensors& t) {
  t.in.push_back(float_slot("input.x", {s.rows, s.cols}, Role::input, 3));
  t.out.push_back(float_slot("output.y", {s.rows, s.cols}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max(s.cols, s.rows);
}

void draw(const Spec& s, const OpCase&, Values& v) {
  // a row's entries past its visible ones are masked: -inf
  auto& x = v.f.at("input.x");
  for (index_t r = 0; r < s.rows; ++r)
    for (index_t j = s.lengths[static_cast<std::size_t>(r)]; j < s.cols; ++j)
      x[static_cast<std::size_t>(r * s.cols + j)] = -INFINITY;
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  softmax_forward(r["output.y"].data(), x.data(), s.lengths.data(), s.rows, s.cols);
  c.done("output.y");
  softmax_backward(r["grad.input.x"].data(), dy.data(), r["output.y"].data(), s.rows, s.cols);
}

}  // namespace

const OpDef& softmax_op() {
  static const OpDef def{
      .name = "softmax",
      .config_keys = {},
      .lengths_key = "visible",
      .lengths_per_row = true,
      .parse = parse_rows_cols,
      .write_sizes = write_rows_cols,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .draw = draw,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 4, "cols": 5, "visible": [5, 2, 0, 1]})"},
  };
  return def;
}

}  // namespace teo::golden::ops
