// The lm_head op (docs/golden-format.md, "Op cases"): a decoder's LM head and its next-token loss,
// as the model runs them after its last layer (or final norm).
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/cross_entropy.hpp"
#include "teo/layers/linear.hpp"

namespace teo::golden::ops {

namespace {

void parse(Spec& s, Reader& r) {
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  s.vocab = r.size("vocab_size", 1);
  s.cols = r.size("d_model", 1);
}

void write_sizes(const Spec& s, ojson& j) {
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["vocab_size"] = s.vocab;
  j["d_model"] = s.cols;
}

void tensors(const Spec& s, OpTensors& t) {
  const double in_d = 1.0 / std::sqrt(static_cast<double>(s.cols));
  t.in.push_back(float_slot("input.x", {s.batch, s.seq, s.cols}, Role::input, 2));
  t.fixed.push_back({"input.tokens", DType::I64, {s.batch, s.seq}, Role::input});
  t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  t.in.push_back(float_slot("param.weight", {s.vocab, s.cols}, Role::param, in_d));
  if (s.cfg.head_bias) t.in.push_back(float_slot("param.bias", {s.vocab}, Role::param, in_d));
  // A fused linear-cross-entropy kernel never forms the logits: it may leave them out.
  Slot logits = float_slot("output.logits", {s.batch, s.seq, s.vocab}, Role::output);
  logits.optional = true;
  t.out.push_back(logits);
  t.out.push_back(float_slot("output.loss", {}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max({s.cols, s.vocab, s.batch * s.seq});
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const index_t N = s.batch * s.seq, D = s.cols, V = s.vocab;
  const auto x = c.in("input.x"), w = c.in("param.weight"), dloss = c.in("grad.output.loss");
  const Tensor<Real> b = s.cfg.head_bias ? c.in("param.bias") : Tensor<Real>();
  const auto& tokens = ints_of(c.v.i64, "input.tokens", N);
  check_range(tokens, V, "input.tokens");
  const auto& lengths = spec_ints_of(c.v, s);
  const auto targets = next_token_targets(tokens.data(), lengths.data(), s.batch, s.seq);
  Tensor<Real>& logits = r["output.logits"];
  linear_forward(logits.data(), x.data(), w.data(), s.cfg.head_bias ? b.data() : nullptr, N, D, V);
  c.done("output.logits");
  Tensor<Real> probs({N, V});
  const Real smoothing = static_cast<Real>(s.cfg.label_smoothing);
  r["output.loss"][0] =
      cross_entropy_forward(probs.data(), logits.data(), targets.data(), N, V, smoothing);
  c.done("output.loss");
  Tensor<Real> dlogits({N, V});
  cross_entropy_backward(dlogits.data(), probs.data(), targets.data(), N, V, smoothing, dloss[0]);
  linear_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(),
                  s.cfg.head_bias ? r["grad.param.bias"].data() : nullptr, dlogits.data(), x.data(),
                  w.data(), N, D, V);
}

}  // namespace

const OpDef& lm_head_op() {
  static const OpDef def{
      .name = "lm_head",
      .config_keys = {"head_bias", "label_smoothing"},
      .lengths_key = "lengths",
      .parse = parse,
      .write_sizes = write_sizes,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"batch": 2, "seq_len": 4, "vocab_size": 5, "d_model": 3, "lengths": [4, 2]})",
           R"({"batch": 3, "seq_len": 3, "vocab_size": 4, "d_model": 2, "lengths": [3, 1, 0], "head_bias": false, "label_smoothing": 0.1})"},
  };
  return def;
}

}  // namespace teo::golden::ops
