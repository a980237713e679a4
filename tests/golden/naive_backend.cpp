#include "golden/naive_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "teo/config.hpp"
#include "teo/contract.hpp"
#include "teo/golden.hpp"

namespace teo::testing {

namespace {

using safetensors::DType;
using safetensors::File;
using Vec = std::vector<double>;
using Mask = std::vector<std::uint8_t>;
using Shape = std::vector<std::int64_t>;

std::size_t ix(std::int64_t i) {
  return static_cast<std::size_t>(i);
}

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
Mask mask(const File& f, const std::string& name, std::size_t n) {
  const auto* t = f.find(name);
  if (!t) return Mask(n, 1);
  auto m = t->values<std::uint8_t>();
  if (m.size() != n) throw FormatError(name + " has the wrong number of elements");
  return m;
}

struct Out {
  File file;
  bool f32;
  void put(const std::string& name, Shape shape, const Vec& v) {
    if (f32) {
      std::vector<float> x(v.begin(), v.end());
      file.add<float>(name, std::move(shape), x.data(), x.size());
    } else {
      file.add<double>(name, std::move(shape), v.data(), v.size());
    }
  }
  void act(const std::string& name, Shape shape, const Vec& v) {
    put("act." + name, std::move(shape), v);
  }
};

// y (rows x out) = x (rows x in) W^T + b, W (out x in); transposed: W read as (in x out).
Vec linear(const Vec& x, std::int64_t rows, std::int64_t in, const Vec& w, const Vec& b,
           std::int64_t out, bool transposed = false) {
  Vec y(ix(rows * out));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      double acc = b[ix(o)];
      for (std::int64_t i = 0; i < in; ++i) {
        const double wv = transposed ? w[ix(i * out + o)] : w[ix(o * in + i)];
        acc += x[ix(r * in + i)] * wv;
      }
      y[ix(r * out + o)] = acc;
    }
  }
  return y;
}

// Backward of y = x W^T + b (x rows x in, W out x in, y rows x out), accumulating:
//   gx[r,i] += sum_o gy[r,o] * W[o,i]
//   gW[o,i] += sum_r gy[r,o] * x[r,i]
//   gb[o]   += sum_r gy[r,o]
void linear_backward(const Vec& gy, const Vec& x, const Vec& w, std::int64_t rows, std::int64_t in,
                     std::int64_t out, Vec& gx, Vec& gw, Vec& gb) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      const double g = gy[ix(r * out + o)];
      gb[ix(o)] += g;
      for (std::int64_t i = 0; i < in; ++i) {
        gx[ix(r * in + i)] += g * w[ix(o * in + i)];
        gw[ix(o * in + i)] += g * x[ix(r * in + i)];
      }
    }
  }
}

// Label-smoothed cross-entropy over n classes: for logits z and label y, writes softmax(z) to
// probs and returns -(1 - eps) logp[y] - (eps / n) sum_c logp[c], logp = z - logsumexp(z).
double smoothed_ce(const double* z, std::int64_t n, std::int64_t y, double eps, double* probs) {
  double mx = z[0];
  for (std::int64_t c = 1; c < n; ++c) mx = std::max(mx, z[c]);
  double total = 0;
  for (std::int64_t c = 0; c < n; ++c) total += std::exp(z[c] - mx);
  const double lse = mx + std::log(total);
  double sum_logp = 0;
  for (std::int64_t c = 0; c < n; ++c) {
    sum_logp += z[c] - lse;
    probs[c] = std::exp(z[c] - lse);
  }
  return -(1 - eps) * (z[y] - lse) - eps / static_cast<double>(n) * sum_logp;
}

// Its gradient with respect to z, times `scale`: g_c = (probs[c] - ((c == y ? 1 - eps : 0) +
// eps / n)) * scale.
void smoothed_ce_grad(const double* probs, std::int64_t n, std::int64_t y, double eps, double scale,
                      double* g) {
  for (std::int64_t c = 0; c < n; ++c) {
    const double target = (c == y ? 1 - eps : 0.0) + eps / static_cast<double>(n);
    g[c] = (probs[c] - target) * scale;
  }
}

// A LayerNorm's (or RMSNorm's) output and the per-row statistics its backward needs.
struct Norm {
  Vec y, mean, rstd;  // y (rows x d); mean, rstd (rows); rstd = 1 / the forward's denominator
};

// RMSNorm: y_c = x_c * rstd * w_c, rstd = (mean_c x_c^2 + eps)^(-1/2); no mean, no bias.
Norm rms_norm(const Vec& x, std::int64_t rows, std::int64_t d, const Vec& w, double eps) {
  Norm n{Vec(x.size()), Vec(ix(rows), 0.0), Vec(ix(rows))};
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* row = x.data() + r * d;
    double ms = 0;
    for (std::int64_t c = 0; c < d; ++c) ms += row[c] * row[c];
    const double rstd = 1.0 / std::sqrt(ms / static_cast<double>(d) + eps);
    for (std::int64_t c = 0; c < d; ++c) n.y[ix(r * d + c)] = row[c] * rstd * w[ix(c)];
    n.rstd[ix(r)] = rstd;
  }
  return n;
}

// Backward of y_c = n_c * w_c, n_c = x_c * rstd: only rstd depends on every x_c' (no mean), so
//   gw_c += g_c * n_c;  dn_c = g_c * w_c;  gx_c += rstd * (dn_c - n_c * (1/d) sum_c' dn_c' * n_c')
void rms_norm_backward(const Vec& g, const Vec& x, const Norm& n, std::int64_t rows, std::int64_t d,
                       const Vec& w, Vec& gx, Vec& gw) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const double rstd = n.rstd[ix(r)];
    double sum_dn_n = 0;
    for (std::int64_t c = 0; c < d; ++c) {
      const double gc = g[ix(r * d + c)], nc = x[ix(r * d + c)] * rstd;
      gw[ix(c)] += gc * nc;
      sum_dn_n += gc * w[ix(c)] * nc;
    }
    for (std::int64_t c = 0; c < d; ++c) {
      const double nc = x[ix(r * d + c)] * rstd;
      gx[ix(r * d + c)] +=
          rstd * (g[ix(r * d + c)] * w[ix(c)] - nc * sum_dn_n / static_cast<double>(d));
    }
  }
}

Norm layer_norm(const Vec& x, std::int64_t rows, std::int64_t d, const Vec& w, const Vec& b,
                double eps, Mutation m) {
  Norm n{Vec(x.size()), Vec(ix(rows)), Vec(ix(rows))};
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
      n.y[ix(r * d + c)] = (row[c] - mean) / denom * w[ix(c)] + b[ix(c)];
    }
    n.mean[ix(r)] = mean;
    n.rstd[ix(r)] = 1.0 / denom;
  }
  return n;
}

// Backward of y_c = n_c * w_c + b_c, n_c = (x_c - mean) * rstd, mean = (1/d) sum_c x_c,
// rstd = (var + eps)^(-1/2), var = (1/d) sum_c (x_c - mean)^2, from the saved mean and rstd:
//   gw_c += g_c * n_c;   gb_c += g_c
//   dn_c  = g_c * w_c                                            (d y_c / d n_c = w_c)
//   gx_c += rstd * (dn_c - (1/d) sum_c' dn_c' - n_c * (1/d) sum_c' dn_c' * n_c')
// The first mean is d mean / d x (every x_c' moves the mean), the second d rstd / d x.
void layer_norm_backward(const Vec& g, const Vec& x, const Norm& n, std::int64_t rows,
                         std::int64_t d, const Vec& w, Vec& gx, Vec& gw, Vec& gb, Mutation m) {
  Vec xn(ix(d)), dn(ix(d));
  for (std::int64_t r = 0; r < rows; ++r) {
    const double mean = n.mean[ix(r)], rstd = n.rstd[ix(r)];
    double sum_dn = 0, sum_dn_n = 0;
    for (std::int64_t c = 0; c < d; ++c) {
      const double gc = g[ix(r * d + c)];
      xn[ix(c)] = (x[ix(r * d + c)] - mean) * rstd;
      dn[ix(c)] = gc * w[ix(c)];
      gw[ix(c)] += gc * xn[ix(c)];
      gb[ix(c)] += gc;
      sum_dn += dn[ix(c)];
      sum_dn_n += dn[ix(c)] * xn[ix(c)];
    }
    const double mean_dn =
        m == Mutation::layer_norm_backward_no_mean ? 0.0 : sum_dn / static_cast<double>(d);
    const double mean_dn_n = sum_dn_n / static_cast<double>(d);
    for (std::int64_t c = 0; c < d; ++c) {
      gx[ix(r * d + c)] += rstd * (dn[ix(c)] - mean_dn - xn[ix(c)] * mean_dn_n);
    }
  }
}

