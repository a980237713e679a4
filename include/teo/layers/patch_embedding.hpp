// ViT's patch embedding (docs/semantics.md, section 18.5): a Conv2d of kernel and stride P is a
// linear map of each flattened patch, and the learned [CLS] token is prepended.
#pragma once

#include "teo/errors.hpp"

namespace teo {

// The sizes of one call: B images of Ch channels, Img x Img pixels, cut into (Img / P)^2 patches,
// projected to D.
struct PatchDims {
  index_t B = 0, Ch = 0, Img = 0, P = 0, D = 0;
  index_t grid() const { return Img / P; }             // patches per row and per column
  index_t patches() const { return grid() * grid(); }  // Np
  index_t patch_len() const { return Ch * P * P; }     // K, a flattened patch's length
};

// cols (B Np, K): row b Np + (py G + px) holds the patch at (py, px) of image b, flattened in
// (Ch, P, P) order, as Conv2d's weight (D, Ch, P, P) is; pixels (B, Ch, Img, Img).
template <class Real>
void im2col_patches(Real* cols, const Real* pixels, const PatchDims& d);
// The inverse: each row of cols put back at its patch's pixels (overwritten).
template <class Real>
void col2im_patches(Real* pixels, const Real* cols, const PatchDims& d);

// out (B, 1 + Np, D): row 0 of each image is cls (D), row 1 + n the linear map of patch n,
// cols W^T + bias, with W (D, K) the weight (D, Ch, P, P) and bias (D).
template <class Real>
void patch_embedding_forward(Real* out, const Real* pixels, const Real* weight, const Real* bias,
                             const Real* cls, const PatchDims& d);

// Accumulates dweight (D, Ch, P, P) += dE^T cols, dbias (D) += the column sums of dE and dcls (D)
// += the sum over the batch of dout's row 0, in increasing b; dE (B Np, D) is dout (B, 1 + Np,
// D) without row 0. With dpixels (else null, as in the model, whose pixels are an input), also
// dpixels (B, Ch, Img, Img) = the patches dE W put back in place (overwritten: every pixel is in
// exactly one patch, the stride being the kernel).
template <class Real>
void patch_embedding_backward(Real* dpixels, Real* dweight, Real* dbias, Real* dcls,
                              const Real* dout, const Real* pixels, const Real* weight,
                              const PatchDims& d);

}  // namespace teo
