// The rms_norm op (docs/golden-format.md, "Op cases"): RMSNorm over the last dimension, the norm
// of LLaMA-style decoders.
#include <algorithm>

#include "golden/ops/op.hpp"
#include "teo/layers/rms_norm.hpp"

namespace teo::golden::ops {

namespace {

const RowsSpec& own(const Spec& s) {
  return s.as<RowsSpec>();
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.in.push_back(float_slot("input.x", {s.rows, s.width}, Role::input, 2, 0.5));
  t.in.push_back(float_slot("param.weight", {s.width}, Role::param, 0.5, 1));
  t.out.push_back(float_slot("output.y", {s.rows, s.width}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max(s.width, s.rows);
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const auto x = c.in("input.x"), w = c.in("param.weight"), dy = c.in("grad.output.y");
  Tensor<Real> rstd({s.rows});
  rms_norm_forward(r["output.y"].data(), rstd.data(), x.data(), w.data(), s.rows, s.width,
                   static_cast<Real>(s.cfg.norms.layer_norm_eps));
  c.done("output.y");
  rms_norm_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(), dy.data(), x.data(),
                    w.data(), rstd.data(), s.rows, s.width);
}

}  // namespace

const OpDef& rms_norm_op() {
  static const OpDef def{
      .name = "rms_norm",
      .config_keys = {"layer_norm_eps"},
      .parse = parse_rows<kDModel>,
      .write_sizes = write_rows<kDModel>,
      .config_of = config_in<RowsSpec>,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples = {R"({"rows": 4, "d_model": 7})",
                  R"({"rows": 3, "d_model": 1, "layer_norm_eps": 0.5})"},
  };
  return def;
}

}  // namespace teo::golden::ops