bool tanh_form(Activation a, Mutation m) {
  return a == Activation::gelu_tanh ||
         (a == Activation::gelu && m == Mutation::tanh_gelu_for_exact);
}

const double kSqrt2OverPi = std::sqrt(2.0 / M_PI);

double activation(double x, Activation a, Mutation m) {
  if (a == Activation::relu) return x > 0 ? x : 0;
  if (a == Activation::silu) return x / (1 + std::exp(-x));
  if (!tanh_form(a, m)) return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
  const double u = kSqrt2OverPi * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1 + std::tanh(u));
}

// d activation(x) / dx.
double activation_grad(double x, Activation a, Mutation m) {
  // relu: y = x > 0 ? x : 0
  if (a == Activation::relu) return x > 0 ? 1 : 0;
  if (a == Activation::silu) {
    // y = x s(x), s = 1 / (1 + exp(-x)):  y' = s + x s (1 - s)
    const double s = 1 / (1 + std::exp(-x));
    return s + x * s * (1 - s);
  }
  if (!tanh_form(a, m)) {
    // y = x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2:  y' = Phi(x) + x phi(x),
    // phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) +
           x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
  }
  // y = x (1 + tanh(u)) / 2, u = sqrt(2/pi) (x + 0.044715 x^3):
  // y' = (1 + t) / 2 + x (1 - t^2) u' / 2, u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
  const double t = std::tanh(kSqrt2OverPi * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kSqrt2OverPi * (1 + 3 * 0.044715 * x * x);
}

// Everything one layer's backward reads, saved by its forward. For post-norm, norm1 =
// LN1(residual1) and norm2 = LN2(residual2); for pre-norm, norm1 = LN1(x) and norm2 =
// LN2(residual1).
// The attention variants as docs/semantics.md section 14 writes them, with the mutations of them.
class Variants {
 public:
  // S positions; `shift_from` (per sequence, or empty): the position of index s >= shift_from[b]
  // is s + 1 (the generation mutant's off-by-one position).
  Variants(const ModelConfig& cfg, std::int64_t S, Mutation mut,
           std::vector<std::int64_t> shift_from = {})
      : cfg_(cfg), mut_(mut), from_(std::move(shift_from)), seq_(S) {
    const std::int64_t H = cfg.attention.num_heads;
    if (cfg.embeddings.positional == Positional::alibi) {
      std::int64_t m = 1;
      while (2 * m <= H) m *= 2;
      for (std::int64_t h = 0; h < H; ++h) {
        const double step =
            h < m ? static_cast<double>(h + 1) / static_cast<double>(m)
                  : (2.0 * static_cast<double>(h - m) + 1) / (2.0 * static_cast<double>(m));
        slopes_.push_back(std::pow(2.0, -cfg.attention.alibi_max_bias * step));
      }
    }
    if (cfg.attention.sliding_window)
      window_ = *cfg.attention.sliding_window + (mut == Mutation::window_one_wider);
    if (cfg.embeddings.positional != Positional::rope) return;
    // RoPE's angles, in double: inv_freq[t] = base^(-2t / r), then the scaling.
    const std::int64_t r = cfg.rotary();
    half_ = r / 2;
    const RopeScaling& sc = cfg.attention.rope_scaling;
    const double orig = static_cast<double>(sc.original_max_len.value_or(cfg.embeddings.max_len));
    const double rd = static_cast<double>(r);
    double base = cfg.attention.rope_base;
    if (sc.type == RopeScalingType::ntk) {
      const double len = std::max(static_cast<double>(cfg.embeddings.position_offset + S), orig);
      base *= std::pow(sc.factor * len / orig - (sc.factor - 1), rd / (rd - 2));
    }
    std::vector<double> inv(static_cast<std::size_t>(half_));
    for (std::int64_t t = 0; t < half_; ++t)
      inv[ix(t)] = 1.0 / std::pow(base, 2.0 * static_cast<double>(t) / rd);
    double mscale = 1;
    if (sc.type == RopeScalingType::linear) {
      for (double& f : inv) f /= sc.factor;
    } else if (sc.type == RopeScalingType::yarn) {
      auto dim = [&](double rotations) {
        return rd * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(base));
      };
      const double low = std::max(std::floor(dim(sc.beta_fast)), 0.0);
      double high = std::min(std::ceil(dim(sc.beta_slow)), rd - 1);
      if (high == low) high += 0.001;
      for (std::int64_t t = 0; t < half_; ++t) {
        const double ramp =
            std::min(1.0, std::max(0.0, (static_cast<double>(t) - low) / (high - low)));
        inv[ix(t)] = inv[ix(t)] / sc.factor * ramp + inv[ix(t)] * (1 - ramp);
      }
      mscale = 0.1 * std::log(sc.factor) + 1;
    }
    for (std::int64_t s = 0; s < S + (from_.empty() ? 0 : 1); ++s) {
      double pos = static_cast<double>(cfg.embeddings.position_offset + s);
      if (mut == Mutation::rope_bf16_positions) {
        int e = 0;
        const double m = std::frexp(pos, &e);  // pos = m 2^e, m in [0.5, 1)
        pos = std::ldexp(std::nearbyint(m * 256.0) / 256.0, e);
      }
      for (std::int64_t t = 0; t < half_; ++t) {
        cos_.push_back(std::cos(pos * inv[ix(t)]) * mscale);
        sin_.push_back(std::sin(pos * inv[ix(t)]) * mscale);
      }
    }
  }

  // The K/V head query head h reads.
  std::int64_t kv_of(std::int64_t h, std::int64_t kv, std::int64_t group) const {
    return mut_ == Mutation::kv_heads_tiled ? h % kv : h / group;
  }

  // Key j visible from query i of a sequence of `len` real tokens.
  bool visible(std::int64_t i, std::int64_t j, std::int64_t len) const {
    if (j >= len || (cfg_.attention.causal && j > i)) return false;
    const std::int64_t dist = i > j ? i - j : j - i;
    return window_ == 0 || dist < window_;
  }

  // The final logit from the scaled score s: cap, bias, mask (or, mutated, mask first).
  double logit(double s, std::int64_t h, std::int64_t i, std::int64_t j, bool vis) const {
    const double inf = std::numeric_limits<double>::infinity();
    const auto dist = static_cast<double>(cfg_.attention.causal ? i - j : (i > j ? i - j : j - i));
    const double bias = slopes_.empty() ? 0.0
                                        : (mut_ == Mutation::alibi_sign_flipped ? 1.0 : -1.0) *
                                              slopes_[ix(h)] * dist;
    const auto cap = [&](double z) {
      return cfg_.attention.attn_logit_softcap
                 ? *cfg_.attention.attn_logit_softcap *
                       std::tanh(z / *cfg_.attention.attn_logit_softcap)
                 : z;
    };
    if (mut_ == Mutation::softcap_after_mask) return cap(vis ? s + bias : -inf);
    return vis ? cap(s) + bias : -inf;
  }

  // d logit / d s at a visible score: 1 - tanh^2(s / c), or 1 without a cap.
  double cap_grad(double s) const {
    if (!cfg_.attention.attn_logit_softcap) return 1.0;
    const double t = std::tanh(s / *cfg_.attention.attn_logit_softcap);
    return 1 - t * t;
  }

  // x (rows, S, Dh) rotated by RoPE, or by its transpose (the backward).
  Vec rotate(const Vec& x, std::int64_t rows, std::int64_t dh, bool transpose) const {
    Vec o = x;
    const std::int64_t S = seq_;
    const bool neox =
        (cfg_.attention.rope_style == RopeStyle::neox) != (mut_ == Mutation::rope_other_convention);
    const auto per_seq = from_.empty() ? rows : rows / static_cast<std::int64_t>(from_.size());
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t s = 0; s < S; ++s)
        for (std::int64_t t = 0; t < half_; ++t) {
          const std::size_t row = ix((r * S + s) * dh);
          const std::size_t a = row + ix(neox ? t : 2 * t),
                            b = row + ix(neox ? t + half_ : 2 * t + 1);
          const std::int64_t pos = s + (!from_.empty() && s >= from_[ix(r / per_seq)] ? 1 : 0);
          const double c = cos_[ix(pos * half_ + t)],
                       sn = (transpose ? -1 : 1) * sin_[ix(pos * half_ + t)];
          o[a] = x[a] * c - x[b] * sn;
          o[b] = x[b] * c + x[a] * sn;
        }
    return o;
  }

 private:
  const ModelConfig& cfg_;
  Mutation mut_;
  std::vector<std::int64_t> from_;
  std::int64_t seq_ = 0;
  std::vector<double> slopes_, cos_, sin_;
  std::int64_t window_ = 0, half_ = 0;
};

