// The pooling op (docs/golden-format.md, "Op cases"): mean, cls or max pooling over each sequence's
// real tokens.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/pooling.hpp"

namespace teo::golden::ops {

namespace {

void parse(Spec& s, Reader& r) {
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  s.cols = r.size("d_model", 1);
}

void write_sizes(const Spec& s, ojson& j) {
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["d_model"] = s.cols;
}

void tensors(const Spec& s, OpTensors& t) {
  t.in.push_back(float_slot("input.x", {s.batch, s.seq, s.cols}, Role::input));
  t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  t.out.push_back(float_slot("output.pooled", {s.batch, s.cols}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max<index_t>(s.seq, s.batch);
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const Values& v = c.v;
  const auto x = c.in("input.x"), dy = c.in("grad.output.pooled");
  const auto& len = spec_ints_of(v, s);
  std::vector<std::int64_t> argmax(static_cast<std::size_t>(s.batch * s.cols), -1);
  pooling_forward(r["output.pooled"].data(), argmax.data(), x.data(), len.data(), s.batch, s.seq,
                  s.cols, s.cfg.pooling);
  c.done("output.pooled");
  pooling_backward(r["grad.input.x"].data(), dy.data(), argmax.data(), len.data(), s.batch, s.seq,
                   s.cols, s.cfg.pooling);
}

}  // namespace

const OpDef& pooling_op() {
  static const OpDef def{
      .name = "pooling",
      .config_keys = {"pooling"},
      .lengths_key = "lengths",
      .parse = parse,
      .write_sizes = write_sizes,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"batch": 3, "seq_len": 4, "d_model": 3, "lengths": [4, 1, 0], "pooling": "mean"})",
           R"({"batch": 3, "seq_len": 4, "d_model": 3, "lengths": [4, 1, 0], "pooling": "cls"})",
           R"({"batch": 3, "seq_len": 4, "d_model": 3, "lengths": [4, 1, 0], "pooling": "max"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
