// One vector interface over xsimd batches and plain scalars, so every kernel is written once.
// Only for inclusion by the per-ISA translation units.
#pragma once

#include <cmath>
#include <cstddef>

#include <xsimd/xsimd.hpp>

namespace teo::simd {

// The scalar "architecture": one lane, with a true fused multiply-add (std::fma), so that it
// rounds exactly as the vector ISAs do.
struct scalar_arch {};

template <class Real, class Arch>
struct Vec {
  using B = xsimd::batch<Real, Arch>;
  static constexpr std::size_t size = B::size;
  static B load(const Real* p) { return B::load_unaligned(p); }
  static void store(Real* p, const B& v) { v.store_unaligned(p); }
  static B set1(Real x) { return B(x); }
  static B fma(const B& a, const B& b, const B& c) { return xsimd::fma(a, b, c); }
  static B mul(const B& a, const B& b) { return a * b; }
};

#if defined(__AVX512F__)
// xsimd 8.1 has no AVX-512 fma and falls back to a separate multiply and add, which would round
// differently from every other ISA: use the fused instruction directly.
template <>
inline xsimd::batch<float, xsimd::avx512f> Vec<float, xsimd::avx512f>::fma(const B& a, const B& b,
                                                                           const B& c) {
  return _mm512_fmadd_ps(a, b, c);
}
template <>
inline xsimd::batch<double, xsimd::avx512f> Vec<double, xsimd::avx512f>::fma(const B& a, const B& b,
                                                                             const B& c) {
  return _mm512_fmadd_pd(a, b, c);
}
#endif

template <class Real>
struct Vec<Real, scalar_arch> {
  using B = Real;
  static constexpr std::size_t size = 1;
  static B load(const Real* p) { return *p; }
  static void store(Real* p, B v) { *p = v; }
  static B set1(Real x) { return x; }
  static B fma(B a, B b, B c) { return std::fma(a, b, c); }
  static B mul(B a, B b) { return a * b; }
};

}  // namespace teo::simd
