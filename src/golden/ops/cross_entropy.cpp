// The cross_entropy op (docs/golden-format.md, "Op cases"): mean label-smoothed cross-entropy.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/cross_entropy.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch rows of num_classes logits, and the config's label smoothing.
struct CrossEntropySpec {
  index_t batch = 0, num_classes = 0;
  ModelConfig cfg;
};

const CrossEntropySpec& own(const Spec& s) {
  return s.as<CrossEntropySpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<CrossEntropySpec>();
  s.cfg = r.op_config();
  s.batch = r.size("batch", 0);
  s.num_classes = r.size("num_classes", 1);
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["num_classes"] = s.num_classes;
}

// the labels, in [0, num_classes)
OpDef::IntBound int_bound(const Spec& spec, const std::string& name) {
  const auto& s = own(spec);
  if (name == "input.labels") return {s.num_classes, "num_classes"};
  return {};
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.logits", {s.batch, s.num_classes}, Role::input, 2));
  t.fixed.push_back({"input.labels", DType::I64, {s.batch}, Role::input});
  t.out.push_back(float_slot("output.loss", {}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max(s.num_classes, s.batch);
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const Values& v = c.v;
  const auto x = c.in("input.logits"), dy = c.in("grad.output.loss");
  const auto& labels = ints_of(v.i64, "input.labels", s.batch);
  check_range(labels, s.num_classes, "input.labels");
  Tensor<Real> probs({s.batch, s.num_classes});
  const Real smoothing = static_cast<Real>(s.cfg.head.label_smoothing);
  r["output.loss"][0] = cross_entropy_forward(probs.data(), x.data(), labels.data(), s.batch,
                                              s.num_classes, smoothing);
  c.done("output.loss");
  cross_entropy_backward(r["grad.input.logits"].data(), probs.data(), labels.data(), s.batch,
                         s.num_classes, smoothing, dy[0]);
}

}  // namespace

const OpDef& cross_entropy_op() {
  static const OpDef def{
      .name = "cross_entropy",
      .config_keys = {"label_smoothing"},
      .parse = parse,
      .write_sizes = write_sizes,
      .config_of = config_in<CrossEntropySpec>,
      .int_bound = int_bound,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"batch": 4, "num_classes": 3, "label_smoothing": 0.1})"},
  };
  return def;
}

}  // namespace teo::golden::ops
