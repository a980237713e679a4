// The GEMM micro- and macro-kernel, written once for every ISA. Only for inclusion by the per-ISA
// translation units, inside an anonymous namespace there.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "isa.hpp"
#include "vec.hpp"

namespace teo::simd {
namespace {

// One MR x NR tile: acc = start(C); for p < kc: acc += op(A)(i, p) x B(p, :); C = acc, where
// op(A)(i, p) = a[i * ai + p * ap] (times alpha, rounded once as pack_a does, when SCALE) and row p
// of B is b + p * ldb. NV = NR / vector width vectors per row. The accumulators live in
// registers: MR * NV of them, plus NV for the B row and one broadcast of A. The packed kernel is
// this one with ai = 1, ap = MR, ldb = NR; the small products' path reads A and B in place.
template <class Real, class Arch, int MR, int NV, bool SCALE>
[[gnu::always_inline]] inline void tile_kernel(index_t kc, Real alpha, const Real* __restrict a,
                                               index_t ai, index_t ap, const Real* __restrict b,
                                               index_t ldb, Real* __restrict c, index_t ldc,
                                               Start start, Real beta) {
  using V = Vec<Real, Arch>;
  using B = typename V::B;
  constexpr int W = static_cast<int>(V::size);
  // Every loop over i and v is fully unrolled so that the accumulators stay in registers.
  B acc[MR][NV];
  if (start == Start::zero) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = V::set1(Real(0));
  } else {
    const B vb = V::set1(beta);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        acc[i][v] = V::load(c + i * ldc + v * W);
        if (start == Start::beta_c) acc[i][v] = V::mul(acc[i][v], vb);
      }
  }
  // One step of k: acc += op(A)(:, p) x B(p, :), with op(A)(i, p) at ak[i * ai] and B's row at bk.
  const auto step = [&](const Real* __restrict ak, const Real* __restrict bk)
      __attribute__((always_inline)) {
    B bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = V::load(bk + v * W);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const Real x = ak[i * ai];
      const B av = V::set1(SCALE ? alpha * x : x);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = V::fma(av, bv[v], acc[i][v]);
    }
  };
  index_t p = 0;
  // Four steps per iteration at fixed offsets from pointers advanced once: fewer scalar
  // instructions beside the FMAs (an Intel core issues them on ports it shares with the FMAs).
  for (; p + 4 <= kc; p += 4) {
    step(a, b);
    step(a + ap, b + ldb);
    step(a + 2 * ap, b + 2 * ldb);
    step(a + 3 * ap, b + 3 * ldb);
    a += 4 * ap;
    b += 4 * ldb;
  }
  for (; p < kc; ++p) {
    step(a, b);
    a += ap;
    b += ldb;
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) V::store(c + i * ldc + v * W, acc[i][v]);
}

// The packed micro-kernel: A and B slivers, k-major.
template <class Real, class Arch, int MR, int NV>
inline void micro_kernel(index_t kc, const Real* __restrict a, const Real* __restrict b,
                         Real* __restrict c, index_t ldc, Start start, Real beta) {
  constexpr int NR = NV * static_cast<int>(Vec<Real, Arch>::size);
  tile_kernel<Real, Arch, MR, NV, false>(kc, Real(1), a, 1, MR, b, NR, c, ldc, start, beta);
}

