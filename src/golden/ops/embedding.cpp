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

// The op's spec: batch sequences of seq_len tokens of a vocabulary of vocab_size, embedded in
// d_model; learned positions' table of max_len rows (0 with sinusoidal ones); and the config's
// positions, scale, token types and embedding norm.
struct EmbeddingSpec {
  index_t batch = 0, seq = 0, vocab = 0, d_model = 0, max_len = 0;
  ModelConfig cfg;
};

const EmbeddingSpec& own(const Spec& s) {
  return s.as<EmbeddingSpec>();
}

// the tokens, in [0, vocab_size), and the token types, in [0, type_vocab_size)
OpDef::IntBound int_bound(const Spec& spec, const std::string& name) {
  const auto& s = own(spec);
  if (name == "input.tokens") return {s.vocab, "vocab_size"};
  if (name == "input.token_types")
    return {s.cfg.embeddings.type_vocab_size.value_or(1), "type_vocab_size"};
  return {};
}

void parse(Spec& spec, Reader& r) {
  auto& s = spec.own.emplace<EmbeddingSpec>();
  s.cfg = r.op_config();
  s.batch = r.size("batch", 0);
  s.seq = r.size("seq_len", 1);
  s.vocab = r.size("vocab_size", 1);
  s.d_model = r.size("d_model", 1);
  if (s.cfg.embeddings.positional != Positional::sinusoidal &&
      s.cfg.embeddings.positional != Positional::learned) {
    throw ConfigError(
        "spec.positional of the embedding op is \"sinusoidal\" or \"learned\", got \"" +
        std::string(to_string(s.cfg.embeddings.positional)) + "\"");
  }
  s.max_len = s.cfg.embeddings.positional == Positional::learned
                  ? (r.has("max_len") ? r.size("max_len", 1) : s.seq)
                  : 0;
  if (s.cfg.embeddings.positional != Positional::learned && r.has("max_len")) {
    throw ConfigError("spec.max_len is for learned positions only");
  }
  if (s.max_len && s.max_len < s.seq) {
    throw ShapeError("spec.seq_len " + std::to_string(s.seq) + " is above max_len " +
                     std::to_string(s.max_len));
  }
  // the norm's eps is spelled out with embedding_norm only, so the other cases read as before
  if (s.cfg.embeddings.embedding_norm) {
    if (const auto eps = r.number("layer_norm_eps")) s.cfg.norms.layer_norm_eps = *eps;
    s.cfg.validate();
  } else if (r.has("layer_norm_eps") || s.cfg.norms.norm != Norm::layernorm) {
    throw ConfigError("spec.layer_norm_eps and norm apply with embedding_norm only");
  }
}

void write_sizes(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  j["batch"] = s.batch;
  j["seq_len"] = s.seq;
  j["vocab_size"] = s.vocab;
  j["d_model"] = s.d_model;
}

void write_options(const Spec& spec, ojson& j) {
  const auto& s = own(spec);
  if (s.max_len) j["max_len"] = s.max_len;
  if (s.cfg.embeddings.embedding_norm) j["layer_norm_eps"] = s.cfg.norms.layer_norm_eps;
}

void tensors(const Spec& spec, OpTensors& t) {
  const auto& s = own(spec);
  t.fixed.push_back({"input.tokens", DType::I64, {s.batch, s.seq}, Role::input});
  if (s.cfg.embeddings.type_vocab_size)
    t.fixed.push_back({"input.token_types", DType::I64, {s.batch, s.seq}, Role::input});
  t.in.push_back(float_slot("param.weight", {s.vocab, s.d_model}, Role::param));
  if (s.cfg.embeddings.positional == Positional::learned) {
    t.in.push_back(float_slot("param.pos_weight", {s.max_len, s.d_model}, Role::param, 0.5));
  }
  if (s.cfg.embeddings.type_vocab_size) {
    t.in.push_back(float_slot("param.type_weight", {*s.cfg.embeddings.type_vocab_size, s.d_model},
                              Role::param, 0.5));
  }
  if (s.cfg.embeddings.embedding_norm) {
    t.in.push_back(float_slot("param.norm_weight", {s.d_model}, Role::param, 0.5, 1));
    if (s.cfg.norms.norm == Norm::layernorm)
      t.in.push_back(float_slot("param.norm_bias", {s.d_model}, Role::param));
  }
  t.out.push_back(float_slot("output.x", {s.batch, s.seq, s.d_model}, Role::output));
}

index_t longest_reduction(const Spec& spec) {
  const auto& s = own(spec);
  return std::max<index_t>(s.batch * s.seq, s.batch);
}

template <class Real>
void run(RunContext<Real>& c) {
  const auto& s = own(c.s);
  auto& r = c.r;
  const Values& v = c.v;
  const auto p = c.p;
  const auto& tokens = ints_of(v.i64, "input.tokens", s.batch * s.seq);
  check_range(tokens, s.vocab, "input.tokens");
  const auto w = c.in("param.weight"), dy = c.in("grad.output.x");
  const index_t n = s.batch * s.seq, D = s.d_model;
  const Real scale =
      s.cfg.embeddings.embed_scale ? static_cast<Real>(std::sqrt(static_cast<double>(D))) : Real(1);
  // As the model: embedding and positional are each stored, then their sum.
  Tensor<Real> emb({s.batch, s.seq, D}), pos({s.seq, D});
  embedding_forward(emb.data(), tokens.data(), w.data(), n, D, scale);
  store(emb, p, "embedding");
  Tensor<Real> pw;
  if (s.cfg.embeddings.positional == Positional::learned) {
    pw = c.in("param.pos_weight");
    std::copy(pw.data(), pw.data() + s.seq * D, pos.data());
  } else {
    sinusoidal_table(pos.data(), s.seq, D);
  }
  store(pos, p, "positional");
  // sum = (embedding + token_type) + positional, as the model adds them
  const bool types = s.cfg.embeddings.type_vocab_size.has_value(),
             normed = s.cfg.embeddings.embedding_norm;
  std::vector<std::int64_t> type_ids;
  Tensor<Real> sum({s.batch, s.seq, D});
  const Real* first = emb.data();
  if (types) {
    type_ids = ints_of(c.v.i64, "input.token_types", n);
    check_range(type_ids, *s.cfg.embeddings.type_vocab_size, "input.token_types");
    Tensor<Real> tt({s.batch, s.seq, D});
    embedding_forward(tt.data(), type_ids.data(), c.in("param.type_weight").data(), n, D, Real(1));
    store(tt, p, "token_type");
    for (index_t i = 0; i < n * D; ++i) sum[i] = emb[i] + tt[i];
    first = sum.data();
  }
  add_positional_forward(normed ? sum.data() : r["output.x"].data(), first, pos.data(), s.batch,
                         s.seq, D);
  Tensor<Real> mean({n}), rstd({n}), nw, nb;
  const Real eps = static_cast<Real>(s.cfg.norms.layer_norm_eps);
  const bool rms = s.cfg.norms.norm == Norm::rmsnorm;
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
  if (s.cfg.embeddings.positional == Positional::learned) {
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
      .config_of = config_in<EmbeddingSpec>,
      .int_bound = int_bound,
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
