// A standalone self-test of the per-ISA kernels, with no dependency beyond the ISA translation
// units and xsimd, so that it cross-compiles for AArch64 and runs under qemu-aarch64. It checks:
//   1. every ISA this CPU runs gives the same bits as the scalar fallback, for GEMMs of every
//      transpose and edge size and for every vector kernel, in float and double;
//   2. the scalar results hash to the values recorded on x86-64 below, so a run on AArch64 proves
//      bitwise agreement with the x86 results;
//   3. the rounding kernels (bf16, fp16, tf32, E4M3, E5M2, E8M0) likewise, on a spread of float bit
//      patterns.
// Output ends with the line "N passed, N failed"; the exit status is 1 on any failure.
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "kernels/gemm_driver.hpp"
#include "teo/rng.hpp"
#include "teo/rounding.hpp"

namespace {

using teo::index_t;
using teo::Trans;
using namespace teo::simd;

int passed = 0, failed = 0;
// Where each kernel's outputs start in run_all's result, to name the first mismatch.
std::vector<std::pair<std::size_t, std::string>> sections;
void mark(std::size_t at, const std::string& name) {
  if (sections.empty() || sections.back().second != name) sections.emplace_back(at, name);
}

void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAIL %s\n", what.c_str());
  }
}

struct Isa {
  const char* name;
  const IsaKernels* k;
};

std::vector<Isa> isas() {
  std::vector<Isa> out{{"scalar", &kernels_scalar()}};
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) out.push_back({"avx2", &kernels_avx2()});
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    out.push_back({"avx512", &kernels_avx512(CpuVendor::other)});
    out.push_back({"avx512 (Intel blocking)", &kernels_avx512(CpuVendor::intel)});
  }
#endif
#if defined(__aarch64__)
  out.push_back({"neon", &kernels_neon()});
#endif
  return out;
}

template <class Real>
std::vector<Real> random(index_t n, std::uint64_t stream, double lo, double hi) {
  std::vector<Real> v(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i)
    v[i] = static_cast<Real>(
        lo + (hi - lo) * teo::rng::uniform01(2024, stream, static_cast<std::uint64_t>(i)));
  return v;
}

template <class Real>
void hash_into(std::uint64_t& h, const std::vector<Real>& v) {
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size() * sizeof(Real); ++i) {
    h ^= p[i];
    h *= 0x100000001B3ull;
  }
}

template <class Real>
const GemmKernel<Real>& gemm_of(const IsaKernels& k) {
  if constexpr (sizeof(Real) == 4)
    return k.sgemm;
  else
    return k.dgemm;
}
// An ISA's two register tiles (the same one twice where it has only one).
template <class Real>
std::array<const GemmKernel<Real>*, 2> tiles_of(const IsaKernels& k) {
  if constexpr (sizeof(Real) == 4)
    return {&k.sgemm, &k.sgemm_alt};
  else
    return {&k.dgemm, &k.dgemm_alt};
}
template <class Real>
const VectorKernels<Real>& vec_of(const IsaKernels& k) {
  if constexpr (sizeof(Real) == 4)
    return k.svec;
  else
    return k.dvec;
}

// The packed, blocked GEMM on one thread: C (m, n), ldc = n, with the given register tile.
template <class Real>
void packed_gemm(const GemmKernel<Real>& kern, Trans ta, Trans tb, index_t m, index_t n, index_t k,
                 Real alpha, const Real* a, index_t lda, const Real* b, index_t ldb, Real beta,
                 Real* c) {
  thread_local teo::detail::PackBuffers<Real> bufs;
  thread_local teo::detail::Buffer<Real> b_buf;
  teo::detail::gemm_blocked(
      kern, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, n, 1, b_buf,
      [](index_t count, auto&& f) {
        for (index_t i = 0; i < count; ++i) f(i);
      },
      [&]() -> teo::detail::PackBuffers<Real>& { return bufs; });
}

