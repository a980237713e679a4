// The simd and blas GEMMs against the reference, and the simd GEMM's determinism: bitwise
// identical across forced ISAs, thread counts (1, 2, 7) and repeated runs.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "kernels/kernels_internal.hpp"
#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/kernels.hpp"

namespace teo {
namespace {

struct GemmCase {
  Trans ta, tb;
  index_t m, n, k;
  double alpha, beta;
};

// Sizes 1, N-1, N, N+1 and primes around every register-tile edge (MR in {4, 6, 8, 12}, NR in
// {4, 6, 8, 12, 16, 24, 32}), a k longer than every KC (so partial sums cross k blocks), and the
// encoder's own shapes at a small batch.
std::vector<GemmCase> cases() {
  std::vector<GemmCase> out;
  const index_t ms[] = {1, 5, 11, 12, 13, 29};
  const index_t ns[] = {1, 7, 13, 15, 16, 17, 23, 25, 31, 33, 47};
  const index_t ks[] = {1, 7, 300};
  int i = 0;
  for (Trans ta : {Trans::no, Trans::yes})
    for (Trans tb : {Trans::no, Trans::yes})
      for (index_t m : ms)
        for (index_t n : ns)
          for (index_t k : ks) {
            const double alpha = (i % 3 == 0) ? 1.0 : 0.37;
            const double beta = (i % 4 == 0) ? 0.0 : (i % 4 == 1 ? 1.0 : -0.5);
            out.push_back({ta, tb, m, n, k, alpha, beta});
            ++i;
          }
  out.push_back({Trans::no, Trans::yes, 96, 130, 773, 1.0, 0.0});   // k across three KC blocks
  out.push_back({Trans::yes, Trans::no, 64, 48, 1000, 1.0, 1.0});   // weight-gradient shape
  out.push_back({Trans::no, Trans::no, 257, 200, 64, 0.125, 0.0});  // attention shape
  // n above every NC: several B panels (of different widths on different ISAs)
  out.push_back({Trans::yes, Trans::yes, 13, 3100, 40, 0.37, -0.5});
  return out;
}

template <class Real>
struct Operands {
  std::vector<Real> a, b, c;
  index_t lda, ldb;
};

template <class Real>
Operands<Real> make(const GemmCase& g, std::uint64_t seed) {
  Operands<Real> o;
  o.a = test::uniform_vector<Real>(g.m * g.k, seed, "a");
  o.b = test::uniform_vector<Real>(g.k * g.n, seed, "b");
  o.c = test::uniform_vector<Real>(g.m * g.n, seed, "c");
  o.lda = g.ta == Trans::no ? g.k : g.m;
  o.ldb = g.tb == Trans::no ? g.n : g.k;
  return o;
}

template <class Real>
std::vector<Real> run(const GemmCase& g, const Operands<Real>& o) {
  std::vector<Real> c = o.c;
  if (g.beta == 0) std::fill(c.begin(), c.end(), std::numeric_limits<Real>::quiet_NaN());
  gemm<Real>(g.ta, g.tb, g.m, g.n, g.k, static_cast<Real>(g.alpha), o.a.data(), o.lda, o.b.data(),
             o.ldb, static_cast<Real>(g.beta), c.data(), g.n);
  return c;
}

std::string describe(const GemmCase& g) {
  return std::string(g.ta == Trans::no ? "N" : "T") + (g.tb == Trans::no ? "N" : "T") +
         " m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) +
         " alpha=" + std::to_string(g.alpha) + " beta=" + std::to_string(g.beta);
}

template <class Real>
class Gemm : public ::testing::Test {
 protected:
  ScopedSettings restore_;
};
TYPED_TEST_SUITE(Gemm, test::Dtypes);

// Each element's error bound: k roundings of terms no larger than max|a| max|b| = 1, plus C.
template <class Real>
double bound(const GemmCase& g) {
  return 4.0 * (static_cast<double>(g.k) + 2) * std::numeric_limits<Real>::epsilon();
}

TYPED_TEST(Gemm, EveryBackendAndIsaMatchesTheReference) {
  using Real = TypeParam;
  for (const GemmCase& g : cases()) {
    const auto o = make<Real>(g, static_cast<std::uint64_t>(g.m * 1000 + g.n * 10 + g.k));
    set_backend(Backend::reference);
    const auto want = run(g, o);
    std::vector<std::pair<std::string, std::vector<Real>>> got;
    set_backend(Backend::blas);
    got.emplace_back("blas", run(g, o));
    set_backend(Backend::simd);
    for (Isa i : supported_isas()) {
      set_isa(i);
      got.emplace_back(std::string("simd/") + to_string(i), run(g, o));
    }
    for (const auto& [name, c] : got)
      for (std::size_t e = 0; e < c.size(); ++e)
        ASSERT_NEAR(c[e], want[e], bound<Real>(g)) << name << " " << describe(g) << " at " << e;
  }
}

TYPED_TEST(Gemm, SimdIsBitwiseIdenticalAcrossIsasAndThreadCounts) {
  using Real = TypeParam;
  set_backend(Backend::simd);
  std::vector<GemmCase> cs = cases();
  cs.push_back({Trans::no, Trans::yes, 300, 200, 520, 1.0, 0.0});  // big enough to go parallel
  cs.push_back({Trans::yes, Trans::no, 200, 96, 700, 1.0, 1.0});
  for (const GemmCase& g : cs) {
    const auto o = make<Real>(g, 99);
    set_isa(Isa::scalar);
    set_num_threads(1);
    const auto want = run(g, o);
    for (Isa i : supported_isas()) {
      set_isa(i);
      for (int t : {1, 2, 7}) {
        set_num_threads(t);
        for (int rep = 0; rep < 2; ++rep) {
          const auto c = run(g, o);
          ASSERT_EQ(std::memcmp(c.data(), want.data(), c.size() * sizeof(Real)), 0)
              << to_string(i) << " threads=" << t << " " << describe(g);
        }
      }
    }
  }
}

// KC, MC, NC and the split among threads (the knobs bench/blocking_sweep.cpp tunes and the
// per-vendor tables set) decide how often C is revisited and which task computes a tile, never the
// order of a sum: the tile teo::gemm uses, with any blocking and either split, on 1, 2 or 3
// threads, gives teo::gemm's bits.
TYPED_TEST(Gemm, BlockingNeverChangesABit) {
  using Real = TypeParam;
  set_backend(Backend::simd);
  const GemmCase cs[] = {{Trans::no, Trans::yes, 100, 130, 773, 1.0, 0.0},
                         {Trans::yes, Trans::no, 64, 48, 1000, 0.37, 1.0},
                         {Trans::no, Trans::no, 257, 200, 64, 0.125, -0.5},
                         {Trans::yes, Trans::yes, 45, 3100, 40, 1.0, 1.0}};
  const std::pair<index_t, index_t> blockings[] = {{1, 1}, {7, 13}, {64, 24}, {5000, 5000}};
  // the owned split keeping each task's packed A across its panels, and packing it per panel
  const std::pair<simd::Split, bool> kSplits[] = {
      {simd::Split::shared_panel, true}, {simd::Split::owned, true}, {simd::Split::owned, false}};
  for (const GemmCase& g : cs) {
    const auto o = make<Real>(g, 7);
    for (Isa i : supported_isas()) {
      set_isa(i);
      set_num_threads(1);
      const auto want = run(g, o);
      for (const auto& [kc, mc] : blockings)
        for (const auto& [split, keep_a] : kSplits)
          for (int t : {1, 2, 3}) {
            set_num_threads(t);
            simd::GemmKernel<Real> kern = detail::gemm_tile<Real>(detail::isa_kernels(), g.m, g.n);
            kern.kc = kc;
            kern.mc = mc;
            kern.nc = std::max<index_t>(kern.nr, mc * 3);
            kern.split = split;
            if (!keep_a) kern.keep_a_bytes = 0;
            std::vector<Real> c = o.c;
            if (g.beta == 0) std::fill(c.begin(), c.end(), std::numeric_limits<Real>::quiet_NaN());
            detail::simd_gemm(kern, g.ta, g.tb, g.m, g.n, g.k, static_cast<Real>(g.alpha),
                              o.a.data(), o.lda, o.b.data(), o.ldb, static_cast<Real>(g.beta),
                              c.data(), g.n);
            ASSERT_EQ(std::memcmp(c.data(), want.data(), c.size() * sizeof(Real)), 0)
                << to_string(i) << " kc=" << kc << " mc=" << mc << " nc=" << kern.nc
                << (split == simd::Split::shared_panel ? " shared panel"
                    : keep_a                           ? " owned, A kept"
                                                       : " owned, A packed per panel")
                << " threads=" << t << " " << describe(g);
          }
    }
  }
}

TYPED_TEST(Gemm, BetaZeroNeverReadsCOnAnyBackend) {
  using Real = TypeParam;
  const GemmCase g{Trans::no, Trans::no, 13, 17, 5, 1.0, 0.0};
  const auto o = make<Real>(g, 5);
  for (Backend b : {Backend::reference, Backend::simd, Backend::blas}) {
    set_backend(b);
    for (Isa i : supported_isas()) {
      set_isa(i);
      for (Real v : run(g, o)) ASSERT_TRUE(std::isfinite(v)) << to_string(b) << "/" << to_string(i);
    }
  }
}

// The cross-ISA tests compare every supported ISA with the scalar fallback: on an x86-64 machine
// without AVX2 they would compare scalar with itself. In CI (CI=true) that is a failure; locally a
// skip that ctest lists. AVX-512 is covered where the machine has it (machines differ), and its
// absence is a listed skip, never a silent one.
TEST(Isa, TheIsasTheSuiteCoversArePresent) {
#if defined(__x86_64__)
  const auto isas = supported_isas();
  const bool ci = std::getenv("CI") && std::string(std::getenv("CI")) == "true";
  const bool avx2 = std::find(isas.begin(), isas.end(), Isa::avx2) != isas.end();
  if (!avx2 && ci)
    FAIL() << "this x86-64 machine has no AVX2: the cross-ISA tests compare scalar "
              "with itself (CI=true makes that a failure)";
  if (!avx2) GTEST_SKIP() << "no AVX2 here: the cross-ISA tests compare scalar with itself";
  if (std::find(isas.begin(), isas.end(), Isa::avx512) == isas.end())
    GTEST_SKIP() << "no AVX-512 here: the AVX-512 kernels are not run on this machine";
#else
  GTEST_SKIP() << "not x86-64: the NEON kernels are covered against the recorded x86-64 hashes";
#endif
}

TEST(Backend, SettingsAreValidatedAndNamed) {
  ScopedSettings restore;
  EXPECT_THROW(set_num_threads(0), ConfigError);
  EXPECT_THROW(set_num_threads(5000), ConfigError);
  EXPECT_THROW(parse_backend("cuda"), ConfigError);
  EXPECT_THROW(parse_isa("sse9"), ConfigError);
  EXPECT_EQ(parse_isa("avx2"), Isa::avx2);
  EXPECT_EQ(supported_isas().back(), Isa::scalar);
  EXPECT_EQ(best_isa(), supported_isas().front());
#if defined(__x86_64__)
  EXPECT_THROW(set_isa(Isa::neon), ConfigError);
#endif
  try {
    parse_backend("cuda", "--backend");
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--backend"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos);
  }
}

}  // namespace
}  // namespace teo
