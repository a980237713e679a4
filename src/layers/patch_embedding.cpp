#include "teo/layers/patch_embedding.hpp"

#include <algorithm>
#include <vector>

#include "teo/layers/linear.hpp"

namespace teo {

template <class Real>
void im2col_patches(Real* cols, const Real* pixels, const PatchDims& d) {
  const index_t G = d.grid(), Np = d.patches(), K = d.patch_len();
  for (index_t b = 0; b < d.B; ++b) {
    for (index_t py = 0; py < G; ++py) {
      for (index_t px = 0; px < G; ++px) {
        Real* row = cols + (b * Np + py * G + px) * K;
        for (index_t c = 0; c < d.Ch; ++c) {
          for (index_t i = 0; i < d.P; ++i) {
            const Real* src = pixels + ((b * d.Ch + c) * d.Img + py * d.P + i) * d.Img + px * d.P;
            std::copy(src, src + d.P, row + (c * d.P + i) * d.P);
          }
        }
      }
    }
  }
}

template <class Real>
void patch_embedding_forward(Real* out, const Real* pixels, const Real* weight, const Real* bias,
                             const Real* cls, const PatchDims& d) {
  const index_t Np = d.patches(), K = d.patch_len(), D = d.D;
  std::vector<Real> cols(static_cast<std::size_t>(d.B * Np * K));
  std::vector<Real> e(static_cast<std::size_t>(d.B * Np * D));
  im2col_patches(cols.data(), pixels, d);
  linear_forward(e.data(), cols.data(), weight, bias, d.B * Np, K, D);
  for (index_t b = 0; b < d.B; ++b) {
    Real* img = out + b * (1 + Np) * D;
    std::copy(cls, cls + D, img);
    std::copy(e.data() + b * Np * D, e.data() + (b + 1) * Np * D, img + D);
  }
}

template <class Real>
void patch_embedding_backward(Real* dweight, Real* dbias, Real* dcls, const Real* dout,
                              const Real* pixels, const PatchDims& d) {
  const index_t Np = d.patches(), K = d.patch_len(), D = d.D;
  std::vector<Real> cols(static_cast<std::size_t>(d.B * Np * K));
  std::vector<Real> de(static_cast<std::size_t>(d.B * Np * D));
  im2col_patches(cols.data(), pixels, d);
  for (index_t b = 0; b < d.B; ++b) {
    const Real* img = dout + b * (1 + Np) * D;
    for (index_t j = 0; j < D; ++j) dcls[j] += img[j];
    std::copy(img + D, img + (1 + Np) * D, de.data() + b * Np * D);
  }
  linear_backward(static_cast<Real*>(nullptr), dweight, dbias, de.data(), cols.data(),
                  static_cast<const Real*>(nullptr), d.B * Np, K, D);
}

#define TEO_INSTANTIATE(Real)                                                                 \
  template void im2col_patches<Real>(Real*, const Real*, const PatchDims&);                   \
  template void patch_embedding_forward<Real>(Real*, const Real*, const Real*, const Real*,   \
                                              const Real*, const PatchDims&);                 \
  template void patch_embedding_backward<Real>(Real*, Real*, Real*, const Real*, const Real*, \
                                               const PatchDims&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
