// Dropout with masks from the counter-based generator (teo/rng.hpp).
#pragma once

#include <cstdint>
#include <string_view>

#include "teo/errors.hpp"
#include "teo/kernels.hpp"

namespace teo {

// mask[i] = 1 (kept) iff uniform01(seed, stream_id(site), i) >= p, else 0. mask (n).
void dropout_mask(std::uint8_t* mask, index_t n, std::uint64_t seed, std::string_view site,
                  double p);

// The scale applied to kept values: 1 / (1 - p), computed in double and rounded to Real.
template <class Real>
Real dropout_scale(double p);

// out[i] = mask[i] ? in[i] * scale : 0. out may alias in.
template <class Real>
void dropout_forward(Real* out, const Real* in, const std::uint8_t* mask, index_t n, Real scale);

// Accumulates din[i] += mask[i] ? dout[i] * scale : 0. With write == overwrite,
// din[i] = mask[i] ? 0 + dout[i] * scale : +0 (din is never read).
template <class Real>
void dropout_backward(Real* din, const Real* dout, const std::uint8_t* mask, index_t n, Real scale,
                      GradWrite write = GradWrite::accumulate);

}  // namespace teo