struct LayerSaved {
  Vec x;               // the layer's input (B, S, D)
  Norm norm1, norm2;   // outputs and statistics of LN1 and LN2
  Vec attn_in;         // x (post) or norm1 (pre)
  Vec q, k, v;         // (B, H, S, Dh); k, v (B, Hkv, S, Dh)
  Vec q_rot, k_rot;    // after RoPE
  Vec raw;             // (B, H, S, S): alpha q.k, before the cap, the bias and the mask
  Vec psink;           // (B, H, S): the sink's share of each row
  Vec probs;           // (B, H, S, S), before dropout
  Mask attn_mask;      // dropout.layers.{i}.attn
  Vec context;         // (B, S, D), heads merged
  Mask r1_mask;        // dropout.layers.{i}.residual1
  Vec residual1;       // x + drop_r1(attn_out)
  Vec ffn_in;          // norm1 (post) or norm2 (pre)
  Vec ffn_gate;        // ffn_in Wg^T + bg (B, S, F); a gated FFN only
  Vec ffn_pre;         // ffn_in W1^T + b1 (B, S, F)
  Mask ffn_mask;       // dropout.layers.{i}.ffn
  Vec dropped_hidden;  // drop_ffn(act(ffn_pre))
  Mask r2_mask;        // dropout.layers.{i}.residual2
  Vec residual2;       // base + drop_r2(ffn_out)
};

File generation_steps(const File& golden, Mutation mut);