// Every kernel's outputs on fixed inputs, concatenated, with every NaN replaced by the canonical
// quiet NaN: IEEE 754 leaves a NaN's sign and payload to the hardware, so only its position is
// compared.
template <class Real>
std::vector<Real> run_all_raw(const IsaKernels& k);
template <class Real>
std::vector<Real> run_all(const IsaKernels& k) {
  auto out = run_all_raw<Real>(k);
  for (auto& v : out)
    if (v != v) v = std::numeric_limits<Real>::quiet_NaN();
  return out;
}
template <class Real>
std::vector<Real> run_all_raw(const IsaKernels& k) {
  std::vector<Real> out;
  std::uint64_t stream = 1;
  for (Trans ta : {Trans::no, Trans::yes})
    for (Trans tb : {Trans::no, Trans::yes})
      for (index_t m : {1, 7, 13, 33})
        for (index_t n : {1, 15, 17, 40})
          for (index_t kk : {1, 9, 300}) {
            const auto a = random<Real>(m * kk, stream++, -1, 1);
            const auto b = random<Real>(kk * n, stream++, -1, 1);
            auto c = random<Real>(m * n, stream++, -1, 1);
            const Real beta = static_cast<Real>((m + n) % 3 == 0 ? 0.0 : (m % 2 ? 1.0 : -0.5));
            const Real alpha = static_cast<Real>(n % 2 ? 1.0 : 0.37);
            packed_gemm(gemm_of<Real>(k), ta, tb, m, n, kk, alpha, a.data(),
                        ta == Trans::no ? kk : m, b.data(), tb == Trans::no ? n : kk, beta,
                        c.data());
            mark(out.size(), "gemm");
            out.insert(out.end(), c.begin(), c.end());
          }
  const auto& v = vec_of<Real>(k);
  for (index_t n : {1, 3, 8, 16, 17, 31, 64, 67, 200}) {
    auto x = random<Real>(n, stream++, -9, 9);
    const auto g = random<Real>(n, stream++, -1, 1);
    const auto w = random<Real>(n, stream++, 0.5, 1.5);
    const auto p = random<Real>(n, stream++, 0, 1);
    std::vector<Real> y(n), d(g);
    // NaN, +-inf and -0 in vector lanes for the element-wise kernels (then restored).
    const auto finite = x;
    const Real specials[] = {std::numeric_limits<Real>::quiet_NaN(),
                             std::numeric_limits<Real>::infinity(),
                             -std::numeric_limits<Real>::infinity(), Real(-0.0)};
    for (index_t j = 0; j < n; j += 5) x[j] = specials[(j / 5) % 4];
    for (int fn = 0; fn < 3; ++fn) {
      mark(out.size(), "math/activation fn " + std::to_string(fn) + " n " + std::to_string(n));
      v.math(y.data(), x.data(), n, static_cast<teo::MathFn>(fn));
      out.insert(out.end(), y.begin(), y.end());
      v.activation_forward(y.data(), x.data(), n, static_cast<teo::Activation>(fn));
      out.insert(out.end(), y.begin(), y.end());
      v.activation_backward(d.data(), g.data(), x.data(), n, static_cast<teo::Activation>(fn),
                            true);
      out.insert(out.end(), d.begin(), d.end());
    }
    x = finite;
    mark(out.size(), "softmax/layer_norm n " + std::to_string(n));
    v.softmax_forward_row(y.data(), x.data(), n - n / 3, n);
    out.insert(out.end(), y.begin(), y.end());
    v.softmax_backward_row(y.data(), p.data(), g.data(), n);
    out.insert(out.end(), y.begin(), y.end());
    Real mean = 0, rstd = 0;
    v.layer_norm_forward_row(y.data(), &mean, &rstd, x.data(), w.data(), g.data(), n, Real(1e-5));
    out.insert(out.end(), y.begin(), y.end());
    out.push_back(mean);
    out.push_back(rstd);
    v.layer_norm_backward_row(d.data(), p.data(), x.data(), w.data(), mean, rstd, n, true);
    out.insert(out.end(), d.begin(), d.end());
    std::vector<Real> dw(n, Real(0)), db(n, Real(0));
    v.layer_norm_param_grads(dw.data(), db.data(), g.data(), x.data(), &mean, &rstd, 1, n, 0, n);
    out.insert(out.end(), dw.begin(), dw.end());
    out.insert(out.end(), db.begin(), db.end());
  }
  return out;
}

