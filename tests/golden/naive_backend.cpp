#include "golden/naive_backend.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/config.hpp"

namespace teo::testing {

namespace {

using safetensors::DType;
using safetensors::File;
using Vec = std::vector<double>;

Vec doubles(const File& f, const std::string& name) {
  const auto* t = f.find(name);
  if (!t) throw FormatError("golden has no " + name);
  if (t->dtype == DType::F64) return t->values<double>();
  const auto v = t->values<float>();
  return {v.begin(), v.end()};
}

std::vector<std::int64_t> ints(const File& f, const std::string& name) {
  const auto* t = f.find(name);
  if (!t) throw FormatError("golden has no " + name);
  return t->values<std::int64_t>();
}

// The dropout mask of a site as 0/1, or all ones when the golden has none.
std::vector<std::uint8_t> mask(const File& f, const std::string& name, std::size_t n) {
  const auto* t = f.find(name);
  if (!t) return std::vector<std::uint8_t>(n, 1);
  return t->values<std::uint8_t>();
}

struct Out {
  File file;
  bool f32;
  void put(const std::string& name, std::vector<std::int64_t> shape, const Vec& v) {
    if (f32) {
      std::vector<float> x(v.begin(), v.end());
      file.add<float>("act." + name, std::move(shape), x.data(), x.size());
    } else {
      file.add<double>("act." + name, std::move(shape), v.data(), v.size());
    }
  }
};

// y (rows x out) = x (rows x in) W^T + b, W (out x in); transposed: W read as (in x out).
Vec linear(const Vec& x, std::int64_t rows, std::int64_t in, const Vec& w, const Vec& b,
           std::int64_t out, bool transposed = false) {
  Vec y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      double acc = b[static_cast<std::size_t>(o)];
      for (std::int64_t i = 0; i < in; ++i) {
        const double wv = transposed ? w[static_cast<std::size_t>(i * out + o)]
                                     : w[static_cast<std::size_t>(o * in + i)];
        acc += x[static_cast<std::size_t>(r * in + i)] * wv;
      }
      y[static_cast<std::size_t>(r * out + o)] = acc;
    }
  }
  return y;
}

Vec layer_norm(const Vec& x, std::int64_t rows, std::int64_t d, const Vec& w, const Vec& b,
               double eps, Mutation m) {
  Vec y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* row = x.data() + r * d;
    double mean = 0;
    for (std::int64_t c = 0; c < d; ++c) mean += row[c];
    mean /= static_cast<double>(d);
    double var = 0;
    for (std::int64_t c = 0; c < d; ++c) var += (row[c] - mean) * (row[c] - mean);
    var /= m == Mutation::layer_norm_unbiased ? static_cast<double>(d - 1) : static_cast<double>(d);
    const double denom =
        m == Mutation::layer_norm_eps_outside ? std::sqrt(var) + eps : std::sqrt(var + eps);
    for (std::int64_t c = 0; c < d; ++c) {
      y[static_cast<std::size_t>(r * d + c)] =
          (row[c] - mean) / denom * w[static_cast<std::size_t>(c)] + b[static_cast<std::size_t>(c)];
    }
  }
  return y;
}

double activation(double x, Activation a, Mutation m) {
  if (a == Activation::relu) return x > 0 ? x : 0;
  if (a == Activation::gelu && m != Mutation::tanh_gelu_for_exact) {
    return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
  }
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1 + std::tanh(u));
}

}  // namespace

const char* mutation_name(Mutation m) {
  switch (m) {
    case Mutation::none:
      return "none";
    case Mutation::no_score_scale:
      return "no_score_scale";
    case Mutation::layer_norm_unbiased:
      return "layer_norm_unbiased";
    case Mutation::layer_norm_eps_outside:
      return "layer_norm_eps_outside";
    case Mutation::pe_sin_cos_swapped:
      return "pe_sin_cos_swapped";
    case Mutation::pe_frequency_off_by_one:
      return "pe_frequency_off_by_one";
    case Mutation::mask_ignores_padding:
      return "mask_ignores_padding";
    case Mutation::softmax_wrong_axis:
      return "softmax_wrong_axis";
    case Mutation::tanh_gelu_for_exact:
      return "tanh_gelu_for_exact";
    case Mutation::transposed_weight:
      return "transposed_weight";
    case Mutation::dropout_scale_missing:
      return "dropout_scale_missing";
    case Mutation::label_smoothing_ignored:
      return "label_smoothing_ignored";
    case Mutation::mean_pool_includes_padding:
      return "mean_pool_includes_padding";
  }
  return "?";
}