// The two inner loops (jr over NR columns, ir over MR rows) over packed panels. Edge tiles run in
// a local MR x NR buffer, so the kernel never touches C outside (mc, nc) and, with Start::zero,
// never reads it.
template <class Real, class Arch, int MR, int NV>
void macro_kernel(index_t mc, index_t nc, index_t kc, const Real* ap, const Real* bp, Real* c,
                  index_t ldc, Start start, Real beta) {
  constexpr int NR = NV * static_cast<int>(Vec<Real, Arch>::size);
  alignas(64) Real tile[MR * NR];
  for (index_t jr = 0; jr < nc; jr += NR) {
    const index_t nb = nc - jr < NR ? nc - jr : NR;
    const Real* b = bp + (jr / NR) * kc * NR;
    for (index_t ir = 0; ir < mc; ir += MR) {
      const index_t mb = mc - ir < MR ? mc - ir : MR;
      const Real* a = ap + (ir / MR) * kc * MR;
      Real* ct = c + ir * ldc + jr;
      // The next tile's C rows (inside this block), so that its first loads do not wait on L2/L3.
      {
        const index_t next_rows = mc - ir - MR < MR ? mc - ir - MR : MR;
        for (index_t i = 0; i < next_rows; ++i)
          for (index_t j = 0; j < nb; j += static_cast<index_t>(64 / sizeof(Real)))
            __builtin_prefetch(ct + (MR + i) * ldc + j, 1);
      }
      if (mb == MR && nb == NR) {
        micro_kernel<Real, Arch, MR, NV>(kc, a, b, ct, ldc, start, beta);
        continue;
      }
      if (start != Start::zero) {
        for (index_t i = 0; i < MR; ++i)
          for (index_t j = 0; j < NR; ++j)
            tile[i * NR + j] = i < mb && j < nb ? ct[i * ldc + j] : Real(0);
      }
      micro_kernel<Real, Arch, MR, NV>(kc, a, b, tile, NR, start, beta);
      for (index_t i = 0; i < mb; ++i)
        for (index_t j = 0; j < nb; ++j) ct[i * ldc + j] = tile[i * NR + j];
    }
  }
}

template <class Real, int WIDTH>
void pack_panel(bool transposed, Real* d, const Real* src, index_t ld, index_t rows, index_t kc,
                Real alpha);

// C (m, n) = start(C) + op(A) op(B) for products too small to repay the blocked driver (attention's
// per-head ones), on the same MR x NR tiles and chains as macro_kernel, so with the same bits. A
// is read in place, op(A)(i, p) = a[i * lda + p], or a[p * lda + i] when ta, times alpha (rounded
// once, as pack_a does); so is B when it is not transposed. Only a transposed B, B's last partial
// NR columns and A's last partial MR rows are packed into `scratch`, which holds
// k * (round_up(n, NR) + MR) values; so no load leaves A or B, and edge tiles go through a local
// tile as in macro_kernel.
template <class Real, class Arch, int MR, int NV>
void small_gemm(bool ta, bool tb, index_t m, index_t n, index_t k, Real alpha, const Real* a,
                index_t lda, const Real* b, index_t ldb, Real* c, index_t ldc, Start start,
                Real beta, Real* scratch) {
  constexpr int NR = NV * static_cast<int>(Vec<Real, Arch>::size);
  const index_t ai = ta ? 1 : lda, ap = ta ? lda : 1;  // op(A)(i, p) = a[i * ai + p * ap]
  // Columns [0, nfull) of B are read in place; the rest are packed into NR-wide slivers.
  const index_t nfull = tb ? 0 : n / NR * NR, mfull = m / MR * MR;
  Real* bpack = scratch;
  Real* apack = scratch + (n - nfull + NR - 1) / NR * NR * k;
  if (nfull < n)
    pack_panel<Real, NR>(tb, bpack, tb ? b + nfull * ldb : b + nfull, ldb, n - nfull, k, Real(1));
  if (mfull < m)
    pack_panel<Real, MR>(!ta, apack, ta ? a + mfull : a + mfull * lda, lda, m - mfull, k, alpha);
  const bool scale = alpha != Real(1);
  alignas(64) Real tile[MR * NR];
  for (index_t j0 = 0; j0 < n; j0 += NR) {
    const index_t nb = n - j0 < NR ? n - j0 : NR;
    const bool b_in_place = j0 < nfull;
    const Real* bs = b_in_place ? b + j0 : bpack + (j0 - nfull) / NR * k * NR;
    const index_t bld = b_in_place ? ldb : NR;
    for (index_t i0 = 0; i0 < m; i0 += MR) {
      const index_t mb = m - i0 < MR ? m - i0 : MR;
      Real* ct = c + i0 * ldc + j0;
      Real* cc = ct;
      index_t cld = ldc;
      const bool edge = mb < MR || nb < NR;
      if (edge) {
        if (start != Start::zero) {
          for (index_t i = 0; i < MR; ++i)
            for (index_t j = 0; j < NR; ++j)
              tile[i * NR + j] = i < mb && j < nb ? ct[i * ldc + j] : Real(0);
        }
        cc = tile;
        cld = NR;
      }
      if (mb < MR)
        tile_kernel<Real, Arch, MR, NV, false>(k, alpha, apack, 1, MR, bs, bld, cc, cld, start,
                                               beta);
      else if (scale)
        tile_kernel<Real, Arch, MR, NV, true>(k, alpha, a + i0 * ai, ai, ap, bs, bld, cc, cld,
                                              start, beta);
      else
        tile_kernel<Real, Arch, MR, NV, false>(k, alpha, a + i0 * ai, ai, ap, bs, bld, cc, cld,
                                               start, beta);
      if (edge)
        for (index_t i = 0; i < mb; ++i)
          for (index_t j = 0; j < nb; ++j) ct[i * ldc + j] = tile[i * NR + j];
    }
  }
}

