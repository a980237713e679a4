// The lm_head op (docs/golden-format.md, "Op cases"): a decoder's LM head and its next-token loss,
// as the model runs them after its last layer (or final norm).
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/cross_entropy.hpp"
#include "teo/layers/linear.hpp"

namespace teo::golden::ops {

namespace {

// The op's spec: batch sequences of seq_len hidden states of d_model, each's real tokens (lengths),
// a vocabulary of vocab_size, and the config's head bias and label smoothing.
struct LmHeadSpec {
  index_t batch = 0, seq = 0, vocab = 0, d_model = 0;
  Lengths lengths;
  ModelConfig cfg;
};

const LmHeadSpec& own(const Spec& s) {
  return s.as<LmHeadSpec>();
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<LmHeadSpec>();
  s.cfg = r.op_config();
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  s.vocab = r.size("vocab_size", 1);
  s.d_model = r.size("d_model", 1);
  s.lengths = r.lengths("lengths", s.batch, s.seq);
}

void fill(Spec& spec) {
  spec.as<LmHeadSpec>().lengths.fill();
}

const std::vector<std::int64_t>* given_ints(const Spec& s, const std::string& name) {
  return name == "input.lengths" ? &own(s).lengths.values : nullptr;
}

// the tokens, in [0, vocab_size)
OpDef::IntBound int_bound(const Spec& spec, const std::string& name) {
  const auto& s = own(spec);
  if (name == "input.tokens") return {s.vocab, "vocab_size"};
  return {};
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["vocab_size"] = s.vocab;
  j["d_model"] = s.d_model;
  j["lengths"] = s.lengths.values;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  const double in_d = 1.0 / std::sqrt(static_cast<double>(s.d_model));
  t.in.push_back(float_slot("input.x", {s.batch, s.seq, s.d_model}, Role::input, 2));
  t.fixed.push_back({"input.tokens", DType::I64, {s.batch, s.seq}, Role::input});
  t.fixed.push_back({"input.lengths", DType::I64, {s.batch}, Role::input});
  t.in.push_back(float_slot("param.weight", {s.vocab, s.d_model}, Role::param, in_d));
  if (s.cfg.head.head_bias) t.in.push_back(float_slot("param.bias", {s.vocab}, Role::param, in_d));
  // A fused linear-cross-entropy kernel never forms the logits: it may leave them out.
  Slot logits = float_slot("output.logits", {s.batch, s.seq, s.vocab}, Role::output);
  logits.optional = true;
  t.out.push_back(logits);
  t.out.push_back(float_slot("output.loss", {}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max({s.d_model, s.vocab, s.batch * s.seq});
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const index_t N = s.batch * s.seq, D = s.d_model, V = s.vocab;
  const auto x = c.in("input.x"), w = c.in("param.weight"), dloss = c.in("grad.output.loss");
  const Tensor<Real> b = s.cfg.head.head_bias ? c.in("param.bias") : Tensor<Real>();
  const auto& tokens = ints_of(c.v.i64, "input.tokens", N);
  check_range(tokens, V, "input.tokens");
  const auto& lengths = spec_ints_of(c.v, c.s);
  const auto targets = next_token_targets(tokens.data(), lengths.data(), s.batch, s.seq);
  Tensor<Real>& logits = r["output.logits"];
  linear_forward(logits.data(), x.data(), w.data(), s.cfg.head.head_bias ? b.data() : nullptr, N, D,
                 V);
  c.done("output.logits");
  Tensor<Real> probs({N, V});
  const Real smoothing = static_cast<Real>(s.cfg.head.label_smoothing);
  r["output.loss"][0] =
      cross_entropy_forward(probs.data(), logits.data(), targets.data(), N, V, smoothing);
  c.done("output.loss");
  Tensor<Real> dlogits({N, V});
  cross_entropy_backward(dlogits.data(), probs.data(), targets.data(), N, V, smoothing, dloss[0]);
  linear_backward(r["grad.input.x"].data(), r["grad.param.weight"].data(),
                  s.cfg.head.head_bias ? r["grad.param.bias"].data() : nullptr, dlogits.data(),
                  x.data(), w.data(), N, D, V);
}

}  // namespace

const OpDef& lm_head_op() {
  static const OpDef def{
      .name = "lm_head",
      .config_keys = {"head_bias", "label_smoothing"},
      .parse = parse,
      .fill = fill,
      .write_sizes = write_sizes,
      .config_of = config_in<LmHeadSpec>,
      .spec_ints = given_ints,
      .int_bound = int_bound,
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
