// The GEMM micro- and macro-kernel, written once for every ISA. Only for inclusion by the per-ISA
// translation units, inside an anonymous namespace there.
#pragma once

#include "isa.hpp"
#include "vec.hpp"

namespace teo::simd {
namespace {

// One MR x NR tile: acc = start(C); for p < kc: acc += a[p] (column of MR) x b[p] (row of NR);
// C = acc. NV = NR / vector width vectors per row. The accumulators live in registers: MR * NV
// of them, plus NV for the B row and one broadcast of A.
template <class Real, class Arch, int MR, int NV>
inline void micro_kernel(index_t kc, const Real* __restrict a, const Real* __restrict b,
                         Real* __restrict c, index_t ldc, Start start, Real beta) {
  using V = Vec<Real, Arch>;
  using B = typename V::B;
  constexpr int W = static_cast<int>(V::size);
  constexpr int NR = NV * W;
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
#pragma GCC unroll 4
  for (index_t p = 0; p < kc; ++p) {
    B bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = V::load(b + p * NR + v * W);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const B av = V::set1(a[p * MR + i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = V::fma(av, bv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) V::store(c + i * ldc + v * W, acc[i][v]);
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

// C (m, n) = start(C) + op(A) B for products too small to repay packing. B is row-major (k, n)
// with leading dimension ldb; op(A)(i, p) is a[i * lda + p], or a[p * lda + i] when ta, times
// alpha (rounded once, as pack_a does). Each element of C is the same fused multiply-add chain in
// increasing p as in macro_kernel, so the result is bit for bit the packed path's. Four rows at a
// time keep four independent chains in flight; the last n % W columns go through a zero-padded
// copy of B's tail columns, so no load leaves B or C.
template <class Real, class Arch>
void small_gemm(bool ta, index_t m, index_t n, index_t k, Real alpha, const Real* a, index_t lda,
                const Real* b, index_t ldb, Real* c, index_t ldc, Start start, Real beta,
                Real* tail) {
  using V = Vec<Real, Arch>;
  using B = typename V::B;
  constexpr index_t W = static_cast<index_t>(V::size);
  constexpr index_t R = 4;
  const index_t nfull = n / W * W, nt = n - nfull;
  if (nt > 0) {
    for (index_t p = 0; p < k; ++p)
      for (index_t j = 0; j < W; ++j) tail[p * W + j] = j < nt ? b[p * ldb + nfull + j] : Real(0);
  }
  const B vb = V::set1(beta);
  alignas(64) Real ctile[R * W];
  for (index_t i0 = 0; i0 < m; i0 += R) {
    const index_t rows = std::min<index_t>(R, m - i0);
    for (index_t j = 0; j < n; j += W) {
      const bool edge = j == nfull;
      const Real* bcol = edge ? tail : b + j;
      const index_t bld = edge ? W : ldb;
      B acc[R];
#pragma GCC unroll 4
      for (index_t r = 0; r < R; ++r) {
        if (r >= rows || start == Start::zero) {
          acc[r] = V::set1(Real(0));
          continue;
        }
        if (edge) {
          for (index_t x = 0; x < W; ++x)
            ctile[r * W + x] = x < nt ? c[(i0 + r) * ldc + j + x] : Real(0);
          acc[r] = V::load(ctile + r * W);
        } else {
          acc[r] = V::load(c + (i0 + r) * ldc + j);
        }
        if (start == Start::beta_c) acc[r] = V::mul(acc[r], vb);
      }
      for (index_t p = 0; p < k; ++p) {
        const B bv = V::load(bcol + p * bld);
#pragma GCC unroll 4
        for (index_t r = 0; r < R; ++r) {
          if (r < rows) {
            const Real av = ta ? a[p * lda + i0 + r] : a[(i0 + r) * lda + p];
            acc[r] = V::fma(V::set1(alpha == Real(1) ? av : alpha * av), bv, acc[r]);
          }
        }
      }
      for (index_t r = 0; r < rows; ++r) {
        if (edge) {
          V::store(ctile + r * W, acc[r]);
          for (index_t x = 0; x < nt; ++x) c[(i0 + r) * ldc + j + x] = ctile[r * W + x];
        } else {
          V::store(c + (i0 + r) * ldc + j, acc[r]);
        }
      }
    }
  }
}

template <class Real, class Arch, int MR, int NV>
constexpr GemmKernel<Real> make_gemm(index_t kc, index_t mc, index_t nc) {
  return GemmKernel<Real>{MR,
                          NV * static_cast<int>(Vec<Real, Arch>::size),
                          kc,
                          mc,
                          nc,
                          &macro_kernel<Real, Arch, MR, NV>,
                          &small_gemm<Real, Arch>};
}

}  // namespace
}  // namespace teo::simd
