// The softmax op (docs/golden-format.md, "Op cases"): softmax over each row's first `visible`
// entries, 0 beyond.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/softmax.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: rows of cols entries, of which each row's first `visible` are visible.
struct SoftmaxSpec {
  index_t rows = 0, cols = 0;
  Lengths visible;  // per row, in [0, cols]
};

const SoftmaxSpec& own(const Spec& s) {
  return s.as<SoftmaxSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<SoftmaxSpec>();
  s.rows = r.size("rows", 0);
  s.cols = r.size("cols", 1);
  s.visible = r.lengths("visible", s.rows, s.cols);
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["rows"] = s.rows;
  j["cols"] = s.cols;
  j["visible"] = s.visible.values;
}

void fill(Spec& spec) {
  spec.as<SoftmaxSpec>().visible.fill();
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.x", {s.rows, s.cols}, Role::input, 3));
  t.out.push_back(float_slot("output.y", {s.rows, s.cols}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max(s.cols, s.rows);
}

void draw(const Spec& spec, const OpCase&, Values& v) {
  const auto& s = own(spec);
  // a row's entries past its visible ones are masked: -inf
  auto& x = v.f.at("input.x");
  for (index_t r = 0; r < s.rows; ++r)
    for (index_t j = s.visible.values[static_cast<std::size_t>(r)]; j < s.cols; ++j)
      x[static_cast<std::size_t>(r * s.cols + j)] = -INFINITY;
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const auto x = c.in("input.x"), dy = c.in("grad.output.y");
  softmax_forward(r["output.y"].data(), x.data(), s.visible.values.data(), s.rows, s.cols);
  c.done("output.y");
  softmax_backward(r["grad.input.x"].data(), dy.data(), r["output.y"].data(), s.rows, s.cols);
}

}  // namespace

const OpDef& softmax_op() {
  static const OpDef def{
      .name = "softmax",
      .config_keys = {},
      .parse = parse,
      .fill = fill,
      .write_sizes = write_sizes,
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
