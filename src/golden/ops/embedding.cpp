// The embedding op (docs/golden-format.md, "Op cases"): token embedding plus sinusoidal or learned
// positions, and BERT's token types and embedding norm (semantics 18).
#include <cmath>

#include "golden/ops/op.hpp"
#include "teo/layers/embedding.hpp"
#include "teo/layers/layer_norm.hpp"
#include "teo/layers/positional.hpp"
#include "teo/layers/rms_norm.hpp"

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
  // the norm's eps is spelled out with embedding_norm only, so the other cases read as before
  if (s.cfg.embedding_norm) {
    if (const auto eps = r.number("layer_norm_eps")) s.cfg.layer_norm_eps = *eps;
    s.cfg.validate();
  } else if (r.has("layer_norm_eps") || s.cfg.norm != Norm::layernorm) {
    throw ConfigError("spec.layer_norm_eps and norm apply with embedding_norm only");
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
  if (s.cfg.embedding_norm) j["layer_norm_eps"] = s.cfg.layer_norm_eps;
}

void tensors(const Spec& s, OpTensors& t) {
  t.fixed.push_back({"input.tokens", DType::I64, {s.batch, s.seq}, Role::input});
  if (s.cfg.type_vocab_size)
    t.fixed.push_back({"input.token_types", DType::I64, {s.batch, s.seq}, Role::input});
  t.in.push_back(float_slot("param.weight", {s.vocab, s.cols}, Role::param));
  if (s.cfg.positional == Positional::learned) {
    t.in.push_back(float_slot("param.pos_weight", {s.max_len, s.cols}, Role::param, 0.5));
  }
  if (s.cfg.type_vocab_size) {
    t.in.push_back(
        float_slot("param.type_weight", {*s.cfg.type_vocab_size, s.cols}, Role::param, 0.5));
  }
  if (s.cfg.embedding_norm) {
    t.in.push_back(float_slot("param.norm_weight", {s.cols}, Role::param, 0.5, 1));
    if (s.cfg.norm == Norm::layernorm)
      t.in.push_back(float_slot("param.norm_bias", {s.cols}, Role::param));
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
  // sum = (embedding + token_type) + positional, as the model adds them
  const bool types = s.cfg.type_vocab_size.has_value(), normed = s.cfg.embedding_norm;
  std::vector<std::int64_t> type_ids;
  Tensor<Real> sum({s.batch, s.seq, D});
  const Real* first = emb.data();
  if (types) {
    type_ids = ints_of(c.v.i64, "input.token_types", n);
    check_range(type_ids, *s.cfg.type_vocab_size, "input.token_types");
    Tensor<Real> tt({s.batch, s.seq, D});
    embedding_forward(tt.data(), type_ids.data(), c.in("param.type_weight").data(), n, D, Real(1));
    store(tt, p, "token_type");
    for (index_t i = 0; i < n * D; ++i) sum[i] = emb[i] + tt[i];
    first = sum.data();
  }
  add_positional_forward(normed ? sum.data() : r["output.x"].data(), first, pos.data(), s.batch,
                         s.seq, D);
  Tensor<Real> mean({n}), rstd({n}), nw, nb;
  const Real eps = static_cast<Real>(s.cfg.layer_norm_eps);
  const bool rms = s.cfg.norm == Norm::rmsnorm;
  if (normed) {
    nw = c.in("param.norm_weight");
    if (rms) {
      rms_norm_forward(r["output.x"].data(), rstd.data(), sum.data(), nw.data(), n, D, eps);
    } else {
      nb = c.in("param.norm_bias");
      layer_norm_forward(r["output.x"].data(), mean.data(), rstd.data(), sum.data(), nw.data(),
                         nb.data(), n, D, eps);
    }
  }
  c.done("output.x");
  // in the forward pass this was: x = norm(sum) or sum; sum = scale * weight[tokens] (+
  // type_weight[token_types]) + pos
  const Real* dsum = dy.data();
  Tensor<Real> ds;
  if (normed) {
    ds.reset({s.batch, s.seq, D});
    if (rms) {
      rms_norm_backward(ds.data(), r["grad.param.norm_weight"].data(), dy.data(), sum.data(),
                        nw.data(), rstd.data(), n, D, GradWrite::overwrite);
    } else {
      layer_norm_backward(ds.data(), r["grad.param.norm_weight"].data(),
                          r["grad.param.norm_bias"].data(), dy.data(), sum.data(), nw.data(),
                          mean.data(), rstd.data(), n, D, GradWrite::overwrite);
    }
    dsum = ds.data();
  }
  embedding_backward(r["grad.param.weight"].data(), dsum, tokens.data(), n, D, scale);
  if (s.cfg.positional == Positional::learned) {
    add_positional_backward(r["grad.param.pos_weight"].data(), dsum, s.batch, s.seq, D);
  }
  if (types) {
    embedding_backward(r["grad.param.type_weight"].data(), dsum, type_ids.data(), n, D, Real(1));
  }
}

}  // namespace

const OpDef& embedding_op() {
  static const OpDef def{
      .name = "embedding",
      .config_keys = {"positional", "embed_scale", "type_vocab_size", "embedding_norm", "norm"},
      .parse = parse,
      .write_sizes = write_sizes,
      .write_options = write_options,
      .tensors = tensors,
      .longest_reduction = longest_reduction,
      .run_float = run<float>,
      .run_double = run<double>,
      .samples =
          {R"({"batch": 2, "seq_len": 3, "vocab_size": 4, "d_model": 5, "positional": "learned", "embed_scale": true})",
           R"({"batch": 2, "seq_len": 3, "vocab_size": 4, "d_model": 6, "positional": "sinusoidal"})",
           R"({"batch": 2, "seq_len": 3, "vocab_size": 4, "d_model": 6, "positional": "learned", "type_vocab_size": 2, "embedding_norm": true, "layer_norm_eps": 1e-12})"},
  };
  return def;
}

}  // namespace teo::golden::ops
