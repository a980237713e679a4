// Rotary position embedding (RoPE): q and k rotated by their position, pair by pair.
#pragma once

#include <vector>

#include "teo/config.hpp"
#include "teo/errors.hpp"

namespace teo {

// The r / 2 angular frequencies of cfg's RoPE (r = rotary_dim), in float64, with its scaling
// (docs/semantics.md, "RoPE"): theta_i = base^(-2i / r), divided by the factor (linear), with the
// base raised for the sequence end (ntk, Hugging Face's dynamic NTK), or blended between the two
// across the correction range (yarn). seq_end is the last position + 1.
struct RopeFrequencies {
  std::vector<double> inv_freq;  // (r / 2)
  double mscale = 1.0;           // YaRN's attention factor on cos and sin; 1 otherwise
};
RopeFrequencies rope_frequencies(const ModelConfig& cfg, index_t seq_end);

// Hugging Face's YaRN get_mscale(factor, m): 1 for factor <= 1, else 0.1 m ln(factor) + 1.
double yarn_mscale(double factor, double m);
// The attention score scale's multiplier: yarn_mscale(factor, mscale_all_dim)^2 under yarn with
// mscale_all_dim set (DeepSeek-V2/V3's attention, docs/semantics.md 14.12); 1 otherwise.
double attention_mscale(const ModelConfig& cfg);

// cos and sin (S, r / 2) for positions offset .. offset + S - 1: angle p * inv_freq[i] in float64,
// times mscale, rounded once to Real.
template <class Real>
void rope_table(Real* cos, Real* sin, const ModelConfig& cfg, index_t seq_len);

// out = the rotation of x (rows = B * heads, S, Dh): for each pair (a, b) of the style, with
// c, s the table entry of the row's position and pair index,
//   out[a] = x[a] c - x[b] s,  out[b] = x[b] c + x[a] s;
// dimensions >= r are copied. out and x must not alias.
template <class Real>
void rope_forward(Real* out, const Real* x, const Real* cos, const Real* sin, index_t rows,
                  index_t seq_len, index_t d_head, index_t rotary_dim, RopeStyle style);

// dx (overwritten) from dout: the inverse rotation, dx[a] = dout[a] c + dout[b] s,
// dx[b] = dout[b] c - dout[a] s; dimensions >= r are copied.
template <class Real>
void rope_backward(Real* dx, const Real* dout, const Real* cos, const Real* sin, index_t rows,
                   index_t seq_len, index_t d_head, index_t rotary_dim, RopeStyle style);

}  // namespace teo
