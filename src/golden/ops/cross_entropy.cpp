// The cross_entropy op (docs/golden-format.md, "Op cases"): mean label-smoothed cross-entropy.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/cross_entropy.hpp"

namespace teo::golden::ops {

namespace {

void parse(Spec& s, Reader& r) {
  s.rows = r.size("batch", 0);
  s.cols = r.size("num_classes", 1);
}

void write_sizes(const Spec& s, ojson& j) {
  j["batch"] = s.rows;
  j["num_classes"] = s.cols;
}

void tensors(const Spec& s, OpTensors& t) {
  t.in.push_back(float_slot("input.logits", {s.rows, s.cols}, Role::input, 2));
  t.fixed.push_back({"input.labels", DType::I64, {s.rows}, Role::input});
  t.out.push_back(float_slot("output.loss", {}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max(s.cols, s.rows);
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const Values& v = c.v;
  const auto x = c.in("input.logits"), dy = c.in("grad.output.loss");
  const auto& labels = ints_of(v.i64, "input.labels", s.rows);
  check_range(labels, s.cols, "input.labels");
  Tensor<Real> probs({s.rows, s.cols});
  const Real smoothing = static_cast<Real>(s.cfg.label_smoothing);
  r["output.loss"][0] =
      cross_entropy_forward(probs.data(), x.data(), labels.data(), s.rows, s.cols, smoothing);
  c.done("output.loss");
  cross_entropy_backward(r["grad.input.logits"].data(), probs.data(), labels.data(), s.rows, s.cols,
                         smoothing, dy[0]);
}

}  // namespace

const OpDef& cross_entropy_op() {
  static const OpDef def{
      .name = "cross_entropy",
      .config_keys = {"label_smoothing"},
      .parse = parse,
      .write_sizes = write_sizes,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"batch": 4, "num_classes": 3, "label_smoothing": 0.1})"},
  };
  return def;
}

}  // namespace teo::golden::ops
