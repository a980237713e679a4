// The vector kernels of the non-GEMM stages, written once over Vec. Reductions use 16 fixed lanes
// (element j goes to lane j mod 16, lanes combine by a fixed tree), whatever the vector width, so
// every ISA produces the same bits. Only for inclusion by the per-ISA translation units.
#pragma once

#include "isa.hpp"
#include "vmath.hpp"

namespace teo::simd {
namespace {

constexpr int kLanes = 16;

// sum over j < n of term(j), where term is a generic lambda called as
// term.template operator()<VV>(j) and returns VV::B for the VV::size elements starting at j.
template <class Real, class Arch, class F>
Real lane_sum(index_t n, const F& term) {
  using V = Vec<Real, Arch>;
  using S = Vec<Real, scalar_arch>;
  constexpr int W = static_cast<int>(V::size);
  constexpr int NA = kLanes / W;
  static_assert(kLanes % W == 0, "vector width must divide the lane count");
  typename V::B acc[NA];
  for (int a = 0; a < NA; ++a) acc[a] = V::set1(Real(0));
  const index_t full = n - n % kLanes;
  for (index_t j = 0; j < full; j += kLanes)
    for (int a = 0; a < NA; ++a) acc[a] = acc[a] + term.template operator()<V>(j + a * W);
  if (full == n) {
    // The same tree in registers: strides of whole vectors first, then fold's halving.
    for (int s = NA / 2; s >= 1; s /= 2)
      for (int a = 0; a < s; ++a) acc[a] = acc[a] + acc[a + s];
    return fold<Real, Arch>(acc[0], [](auto x, auto y) { return x + y; });
  }
  alignas(64) Real lanes[kLanes];
  for (int a = 0; a < NA; ++a) V::store(lanes + a * W, acc[a]);
  for (index_t j = full; j < n; ++j)
    lanes[j - full] = lanes[j - full] + term.template operator()<S>(j);
  for (int stride = kLanes / 2; stride >= 1; stride /= 2)
    for (int i = 0; i < stride; ++i) lanes[i] = lanes[i] + lanes[i + stride];
  return lanes[0];
}

// for j in [0, n): op.template operator()<VV>(j) on full vectors, then the scalar tail.
template <class Real, class Arch, class F>
void for_each_vec(index_t n, const F& op) {
  using V = Vec<Real, Arch>;
  constexpr index_t W = static_cast<index_t>(V::size);
  const index_t full = n - n % W;
  for (index_t j = 0; j < full; j += W) op.template operator()<V>(j);
  for (index_t j = full; j < n; ++j) op.template operator()<Vec<Real, scalar_arch>>(j);
}

// for_each_vec for the long element-wise formulas (GELU's erf): kWide vectors at a time in
// lockstep (multi in vec.hpp), then single vectors, then the scalar tail; the same bits as
// for_each_vec.
constexpr int kWide = 4;
template <class Real, class Arch, class F>
void for_each_vec_wide(index_t n, const F& op) {
  using V = Vec<Real, multi<Arch, kWide>>;
  constexpr index_t WW = static_cast<index_t>(V::size);
  const index_t wide = n - n % WW;
  for (index_t j = 0; j < wide; j += WW) op.template operator()<V>(j);
  for_each_vec<Real, Arch>(n - wide,
                           [&]<class VV>(index_t j) { op.template operator()<VV>(wide + j); });
}

template <class Real, class Arch>
struct Kernels {
  template <class VV>
  using M = Math<Real, typename VV::arch>;

  // out = act(in) element-wise, in the reference's operation order.
  static void activation_forward(Real* out, const Real* in, index_t n, Activation act) {
    for_each_vec_wide<Real, Arch>(n, [&]<class VV>(index_t j) {
      using B = typename VV::B;
      const B x = VV::load(in + j);
      const B half = VV::set1(Real(0.5)), one = VV::set1(Real(1));
      B y;
      if (act == Activation::relu) {
        y = VV::select(VV::isnan(x), x, VV::select(x > VV::set1(Real(0)), x, VV::set1(Real(0))));
      } else if (act == Activation::gelu) {
        y = half * x * (one + M<VV>::erf(x * VV::set1(static_cast<Real>(0.70710678118654752440))));
      } else if (act == Activation::silu) {
        y = VV::div(x, one + M<VV>::exp(-x));
      } else {
        const B inner = VV::set1(static_cast<Real>(0.79788456080286535588)) *
                        (x + VV::set1(static_cast<Real>(0.044715)) * x * x * x);
        y = half * x * (one + M<VV>::tanh(inner));
      }
      VV::store(out + j, y);
    });
  }

