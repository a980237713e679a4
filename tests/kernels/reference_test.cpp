#include <cmath>
#include <limits>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/kernels.hpp"

namespace teo {
namespace {

template <class Real>
class GemmReference : public ::testing::Test {};
TYPED_TEST_SUITE(GemmReference, test::Dtypes);

// C = alpha op(A) op(B) + beta C, checked element by element against a long-double loop.
TYPED_TEST(GemmReference, MatchesNaiveProductForEveryTranspose) {
  using Real = TypeParam;
  const index_t m = 7, n = 5, k = 9;
  for (Trans ta : {Trans::no, Trans::yes}) {
    for (Trans tb : {Trans::no, Trans::yes}) {
      const auto a = test::uniform_vector<Real>(m * k, 1, "a");
      const auto b = test::uniform_vector<Real>(k * n, 2, "b");
      auto c = test::uniform_vector<Real>(m * n, 3, "c");
      const auto c0 = c;
      const index_t lda = ta == Trans::no ? k : m, ldb = tb == Trans::no ? n : k;
      gemm<Real>(ta, tb, m, n, k, Real(0.5), a.data(), lda, b.data(), ldb, Real(2), c.data(), n);
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < n; ++j) {
          long double acc = 0;
          for (index_t p = 0; p < k; ++p) {
            const Real av = ta == Trans::no ? a[i * lda + p] : a[p * lda + i];
            const Real bv = tb == Trans::no ? b[p * ldb + j] : b[j * ldb + p];
            acc += static_cast<long double>(av) * bv;
          }
          const double want = static_cast<double>(0.5L * acc + 2.0L * c0[i * n + j]);
          EXPECT_NEAR(c[i * n + j], want, 20 * std::numeric_limits<Real>::epsilon() * k);
        }
    }
  }
}

TYPED_TEST(GemmReference, BetaZeroNeverReadsC) {
  using Real = TypeParam;
  const auto a = test::uniform_vector<Real>(12, 1, "a");
  const auto b = test::uniform_vector<Real>(12, 2, "b");
  std::vector<Real> c(9, std::numeric_limits<Real>::quiet_NaN());
  gemm<Real>(Trans::no, Trans::no, 3, 3, 4, Real(1), a.data(), 4, b.data(), 3, Real(0), c.data(),
             3);
  for (Real v : c) EXPECT_TRUE(std::isfinite(v));
}

TYPED_TEST(GemmReference, EmptyDimensionsAreNoOps) {
  using Real = TypeParam;
  std::vector<Real> c(4, Real(7));
  gemm<Real>(Trans::no, Trans::no, 2, 2, 0, Real(1), nullptr, 0, nullptr, 2, Real(1), c.data(), 2);
  for (Real v : c) EXPECT_EQ(v, Real(7));  // k = 0: C = beta C
  gemm<Real>(Trans::no, Trans::no, 0, 2, 3, Real(1), nullptr, 3, nullptr, 2, Real(0), nullptr, 2);
}

}  // namespace
}  // namespace teo
