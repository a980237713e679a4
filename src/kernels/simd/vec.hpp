// One vector interface over xsimd batches and plain scalars, so every kernel is written once.
// Only for inclusion by the per-ISA translation units.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <xsimd/xsimd.hpp>

namespace teo::simd {
// Internal linkage: each ISA's translation unit gets its own copy of every helper here, so no
// inline function compiled with one ISA's flags can be picked by the linker for another.
namespace {

// The scalar "architecture": one lane, with a true fused multiply-add (std::fma), so that it
// rounds exactly as the vector ISAs do.
struct scalar_arch {};

// Integer twin of a floating type, for building powers of two from their bits.
template <class Real>
struct Bits;
template <>
struct Bits<float> {
  using I = std::int32_t;
  static constexpr float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  static constexpr I magic_bits = 0x4B400000;
  static constexpr I bias = 127;
  static constexpr int mantissa = 23;
};
template <>
struct Bits<double> {
  using I = std::int64_t;
  static constexpr double magic = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr I magic_bits = 0x4338000000000000;
  static constexpr I bias = 1023;
  static constexpr int mantissa = 52;
};

// Every operation a kernel may use. Each has the same IEEE result on every ISA: no operation
// whose rounding or NaN handling differs between instruction sets is exposed.
template <class Real, class Arch>
struct Vec {
  using arch = Arch;
  using B = xsimd::batch<Real, Arch>;
  using M = xsimd::batch_bool<Real, Arch>;
  static constexpr std::size_t size = B::size;
  static B load(const Real* p) { return B::load_unaligned(p); }
  static void store(Real* p, const B& v) { v.store_unaligned(p); }
  static B set1(Real x) { return B(x); }
  static B fma(const B& a, const B& b, const B& c) { return xsimd::fma(a, b, c); }
  static B mul(const B& a, const B& b) { return a * b; }
  static B div(const B& a, const B& b) { return a / b; }
  static B select(const M& m, const B& a, const B& b) { return xsimd::select(m, a, b); }
  static bool any(const M& m) { return xsimd::any(m); }
  // Unordered compare: xsimd 8.1's != is an ordered compare on x86 (false for NaN).
  static M isnan(const B& a) { return xsimd::isnan(a); }
  // 2^n for integer-valued n with a normal result (|n| <= 126 for float, 1022 for double).
  static B pow2n(const B& n) {
    using I = xsimd::batch<typename Bits<Real>::I, Arch>;
    I i = xsimd::bitwise_cast<I>(n + B(Bits<Real>::magic));
    i = i - I(Bits<Real>::magic_bits - Bits<Real>::bias);
    i = i << Bits<Real>::mantissa;
    return xsimd::bitwise_cast<B>(i);
  }
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

#if defined(__aarch64__)
// xsimd 8.1 divides float vectors on NEON by a reciprocal estimate and two Newton steps, which is
// not IEEE division: use the real instruction.
template <>
inline xsimd::batch<float, xsimd::neon64> Vec<float, xsimd::neon64>::div(const B& a, const B& b) {
  return vdivq_f32(a, b);
}
#endif

template <class Real>
struct Vec<Real, scalar_arch> {
  using arch = scalar_arch;
  using B = Real;
  using M = bool;
  static constexpr std::size_t size = 1;
  static B load(const Real* p) { return *p; }
  static void store(Real* p, B v) { *p = v; }
  static B set1(Real x) { return x; }
  static B fma(B a, B b, B c) { return std::fma(a, b, c); }
  static B mul(B a, B b) { return a * b; }
  static B div(B a, B b) { return a / b; }
  static B select(M m, B a, B b) { return m ? a : b; }
  static bool any(M m) { return m; }
  static M isnan(B a) { return std::isnan(a); }
  static B pow2n(B n) {
    using I = typename Bits<Real>::I;
    I i;
    const Real t = n + Bits<Real>::magic;
    std::memcpy(&i, &t, sizeof i);
    i = (i - (Bits<Real>::magic_bits - Bits<Real>::bias)) << Bits<Real>::mantissa;
    Real r;
    std::memcpy(&r, &i, sizeof r);
    return r;
  }
};

// The lanes of one vector combined by a halving tree: op(lane i, lane i + W/2) for i < W/2, then
// the same on that half, down to one value; the order of the fixed lane trees in
// vector_kernels.hpp, done in registers. op is called on half-width vectors and on two scalars.
template <class Real, class Arch, class Op>
[[gnu::always_inline]] inline Real fold(const typename Vec<Real, Arch>::B& v, Op op) {
  [[maybe_unused]] constexpr bool f32 = std::is_same_v<Real, float>;
  if constexpr (std::is_same_v<Arch, scalar_arch>) {
    return v;
#if defined(__AVX512F__)
  } else if constexpr (std::is_same_v<Arch, xsimd::avx512f> && f32) {
    const __m512 x = v;
    const __m256 s8 = op(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    const __m128 s4 = op(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = op(s4, _mm_movehl_ps(s4, s4));
    return op(s2[0], s2[1]);
  } else if constexpr (std::is_same_v<Arch, xsimd::avx512f>) {
    const __m512d x = v;
    const __m256d s4 = op(_mm512_castpd512_pd256(x), _mm512_extractf64x4_pd(x, 1));
    const __m128d s2 = op(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return op(s2[0], s2[1]);
#endif
#if defined(__AVX2__)
  } else if constexpr (std::is_same_v<Arch, xsimd::fma3<xsimd::avx2>> && f32) {
    const __m256 x = v;
    const __m128 s4 = op(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 s2 = op(s4, _mm_movehl_ps(s4, s4));
    return op(s2[0], s2[1]);
  } else if constexpr (std::is_same_v<Arch, xsimd::fma3<xsimd::avx2>>) {
    const __m256d x = v;
    const __m128d s2 = op(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return op(s2[0], s2[1]);
#endif
#if defined(__aarch64__)
  } else if constexpr (std::is_same_v<Arch, xsimd::neon64> && f32) {
    const float32x4_t x = v;
    const float32x2_t s2 = op(vget_low_f32(x), vget_high_f32(x));
    return op(s2[0], s2[1]);
  } else if constexpr (std::is_same_v<Arch, xsimd::neon64>) {
    const float64x2_t x = v;
    return op(x[0], x[1]);
#endif
  } else {
    constexpr int W = static_cast<int>(Vec<Real, Arch>::size);
    alignas(64) Real lanes[W];
    Vec<Real, Arch>::store(lanes, v);
    for (int stride = W / 2; stride >= 1; stride /= 2)
      for (int i = 0; i < stride; ++i) lanes[i] = op(lanes[i], lanes[i + stride]);
    return lanes[0];
  }
}

// NB vectors of Arch processed in lockstep as one wider vector: every operation is the element-wise
// one of Arch, so results are bit for bit Arch's. Long dependency chains (erf's series and
// continued fraction) then interleave NB independent chains, which the core overlaps.
template <class Arch, int NB>
struct multi {};

template <class Real, class Arch, int NB>
struct Vec<Real, multi<Arch, NB>> {
  using arch = multi<Arch, NB>;
  using E = Vec<Real, Arch>;
  static constexpr std::size_t size = E::size * NB;
  struct M {
    typename E::M v[NB];
  };
  struct B {
    typename E::B v[NB];
#define TEO_MULTI_BINARY(op, R)                                                     \
  [[gnu::always_inline]] friend R operator op(const B& a, const B& b) {             \
    R r;                                                                            \
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) r.v[i] = a.v[i] op b.v[i]; \
    return r;                                                                       \
  }
    TEO_MULTI_BINARY(+, B)
    TEO_MULTI_BINARY(-, B)
    TEO_MULTI_BINARY(*, B)
    TEO_MULTI_BINARY(>, M)
    TEO_MULTI_BINARY(<, M)
    TEO_MULTI_BINARY(==, M)
#undef TEO_MULTI_BINARY
    [[gnu::always_inline]] friend B operator-(const B& a) {
      B r;
      _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) r.v[i] = -a.v[i];
      return r;
    }
  };
  template <class F>
  [[gnu::always_inline]] static B each(F&& f) {
    B r;
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) r.v[i] = f(i);
    return r;
  }
  [[gnu::always_inline]] static B load(const Real* p) {
    return each([&](int i) { return E::load(p + i * E::size); });
  }
  [[gnu::always_inline]] static void store(Real* p, const B& v) {
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) E::store(p + i * E::size, v.v[i]);
  }
  [[gnu::always_inline]] static B set1(Real x) {
    return each([&](int) { return E::set1(x); });
  }
  [[gnu::always_inline]] static B fma(const B& a, const B& b, const B& c) {
    return each([&](int i) { return E::fma(a.v[i], b.v[i], c.v[i]); });
  }
  [[gnu::always_inline]] static B mul(const B& a, const B& b) {
    return each([&](int i) { return E::mul(a.v[i], b.v[i]); });
  }
  [[gnu::always_inline]] static B div(const B& a, const B& b) {
    return each([&](int i) { return E::div(a.v[i], b.v[i]); });
  }
  [[gnu::always_inline]] static B select(const M& m, const B& a, const B& b) {
    return each([&](int i) { return E::select(m.v[i], a.v[i], b.v[i]); });
  }
  [[gnu::always_inline]] static bool any(const M& m) {
    bool r = false;
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) r = r || E::any(m.v[i]);
    return r;
  }
  [[gnu::always_inline]] static M isnan(const B& a) {
    M r;
    _Pragma("GCC unroll 8") for (int i = 0; i < NB; ++i) r.v[i] = E::isnan(a.v[i]);
    return r;
  }
  [[gnu::always_inline]] static B pow2n(const B& n) {
    return each([&](int i) { return E::pow2n(n.v[i]); });
  }
};

}  // namespace
}  // namespace teo::simd
