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

template <class Real, class Arch, int MR, int NV>
constexpr GemmKernel<Real> make_gemm(index_t kc, index_t mc, index_t nc) {
  return GemmKernel<Real>{MR, NV * static_cast<int>(Vec<Real, Arch>::size),
                          kc, mc,
                          nc, &macro_kernel<Real, Arch, MR, NV>};
}

}  // namespace
}  // namespace teo::simd
