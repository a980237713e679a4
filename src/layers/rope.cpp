#include "teo/layers/rope.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/parallel.hpp"

namespace teo {

namespace {

// YaRN's correction range over the r / 2 frequencies (Hugging Face's find_correction_range,
// truncated): the frequency index at which a dimension makes `rotations` turns over the original
// context.
double correction_dim(double rotations, double r, double base, double original) {
  return r * std::log(original / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

}  // namespace

double yarn_mscale(double factor, double m) {
  return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

double attention_mscale(const ModelConfig& cfg) {
  const RopeScaling& sc = cfg.attention.rope_scaling;
  if (cfg.embeddings.positional != Positional::rope || sc.type != RopeScalingType::yarn ||
      !sc.mscale_all_dim)
    return 1.0;
  const double m = yarn_mscale(sc.factor, *sc.mscale_all_dim);
  return m * m;
}

RopeFrequencies rope_frequencies(const ModelConfig& cfg, index_t seq_end) {
  const index_t r = cfg.rotary();
  const RopeScaling& sc = cfg.attention.rope_scaling;
  const double original = static_cast<double>(sc.original_max_len.value_or(cfg.embeddings.max_len));
  double base = cfg.attention.rope_base;
  if (sc.type == RopeScalingType::ntk) {
    // Dynamic NTK: the base grows once the sequence passes the original context.
    const double len = std::max(static_cast<double>(seq_end), original);
    base *= std::pow(sc.factor * len / original - (sc.factor - 1.0),
                     static_cast<double>(r) / static_cast<double>(r - 2));
  }
  RopeFrequencies f;
  f.inv_freq.resize(static_cast<std::size_t>(r / 2));
  for (index_t i = 0; i < r / 2; ++i) {
    const double theta =
        std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(r));  // base^(-2i/r)
    f.inv_freq[static_cast<std::size_t>(i)] = theta;
  }
  if (sc.type == RopeScalingType::linear) {
    for (double& t : f.inv_freq) t /= sc.factor;
  } else if (sc.type == RopeScalingType::yarn) {
    const auto rd = static_cast<double>(r);
    // the correction range, rounded outwards to whole dimensions unless truncate is false
    double low = correction_dim(sc.beta_fast, rd, base, original);
    double high = correction_dim(sc.beta_slow, rd, base, original);
    if (sc.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, rd - 1.0);
    if (low == high) high += 0.001;
    for (index_t i = 0; i < r / 2; ++i) {
      double& t = f.inv_freq[static_cast<std::size_t>(i)];
      // ramp 0 below the range (extrapolate: keep theta), 1 above it (interpolate: theta / factor)
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      const double extrapolation = 1.0 - ramp;
      t = (t / sc.factor) * (1.0 - extrapolation) + t * extrapolation;
    }
    // Hugging Face's get_mscale(factor, m); DeepSeek's pair of them when both are set
    f.mscale = sc.mscale && sc.mscale_all_dim
                   ? yarn_mscale(sc.factor, *sc.mscale) / yarn_mscale(sc.factor, *sc.mscale_all_dim)
                   : yarn_mscale(sc.factor, 1.0);
  }
  return f;
}

template <class Real>
void rope_table(Real* cos, Real* sin, const ModelConfig& cfg, index_t seq_len) {
  const RopeFrequencies f = rope_frequencies(cfg, cfg.embeddings.position_offset + seq_len);
  const auto half = static_cast<index_t>(f.inv_freq.size());
  for (index_t s = 0; s < seq_len; ++s) {
    const auto p = static_cast<double>(cfg.embeddings.position_offset + s);  // exact: p <= 2^41
    for (index_t i = 0; i < half; ++i) {
      const double angle = p * f.inv_freq[static_cast<std::size_t>(i)];
      cos[s * half + i] = static_cast<Real>(std::cos(angle) * f.mscale);
      sin[s * half + i] = static_cast<Real>(std::sin(angle) * f.mscale);
    }
  }
}

namespace {

// Applies the rotation with sign `dir` (+1 forward, -1 its inverse) to every row.
template <class Real>
void rotate(Real* out, const Real* x, const Real* cos, const Real* sin, index_t rows,
            index_t seq_len, index_t d_head, index_t r, RopeStyle style, Real dir) {
  const index_t half = r / 2;
  detail::for_blocks(rows, 1, [&](index_t r0, index_t r1) {
    for (index_t row = r0; row < r1; ++row)
      for (index_t s = 0; s < seq_len; ++s) {
        const Real* xi = x + (row * seq_len + s) * d_head;
        Real* o = out + (row * seq_len + s) * d_head;
        for (index_t i = 0; i < half; ++i) {
          const index_t a = style == RopeStyle::neox ? i : 2 * i;
          const index_t b = style == RopeStyle::neox ? i + half : 2 * i + 1;
          const Real c = cos[s * half + i], sn = dir * sin[s * half + i];
          const Real xa = xi[a], xb = xi[b];
          o[a] = xa * c - xb * sn;
          o[b] = xb * c + xa * sn;
        }
        for (index_t j = r; j < d_head; ++j) o[j] = xi[j];
      }
  });
}

}  // namespace

template <class Real>
void rope_forward(Real* out, const Real* x, const Real* cos, const Real* sin, index_t rows,
                  index_t seq_len, index_t d_head, index_t rotary_dim, RopeStyle style) {
  rotate(out, x, cos, sin, rows, seq_len, d_head, rotary_dim, style, Real(1));
}

template <class Real>
void rope_backward(Real* dx, const Real* dout, const Real* cos, const Real* sin, index_t rows,
                   index_t seq_len, index_t d_head, index_t rotary_dim, RopeStyle style) {
  rotate(dx, dout, cos, sin, rows, seq_len, d_head, rotary_dim, style, Real(-1));
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void rope_table<Real>(Real*, Real*, const ModelConfig&, index_t);                       \
  template void rope_forward<Real>(Real*, const Real*, const Real*, const Real*, index_t, index_t, \
                                   index_t, index_t, RopeStyle);                                   \
  template void rope_backward<Real>(Real*, const Real*, const Real*, const Real*, index_t,         \
                                    index_t, index_t, index_t, RopeStyle);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
