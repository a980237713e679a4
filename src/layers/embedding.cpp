#include "teo/layers/embedding.hpp"

#include "kernels/parallel.hpp"

namespace teo {

template <class Real>
void embedding_forward(Real* out, const std::int64_t* tokens, const Real* weight, index_t n,
                       index_t d, Real scale) {
  detail::for_blocks(n, 64, [&](index_t t0, index_t t1) {
    for (index_t t = t0; t < t1; ++t) {
      const Real* row = weight + tokens[t] * d;  // (D)
      Real* o = out + t * d;                     // (D)
      for (index_t c = 0; c < d; ++c) o[c] = row[c] * scale;
    }
  });
}

template <class Real>
void embedding_backward(Real* dweight, const Real* dout, const std::int64_t* tokens, index_t n,
                        index_t d, Real scale, std::int64_t padding_idx) {
  // in the forward pass this was: out[t] = weight[tokens[t]] * scale
  for (index_t t = 0; t < n; ++t) {
    if (tokens[t] == padding_idx) continue;
    Real* drow = dweight + tokens[t] * d;
    const Real* g = dout + t * d;
    for (index_t c = 0; c < d; ++c) drow[c] += g[c] * scale;
  }
}

#define TEO_INSTANTIATE(Real)                                                                      \
  template void embedding_forward<Real>(Real*, const std::int64_t*, const Real*, index_t, index_t, \
                                        Real);                                                     \
  template void embedding_backward<Real>(Real*, const Real*, const std::int64_t*, index_t,         \
                                         index_t, Real, std::int64_t);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