// The scalar results' hashes as computed on x86-64 (GCC 12, -O2 -ffp-contract=off).
constexpr std::uint64_t kExpectedFloat = 0x6c6cc1f8b880d55cull;
constexpr std::uint64_t kExpectedDouble = 0x44e70d6fcf6a680full;

template <class Real>
void test_dtype(const char* dtype, std::uint64_t expected) {
  const auto all = isas();
  const auto want = run_all<Real>(*all.front().k);
  std::uint64_t h = 0xCBF29CE484222325ull;
  hash_into(h, want);
  std::printf("%s: %zu values, scalar hash 0x%016llx\n", dtype, want.size(),
              static_cast<unsigned long long>(h));
  check(h == expected, std::string(dtype) + " scalar results match the recorded x86-64 hash");
  for (std::size_t i = 1; i < all.size(); ++i) {
    sections.clear();
    const auto got = run_all<Real>(*all[i].k);
    for (std::size_t e = 0; e < want.size() && e < got.size(); ++e) {
      if (std::memcmp(&got[e], &want[e], sizeof(Real)) != 0) {
        std::string where = "?";
        for (const auto& [at, name] : sections)
          if (at <= e) where = name;
        std::printf("  first difference at %zu (%s): %.9g vs %.9g\n", e, where.c_str(),
                    static_cast<double>(got[e]), static_cast<double>(want[e]));
        break;
      }
    }
    check(got.size() == want.size() &&
              std::memcmp(got.data(), want.data(), want.size() * sizeof(Real)) == 0,
          std::string(dtype) + " " + all[i].name + " is bitwise identical to scalar");
  }
}

// Every rounding kernel's output bytes on 2^16 float bit patterns spread over all 2^32 (a
// multiplicative hash of the index) and the specials, every fp8 and 16-bit byte widened.
std::vector<unsigned char> run_rounding(const RoundKernels& r) {
  std::vector<std::uint32_t> bits;
  for (std::uint32_t i = 0; i < (1u << 16); ++i) bits.push_back(i * 0x9E3779B1u);
  for (std::uint32_t u : {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                          0x7F800001u, 0x43E80000u, 0x47700000u, 0x477FF000u, 0x00000001u})
    bits.push_back(u);
  const auto n = static_cast<index_t>(bits.size());
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  std::vector<unsigned char> out;
  const auto append = [&](const void* p, std::size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(p);
    out.insert(out.end(), c, c + bytes);
  };
  std::vector<float> f(bits.size());
  std::vector<std::uint16_t> h(bits.size());
  std::vector<std::uint8_t> b(bits.size());
  for (teo::Precision p : {teo::Precision::bf16, teo::Precision::fp16, teo::Precision::tf32}) {
    r.round(f.data(), in.data(), n, p);
    append(f.data(), f.size() * 4);
  }
  for (teo::Precision p : {teo::Precision::bf16, teo::Precision::fp16}) {
    r.narrow(h.data(), in.data(), n, p);
    append(h.data(), h.size() * 2);
    std::vector<std::uint16_t> all(1 << 16);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
    std::vector<float> w(all.size());
    r.widen(w.data(), all.data(), static_cast<index_t>(all.size()), p);
    append(w.data(), w.size() * 4);
  }
  for (teo::Fp8Format fmt : {teo::Fp8Format::e4m3, teo::Fp8Format::e5m2}) {
    for (bool sat : {false, true}) {
      r.round_fp8(f.data(), in.data(), n, fmt, sat);
      append(f.data(), f.size() * 4);
      r.narrow_fp8(b.data(), in.data(), n, fmt, sat);
      append(b.data(), b.size());
    }
    std::vector<std::uint8_t> all(256);
    for (int i = 0; i < 256; ++i) all[i] = static_cast<std::uint8_t>(i);
    std::vector<float> w(256);
    r.widen_fp8(w.data(), all.data(), 256, fmt);
    append(w.data(), w.size() * 4);
  }
  for (int offset : {0, 8}) {
    for (bool up : {false, true}) {
      r.to_e8m0(b.data(), in.data(), n, offset, up);
      append(b.data(), b.size());
    }
  }
  return out;
}

// The scalar rounding results' hash as computed on x86-64.
constexpr std::uint64_t kExpectedRounding = 0xd94570d3c801e813ull;

