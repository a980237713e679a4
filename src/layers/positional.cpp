#include "teo/layers/positional.hpp"

#include <cmath>

namespace teo {

template <class Real>
void sinusoidal_table(Real* out, index_t seq_len, index_t d, index_t offset) {
  for (index_t pos = 0; pos < seq_len; ++pos) {
    for (index_t c = 0; c < d; ++c) {
      const index_t two_i = c - (c % 2);
      const double denom = std::pow(10000.0, static_cast<double>(two_i) / static_cast<double>(d));
      const double angle = static_cast<double>(offset + pos) / denom;
      out[pos * d + c] = static_cast<Real>(c % 2 == 0 ? std::sin(angle) : std::cos(angle));
    }
  }
}

template <class Real>
void add_positional_forward(Real* out, const Real* in, const Real* pe, index_t batch,
                            index_t seq_len, index_t d) {
  for (index_t b = 0; b < batch; ++b)
    for (index_t s = 0; s < seq_len; ++s)
      for (index_t c = 0; c < d; ++c) {
        const index_t i = (b * seq_len + s) * d + c;
        out[i] = in[i] + pe[s * d + c];
      }
}

template <class Real>
void add_positional_backward(Real* dpe, const Real* dout, index_t batch, index_t seq_len,
                             index_t d) {
  // in the forward pass this was: out[b, s] = in[b, s] + pe[s]
  for (index_t b = 0; b < batch; ++b)
    for (index_t s = 0; s < seq_len; ++s)
      for (index_t c = 0; c < d; ++c) dpe[s * d + c] += dout[(b * seq_len + s) * d + c];
}

#define TEO_INSTANTIATE(Real)                                                                   \
  template void sinusoidal_table<Real>(Real*, index_t, index_t, index_t);                       \
  template void add_positional_forward<Real>(Real*, const Real*, const Real*, index_t, index_t, \
                                             index_t);                                          \
  template void add_positional_backward<Real>(Real*, const Real*, index_t, index_t, index_t);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