#if defined(__AVX2__)
// In-register transposes of one W x W block: on return r[q] holds column q of the rows passed in.
inline void transpose_block(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);  // r_i0 r_(i+1)0 r_i1 r_(i+1)1 | same for 4, 5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {
    u[h + 0] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));      // columns 0 | 4
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));      // columns 1 | 5
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));  // columns 2 | 6
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));  // columns 3 | 7
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2f128_ps(u[q], u[q + 4], 0x20);
    r[q + 4] = _mm256_permute2f128_ps(u[q], u[q + 4], 0x31);
  }
}
inline void transpose_block(__m256d r[4]) {
  const __m256d t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
  const __m256d t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
  r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
  r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
  r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
  r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
}
template <class Real>
struct Avx2Block;
template <>
struct Avx2Block<float> {
  using R = __m256;
  static constexpr int W = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R zero() { return _mm256_setzero_ps(); }
  static R mul(R a, float s) { return _mm256_mul_ps(a, _mm256_set1_ps(s)); }
  static void transpose(R* r) { transpose_block(r); }
  // The first N lanes, in 4-, 2- and 1-lane pieces, so that nothing past p + N is written.
  template <int N>
  static void store(float* p, R v) {
    if constexpr (N == 8) {
      _mm256_storeu_ps(p, v);
    } else {
      __m128 part = _mm256_castps256_ps128(v);
      if constexpr (N >= 4) {
        _mm_storeu_ps(p, part);
        part = _mm256_extractf128_ps(v, 1);
      }
      constexpr int rest = N % 4, at = N - rest;
      if constexpr (rest >= 2) _mm_storel_pi(reinterpret_cast<__m64*>(p + at), part);
      if constexpr (rest == 1) _mm_store_ss(p + at, part);
      if constexpr (rest == 3) _mm_store_ss(p + at + 2, _mm_movehl_ps(part, part));
    }
  }
};
template <>
struct Avx2Block<double> {
  using R = __m256d;
  static constexpr int W = 4;
  static R load(const double* p) { return _mm256_loadu_pd(p); }
  static R zero() { return _mm256_setzero_pd(); }
  static R mul(R a, double s) { return _mm256_mul_pd(a, _mm256_set1_pd(s)); }
  static void transpose(R* r) { transpose_block(r); }
  template <int N>
  static void store(double* p, R v) {
    if constexpr (N == 4) {
      _mm256_storeu_pd(p, v);
    } else {
      __m128d part = _mm256_castpd256_pd128(v);
      if constexpr (N >= 2) {
        _mm_storeu_pd(p, part);
        part = _mm256_extractf128_pd(v, 1);
      }
      if constexpr (N % 2 == 1) _mm_store_sd(p + N - 1, part);
    }
  }
};

