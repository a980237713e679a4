// The dropout op (docs/golden-format.md, "Op cases"): a replayed dropout mask.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/dropout.hpp"

namespace teo::golden::ops {

namespace {

void parse(Spec& s, Reader& r) {
  s.rows = r.size("rows", 0);
  s.cols = r.size("cols", 1);
}

void write_sizes(const Spec& s, ojson& j) {
  j["rows"] = s.rows;
  j["cols"] = s.cols;
}

void tensors(const Spec& s, OpTensors& t) {
  auto& in = t.in;
  auto& out = t.out;
  auto& fixed = t.fixed;
  in.push_back(float_slot("input.x", {s.rows, s.cols}, Role::input));
  fixed.push_back({"input.mask", DType::U8, {s.rows, s.cols}, Role::input});
  out.push_back(float_slot("output.y", {s.rows, s.cols}, Role::output));
}

// element-wise: no sums
index_t longest_reduction(const Spec&) {
  return 1;
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const auto in = [&](const std::string& n) { return c.in(n); };
  const auto done = [&](const std::string& n) { c.done(n); };
  const Values& v = c.v;
  const auto x = in("input.x"), dy = in("grad.output.y");
  const auto& m = ints_of(v.u8, "input.mask", x.numel());
  const Real scale = dropout_scale<Real>(s.cfg.dropout);
  dropout_forward(r["output.y"].data(), x.data(), m.data(), x.numel(), scale);
  done("output.y");
  dropout_backward(r["grad.input.x"].data(), dy.data(), m.data(), x.numel(), scale);
}

}  // namespace

const OpDef& dropout_op() {
  static const OpDef def{
      .name = "dropout",
      .config_keys = {"dropout"},
      .parse = parse,
      .write_sizes = write_sizes,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 3, "cols": 5, "dropout": 0.3})"},
  };
  return def;
}

}  // namespace teo::golden::ops