File naive_forward(const File& golden, Mutation mut) {
  const std::string* cfg_text = golden.meta("config");
  const std::string* case_text = golden.meta("case");
  if (!cfg_text || !case_text) throw FormatError("golden has no config or case metadata");
  const EncoderConfig cfg = EncoderConfig::from_json_text(*cfg_text);
  const auto cj = nlohmann::json::parse(*case_text);
  const std::int64_t B = cj.at("batch"), S = cj.at("seq_len");
  const std::int64_t D = cfg.d_model, H = cfg.num_heads, Dh = D / H, F = cfg.d_ff;
  const std::int64_t C = cfg.num_classes;
  const auto tokens = ints(golden, "input.tokens");
  const auto lengths = ints(golden, "input.lengths");
  const auto labels = ints(golden, "input.labels");
  const double p = cfg.dropout;
  const double keep_scale = p > 0 && mut != Mutation::dropout_scale_missing ? 1.0 / (1.0 - p) : 1.0;
  auto dropped = [&](const Vec& x, const std::string& site) {
    const auto mk = mask(golden, site, x.size());
    Vec y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = mk[i] ? x[i] * keep_scale : 0.0;
    return y;
  };
  auto param = [&](const std::string& n) { return doubles(golden, "param." + n); };
  auto at = [](Vec& v, std::int64_t i) -> double& { return v[static_cast<std::size_t>(i)]; };

  Out out{File{}, cj.at("dtype") == "float32"};
  out.file.metadata.emplace_back("format", "teo-candidate/1");
  out.file.metadata.emplace_back("backend", std::string("naive-double/") + mutation_name(mut));

  // Embedding and positions.
  const Vec emb_w = param("embedding.weight");
  const double escale = cfg.embed_scale ? std::sqrt(static_cast<double>(D)) : 1.0;
  Vec embedding(static_cast<std::size_t>(B * S * D));
  for (std::int64_t t = 0; t < B * S; ++t) {
    for (std::int64_t c = 0; c < D; ++c) {
      at(embedding, t * D + c) =
          emb_w[static_cast<std::size_t>(tokens[static_cast<std::size_t>(t)] * D + c)] * escale;
    }
  }
  Vec positional(static_cast<std::size_t>(S * D));
  if (cfg.positional == Positional::learned) {
    const Vec pw = param("pos_embedding.weight");
    for (std::int64_t i = 0; i < S * D; ++i) at(positional, i) = pw[static_cast<std::size_t>(i)];
  } else {
    for (std::int64_t s = 0; s < S; ++s) {
      for (std::int64_t c = 0; c < D; ++c) {
        const std::int64_t two_i = c - c % 2 + (mut == Mutation::pe_frequency_off_by_one ? 2 : 0);
        const double angle = static_cast<double>(s) /
                             std::pow(10000.0, static_cast<double>(two_i) / static_cast<double>(D));
        const bool use_sin = (c % 2 == 0) != (mut == Mutation::pe_sin_cos_swapped);
        at(positional, s * D + c) = use_sin ? std::sin(angle) : std::cos(angle);
      }
    }
  }
  Vec sum(embedding.size());
  for (std::int64_t t = 0; t < B * S; ++t) {
    for (std::int64_t c = 0; c < D; ++c) {
      at(sum, t * D + c) = at(embedding, t * D + c) + at(positional, (t % S) * D + c);
    }
  }
  const Vec input = dropped(sum, "dropout.input");
  out.put("embedding", {B, S, D}, embedding);
  out.put("positional", {S, D}, positional);
  out.put("input", {B, S, D}, input);

  const double alpha =
      mut == Mutation::no_score_scale ? 1.0 : 1.0 / std::sqrt(static_cast<double>(Dh));
  const double inf = std::numeric_limits<double>::infinity();
  Vec x = input;
  for (std::int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string pl = "layers." + std::to_string(l) + ".";
    auto lp = [&](const std::string& n) { return param(pl + n); };
    const std::int64_t N = B * S;
    Vec attn_in = x;
    if (cfg.norm_first) {
      attn_in = layer_norm(x, N, D, lp("norm1.weight"), lp("norm1.bias"), cfg.layer_norm_eps, mut);
      out.put(pl + "norm1", {B, S, D}, attn_in);
    }
    const bool tq = mut == Mutation::transposed_weight;
    const Vec qf = linear(attn_in, N, D, lp("attn.q.weight"), lp("attn.q.bias"), D, tq);
    const Vec kf = linear(attn_in, N, D, lp("attn.k.weight"), lp("attn.k.bias"), D);
    const Vec vf = linear(attn_in, N, D, lp("attn.v.weight"), lp("attn.v.bias"), D);
    // Per head: (B, H, S, Dh).
    auto heads = [&](const Vec& y) {
      Vec o(y.size());
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t s = 0; s < S; ++s)
            for (std::int64_t c = 0; c < Dh; ++c)
              o[static_cast<std::size_t>(((b * H + h) * S + s) * Dh + c)] =
                  y[static_cast<std::size_t>((b * S + s) * D + h * Dh + c)];
      return o;
    };
    const Vec q = heads(qf), k = heads(kf), v = heads(vf);
    Vec scores(static_cast<std::size_t>(B * H * S * S)), probs(scores.size());
    Vec context(static_cast<std::size_t>(B * S * D));
    const auto amask = mask(golden, "dropout." + pl + "attn", scores.size());
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t len =
          mut == Mutation::mask_ignores_padding ? S : lengths[static_cast<std::size_t>(b)];
      auto visible = [&](std::int64_t i) { return cfg.causal ? std::min(len, i + 1) : len; };
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t base = (b * H + h) * S;
        auto sc = [&](std::int64_t i, std::int64_t j) -> double& {
          return at(scores, (base + i) * S + j);
        };
        auto pr = [&](std::int64_t i, std::int64_t j) -> double& {
          return at(probs, (base + i) * S + j);
        };
        for (std::int64_t i = 0; i < S; ++i) {
          for (std::int64_t j = 0; j < S; ++j) {
            if (j >= visible(i)) {
              sc(i, j) = -inf;
              continue;
            }
            double dot = 0;
            for (std::int64_t c = 0; c < Dh; ++c) {
              dot += q[static_cast<std::size_t>((base + i) * Dh + c)] *
                     k[static_cast<std::size_t>((base + j) * Dh + c)];
            }
            sc(i, j) = dot * alpha;
          }
        }
        // Softmax over the visible keys of each query (or, mutated, over the queries that see
        // each key); a row or column with nothing visible is 0.
        const bool by_col = mut == Mutation::softmax_wrong_axis;
        for (std::int64_t a = 0; a < S; ++a) {
          double mx = -inf;
          for (std::int64_t z = 0; z < S; ++z) {
            const double s = by_col ? sc(z, a) : sc(a, z);
            mx = std::max(mx, s);
          }
          double total = 0;
          for (std::int64_t z = 0; z < S; ++z) {
            const double s = by_col ? sc(z, a) : sc(a, z);
            if (s != -inf) total += std::exp(s - mx);
          }
          for (std::int64_t z = 0; z < S; ++z) {
            const double s = by_col ? sc(z, a) : sc(a, z);
            (by_col ? pr(z, a) : pr(a, z)) = s == -inf ? 0.0 : std::exp(s - mx) / total;
          }
        }
        for (std::int64_t i = 0; i < S; ++i) {
          for (std::int64_t c = 0; c < Dh; ++c) {
            double acc = 0;
            for (std::int64_t j = 0; j < S; ++j) {
              const std::size_t pij = static_cast<std::size_t>((base + i) * S + j);
              const double pv = amask[pij] ? probs[pij] * keep_scale : 0.0;
              acc += pv * v[static_cast<std::size_t>((base + j) * Dh + c)];
            }
            at(context, (b * S + i) * D + h * Dh + c) = acc;
          }
        }
      }
    }
    const Vec attn_out = linear(context, N, D, lp("attn.o.weight"), lp("attn.o.bias"), D);
    const Vec r1d = dropped(attn_out, "dropout." + pl + "residual1");
    Vec residual1(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) residual1[i] = x[i] + r1d[i];
    out.put(pl + "q", {B, H, S, Dh}, q);
    out.put(pl + "k", {B, H, S, Dh}, k);
    out.put(pl + "v", {B, H, S, Dh}, v);
    out.put(pl + "scores", {B, H, S, S}, scores);
    out.put(pl + "probs", {B, H, S, S}, probs);
    out.put(pl + "context", {B, S, D}, context);
    out.put(pl + "attn_out", {B, S, D}, attn_out);
    out.put(pl + "residual1", {B, S, D}, residual1);
    Vec ffn_in;
    if (cfg.norm_first) {
      ffn_in = layer_norm(residual1, N, D, lp("norm2.weight"), lp("norm2.bias"), cfg.layer_norm_eps,
                          mut);
      out.put(pl + "norm2", {B, S, D}, ffn_in);
    } else {
      ffn_in = layer_norm(residual1, N, D, lp("norm1.weight"), lp("norm1.bias"), cfg.layer_norm_eps,
                          mut);
      out.put(pl + "norm1", {B, S, D}, ffn_in);
    }
    Vec hidden = linear(ffn_in, N, D, lp("ffn.fc1.weight"), lp("ffn.fc1.bias"), F);
    for (auto& h : hidden) h = activation(h, cfg.activation, mut);
    const Vec ffn_out = linear(dropped(hidden, "dropout." + pl + "ffn"), N, F, lp("ffn.fc2.weight"),
                               lp("ffn.fc2.bias"), D);
    const Vec r2d = dropped(ffn_out, "dropout." + pl + "residual2");
    const Vec& res_base = cfg.norm_first ? residual1 : ffn_in;
    Vec residual2(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) residual2[i] = res_base[i] + r2d[i];
    out.put(pl + "ffn_hidden", {B, S, F}, hidden);
    out.put(pl + "ffn_out", {B, S, D}, ffn_out);
    if (cfg.norm_first) {
      x = residual2;
    } else {
      x = layer_norm(residual2, N, D, lp("norm2.weight"), lp("norm2.bias"), cfg.layer_norm_eps,
                     mut);
      out.put(pl + "norm2", {B, S, D}, x);
    }
    out.put(pl + "output", {B, S, D}, x);
  }
  if (cfg.norm_first) {
    x = layer_norm(x, B * S, D, param("final_norm.weight"), param("final_norm.bias"),
                   cfg.layer_norm_eps, mut);
    out.put("final_norm", {B, S, D}, x);
  }

  Vec pooled(static_cast<std::size_t>(B * D), 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t len = lengths[static_cast<std::size_t>(b)];
    if (len == 0) continue;
    for (std::int64_t c = 0; c < D; ++c) {
      auto top = [&](std::int64_t s) { return at(x, (b * S + s) * D + c); };
      double r = 0;
      if (cfg.pooling == Pooling::cls) {
        r = top(0);
      } else if (cfg.pooling == Pooling::max) {
        r = top(0);
        for (std::int64_t s = 1; s < len; ++s) r = std::max(r, top(s));
      } else {
        const std::int64_t n = mut == Mutation::mean_pool_includes_padding ? S : len;
        for (std::int64_t s = 0; s < n; ++s) r += top(s);
        r /= static_cast<double>(n);
      }
      at(pooled, b * D + c) = r;
    }
  }
  const Vec logits = linear(pooled, B, D, param("head.weight"), param("head.bias"), C);
  const double eps = mut == Mutation::label_smoothing_ignored ? 0.0 : cfg.label_smoothing;
  double loss = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    const double* z = logits.data() + b * C;
    double mx = z[0];
    for (std::int64_t c = 1; c < C; ++c) mx = std::max(mx, z[c]);
    double total = 0;
    for (std::int64_t c = 0; c < C; ++c) total += std::exp(z[c] - mx);
    const double lse = mx + std::log(total);
    double sum_logp = 0;
    for (std::int64_t c = 0; c < C; ++c) sum_logp += z[c] - lse;
    const double logp_y = z[labels[static_cast<std::size_t>(b)]] - lse;
    loss += -(1 - eps) * logp_y - eps / static_cast<double>(C) * sum_logp;
  }
  if (B > 0) loss /= static_cast<double>(B);
  out.put("pooled", {B, D}, pooled);
  out.put("logits", {B, C}, logits);
  out.put("loss", {}, Vec{loss});
  return out.file;
}

}  // namespace teo::testing