// shift_from (per sequence, or empty): positions from shift_from[b] on are one further on (the
// generation mutant, on the grown sequences only).
File run(const File& golden, Mutation mut, bool with_backward,
         const std::vector<std::int64_t>& shift_from = {}) {
  const std::string* cfg_text = golden.meta("config");
  const std::string* case_text = golden.meta("case");
  if (!cfg_text || !case_text) throw FormatError("golden has no config or case metadata");
  const ModelConfig cfg = ModelConfig::from_json_text(*cfg_text);
  const auto cj = nlohmann::json::parse(*case_text);
  const std::int64_t B = cj.at("batch"), S = cj.at("seq_len");
  const std::int64_t D = cfg.d_model, H = cfg.attention.num_heads, Dh = D / H, F = cfg.ffn.d_ff;
  const std::int64_t C = cfg.head.num_classes, L = cfg.num_layers, N = B * S;
  const std::int64_t K = cfg.kv_heads(), G = H / K, Dkv = K * Dh,
                     P0 = cfg.embeddings.position_offset;
  const bool pre = cfg.norms.norm_first;
  const bool patches = cfg.patches_input();
  const auto tokens = patches ? std::vector<std::int64_t>() : ints(golden, "input.tokens");
  const auto lengths = ints(golden, "input.lengths");
  const bool decoder = cfg.decoder();
  const auto labels = decoder ? std::vector<std::int64_t>() : ints(golden, "input.labels");
  const std::int64_t V = cfg.embeddings.vocab_size;
  const bool rms = cfg.norms.norm == teo::Norm::rmsnorm, gated = cfg.gated();
  const Activation act_fn = cfg.ffn_activation();
  const double p = cfg.dropout;
  const double keep_scale = p > 0 && mut != Mutation::dropout_scale_missing ? 1.0 / (1.0 - p) : 1.0;
  // out = mask ? in * scale : 0
  auto apply = [&](const Vec& x, const Mask& mk) {
    Vec y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = mk[i] ? x[i] * keep_scale : 0.0;
    return y;
  };
  auto param = [&](const std::string& n) { return doubles(golden, "param." + n); };
  // A bias the config may leave out: its values, or n zeros.
  auto bias = [&](const std::string& n, std::int64_t size) {
    return golden.find("param." + n) ? param(n) : Vec(ix(size), 0.0);
  };
  // The config's norm of rows of D under parameters `pfx`.weight (and .bias).
  auto norm = [&](const Vec& xin, const std::string& pfx) {
    if (rms) return rms_norm(xin, N, D, param(pfx + ".weight"), cfg.norms.layer_norm_eps);
    return layer_norm(xin, N, D, param(pfx + ".weight"), param(pfx + ".bias"),
                      cfg.norms.layer_norm_eps, mut);
  };
  auto at = [](Vec& v, std::int64_t i) -> double& { return v[ix(i)]; };

  Out out{File{}, cj.at("dtype") == "float32"};
  out.file.metadata.emplace_back("format", "teo-candidate/1");
  out.file.metadata.emplace_back("backend", std::string("naive-double/") + mutation_name(mut));

  // ---- forward ----------------------------------------------------------------------------

  // Embedding and positions.
  const double escale = cfg.embeddings.embed_scale ? std::sqrt(static_cast<double>(D)) : 1.0;
  Vec embedding(ix(N * D));
  // ViT (semantics 18.5): position 0 of image b is cls_token; position 1 + py Gp + px is the
  // patch at (py, px), sum over (ch, i, j) of W[c, ch, i, j] pixels[b, ch, py P + i, px P + j],
  // plus the bias. patch_at(b, n, k): pixel k of patch n, k = (ch P + i) P + j.
  const std::int64_t Ch = cfg.embeddings.channels, Img = cfg.embeddings.image_size,
                     Pp = cfg.embeddings.patch_size;
  const std::int64_t Gp = patches ? Img / Pp : 0, Np = Gp * Gp, Kp = Ch * Pp * Pp;
  const Vec pixels = patches ? doubles(golden, "input.pixels") : Vec();
  auto patch_at = [&](std::int64_t b, std::int64_t n, std::int64_t k) {
    std::int64_t ch = k / (Pp * Pp), i = k / Pp % Pp, j = k % Pp;
    if (mut == Mutation::patches_hwc_flattened) i = k / (Pp * Ch), j = k / Ch % Pp, ch = k % Ch;
    return pixels[ix(((b * Ch + ch) * Img + n / Gp * Pp + i) * Img + n % Gp * Pp + j)];
  };
  // the sequence position of patch n (0 .. Np - 1) and of the [CLS] token
  const bool appended = mut == Mutation::cls_token_appended;
  auto patch_pos = [&](std::int64_t n) { return appended ? n : 1 + n; };
  const std::int64_t cls_pos = appended ? Np : 0;
  if (patches) {
    const Vec pw = param("patch_embedding.weight"), pb = param("patch_embedding.bias");
    const Vec cls = param("cls_token");
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t c = 0; c < D; ++c) at(embedding, (b * S + cls_pos) * D + c) = cls[ix(c)];
      for (std::int64_t n = 0; n < Np; ++n) {
        for (std::int64_t c = 0; c < D; ++c) {
          double acc = 0;
          for (std::int64_t k = 0; k < Kp; ++k) acc += pw[ix(c * Kp + k)] * patch_at(b, n, k);
          at(embedding, (b * S + patch_pos(n)) * D + c) = acc + pb[ix(c)];
        }
      }
    }
  } else {
    const Vec emb_w = param("embedding.weight");
    for (std::int64_t t = 0; t < N; ++t) {
      for (std::int64_t c = 0; c < D; ++c) {
        at(embedding, t * D + c) = emb_w[ix(tokens[ix(t)] * D + c)] * escale;
      }
    }
  }
  // Positions P0 .. P0 + S - 1 (one more for the shifted ones); none, rope and alibi add nothing
  // here.
  const std::int64_t PS = S + (shift_from.empty() ? 0 : 1);
  if (cfg.embeddings.positional == Positional::learned && P0 + PS > cfg.embeddings.max_len)
    throw ShapeError("the shifted positions run past max_len");
  Vec positional(ix(PS * D), 0.0);
  if (cfg.embeddings.positional == Positional::learned) {
    const Vec pw = param("pos_embedding.weight");
    for (std::int64_t i = 0; i < PS * D; ++i) at(positional, i) = pw[ix(P0 * D + i)];
  } else if (cfg.embeddings.positional == Positional::sinusoidal) {
    for (std::int64_t s = 0; s < PS; ++s) {
      for (std::int64_t c = 0; c < D; ++c) {
        const std::int64_t two_i = c - c % 2 + (mut == Mutation::pe_frequency_off_by_one ? 2 : 0);
        const double angle = static_cast<double>(P0 + s) /
                             std::pow(10000.0, static_cast<double>(two_i) / static_cast<double>(D));
        const bool use_sin = (c % 2 == 0) != (mut == Mutation::pe_sin_cos_swapped);
        at(positional, s * D + c) = use_sin ? std::sin(angle) : std::cos(angle);
      }
    }
  }
  // token_type[t] = token_type_embedding.weight[token_types[t]] (type_vocab_size only)
  const bool types = cfg.embeddings.type_vocab_size.has_value();
  const auto token_types = types ? ints(golden, "input.token_types") : std::vector<std::int64_t>();
  Vec token_type(types ? ix(N * D) : 0, 0.0);
  if (types) {
    const Vec tw = param("token_type_embedding.weight");
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t c = 0; c < D; ++c)
        at(token_type, t * D + c) = tw[ix(token_types[ix(t)] * D + c)];
  }
  // sum = (embedding + token_type) + positional, BERT's order (semantics 18.1)
  Vec sum(embedding.size());
  for (std::int64_t t = 0; t < N; ++t) {
    const std::int64_t s = t % S;
    const std::int64_t pos = s + (!shift_from.empty() && s >= shift_from[ix(t / S)] ? 1 : 0);
    for (std::int64_t c = 0; c < D; ++c) {
      double e = at(embedding, t * D + c);
      if (types && mut != Mutation::token_types_ignored) e += at(token_type, t * D + c);
      at(sum, t * D + c) = e + at(positional, pos * D + c);
    }
  }
  positional.resize(ix(S * D));
  const Mask input_mask = mask(golden, "dropout.input", sum.size());
  // input = drop(norm(sum)) with embedding_norm (the mutant: norm(drop(sum))), else drop(sum)
  Norm emb_norm;
  Vec input;
  if (cfg.embeddings.embedding_norm && mut == Mutation::embedding_norm_after_dropout) {
    emb_norm = norm(apply(sum, input_mask), "embedding_norm");
    input = emb_norm.y;
  } else if (cfg.embeddings.embedding_norm) {
    emb_norm = norm(sum, "embedding_norm");
    input = apply(emb_norm.y, input_mask);
  } else {
    input = apply(sum, input_mask);
  }
  out.act("embedding", {B, S, D}, embedding);
  out.act("positional", {S, D}, positional);
  if (types) out.act("token_type", {B, S, D}, token_type);
  if (cfg.embeddings.embedding_norm) out.act("embedding_norm", {B, S, D}, emb_norm.y);
  out.act("input", {B, S, D}, input);

  const double alpha =
      mut == Mutation::no_score_scale ? 1.0 : 1.0 / std::sqrt(static_cast<double>(Dh));
  const double inf = std::numeric_limits<double>::infinity();
  // (B, S, nh*Dh) -> (B, nh, S, Dh) and back.
  auto heads = [&](const Vec& y, std::int64_t nh = 0) {
    nh = nh ? nh : H;
    Vec o(y.size());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < nh; ++h)
        for (std::int64_t s = 0; s < S; ++s)
          for (std::int64_t c = 0; c < Dh; ++c)
            o[ix(((b * nh + h) * S + s) * Dh + c)] = y[ix((b * S + s) * nh * Dh + h * Dh + c)];
    return o;
  };
  auto merge = [&](const Vec& y, std::int64_t nh = 0) {
    nh = nh ? nh : H;
    Vec o(y.size());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < nh; ++h)
        for (std::int64_t s = 0; s < S; ++s)
          for (std::int64_t c = 0; c < Dh; ++c)
            o[ix((b * S + s) * nh * Dh + h * Dh + c)] = y[ix(((b * nh + h) * S + s) * Dh + c)];
    return o;
  };

  // The attention variants (docs/semantics.md section 14).
  ModelConfig attn_cfg = cfg;
  if (mut == Mutation::decoder_not_causal) attn_cfg.attention.causal = false;
  const Variants var(attn_cfg, S, mut, shift_from);
  const bool rope = cfg.embeddings.positional == Positional::rope;
  std::vector<LayerSaved> saved(ix(L));
  Vec x = input;
  for (std::int64_t l = 0; l < L; ++l) {
    const std::string pl = "layers." + std::to_string(l) + ".";
    auto lp = [&](const std::string& n) { return param(pl + n); };
    LayerSaved& sv = saved[ix(l)];
    sv.x = x;
    sv.attn_in = x;
    if (pre) {
      sv.norm1 = norm(x, pl + "norm1");
      sv.attn_in = sv.norm1.y;
      out.act(pl + "norm1", {B, S, D}, sv.attn_in);
    }
    const bool tq = mut == Mutation::transposed_weight;
    auto lb = [&](const std::string& n, std::int64_t size) { return bias(pl + n, size); };
    sv.q = heads(linear(sv.attn_in, N, D, lp("attn.q.weight"), lb("attn.q.bias", D), D, tq));
    sv.k = heads(linear(sv.attn_in, N, D, lp("attn.k.weight"), lb("attn.k.bias", Dkv), Dkv), K);
    sv.v = heads(linear(sv.attn_in, N, D, lp("attn.v.weight"), lb("attn.v.bias", Dkv), Dkv), K);
    if (rope) {
      sv.q_rot = var.rotate(sv.q, B * H, Dh, false);
      sv.k_rot = var.rotate(sv.k, B * K, Dh, false);
    }
    const Vec &q = rope ? sv.q_rot : sv.q, &k = rope ? sv.k_rot : sv.k, &v = sv.v;
    const Vec sinks = cfg.attention.attn_sinks ? lp("attn.sinks") : Vec();
    Vec scores(ix(B * H * S * S));
    sv.raw.assign(scores.size(), 0.0);
    sv.psink.assign(ix(B * H * S), 0.0);
    sv.probs.assign(scores.size(), 0.0);
    sv.context.assign(ix(N * D), 0.0);
    sv.attn_mask = mask(golden, "dropout." + pl + "attn", scores.size());
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t len = mut == Mutation::mask_ignores_padding ? S : lengths[ix(b)];
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t base = (b * H + h) * S, kbase = (b * K + var.kv_of(h, K, G)) * S;
        auto sc = [&](std::int64_t i, std::int64_t j) -> double& {
          return at(scores, (base + i) * S + j);
        };
        auto pr = [&](std::int64_t i, std::int64_t j) -> double& {
          return at(sv.probs, (base + i) * S + j);
        };
        for (std::int64_t i = 0; i < S; ++i) {
          for (std::int64_t j = 0; j < S; ++j) {
            double dot = 0;
            for (std::int64_t c = 0; c < Dh; ++c) {
              dot += q[ix((base + i) * Dh + c)] * k[ix((kbase + j) * Dh + c)];
            }
            at(sv.raw, (base + i) * S + j) = dot * alpha;
            sc(i, j) = var.logit(dot * alpha, h, i, j, var.visible(i, j, len));
          }
        }
        // Softmax over the visible keys of each query (or, mutated, over the queries that see
        // each key); a row or column with nothing visible is 0.
        // With sinks, each row's sink logit joins the softmax; its share is kept apart.
        const bool by_col = mut == Mutation::softmax_wrong_axis;
        const bool sunk = cfg.attention.attn_sinks;
        for (std::int64_t a = 0; a < S; ++a) {
          double mx = sunk ? sinks[ix(h)] : -inf;
          for (std::int64_t z = 0; z < S; ++z) {
            const double s = by_col ? sc(z, a) : sc(a, z);
            mx = std::max(mx, s);
          }
          double total = sunk ? std::exp(sinks[ix(h)] - mx) : 0.0;
          for (std::int64_t z = 0; z < S; ++z) {
            const double s = by_col ? sc(z, a) : sc(a, z);
            if (s != -inf) total += std::exp(s - mx);
          }
          for (std::int64_t z = 0; z < S; ++z) {
            const double s = by_col ? sc(z, a) : sc(a, z);
            (by_col ? pr(z, a) : pr(a, z)) = s == -inf ? 0.0 : std::exp(s - mx) / total;
          }
          if (sunk) {
            const double share = std::exp(sinks[ix(h)] - mx) / total;
            at(sv.psink, base + a) = share;
            if (mut == Mutation::sink_column_kept) {
              // [p_0 .. p_{S-1}, p_sink] sliced [1:] instead of [:-1]
              for (std::int64_t z = 0; z + 1 < S; ++z) pr(a, z) = pr(a, z + 1);
              pr(a, S - 1) = share;
            }
          }
        }
        for (std::int64_t i = 0; i < S; ++i) {
          for (std::int64_t c = 0; c < Dh; ++c) {
            double acc = 0;
            for (std::int64_t j = 0; j < S; ++j) {
              const std::size_t pij = ix((base + i) * S + j);
              const double pv = sv.attn_mask[pij] ? sv.probs[pij] * keep_scale : 0.0;
              acc += pv * v[ix((kbase + j) * Dh + c)];
            }
            at(sv.context, (b * S + i) * D + h * Dh + c) = acc;
          }
        }
      }
    }
    const Vec attn_out = linear(sv.context, N, D, lp("attn.o.weight"), lb("attn.o.bias", D), D);
    sv.r1_mask = mask(golden, "dropout." + pl + "residual1", attn_out.size());
    const Vec r1d = apply(attn_out, sv.r1_mask);
    sv.residual1.resize(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) sv.residual1[i] = x[i] + r1d[i];
    out.act(pl + "q", {B, H, S, Dh}, sv.q);
    out.act(pl + "k", {B, K, S, Dh}, sv.k);
    out.act(pl + "v", {B, K, S, Dh}, v);
    if (rope) {
      out.act(pl + "q_rot", {B, H, S, Dh}, sv.q_rot);
      out.act(pl + "k_rot", {B, K, S, Dh}, sv.k_rot);
    }
    out.act(pl + "scores", {B, H, S, S}, scores);
    out.act(pl + "probs", {B, H, S, S}, sv.probs);
    out.act(pl + "context", {B, S, D}, sv.context);
    out.act(pl + "attn_out", {B, S, D}, attn_out);
    out.act(pl + "residual1", {B, S, D}, sv.residual1);
    if (pre) {
      sv.norm2 = norm(sv.residual1, pl + "norm2");
      sv.ffn_in = sv.norm2.y;
      out.act(pl + "norm2", {B, S, D}, sv.ffn_in);
    } else {
      sv.norm1 = norm(sv.residual1, pl + "norm1");
      sv.ffn_in = sv.norm1.y;
      out.act(pl + "norm1", {B, S, D}, sv.ffn_in);
    }
    // hidden = act(fc1(ffn_in)), or gated: act(gate(ffn_in)) * fc1(ffn_in)
    if (gated)
      sv.ffn_gate = linear(sv.ffn_in, N, D, lp("ffn.gate.weight"), lb("ffn.gate.bias", F), F);
    sv.ffn_pre = linear(sv.ffn_in, N, D, lp("ffn.fc1.weight"), lb("ffn.fc1.bias", F), F);
    Vec hidden(sv.ffn_pre.size());
    for (std::size_t i = 0; i < hidden.size(); ++i) {
      hidden[i] = gated ? activation(sv.ffn_gate[i], act_fn, mut) * sv.ffn_pre[i]
                        : activation(sv.ffn_pre[i], act_fn, mut);
    }
    sv.ffn_mask = mask(golden, "dropout." + pl + "ffn", hidden.size());
    sv.dropped_hidden = apply(hidden, sv.ffn_mask);
    const Vec ffn_out =
        linear(sv.dropped_hidden, N, F, lp("ffn.fc2.weight"), lb("ffn.fc2.bias", D), D);
    sv.r2_mask = mask(golden, "dropout." + pl + "residual2", ffn_out.size());
    const Vec r2d = apply(ffn_out, sv.r2_mask);
    const Vec& res_base = pre ? sv.residual1 : sv.ffn_in;
    sv.residual2.resize(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) sv.residual2[i] = res_base[i] + r2d[i];
    out.act(pl + "ffn_hidden", {B, S, F}, hidden);
    out.act(pl + "ffn_out", {B, S, D}, ffn_out);
    if (pre) {
      x = sv.residual2;
    } else {
      sv.norm2 = norm(sv.residual2, pl + "norm2");
      x = sv.norm2.y;
      out.act(pl + "norm2", {B, S, D}, x);
    }
    out.act(pl + "output", {B, S, D}, x);
  }
  const Vec last = x;  // layers.{L-1}.output, or input when L = 0
  Norm final_norm;
  if (pre) {
    final_norm = norm(last, "final_norm");
    x = final_norm.y;
    out.act("final_norm", {B, S, D}, x);
  }
  const Vec& top = x;

  const double eps = mut == Mutation::label_smoothing_ignored ? 0.0 : cfg.head.label_smoothing;
  double loss = 0;
  // an encoder's pooling and classifier head
  Vec pooled(ix(B * D), 0.0), pooler, head_w, logits, class_probs;
  std::vector<std::int64_t> argmax(ix(B * D), -1);
  // a decoder's LM head and next-token loss: position t of sequence b predicts token t + 1
  // (-1: ignored, the last real position and the padding); lm_w is the embedding when tied
  Vec lm_w, lm_logits, lm_probs;
  std::vector<std::int64_t> targets;
  std::int64_t counted = 0;
  if (decoder) {
    lm_w = param(cfg.head.tie_embeddings ? "embedding.weight" : "lm_head.weight");
    lm_logits = linear(top, N, D, lm_w, bias("lm_head.bias", V), V);
    lm_probs.assign(lm_logits.size(), 0.0);
    targets.assign(ix(N), -1);
    const std::int64_t shift = mut == Mutation::labels_not_shifted ? 0 : 1;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t + 1 < lengths[ix(b)]; ++t)
        targets[ix(b * S + t)] = tokens[ix(b * S + t + shift)];
    for (std::int64_t r = 0; r < N; ++r) {
      if (targets[ix(r)] < 0) continue;  // ignored: its probs stay 0, its gradient is 0
      loss +=
          smoothed_ce(lm_logits.data() + r * V, V, targets[ix(r)], eps, lm_probs.data() + r * V);
      ++counted;
    }
    if (counted > 0) loss /= static_cast<double>(counted);
    out.act("lm_logits", {B, S, V}, lm_logits);
  } else {
    // Pooling over the real tokens; for max, the first maximum (or the first NaN) of each column.
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t len = lengths[ix(b)];
      if (len == 0) continue;
      for (std::int64_t c = 0; c < D; ++c) {
        auto tp = [&](std::int64_t s) { return top[ix((b * S + s) * D + c)]; };
        double r = 0;
        if (cfg.head.pooling == Pooling::cls) {
          r = tp(0);
        } else if (cfg.head.pooling == Pooling::max) {
          std::int64_t best = 0;
          for (std::int64_t s = 1; s < len; ++s) {
            if (tp(s) > tp(best) || (std::isnan(tp(s)) && !std::isnan(tp(best)))) best = s;
          }
          argmax[ix(b * D + c)] = best;
          r = tp(best);
        } else {
          const std::int64_t n = mut == Mutation::mean_pool_includes_padding ? S : len;
          for (std::int64_t s = 0; s < n; ++s) r += tp(s);
          r /= static_cast<double>(n);
        }
        at(pooled, b * D + c) = r;
      }
    }
    // pooler = tanh(pooled Wp^T + bp) (pooler dense_tanh; the mutant leaves out the tanh)
    if (cfg.head.pooler == Pooler::dense_tanh) {
      pooler = linear(pooled, B, D, param("pooler.weight"), param("pooler.bias"), D);
      if (mut != Mutation::pooler_without_tanh)
        for (double& v : pooler) v = std::tanh(v);
    }
    const Vec& head_in = cfg.head.pooler == Pooler::dense_tanh ? pooler : pooled;
    head_w = param("head.weight");
    logits = linear(head_in, B, D, head_w, bias("head.bias", C), C);
    class_probs.assign(ix(B * C), 0.0);
    for (std::int64_t b = 0; b < B; ++b)
      loss += smoothed_ce(logits.data() + b * C, C, labels[ix(b)], eps, class_probs.data() + b * C);
    if (B > 0) loss /= static_cast<double>(B);
    out.act("pooled", {B, D}, pooled);
    if (cfg.head.pooler == Pooler::dense_tanh) out.act("pooler", {B, D}, pooler);
    out.act("logits", {B, C}, logits);
  }
  out.act("loss", {}, Vec{loss});
  if (golden.find("input.generate.tokens")) {
    for (auto& t : generation_steps(golden, mut).tensors)
      out.file.add(t.name, t.dtype, t.shape, t.data().data(), t.data().size());
  }
  if (!with_backward) return out.file;

  // ---- backward ---------------------------------------------------------------------------
  // d loss / d X for every X, walking back through the saved forward values. Each step quotes
  // the forward expression it differentiates. Parameter gradients accumulate in `grads`.

  std::map<std::string, Vec> grads;                    // parameter name -> gradient
  std::vector<std::pair<std::string, Vec>> act_grads;  // activation name -> gradient
  std::map<std::string, Shape> act_shapes;
  auto grad = [&](const std::string& name) -> Vec& {
    auto it = grads.find(name);
    if (it == grads.end())
      it = grads.emplace(name, Vec(doubles(golden, "param." + name).size(), 0.0)).first;
    return it->second;
  };
  // The gradient of a bias the config may leave out: a scratch vector when it is absent.
  std::map<std::string, Vec> absent;
  auto bgrad = [&](const std::string& name, std::int64_t size) -> Vec& {
    if (golden.find("param." + name)) return grad(name);
    return absent.emplace(name, Vec(ix(size), 0.0)).first->second;
  };
  auto norm_backward = [&](const Vec& g, const Vec& xin, const Norm& n, const std::string& pfx,
                           Vec& gx) {
    if (rms) {
      rms_norm_backward(g, xin, n, N, D, param(pfx + ".weight"), gx, grad(pfx + ".weight"));
    } else {
      layer_norm_backward(g, xin, n, N, D, param(pfx + ".weight"), gx, grad(pfx + ".weight"),
                          grad(pfx + ".bias"), mut);
    }
  };
  auto keep = [&](const std::string& name, Shape shape, const Vec& g) {
    act_grads.emplace_back(name, g);
    act_shapes[name] = std::move(shape);
  };
  // Backward of out = mask ? in * scale : 0:  gin = mask ? gout * scale : 0
  auto unapply = [&](const Vec& g, const Mask& mk) { return apply(g, mk); };

  Vec g_top(ix(N * D), 0.0);
  if (decoder) {
    // loss = (1/n) sum over the n counted rows of -(1 - eps) logp[y] - (eps/V) sum_c logp[c]:
    //   d loss / d z_c = (lm_probs[c] - ((c == y ? 1 - eps : 0) + eps/V)) / n; 0 on ignored rows
    Vec g_lm(lm_logits.size(), 0.0);
    for (std::int64_t r = 0; r < N; ++r) {
      if (targets[ix(r)] < 0) continue;
      smoothed_ce_grad(lm_probs.data() + r * V, V, targets[ix(r)], eps,
                       1.0 / static_cast<double>(counted), g_lm.data() + r * V);
    }
    keep("lm_logits", {B, S, V}, g_lm);
    // lm_logits = top W^T + b, W = embedding.weight when tied: its gradient adds to the
    // embedding's (the mutant drops it)
    Vec dropped_w(lm_w.size(), 0.0);
    Vec& g_w = !cfg.head.tie_embeddings                  ? grad("lm_head.weight")
               : mut == Mutation::tied_head_grad_dropped ? dropped_w
                                                         : grad("embedding.weight");
    linear_backward(g_lm, top, lm_w, N, D, V, g_top, g_w, bgrad("lm_head.bias", V));
  } else {
    // loss = (1/B) sum_b loss_b,  loss_b = -(1 - eps) logp[y] - (eps/C) sum_c logp[c],
    // logp = z - logsumexp(z):  d loss_b / d z_c = class_probs[c] - ((c == y ? 1 - eps : 0) +
    // eps/C)
    Vec g_logits(ix(B * C), 0.0);
    for (std::int64_t b = 0; b < B; ++b) {
      smoothed_ce_grad(class_probs.data() + b * C, C, labels[ix(b)], eps,
                       1.0 / static_cast<double>(B), g_logits.data() + b * C);
    }
    keep("logits", {B, C}, g_logits);

    // logits = head_in Wh^T + bh, head_in = pooler or pooled
    Vec g_pooled(ix(B * D), 0.0);
    if (cfg.head.pooler == Pooler::dense_tanh) {
      Vec g_pooler(ix(B * D), 0.0);
      linear_backward(g_logits, pooler, head_w, B, D, C, g_pooler, grad("head.weight"),
                      bgrad("head.bias", C));
      keep("pooler", {B, D}, g_pooler);
      // pooler = tanh(pre), pre = pooled Wp^T + bp:  g_pre = g_pooler (1 - pooler^2)
      Vec g_pre(g_pooler.size());
      for (std::size_t i = 0; i < g_pre.size(); ++i)
        g_pre[i] = g_pooler[i] * (1.0 - pooler[i] * pooler[i]);
      linear_backward(g_pre, pooled, param("pooler.weight"), B, D, D, g_pooled,
                      grad("pooler.weight"), grad("pooler.bias"));
    } else {
      linear_backward(g_logits, pooled, head_w, B, D, C, g_pooled, grad("head.weight"),
                      bgrad("head.bias", C));
    }
    keep("pooled", {B, D}, g_pooled);

    // pooled[b,c] = mean_{s < len} top[b,s,c] | top[b,0,c] | top[b,argmax[b,c],c]; 0 if len == 0
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t len = lengths[ix(b)];
      if (len == 0) continue;  // pooled = 0: no dependence on top
      for (std::int64_t c = 0; c < D; ++c) {
        const double g = at(g_pooled, b * D + c);
        if (cfg.head.pooling == Pooling::cls) {
          at(g_top, (b * S) * D + c) += g;
        } else if (cfg.head.pooling == Pooling::max) {
          at(g_top, (b * S + argmax[ix(b * D + c)]) * D + c) += g;
        } else {
          const std::int64_t n = mut == Mutation::mean_pool_includes_padding ? S : len;
          for (std::int64_t s = 0; s < n; ++s)
            at(g_top, (b * S + s) * D + c) += g / static_cast<double>(n);
        }
      }
    }
  }

  // top = final_norm = LN(last) (pre-norm); top = last (post-norm)
  Vec g_x;
  if (pre) {
    g_x.assign(ix(N * D), 0.0);
    norm_backward(g_top, last, final_norm, "final_norm", g_x);
  } else {
    g_x = g_top;
  }

  for (std::int64_t l = L - 1; l >= 0; --l) {
    const std::string pl = "layers." + std::to_string(l) + ".";
    auto lp = [&](const std::string& n) { return param(pl + n); };
    auto lg = [&](const std::string& n) -> Vec& { return grad(pl + n); };
    const LayerSaved& sv = saved[ix(l)];
    keep(pl + "output", {B, S, D}, g_x);
    const Vec& g_output = g_x;

    // post: output = norm2 = LN2(residual2);  pre: output = residual2
    Vec g_residual2;
    if (pre) {
      g_residual2 = g_output;
    } else {
      g_residual2.assign(ix(N * D), 0.0);
      norm_backward(g_output, sv.residual2, sv.norm2, pl + "norm2", g_residual2);
    }
    // residual2 = base + drop_r2(ffn_out), base = norm1 (post) or residual1 (pre)
    const Vec g_ffn_out = unapply(g_residual2, sv.r2_mask);
    const Vec& g_base = g_residual2;
    // ffn_out = dropped_hidden W2^T + b2
    Vec g_dropped(ix(N * F), 0.0);
    auto lbg = [&](const std::string& n, std::int64_t size) -> Vec& { return bgrad(pl + n, size); };
    linear_backward(g_ffn_out, sv.dropped_hidden, lp("ffn.fc2.weight"), N, F, D, g_dropped,
                    lg("ffn.fc2.weight"), lbg("ffn.fc2.bias", D));
    // dropped_hidden = drop_ffn(ffn_hidden)
    const Vec g_hidden = unapply(g_dropped, sv.ffn_mask);
    // ffn_hidden = act(ffn_pre), or gated: act(ffn_gate) * ffn_pre
    Vec g_pre(g_hidden.size()), g_gate(gated ? g_hidden.size() : 0);
    for (std::size_t i = 0; i < g_pre.size(); ++i) {
      if (gated) {
        g_gate[i] = activation_grad(sv.ffn_gate[i], act_fn, mut) * sv.ffn_pre[i] * g_hidden[i];
        g_pre[i] = activation(sv.ffn_gate[i], act_fn, mut) * g_hidden[i];
      } else {
        g_pre[i] = activation_grad(sv.ffn_pre[i], act_fn, mut) * g_hidden[i];
      }
    }
    // ffn_pre = ffn_in W1^T + b1 (and ffn_gate = ffn_in Wg^T + bg), ffn_in = norm1 (post) or
    // norm2 (pre)
    Vec g_ffn_in(ix(N * D), 0.0);
    if (gated) {
      linear_backward(g_gate, sv.ffn_in, lp("ffn.gate.weight"), N, D, F, g_ffn_in,
                      lg("ffn.gate.weight"), lbg("ffn.gate.bias", F));
    }
    linear_backward(g_pre, sv.ffn_in, lp("ffn.fc1.weight"), N, D, F, g_ffn_in, lg("ffn.fc1.weight"),
                    lbg("ffn.fc1.bias", F));
    Vec g_residual1;
    if (pre) {
      // residual2 = residual1 + ...: the base term;  ffn_in = norm2 = LN2(residual1)
      g_residual1 = g_base;
      norm_backward(g_ffn_in, sv.residual1, sv.norm2, pl + "norm2", g_residual1);
    } else {
      // norm1 feeds both the FFN (ffn_in) and residual2 (base); norm1 = LN1(residual1)
      Vec g_norm1(g_ffn_in.size());
      for (std::size_t i = 0; i < g_norm1.size(); ++i) g_norm1[i] = g_base[i] + g_ffn_in[i];
      g_residual1.assign(ix(N * D), 0.0);
      norm_backward(g_norm1, sv.residual1, sv.norm1, pl + "norm1", g_residual1);
    }
    // residual1 = x + drop_r1(attn_out)
    Vec g_in = g_residual1;
    const Vec g_attn_out = unapply(g_residual1, sv.r1_mask);
    // attn_out = context Wo^T + bo
    Vec g_context(ix(N * D), 0.0);
    linear_backward(g_attn_out, sv.context, lp("attn.o.weight"), N, D, D, g_context,
                    lg("attn.o.weight"), lbg("attn.o.bias", D));

    // Attention, per (b, h), in the (B, H, S, Dh) layout.
    const Vec gctx = heads(g_context);
    Vec gq(sv.q.size(), 0.0), gk(sv.k.size(), 0.0), gv(sv.v.size(), 0.0);
    Vec gprobs(ix(S)), gscores(ix(S));
    const Vec& qa = rope ? sv.q_rot : sv.q;
    const Vec& ka = rope ? sv.k_rot : sv.k;
    for (std::int64_t bh = 0; bh < B * H; ++bh) {
      const std::int64_t base = bh * S, h = bh % H;
      const std::int64_t kbase = ((bh / H) * K + var.kv_of(h, K, G)) * S;
      for (std::int64_t i = 0; i < S; ++i) {
        const double* pr = sv.probs.data() + (base + i) * S;
        const std::uint8_t* am = sv.attn_mask.data() + (base + i) * S;
        const double* gc = gctx.data() + (base + i) * Dh;
        // context[i,c] = sum_j pv[i,j] v[j,c], pv[i,j] = mask ? probs[i,j] * scale : 0
        //   gv[j,c] += pv[i,j] gctx[i,c];  gpv[i,j] = sum_c gctx[i,c] v[j,c]
        //   gprobs[i,j] = mask ? gpv[i,j] * scale : 0
        for (std::int64_t j = 0; j < S; ++j) {
          const double pv = am[j] ? pr[j] * keep_scale : 0.0;
          double gpv = 0;
          for (std::int64_t c = 0; c < Dh; ++c) {
            at(gv, (kbase + j) * Dh + c) += pv * gc[c];
            gpv += gc[c] * sv.v[ix((kbase + j) * Dh + c)];
          }
          gprobs[ix(j)] = am[j] ? gpv * keep_scale : 0.0;
        }
        // probs[i,j] = exp(scores[i,j]) / sum_j' exp(scores[i,j']) over the visible keys:
        //   gscores[i,j] = probs[i,j] (gprobs[i,j] - sum_j' probs[i,j'] gprobs[i,j'])
        // A masked key (scores = -inf, probs = 0) gets 0, and so does a row with no visible key.
        double row_dot = 0;
        for (std::int64_t j = 0; j < S; ++j) row_dot += pr[j] * gprobs[ix(j)];
        // With a sink (whose own gprobs is 0): gsink += p_sink (0 - row_dot).
        if (cfg.attention.attn_sinks) lg("attn.sinks")[ix(h)] -= sv.psink[ix(base + i)] * row_dot;
        if (mut == Mutation::softmax_backward_no_row_sum) row_dot = 0;
        for (std::int64_t j = 0; j < S; ++j) gscores[ix(j)] = pr[j] * (gprobs[ix(j)] - row_dot);
        // scores[i,j] = cap(alpha sum_c q[i,c] k[j,c]) + bias  (visible j; masked: a constant)
        //   g_raw = gscores (1 - tanh^2(raw / c));
        //   gq[i,c] += alpha sum_j g_raw[i,j] k[j,c];  gk[j,c] += alpha g_raw[i,j] q[i,c]
        for (std::int64_t j = 0; j < S; ++j) {
          const double gs = gscores[ix(j)] * var.cap_grad(sv.raw[ix((base + i) * S + j)]);
          if (gs == 0) continue;
          for (std::int64_t c = 0; c < Dh; ++c) {
            at(gq, (base + i) * Dh + c) += alpha * gs * ka[ix((kbase + j) * Dh + c)];
            at(gk, (kbase + j) * Dh + c) += alpha * gs * qa[ix((base + i) * Dh + c)];
          }
        }
      }
    }
    // q | k | v = heads(attn_in W^T + b), attn_in = x (post) or norm1 (pre)
    if (rope) {
      // q_rot = R q, k_rot = R k:  gq = R^T g_q_rot
      gq = var.rotate(gq, B * H, Dh, true);
      gk = var.rotate(gk, B * K, Dh, true);
    }
    Vec g_attn_in(ix(N * D), 0.0);
    linear_backward(merge(gq), sv.attn_in, lp("attn.q.weight"), N, D, D, g_attn_in,
                    lg("attn.q.weight"), lbg("attn.q.bias", D));
    linear_backward(merge(gk, K), sv.attn_in, lp("attn.k.weight"), N, D, Dkv, g_attn_in,
                    lg("attn.k.weight"), lbg("attn.k.bias", Dkv));
    linear_backward(merge(gv, K), sv.attn_in, lp("attn.v.weight"), N, D, Dkv, g_attn_in,
                    lg("attn.v.weight"), lbg("attn.v.bias", Dkv));
    if (pre) {
      // attn_in = norm1 = LN1(x)
      norm_backward(g_attn_in, sv.x, sv.norm1, pl + "norm1", g_in);
    } else {
      // attn_in = x
      for (std::size_t i = 0; i < g_in.size(); ++i) g_in[i] += g_attn_in[i];
    }
    g_x = std::move(g_in);
  }
  keep("input", {B, S, D}, g_x);

  // input = drop_in(sum), or drop_in(en) with en = norm(sum)
  Vec g_sum(ix(N * D), 0.0);
  if (cfg.embeddings.embedding_norm) {
    norm_backward(unapply(g_x, input_mask), sum, emb_norm, "embedding_norm", g_sum);
  } else {
    g_sum = unapply(g_x, input_mask);
  }
  // sum += token_type[t] = token_type_embedding.weight[token_types[t]]
  if (types) {
    Vec& g_tw = grad("token_type_embedding.weight");
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t c = 0; c < D; ++c)
        g_tw[ix(token_types[ix(t)] * D + c)] += g_sum[ix(t * D + c)];
  }
  // sum[b,s,:] = embedding[b,s,:] + positional[s,:];  embedding[t] = embedding.weight[tokens[t]] *
  // escale;  positional = pos_embedding.weight[0:S] (learned; sinusoidal has no parameter)
  // the padding_idx row gets no gradient from the lookup (nn.Embedding(padding_idx))
  if (patches) {
    // embedding[b, cls_pos] = cls_token; embedding[b, patch_pos(n)] = W patch(b, n) + bias
    Vec& g_pw = grad("patch_embedding.weight");
    Vec& g_pb = grad("patch_embedding.bias");
    Vec& g_cls = grad("cls_token");
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t c = 0; c < D; ++c) g_cls[ix(c)] += g_sum[ix((b * S + cls_pos) * D + c)];
      for (std::int64_t n = 0; n < Np; ++n) {
        for (std::int64_t c = 0; c < D; ++c) {
          const double g = g_sum[ix((b * S + patch_pos(n)) * D + c)];
          g_pb[ix(c)] += g;
          for (std::int64_t k = 0; k < Kp; ++k) g_pw[ix(c * Kp + k)] += g * patch_at(b, n, k);
        }
      }
    }
  } else {
    Vec& g_emb_w = grad("embedding.weight");
    for (std::int64_t t = 0; t < N; ++t) {
      if (cfg.embeddings.padding_idx && tokens[ix(t)] == *cfg.embeddings.padding_idx) continue;
      for (std::int64_t c = 0; c < D; ++c) {
        g_emb_w[ix(tokens[ix(t)] * D + c)] += g_sum[ix(t * D + c)] * escale;
      }
    }
  }
  if (cfg.embeddings.positional == Positional::learned) {
    Vec& g_pos_w = grad("pos_embedding.weight");
    for (std::int64_t t = 0; t < N; ++t) {
      for (std::int64_t c = 0; c < D; ++c)
        g_pos_w[ix((P0 + t % S) * D + c)] += g_sum[ix(t * D + c)];
    }
  }
  // Every parameter has a gradient, 0 where the loss does not reach it (e.g. batch 0).
  for (const auto& t : golden.tensors) {
    if (t.name.starts_with("param.")) grad(t.name.substr(6));
  }

  // Write the gradients in the golden's order, then anything the golden does not name.
  std::map<std::string, bool> written;
  for (const auto& t : golden.tensors) {
    if (!t.name.starts_with("grad.")) continue;
    if (t.name.starts_with("grad.act.")) {
      const std::string n = t.name.substr(9);
      for (const auto& [name, g] : act_grads) {
        if (name == n) {
          out.put(t.name, act_shapes.at(name), g);
          written[t.name] = true;
        }
      }
    } else if (auto it = grads.find(t.name.substr(5)); it != grads.end()) {
      out.put(t.name, golden.find("param." + it->first)->shape, it->second);
      written[t.name] = true;
    }
  }
  for (const auto& [name, g] : act_grads) {
    if (!written.count("grad.act." + name)) out.put("grad.act." + name, act_shapes.at(name), g);
  }
  const teo::ModelConfig qcfg = teo::golden::case_of(golden).config;
  for (const auto& [name, g] : grads) {
    // a quantized weight has no gradient in the contract
    if (!written.count("grad." + name) && !teo::contract::is_quantized(qcfg, name))
      out.put("grad." + name, golden.find("param." + name)->shape, g);
  }
  return out.file;
}

