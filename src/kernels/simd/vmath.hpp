// exp, erf and tanh written once over Vec, from +, -, *, /, fma, sqrt, select and exact power of
// two scaling only, so every ISA (and the scalar fallback) produces the same bits. Only for
// inclusion by the per-ISA translation units.
#pragma once

#include <array>
#include <limits>

#include "vec.hpp"

namespace teo::simd {
namespace {

template <class Real>
struct MathConst;

// float: Taylor degree 7 for e^r on |r| <= ln2 / 2 (truncation 5e-9 < 2^-24); erf by its
// Maclaurin series (22 terms) on |x| <= 2 and 1 - erfc by a 16-term continued fraction above.
template <>
struct MathConst<float> {
  static constexpr int exp_degree = 7;
  static constexpr int erf_terms = 22;
  static constexpr int erfc_terms = 16;
  static constexpr float exp_hi = 88.72283172607421875f;  // above: +inf
  static constexpr float exp_lo = -103.972076416015625f;  // below: 0 (under the least subnormal)
  static constexpr float ln2_hi = 0.693145751953125f;
  static constexpr float ln2_lo = 1.428606765330187e-06f;
  static constexpr float erf_one = 4.0f;  // erf(x) rounds to 1 beyond this
};

// double: Taylor degree 13 (truncation 4e-18); erf series 30 terms on |x| <= 2 (error < 6e-16),
// continued fraction 40 terms above (error < 3e-16).
template <>
struct MathConst<double> {
  static constexpr int exp_degree = 13;
  static constexpr int erf_terms = 30;
  static constexpr int erfc_terms = 40;
  static constexpr double exp_hi = 709.782712893383973096;
  static constexpr double exp_lo = -745.1332191019411;
  static constexpr double ln2_hi = 6.93147180369123816490e-01;
  static constexpr double ln2_lo = 1.90821492927058770002e-10;
  static constexpr double erf_one = 6.0;
};

template <class Real, class Arch>
struct Math {
  using V = Vec<Real, Arch>;
  using B = typename V::B;
  using C = MathConst<Real>;

  // Round to the nearest integer, ties to even, for |x| < 2^22 (float) / 2^51 (double).
  static B round(const B& x) {
    const B m = V::set1(Bits<Real>::magic);
    return (x + m) - m;
  }

  static B exp(const B& x_in) {
    const B x = V::select(x_in > V::set1(C::exp_hi), V::set1(C::exp_hi),
                          V::select(x_in < V::set1(C::exp_lo), V::set1(C::exp_lo), x_in));
    const B n = round(x * V::set1(static_cast<Real>(1.4426950408889634)));
    B r = V::fma(-n, V::set1(C::ln2_hi), x);
    r = V::fma(-n, V::set1(C::ln2_lo), r);
    // Horner from the highest Taylor coefficient 1/k!.
    static constexpr auto coef = [] {
      std::array<Real, C::exp_degree + 1> c{};
      c[0] = 1;
      for (int k = 1; k <= C::exp_degree; ++k) c[k] = c[k - 1] / static_cast<Real>(k);
      return c;
    }();
    B p = V::set1(coef[C::exp_degree]);
#pragma GCC unroll 64
    for (int k = C::exp_degree - 1; k >= 0; --k) p = V::fma(p, r, V::set1(coef[k]));
    // 2^n in two normal halves, so that subnormal results are rounded once, correctly.
    const B n1 = round(n * V::set1(Real(0.5)));
    const B n2 = n - n1;
    B y = (p * V::pow2n(n1)) * V::pow2n(n2);
    y = V::select(x_in > V::set1(C::exp_hi), V::set1(std::numeric_limits<Real>::infinity()), y);
    y = V::select(x_in < V::set1(C::exp_lo), V::set1(Real(0)), y);
    return V::select(V::isnan(x_in), x_in, y);  // NaN stays NaN
  }

  static B erf(const B& x) {
    const B z = V::select(x < V::set1(Real(0)), -x, x);
    // Series: erf(z) = 2/sqrt(pi) * sum_n (-1)^n z^(2n+1) / (n! (2n+1)), Horner in z^2.
    const B z2 = z * z;
    static constexpr auto coef = [] {
      std::array<Real, C::erf_terms> c{};
      double fact = 1;
      for (int n = 0; n < C::erf_terms; ++n) {
        if (n > 0) fact *= n;
        c[n] = static_cast<Real>((n % 2 ? -1.0 : 1.0) / (fact * (2 * n + 1)));
      }
      return c;
    }();
    B s = V::set1(coef[C::erf_terms - 1]);
#pragma GCC unroll 64
    for (int n = C::erf_terms - 2; n >= 0; --n) s = V::fma(s, z2, V::set1(coef[n]));
    const B series = z * s * V::set1(static_cast<Real>(1.1283791670955126));  // 2 / sqrt(pi)
    B r = series;
    // Continued fraction: erfc(z) = exp(-z^2) / (sqrt(pi) t), t = z + (1/2)/(z + 1/(z + ...)),
    // the k-th partial numerator being k/2. Its last convergent P/Q comes from the forward
    // recurrence P_k = z P_(k-1) + (k/2) P_(k-2) (Q alike): only positive terms, so no
    // cancellation, and a single division instead of one per term. z is clamped to [1, erf_one]
    // (beyond, the result is 1 anyway) so that P and Q stay finite. Skipped when no lane needs it:
    // the selected values are the same either way.
    const auto far = z > V::set1(Real(2));
    if (V::any(far)) {
      const B zc = V::select(z < V::set1(Real(1)), V::set1(Real(1)),
                             V::select(z > V::set1(C::erf_one), V::set1(C::erf_one), z));
      B p_prev = V::set1(Real(1)), p = zc, q_prev = V::set1(Real(0)), q = V::set1(Real(1));
#pragma GCC unroll 64
      for (int k = 1; k <= C::erfc_terms; ++k) {
        const B a = V::set1(static_cast<Real>(0.5 * k));
        const B p_next = V::fma(zc, p, a * p_prev), q_next = V::fma(zc, q, a * q_prev);
        p_prev = p;
        p = p_next;
        q_prev = q;
        q = q_next;
      }
      // erfc = exp(-z^2) q / (sqrt(pi) p)
      const B erfc =
          V::div(exp(-(zc * zc)) * q, p * V::set1(static_cast<Real>(1.7724538509055160)));
      r = V::select(far, V::set1(Real(1)) - erfc, series);
    }
    r = V::select(z > V::set1(C::erf_one), V::set1(Real(1)), r);
    r = V::select(x < V::set1(Real(0)), -r, r);
    return V::select(V::isnan(x), x, r);
  }

  // tanh(y) = 1 - 2 / (e^(2y) + 1): exact limits +-1, absolute error a few ulp of 1.
  static B tanh(const B& y) {
    const B e = exp(y + y);
    const B t = V::set1(Real(1)) - V::div(V::set1(Real(2)), e + V::set1(Real(1)));
    return V::select(V::isnan(y), y, t);
  }
};

}  // namespace
}  // namespace teo::simd
