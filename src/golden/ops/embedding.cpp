// The embedding op (docs/golden-format.md, "Op cases"): token embedding plus sinusoidal or learned
// positions.
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/positional.hpp"

namespace teo::golden::ops {

namespace {

void parse(Spec& s, Reader& r) {
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  s.vocab = r.size("vocab_size", 1);
  s.cols = r.size("d_model", 1);
  if (s.cfg.positional != Positional::sinusoidal && s.cfg.positional != Positional::learned) {
    throw ConfigError(
        "spec.positional of the embedding op is \"sinusoidal\" or \"learned\", got \"" +
        std::string(to_string(s.cfg.positional)) + "\"");
  }
  s.max_len = s.cfg.positional == Positional::learned
                  ? (r.has("max_len") ? r.size("max_len", 1) : s.seq)
                  : 0;
  if (s.cfg.positional != Positional::learned && r.has("max_len")) {
    throw ConfigError("spec.max_len is for learned positions only");
  }
  if (s.max_len && s.max_len < s.seq) {
    throw ShapeError("spec.seq_len " + std::to_string(s.seq) + " is above max_len " +
                     std::to_string(s.max_len));
  }
}

void write_sizes(const Spec& s, ojson& j) {
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["vocab_size"] = s.vocab;
  j["d_model"] = s.cols;
}

void write_options(const Spec& s, ojson& j) {
  if (s.max_len) j["max_len"] = s.max_len;
}

void tensors(const Spec& s, OpTensors& t) {
  t.fixed.push_back({"input.tokens", DType::I64, {s.batch, s.seq}, Role::input});
  t.in.push_back(float_slot("param.weight", {s.vocab, s.cols}, Role::param));
  if (s.cfg.positional == Positional::learned) {
    t.in.push_back(float_slot("param.pos_weight", {s.max_len, s.cols}, Role::param, 0.5));
  }
  t.out.push_back(float_slot("output.x", {s.batch, s.seq, s.cols}, Role::output));
}

index_t longest_reduction(const Spec& s) {
  return std::max<index_t>(s.batch * s.seq, s.batch);
}

template <class Real>
void run(RunContext<Real>& c) {
  const Spec& s = c.s;
  auto& r = c.r;
  const Values& v = c.v;
  const auto p = c.p;
  const auto& tokens = ints_of(v.i64, "input.tokens", s.batch * s.seq);
  check_range(tokens, s.vocab, "input.tokens");
  const auto w = c.in("param.weight"), dy = c.in("grad.output.x");
  const index_t n = s.batch * s.seq, D = s.cols;
  const Real scale =
      s.cfg.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(D))) : Real(1);
  // As the model: embedding and positional are each stored, then their sum.
  Tensor<Real> emb({s.batch, s.seq, D}), pos({s.seq, D});
  embedding_forward(emb.data(), tokens.data(), w.data(), n, D, scale);
  store(emb, p, "embedding");
  Tensor<Real> pw;
  if (s.cfg.positional == Positional::learned) {
    pw = c.in("param.pos_weight");
    std::copy(pw.data(), pw.data() + s.seq * D, pos.data());
  } else {
    sinusoidal_table(pos.data(), s.seq, D);
  }
  store(pos, p, "positional");
  add_positional_forward(r["output.x"].data(), emb.data(), pos.data(), s.batch, s.seq, D);
  c.done("output.x");
  // in the forward pass this was: x = scale * weight[tokens] + pos
  embedding_backward(r["grad.param.weight"].data(), dy.data(), tokens.data(), n, D, scale);
  if (s.cfg.positional == Positional::learned) {
    add_positional_backward(r["grad.param.pos_weight"].data(), dy.data(), s.batch, s.seq, D);
  }
}

}  // namespace

const OpDef& embedding_op() {
  static const OpDef def{
      .name = "embedding",
      .config_keys = {"positional", "embed_scale"},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"batch": 2, "seq_len": 3, "vocab_size": 4, "d_model": 5, "positional": "learned", "embed_scale": true})",
           R"({"batch": 2, "seq_len": 3, "vocab_size": 4, "d_model": 6, "positional": "sinusoidal"})"},
  };
  return def;
}

}  // namespace teo::golden::ops
