// The dropout op (docs/golden-format.md, "Op cases"): a replayed dropout mask.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/dropout.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: rows of cols entries, and the config's dropout rate.
struct DropoutSpec {
  index_t rows = 0, cols = 0;
  EncoderConfig cfg;
};

const DropoutSpec& own(const Spec& s) {
  return s.as<DropoutSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<DropoutSpec>();
  s.cfg = r.op_config();
  s.rows = r.size("rows", 0);
  s.cols = r.size("cols", 1);
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["rows"] = s.rows;
  j["cols"] = s.cols;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.x", {s.rows, s.cols}, Role::input));
  t.fixed.push_back({"input.mask", DType::U8, {s.rows, s.cols}, Role::input});
  t.out.push_back(float_slot("output.y", {s.rows, s.cols}, Role::output));
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
      .parse = parse,
      .write_sizes = write_sizes,
      .config_of = config_in<DropoutSpec>,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 3, "cols": 5, "dropout": 0.3})"},
  };
  return def;
}

}  // namespace teo::golden::ops