  // din += act'(in) * dout, with relu'(0) = 0; without `accumulate`, din = +0 + act'(in) * dout
  // (din is not read).
  static void activation_backward(Real* din, const Real* dout, const Real* in, index_t n,
                                  Activation act, bool accumulate) {
    for_each_vec_wide<Real, Arch>(n, [&]<class VV>(index_t j) {
      using B = typename VV::B;
      const B x = VV::load(in + j);
      const B half = VV::set1(Real(0.5)), one = VV::set1(Real(1));
      B g;
      if (act == Activation::relu) {
        g = VV::select(x > VV::set1(Real(0)), one, VV::set1(Real(0)));
      } else if (act == Activation::gelu) {
        const B cdf =
            half * (one + M<VV>::erf(x * VV::set1(static_cast<Real>(0.70710678118654752440))));
        const B pdf =
            VV::set1(static_cast<Real>(0.39894228040143267794)) * M<VV>::exp(-(half * x * x));
        g = cdf + x * pdf;
      } else if (act == Activation::silu) {
        const B sig = VV::div(one, one + M<VV>::exp(-x));
        g = sig * (one + x * (one - sig));
      } else {
        const B k0 = VV::set1(static_cast<Real>(0.79788456080286535588));
        const B t = M<VV>::tanh(k0 * (x + VV::set1(static_cast<Real>(0.044715)) * x * x * x));
        g = half * (one + t) + half * x * (one - t * t) * k0 *
                                   (one + VV::set1(static_cast<Real>(3 * 0.044715)) * x * x);
      }
      const B base = accumulate ? VV::load(din + j) : VV::set1(Real(0));
      VV::store(din + j, base + g * VV::load(dout + j));
    });
  }

  // One attention row: probs over the nv visible keys (the rest 0), from scores.
  static void softmax_forward_row(Real* prow, const Real* srow, index_t nv, index_t n) {
    for (index_t j = nv; j < n; ++j) prow[j] = Real(0);
    if (nv == 0) return;
    // The maximum by the rule m = s > m ? s : m from m = srow[0]: every lane starts from srow[0]
    // and the lanes combine by the same rule, which gives the serial loop's value in any order
    // (a NaN in srow[0] stays; any later NaN is skipped), up to the sign of a zero maximum, which
    // no result sees: s - (+0) and s - (-0) have the same exp.
    using V = Vec<Real, Arch>;
    constexpr index_t W = static_cast<index_t>(V::size);
    typename V::B vm = V::set1(srow[0]);
    const index_t full = nv - nv % W;
    for (index_t j = 0; j < full; j += W) {
      const typename V::B x = V::load(srow + j);
      vm = V::select(x > vm, x, vm);
    }
    // The lanes are all NaN (from a NaN srow[0]) or none is, so any order of combining them
    // gives the serial loop's maximum.
    const Real lanes_max = fold<Real, Arch>(vm, [](auto x, auto y) { return y > x ? y : x; });
    Real mx = lanes_max > srow[0] ? lanes_max : srow[0];
    for (index_t j = full; j < nv; ++j) mx = srow[j] > mx ? srow[j] : mx;
    for_each_vec<Real, Arch>(nv, [&]<class VV>(index_t j) {
      VV::store(prow + j, M<VV>::exp(VV::load(srow + j) - VV::set1(mx)));
    });
    const Real sum =
        lane_sum<Real, Arch>(nv, [&]<class VV>(index_t j) { return VV::load(prow + j); });
    const Real inv = Real(1) / sum;
    for_each_vec<Real, Arch>(
        nv, [&]<class VV>(index_t j) { VV::store(prow + j, VV::load(prow + j) * VV::set1(inv)); });
  }

  // dscores = probs * (dprobs - sum_j probs * dprobs), exactly 0 where probs is 0.
  static void softmax_backward_row(Real* dsrow, const Real* prow, const Real* dprow, index_t n) {
    const Real dot = lane_sum<Real, Arch>(
        n, [&]<class VV>(index_t j) { return VV::load(prow + j) * VV::load(dprow + j); });
    for_each_vec<Real, Arch>(n, [&]<class VV>(index_t j) {
      const auto p = VV::load(prow + j);
      VV::store(dsrow + j, VV::select(p == VV::set1(Real(0)), VV::set1(Real(0)),
                                      p * (VV::load(dprow + j) - VV::set1(dot))));
    });
  }