// One full sliver (rows == WIDTH) transposed with X's W x W register blocks (Avx2Block,
// Avx512Block): for each W values of k, blocks of W rows are loaded (zero past WIDTH), transposed
// in registers and stored, rows past WIDTH left out. Returns the number of k values done (a
// multiple of W); the caller does the rest.
template <class X, int WIDTH, bool SCALE, class Real>
index_t pack_transposed_blocks(Real* __restrict d, const Real* __restrict src, index_t ld,
                               index_t kc, Real alpha) {
  constexpr int W = X::W;
  index_t p0 = 0;
  for (; p0 + W <= kc; p0 += W) {
    [&]<int... B>(std::integer_sequence<int, B...>) {
      // One step per block of W rows: i0 = B * W.
      (
          [&] {
            constexpr int i0 = B * W, rb = WIDTH - i0 < W ? WIDTH - i0 : W;
            typename X::R r[W];
            for (int i = 0; i < W; ++i) {
              r[i] = i < rb ? X::load(src + (i0 + i) * ld + p0) : X::zero();
              if constexpr (SCALE) r[i] = X::mul(r[i], alpha);
            }
            X::transpose(r);
            for (int q = 0; q < W; ++q) X::template store<rb>(d + (p0 + q) * WIDTH + i0, r[q]);
          }(),
          ...);
    }
    (std::make_integer_sequence<int, (WIDTH + W - 1) / W>{});
  }
  return p0;
}

// One full sliver (rows == WIDTH) transposed: blocks of W rows by W values of k, transposed in
// registers. Returns the number of k values done (a multiple of W); the caller does the rest.
template <class Real, int WIDTH, bool SCALE>
index_t pack_transposed_avx2(Real* __restrict d, const Real* __restrict src, index_t ld, index_t kc,
                             Real alpha) {
  using X = Avx2Block<Real>;
  index_t p0 = 0;
  if constexpr (std::is_same_v<Real, float> && WIDTH == 4) {
    // Four rows by 8 values of k: the sliver's 8 x 4 block is 32 contiguous floats, written as
    // four full vectors from a 4-row transpose (no padding rows, no partial stores).
    for (; p0 + 8 <= kc; p0 += 8) {
      __m256 r[4];
      for (int i = 0; i < 4; ++i) {
        r[i] = X::load(src + i * ld + p0);
        if constexpr (SCALE) r[i] = X::mul(r[i], alpha);
      }
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 c04 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));  // k 0 | k 4
      const __m256 c15 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));  // k 1 | k 5
      const __m256 c26 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));  // k 2 | k 6
      const __m256 c37 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));  // k 3 | k 7
      float* dp = d + p0 * 4;
      _mm256_storeu_ps(dp, _mm256_permute2f128_ps(c04, c15, 0x20));
      _mm256_storeu_ps(dp + 8, _mm256_permute2f128_ps(c26, c37, 0x20));
      _mm256_storeu_ps(dp + 16, _mm256_permute2f128_ps(c04, c15, 0x31));
      _mm256_storeu_ps(dp + 24, _mm256_permute2f128_ps(c26, c37, 0x31));
    }
    return p0;
  } else {
    return pack_transposed_blocks<X, WIDTH, SCALE>(d, src, ld, kc, alpha);
  }
}
#endif