void test_rounding() {
  const auto all = isas();
  const auto want = run_rounding(all.front().k->rounding);
  std::uint64_t h = 0xCBF29CE484222325ull;
  hash_into(h, want);
  std::printf("rounding: %zu bytes, scalar hash 0x%016llx\n", want.size(),
              static_cast<unsigned long long>(h));
  check(h == kExpectedRounding, "rounding scalar results match the recorded x86-64 hash");
  for (std::size_t i = 1; i < all.size(); ++i) {
    const auto got = run_rounding(all[i].k->rounding);
    check(got == want, std::string("rounding ") + all[i].name + " is bitwise identical to scalar");
  }
}

}  // namespace

// The small-GEMM path (A and B read in place) gives the packed path's bits for every transpose,
// alpha and beta, on every ISA and both register tiles (simd_gemm picks it by size alone, so the
// two must agree), with leading dimensions wider than the operands, and writes nothing outside C.
template <class Real>
void test_small_gemm(const Isa& isa) {
  std::uint64_t stream = 9000;
  int mismatches = 0;
  for (const GemmKernel<Real>* tile : tiles_of<Real>(*isa.k))
    for (Trans ta : {Trans::no, Trans::yes})
      for (Trans tb : {Trans::no, Trans::yes})
        for (index_t m : {1, 3, 5, 14, 17, 64})
          for (index_t n : {1, 7, 8, 14, 16, 33, 64})
            for (index_t kk : {1, 4, 16, 50, 300})  // 300: several KC blocks on the packed path
              for (int variant = 0; variant < 3; ++variant) {
                const index_t lda = (ta == Trans::no ? kk : m) + 3;
                const index_t ldb = (tb == Trans::no ? n : kk) + 2, ldc = n + 1;
                const auto a = random<Real>((ta == Trans::no ? m : kk) * lda, stream++, -1, 1);
                const auto b = random<Real>((tb == Trans::no ? kk : n) * ldb, stream++, -1, 1);
                const auto c0 = random<Real>(m * ldc, stream++, -1, 1);
                const Real beta = static_cast<Real>(variant == 0   ? 0.0
                                                    : variant == 1 ? 1.0
                                                                   : -0.75);
                const Real alpha = static_cast<Real>(variant == 2 ? 0.37 : 1.0);
                // The packed path on a dense copy of C.
                std::vector<Real> packed(static_cast<std::size_t>(m * n));
                for (index_t i = 0; i < m; ++i)
                  for (index_t j = 0; j < n; ++j)
                    packed[static_cast<std::size_t>(i * n + j)] =
                        c0[static_cast<std::size_t>(i * ldc + j)];
                packed_gemm(*tile, ta, tb, m, n, kk, alpha, a.data(), lda, b.data(), ldb, beta,
                            packed.data());
                std::vector<Real> scratch(
                    static_cast<std::size_t>(teo::detail::small_scratch_size(*tile, n, kk)));
                auto small = c0;
                const teo::simd::Start start = teo::detail::start_of(beta);
                tile->small(ta == Trans::yes, tb == Trans::yes, m, n, kk, alpha, a.data(), lda,
                            b.data(), ldb, small.data(), ldc, start, beta, scratch.data());
                bool same = true;
                for (index_t i = 0; i < m; ++i)
                  for (index_t j = 0; j < ldc; ++j) {
                    const std::size_t at = static_cast<std::size_t>(i * ldc + j);
                    const Real want = j < n ? packed[static_cast<std::size_t>(i * n + j)] : c0[at];
                    same = same && std::memcmp(&small[at], &want, sizeof(Real)) == 0;
                  }
                if (!same) ++mismatches;
              }
  check(mismatches == 0, std::string(isa.name) + " " + (sizeof(Real) == 4 ? "float" : "double") +
                             " small GEMM equals the packed GEMM bit for bit (" +
                             std::to_string(mismatches) + " mismatching shapes)");
}