  static void layer_norm_forward_row(Real* y, Real* mean, Real* rstd, const Real* x, const Real* w,
                                     const Real* b, index_t cols, Real eps) {
    const Real m =
        lane_sum<Real, Arch>(cols, [&]<class VV>(index_t j) { return VV::load(x + j); }) /
        static_cast<Real>(cols);
    const Real v = lane_sum<Real, Arch>(cols,
                                        [&]<class VV>(index_t j) {
                                          const auto d = VV::load(x + j) - VV::set1(m);
                                          return d * d;
                                        }) /
                   static_cast<Real>(cols);
    const Real s = Real(1) / std::sqrt(v + eps);
    for_each_vec<Real, Arch>(cols, [&]<class VV>(index_t j) {
      VV::store(y + j,
                (VV::load(x + j) - VV::set1(m)) * VV::set1(s) * VV::load(w + j) + VV::load(b + j));
    });
    *mean = m;
    *rstd = s;
  }

  // dx += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm = g * w.
  // dx += the row's input gradient; without `accumulate`, dx = +0 + it (dx is not read).
  static void layer_norm_backward_row(Real* dx, const Real* g, const Real* x, const Real* w, Real m,
                                      Real s, index_t cols, bool accumulate) {
    const Real dmean =
        lane_sum<Real, Arch>(
            cols, [&]<class VV>(index_t j) { return VV::load(g + j) * VV::load(w + j); }) /
        static_cast<Real>(cols);
    const Real dnmean = lane_sum<Real, Arch>(cols,
                                             [&]<class VV>(index_t j) {
                                               const auto norm =
                                                   (VV::load(x + j) - VV::set1(m)) * VV::set1(s);
                                               return VV::load(g + j) * VV::load(w + j) * norm;
                                             }) /
                        static_cast<Real>(cols);
    for_each_vec<Real, Arch>(cols, [&]<class VV>(index_t j) {
      const auto norm = (VV::load(x + j) - VV::set1(m)) * VV::set1(s);
      const auto dnorm = VV::load(g + j) * VV::load(w + j);
      const auto base = accumulate ? VV::load(dx + j) : VV::set1(Real(0));
      VV::store(dx + j, base + (dnorm - VV::set1(dmean) - norm * VV::set1(dnmean)) * VV::set1(s));
    });
  }

  // dw[c] += sum over rows (in order) of g * norm; db[c] += sum of g; for columns [c0, c1).
  static void layer_norm_param_grads(Real* dw, Real* db, const Real* g, const Real* x,
                                     const Real* mean, const Real* rstd, index_t rows, index_t cols,
                                     index_t c0, index_t c1) {
    for (index_t r = 0; r < rows; ++r) {
      const Real* gr = g + r * cols + c0;
      const Real* xr = x + r * cols + c0;
      const Real m = mean[r], s = rstd[r];
      for_each_vec<Real, Arch>(c1 - c0, [&]<class VV>(index_t j) {
        const auto gv = VV::load(gr + j);
        VV::store(dw + c0 + j,
                  VV::load(dw + c0 + j) + gv * ((VV::load(xr + j) - VV::set1(m)) * VV::set1(s)));
        VV::store(db + c0 + j, VV::load(db + c0 + j) + gv);
      });
    }
  }

  static void math(Real* out, const Real* in, index_t n, MathFn fn) {
    for_each_vec<Real, Arch>(n, [&]<class VV>(index_t j) {
      const auto x = VV::load(in + j);
      VV::store(out + j, fn == MathFn::exp   ? M<VV>::exp(x)
                         : fn == MathFn::erf ? M<VV>::erf(x)
                                             : M<VV>::tanh(x));
    });
  }

  // acc = acc * x + y in each chain: x = 1 - 2^-10 and y = 2^-10 are exact in every type and keep
  // the values near 1 (no overflow, no subnormals, which would slow some cores).
  static Real fma_chains(std::int64_t iters) {
    using V = Vec<Real, Arch>;
    using B = typename V::B;
    B acc[kPeakChains];
#pragma GCC unroll 16
    for (int c = 0; c < kPeakChains; ++c) acc[c] = V::set1(Real(1) + Real(c) / Real(64));
    const B x = V::set1(Real(1) - Real(1) / Real(1024)), y = V::set1(Real(1) / Real(1024));
    for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
      for (int c = 0; c < kPeakChains; ++c) acc[c] = V::fma(acc[c], x, y);
    }
    alignas(64) Real out[V::size];
    Real sum = 0;
#pragma GCC unroll 16
    for (int c = 0; c < kPeakChains; ++c) {
      V::store(out, acc[c]);
      for (std::size_t l = 0; l < V::size; ++l) sum += out[l];
    }
    return sum;
  }

  static constexpr VectorKernels<Real> table() {
    return VectorKernels<Real>{&activation_forward,
                               &activation_backward,
                               &softmax_forward_row,
                               &softmax_backward_row,
                               &layer_norm_forward_row,
                               &layer_norm_backward_row,
                               &layer_norm_param_grads,
                               &math,
                               &fma_chains,
                               static_cast<int>(Vec<Real, Arch>::size)};
  }
};

}  // namespace
}  // namespace teo::simd
