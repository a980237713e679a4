#include "teo/layers/pooling.hpp"

#include <cmath>

namespace teo {

template <class Real>
void pooling_forward(Real* out, std::int64_t* argmax, const Real* in, const std::int64_t* lengths,
                     index_t batch, index_t seq_len, index_t d, Pooling kind) {
  for (index_t b = 0; b < batch; ++b) {
    const index_t len = lengths[b];
    const Real* x = in + b * seq_len * d;  // (S, D)
    Real* o = out + b * d;                 // (D)
    for (index_t c = 0; c < d; ++c) o[c] = Real(0);
    if (kind == Pooling::max && argmax)
      for (index_t c = 0; c < d; ++c) argmax[b * d + c] = -1;
    if (len == 0) continue;  // pooling over no real token gives 0
    switch (kind) {
      case Pooling::mean: {
        for (index_t s = 0; s < len; ++s)
          for (index_t c = 0; c < d; ++c) o[c] += x[s * d + c];
        const Real inv = Real(1) / static_cast<Real>(len);
        for (index_t c = 0; c < d; ++c) o[c] *= inv;
        break;
      }
      case Pooling::cls:
        for (index_t c = 0; c < d; ++c) o[c] = x[c];
        break;
      case Pooling::max:
        for (index_t c = 0; c < d; ++c) {
          index_t best = 0;
          for (index_t s = 1; s < len; ++s)
            // Strict, so ties keep the first; the first NaN wins, as torch.max propagates NaN.
            if (x[s * d + c] > x[best * d + c] ||
                (std::isnan(x[s * d + c]) && !std::isnan(x[best * d + c])))
              best = s;
          o[c] = x[best * d + c];
          argmax[b * d + c] = best;
        }
        break;
    }
  }
}

template <class Real>
void pooling_backward(Real* din, const Real* dout, const std::int64_t* argmax,
                      const std::int64_t* lengths, index_t batch, index_t seq_len, index_t d,
                      Pooling kind) {
  for (index_t b = 0; b < batch; ++b) {
    const index_t len = lengths[b];
    if (len == 0) continue;
    Real* dx = din + b * seq_len * d;
    const Real* g = dout + b * d;
    switch (kind) {
      case Pooling::mean: {
        // in the forward pass this was: out = sum_{s < len} x[s] * (1 / len)
        const Real inv = Real(1) / static_cast<Real>(len);
        for (index_t s = 0; s < len; ++s)
          for (index_t c = 0; c < d; ++c) dx[s * d + c] += g[c] * inv;
        break;
      }
      case Pooling::cls:
        for (index_t c = 0; c < d; ++c) dx[c] += g[c];
        break;
      case Pooling::max:
        for (index_t c = 0; c < d; ++c) dx[argmax[b * d + c] * d + c] += g[c];
        break;
    }
  }
}

#define TEO_INSTANTIATE(Real)                                                                 \
  template void pooling_forward<Real>(Real*, std::int64_t*, const Real*, const std::int64_t*, \
                                      index_t, index_t, index_t, Pooling);                    \
  template void pooling_backward<Real>(Real*, const Real*, const std::int64_t*,               \
                                       const std::int64_t*, index_t, index_t, index_t, Pooling);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
