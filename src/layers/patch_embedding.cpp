#include "teo/layers/patch_embedding.hpp"

#include <algorithm>
#include <vector>

#include "teo/layers/linear.hpp"

namespace teo {

namespace {

// Calls f(col, pix) for each run of P pixels: row i of channel c of patch (py, px) of image b,
// at offset col of the patches and offset pix of the pixels.
template <class F>
void for_patch_rows(const PatchDims& d, F&& f) {
  const index_t G = d.grid(), Np = d.patches(), K = d.patch_len();
  for (index_t b = 0; b < d.B; ++b)
    for (index_t py = 0; py < G; ++py)
      for (index_t px = 0; px < G; ++px)
        for (index_t c = 0; c < d.Ch; ++c)
          for (index_t i = 0; i < d.P; ++i)
            f((b * Np + py * G + px) * K + (c * d.P + i) * d.P,
              ((b * d.Ch + c) * d.Img + py * d.P + i) * d.Img + px * d.P);
}

}  // namespace

template <class Real>
void im2col_patches(Real* cols, const Real* pixels, const PatchDims& d) {
  for_patch_rows(d, [&](index_t col, index_t pix) {
    std::copy(pixels + pix, pixels + pix + d.P, cols + col);
  });
}

template <class Real>
void col2im_patches(Real* pixels, const Real* cols, const PatchDims& d) {
  for_patch_rows(
      d, [&](index_t col, index_t pix) { std::copy(cols + col, cols + col + d.P, pixels + pix); });
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
void patch_embedding_backward(Real* dpixels, Real* dweight, Real* dbias, Real* dcls,
                              const Real* dout, const Real* pixels, const Real* weight,
                              const PatchDims& d) {
  const index_t Np = d.patches(), K = d.patch_len(), D = d.D;
  std::vector<Real> cols(static_cast<std::size_t>(d.B * Np * K));
  std::vector<Real> de(static_cast<std::size_t>(d.B * Np * D));
  im2col_patches(cols.data(), pixels, d);
  for (index_t b = 0; b < d.B; ++b) {
    const Real* img = dout + b * (1 + Np) * D;
    for (index_t j = 0; j < D; ++j) dcls[j] += img[j];
    std::copy(img + D, img + (1 + Np) * D, de.data() + b * Np * D);
  }
  // dcols = dE W (with dpixels only), dweight += dE^T cols, dbias += the column sums of dE
  std::vector<Real> dcols(dpixels ? cols.size() : 0);
  linear_backward(dpixels ? dcols.data() : nullptr, dweight, dbias, de.data(), cols.data(), weight,
                  d.B * Np, K, D, GradWrite::overwrite);
  if (dpixels) col2im_patches(dpixels, dcols.data(), d);
}

#define TEO_INSTANTIATE(Real)                                                               \
  template void im2col_patches<Real>(Real*, const Real*, const PatchDims&);                 \
  template void col2im_patches<Real>(Real*, const Real*, const PatchDims&);                 \
  template void patch_embedding_forward<Real>(Real*, const Real*, const Real*, const Real*, \
                                              const Real*, const PatchDims&);               \
  template void patch_embedding_backward<Real>(Real*, Real*, Real*, Real*, const Real*,     \
                                               const Real*, const Real*, const PatchDims&);
TEO_INSTANTIATE(float)
TEO_INSTANTIATE(double)

}  // namespace teo