#if defined(__AVX512F__)
// In-register transposes of one W x W block on AVX-512: on return r[c] holds column c of the rows
// passed in. Within each 128-bit lane, unpack and shuffle give each lane one column of four rows
// (two for double); a 4 x 4 transpose of the lanes (shuffle_f32x4 / shuffle_f64x2) then gathers
// each column's four lanes.
template <class V, class Lanes>
inline void transpose_lanes(V b[4], V out[4], Lanes shuffle) {
  const V c0 = shuffle.template operator()<0x44>(b[0], b[1]);  // b0[0] b0[1] b1[0] b1[1]
  const V c1 = shuffle.template operator()<0xEE>(b[0], b[1]);  // b0[2] b0[3] b1[2] b1[3]
  const V c2 = shuffle.template operator()<0x44>(b[2], b[3]);
  const V c3 = shuffle.template operator()<0xEE>(b[2], b[3]);
  out[0] = shuffle.template operator()<0x88>(c0, c2);  // b0[0] b1[0] b2[0] b3[0]
  out[1] = shuffle.template operator()<0xDD>(c0, c2);  // b0[1] b1[1] b2[1] b3[1]
  out[2] = shuffle.template operator()<0x88>(c1, c3);
  out[3] = shuffle.template operator()<0xDD>(c1, c3);
}
inline void transpose_block(__m512 r[16]) {
  __m512 a[16], b[16];
  for (int k = 0; k < 16; k += 2) {
    a[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
    a[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // b[g + q], lane L: column 4L + q of rows g .. g + 3
    b[g + 0] = _mm512_shuffle_ps(a[g], a[g + 2], _MM_SHUFFLE(1, 0, 1, 0));
    b[g + 1] = _mm512_shuffle_ps(a[g], a[g + 2], _MM_SHUFFLE(3, 2, 3, 2));
    b[g + 2] = _mm512_shuffle_ps(a[g + 1], a[g + 3], _MM_SHUFFLE(1, 0, 1, 0));
    b[g + 3] = _mm512_shuffle_ps(a[g + 1], a[g + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  const auto shuffle = []<int I>(__m512 x, __m512 y) { return _mm512_shuffle_f32x4(x, y, I); };
  for (int q = 0; q < 4; ++q) {
    __m512 in[4] = {b[q], b[4 + q], b[8 + q], b[12 + q]}, out[4];
    transpose_lanes(in, out, shuffle);
    for (int L = 0; L < 4; ++L) r[4 * L + q] = out[L];
  }
}
inline void transpose_block(__m512d r[8]) {
  __m512d a[8];
  for (int k = 0; k < 8; k += 2) {  // a[k + q], lane L: column 2L + q of rows k, k + 1
    a[k] = _mm512_unpacklo_pd(r[k], r[k + 1]);
    a[k + 1] = _mm512_unpackhi_pd(r[k], r[k + 1]);
  }
  const auto shuffle = []<int I>(__m512d x, __m512d y) { return _mm512_shuffle_f64x2(x, y, I); };
  for (int q = 0; q < 2; ++q) {
    __m512d in[4] = {a[q], a[2 + q], a[4 + q], a[6 + q]}, out[4];
    transpose_lanes(in, out, shuffle);
    for (int L = 0; L < 4; ++L) r[2 * L + q] = out[L];
  }
}
template <class Real>
struct Avx512Block;
template <>
struct Avx512Block<float> {
  using R = __m512;
  static constexpr int W = 16;
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R zero() { return _mm512_setzero_ps(); }
  static R mul(R a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
  static void transpose(R* r) { transpose_block(r); }
  template <int N>
  static void store(float* p, R v) {  // the first N lanes only
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << N) - 1), v);
  }
};
template <>
struct Avx512Block<double> {
  using R = __m512d;
  static constexpr int W = 8;
  static R load(const double* p) { return _mm512_loadu_pd(p); }
  static R zero() { return _mm512_setzero_pd(); }
  static R mul(R a, double s) { return _mm512_mul_pd(a, _mm512_set1_pd(s)); }
  static void transpose(R* r) { transpose_block(r); }
  template <int N>
  static void store(double* p, R v) {
    _mm512_mask_storeu_pd(p, static_cast<__mmask8>((1u << N) - 1), v);
  }
};

// One full sliver (rows == WIDTH) transposed in 16 x 16 (float) or 8 x 8 (double) blocks.
template <class Real, int WIDTH, bool SCALE>
index_t pack_transposed_avx512(Real* __restrict d, const Real* __restrict src, index_t ld,
                               index_t kc, Real alpha) {
  return pack_transposed_blocks<Avx512Block<Real>, WIDTH, SCALE>(d, src, ld, kc, alpha);
}
#endif

// Packing is a pure copy (times alpha, rounded once per value, when alpha is not 1), so it
// changes no result however it is done. A sliver is kc x WIDTH, k-major: d[p * WIDTH + i] =
// op(S)(i, p) for i < rows (rows <= WIDTH) and zero above, where op(S)(i, p) is src[i * ld + p]
// when transposed (rows of S become columns of the sliver) and src[p * ld + i] otherwise.

// One transposed sliver.
template <class Real, int WIDTH, bool SCALE>
void pack_transposed_sliver(Real* __restrict d, const Real* __restrict src, index_t ld,
                            index_t rows, index_t kc, Real alpha) {
  index_t p0 = 0;
#if defined(__AVX512F__)
  if (rows == WIDTH) p0 = pack_transposed_avx512<Real, WIDTH, SCALE>(d, src, ld, kc, alpha);
#elif defined(__AVX2__)
  if (rows == WIDTH) p0 = pack_transposed_avx2<Real, WIDTH, SCALE>(d, src, ld, kc, alpha);
#endif
  // The remaining k values (all of them for an edge sliver or without AVX2), in blocks of 8 so
  // that each source row is read a cache line at a time.
  for (; p0 < kc; p0 += 8) {
    const index_t pb = std::min<index_t>(8, kc - p0);
    for (index_t i = 0; i < WIDTH; ++i) {
      if (i >= rows) {
        for (index_t q = 0; q < pb; ++q) d[(p0 + q) * WIDTH + i] = Real(0);
        continue;
      }
      const Real* sp = src + i * ld + p0;
      for (index_t q = 0; q < pb; ++q) d[(p0 + q) * WIDTH + i] = SCALE ? alpha * sp[q] : sp[q];
    }
  }
}

// A whole panel of WIDTH-wide slivers (WIDTH is MR for A, NR for B): ceil(rows / WIDTH)
// consecutive slivers, sliver s holding rows [s * WIDTH, s * WIDTH + WIDTH) of op(S).
template <class Real, int WIDTH, bool SCALE>
void pack_panel_t(bool transposed, Real* d, const Real* src, index_t ld, index_t rows, index_t kc,
                  Real alpha) {
  const index_t slivers = (rows + WIDTH - 1) / WIDTH;
  if (transposed) {
    for (index_t s = 0; s < slivers; ++s)
      pack_transposed_sliver<Real, WIDTH, SCALE>(d + s * kc * WIDTH, src + s * WIDTH * ld, ld,
                                                 std::min<index_t>(WIDTH, rows - s * WIDTH), kc,
                                                 alpha);
    return;
  }
  // Without transposition, 16 source rows at a time: those rows stay in L1 while each sliver gets
  // its 16 contiguous destination rows (one row across all slivers at once would write to
  // addresses kc * WIDTH apart, a multiple of 4 KiB that maps them all to one L1 set). A full,
  // unscaled row piece is a fixed-size copy: a few vector moves.
  constexpr index_t kRows = 16;
  for (index_t p0 = 0; p0 < kc; p0 += kRows) {
    const index_t p1 = std::min(kc, p0 + kRows);
    for (index_t s = 0; s < slivers; ++s) {
      Real* __restrict dp = d + s * kc * WIDTH;
      const Real* __restrict sp = src + s * WIDTH;
      const index_t n = std::min<index_t>(WIDTH, rows - s * WIDTH);
      if (!SCALE && n == WIDTH) {
        for (index_t p = p0; p < p1; ++p)
          std::memcpy(dp + p * WIDTH, sp + p * ld, sizeof(Real) * WIDTH);
        continue;
      }
      for (index_t p = p0; p < p1; ++p)
        for (index_t i = 0; i < WIDTH; ++i)
          dp[p * WIDTH + i] = i >= n ? Real(0) : SCALE ? alpha * sp[p * ld + i] : sp[p * ld + i];
    }
  }
}

template <class Real, int WIDTH>
void pack_panel(bool transposed, Real* d, const Real* src, index_t ld, index_t rows, index_t kc,
                Real alpha) {
  if (alpha == Real(1))
    pack_panel_t<Real, WIDTH, false>(transposed, d, src, ld, rows, kc, alpha);
  else
    pack_panel_t<Real, WIDTH, true>(transposed, d, src, ld, rows, kc, alpha);
}

template <class Real, class Arch, int MR, int NV>
constexpr GemmKernel<Real> make_gemm(index_t kc, index_t mc, index_t nc,
                                     Split split = Split::shared_panel) {
  return GemmKernel<Real>{MR,
                          NV * static_cast<int>(Vec<Real, Arch>::size),
                          kc,
                          mc,
                          nc,
                          &macro_kernel<Real, Arch, MR, NV>,
                          &small_gemm<Real, Arch, MR, NV>,
                          &pack_panel<Real, MR>,
                          &pack_panel<Real, NV* static_cast<int>(Vec<Real, Arch>::size)>,
                          split};
}

}  // namespace
}  // namespace teo::simd