// A generation case's steps without a cache: each sequence grown by the tokens it is fed (its
// prompt, then input.generate.tokens) runs through the whole causal forward once, and step t's
// logits are its LM logits at position lengths[b] + t (docs/semantics.md, section 17.3).
File generation_steps(const File& golden, Mutation mut) {
  auto cj = nlohmann::json::parse(*golden.meta("case"));
  const std::int64_t B = cj.at("batch"), S = cj.at("seq_len"), T = cj.at("generate").at("steps");
  const ModelConfig cfg = ModelConfig::from_json_text(*golden.meta("config"));
  const auto tokens = ints(golden, "input.tokens"), lengths = ints(golden, "input.lengths");
  const auto fed = ints(golden, "input.generate.tokens");  // (T, B)
  std::int64_t S2 = 0;
  for (auto len : lengths) S2 = std::max(S2, len + T);
  std::vector<std::int64_t> grown(ix(B * S2), 0), grown_len(ix(B));
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t len = lengths[ix(b)];
    for (std::int64_t s = 0; s < len; ++s) grown[ix(b * S2 + s)] = tokens[ix(b * S + s)];
    for (std::int64_t t = 0; t < T; ++t) grown[ix(b * S2 + len + t)] = fed[ix(t * B + b)];
    grown_len[ix(b)] = len + T;
  }
  File g;
  cj["seq_len"] = S2;
  cj["lengths"] = grown_len;
  cj.erase("generate");
  auto config = nlohmann::json::parse(*golden.meta("config"));
  config["dropout"] = 0.0;  // generation runs in eval mode
  g.metadata = {{"config", config.dump()}, {"case", cj.dump()}};
  g.add<std::int64_t>("input.tokens", {B, S2}, grown.data(), grown.size());
  g.add<std::int64_t>("input.lengths", {B}, grown_len.data(), grown_len.size());
  for (const auto& t : golden.tensors) {
    if (t.name.starts_with("param."))
      g.add(t.name, t.dtype, t.shape, t.data().data(), t.data().size());
  }
  const bool shifted = mut == Mutation::generation_position_off_by_one;
  const File r = run(g, shifted ? Mutation::none : mut, false,
                     shifted ? lengths : std::vector<std::int64_t>{});
  const auto* lm = r.find("act.lm_logits");
  const std::int64_t V = cfg.embeddings.vocab_size;
  const auto lm_bytes = lm->data();
  const std::size_t elem = lm_bytes.size() / ix(B * S2 * V);
  File out;
  std::vector<std::uint8_t> step(ix(B * V) * elem);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t b = 0; b < B; ++b) {
      const std::size_t from = ix((b * S2 + lengths[ix(b)] + t) * V) * elem;
      std::memcpy(step.data() + ix(b * V) * elem, lm_bytes.data() + from, ix(V) * elem);
    }
    out.add("act.generate." + std::to_string(t) + ".logits", lm->dtype, {B, V}, step.data(),
            step.size());
  }
  return out;
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
    case Mutation::layer_norm_backward_no_mean:
      return "layer_norm_backward_no_mean";
    case Mutation::softmax_backward_no_row_sum:
      return "softmax_backward_no_row_sum";
    case Mutation::kv_heads_tiled:
      return "kv_heads_tiled";
    case Mutation::rope_other_convention:
      return "rope_other_convention";
    case Mutation::rope_bf16_positions:
      return "rope_bf16_positions";
    case Mutation::window_one_wider:
      return "window_one_wider";
    case Mutation::alibi_sign_flipped:
      return "alibi_sign_flipped";
    case Mutation::softcap_after_mask:
      return "softcap_after_mask";
    case Mutation::decoder_not_causal:
      return "decoder_not_causal";
    case Mutation::labels_not_shifted:
      return "labels_not_shifted";
    case Mutation::generation_position_off_by_one:
      return "generation_position_off_by_one";
    case Mutation::token_types_ignored:
      return "token_types_ignored";
    case Mutation::embedding_norm_after_dropout:
      return "embedding_norm_after_dropout";
    case Mutation::pooler_without_tanh:
      return "pooler_without_tanh";
    case Mutation::patches_hwc_flattened:
      return "patches_hwc_flattened";
    case Mutation::cls_token_appended:
      return "cls_token_appended";
    case Mutation::tied_head_grad_dropped:
      return "tied_head_grad_dropped";
    case Mutation::sink_column_kept:
      return "sink_column_kept";
  }
  return "?";
}

File naive_forward(const File& golden, Mutation m) {
  return run(golden, m, false);
}

File naive_candidate(const File& golden, Mutation m) {
  return run(golden, m, true);
}

}  // namespace teo::testing