// Every ISA's packing routine writes exactly what the plain loop of its contract writes, including
// the zero padding and the alpha scaling, for both layouts, for one sliver and for several, and for
// widths and depths that leave partial in-register blocks (nothing past the panel is touched).
template <class Real>
void test_pack(const Isa& isa) {
  std::uint64_t stream = 7000;
  int mismatches = 0;
  const auto tiles = tiles_of<Real>(*isa.k);
  for (const GemmKernel<Real>* tile : tiles)
    for (bool transposed : {false, true})
      for (bool is_a : {true, false})  // pack_a (MR-wide slivers), then pack_b (NR-wide)
        for (const index_t width = is_a ? tile->mr : tile->nr;
             index_t rows : {index_t{1}, width / 2 + 1, width, 3 * width - 1, 4 * width})
          for (index_t kc : {1, 7, 8, 9, 17, 64, 77})
            for (Real alpha : {Real(1), static_cast<Real>(0.37)}) {
              const index_t slivers = (rows + width - 1) / width;
              const index_t ld = (transposed ? kc : rows) + 3;
              const auto src = random<Real>((transposed ? rows : kc) * ld, stream++, -1, 1);
              std::vector<Real> want(static_cast<std::size_t>(slivers * width * kc + 5), Real(-7));
              auto got = want;
              for (index_t s = 0; s < slivers; ++s)
                for (index_t p = 0; p < kc; ++p)
                  for (index_t i = 0; i < width; ++i) {
                    const index_t r = s * width + i;
                    const Real v = r >= rows    ? Real(0)
                                   : transposed ? src[static_cast<std::size_t>(r * ld + p)]
                                                : src[static_cast<std::size_t>(p * ld + r)];
                    want[static_cast<std::size_t>((s * kc + p) * width + i)] =
                        alpha == Real(1) ? v : alpha * v;
                  }
              (is_a ? tile->pack_a : tile->pack_b)(transposed, got.data(), src.data(), ld, rows, kc,
                                                   alpha);
              if (std::memcmp(got.data(), want.data(), got.size() * sizeof(Real)) != 0)
                ++mismatches;
            }
  check(mismatches == 0, std::string(isa.name) + " " + (sizeof(Real) == 4 ? "float" : "double") +
                             " packing equals the plain copy (" + std::to_string(mismatches) +
                             " mismatching cases)");
}

// The second register tile gives the first one's bits (simd_gemm picks between them by shape).
template <class Real>
void test_alt_tile(const Isa& isa) {
  const auto tiles = tiles_of<Real>(*isa.k);
  std::uint64_t stream = 11000;
  int mismatches = 0;
  for (Trans ta : {Trans::no, Trans::yes})
    for (Trans tb : {Trans::no, Trans::yes})
      for (index_t m : {1, 5, 13, 64})
        for (index_t n : {7, 32, 50, 64})
          for (index_t kk : {3, 64, 300}) {
            const auto a = random<Real>(m * kk, stream++, -1, 1);
            const auto b = random<Real>(kk * n, stream++, -1, 1);
            const auto c0 = random<Real>(m * n, stream++, -1, 1);
            const Real alpha = static_cast<Real>(kk == 64 ? 0.125 : 1.0);
            const Real beta = static_cast<Real>(m == 5 ? 0.5 : 0.0);
            const index_t lda = ta == Trans::no ? kk : m, ldb = tb == Trans::no ? n : kk;
            std::vector<Real> out[2] = {c0, c0};
            for (int t = 0; t < 2; ++t)
              packed_gemm(*tiles[t], ta, tb, m, n, kk, alpha, a.data(), lda, b.data(), ldb, beta,
                          out[t].data());
            if (std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(Real)) != 0)
              ++mismatches;
          }
  check(mismatches == 0, std::string(isa.name) + " " + (sizeof(Real) == 4 ? "float" : "double") +
                             " second register tile equals the first bit for bit (" +
                             std::to_string(mismatches) + " mismatching shapes)");
}

int main() {
  std::string names;
  for (const auto& i : isas()) names += std::string(" ") + i.name;
  std::printf("ISAs here:%s\n", names.c_str());
  test_dtype<float>("float", kExpectedFloat);
  test_dtype<double>("double", kExpectedDouble);
  test_rounding();
  for (const auto& i : isas()) {
    test_small_gemm<float>(i);
    test_small_gemm<double>(i);
    test_pack<float>(i);
    test_pack<double>(i);
    test_alt_tile<float>(i);
    test_alt_tile<double>(i);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
