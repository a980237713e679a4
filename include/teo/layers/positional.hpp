// Positional encodings.
#pragma once

#include "teo/errors.hpp"

namespace teo {

// The sinusoidal table, computed in double and rounded once to Real:
//   PE(pos, 2i) = sin(pos / 10000^(2i / D)),  PE(pos, 2i + 1) = cos(pos / 10000^(2i / D)).
// An odd D ends with a sin column. out (S, D) holds positions offset .. offset + S - 1.
template <class Real>
void sinusoidal_table(Real* out, index_t seq_len, index_t d, index_t offset = 0);

// out[b, s, :] = in[b, s, :] + pe[s, :]. out, in (B, S, D); pe (S, D). out may alias in.
template <class Real>
void add_positional_forward(Real* out, const Real* in, const Real* pe, index_t batch,
                            index_t seq_len, index_t d);

// Accumulates dpe[s, :] += sum over b of dout[b, s, :] (b increasing). dpe (S, D).
template <class Real>
void add_positional_backward(Real* dpe, const Real* dout, index_t batch, index_t seq_len,
                             index_t d);

}  // namespace teo
