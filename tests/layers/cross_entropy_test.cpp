#include <cmath>

#include "support.hpp"
#include "teo/layers/cross_entropy.hpp"

namespace teo {
namespace {

template <class Real>
class CrossEntropy : public ::testing::Test {};
TYPED_TEST_SUITE(CrossEntropy, test::Dtypes);

TYPED_TEST(CrossEntropy, MatchesPyTorchDefinitionWithLabelSmoothing) {
  using Real = TypeParam;
  const index_t b = 3, c = 5;
  const auto z = test::uniform_vector<Real>(b * c, 1, "z", -4, 4);
  const std::vector<std::int64_t> y = {0, 4, 2};
  for (double eps : {0.0, 0.1, 1.0}) {
    std::vector<Real> p(b * c);
    const Real loss =
        cross_entropy_forward(p.data(), z.data(), y.data(), b, c, static_cast<Real>(eps));
    double want = 0;
    for (index_t i = 0; i < b; ++i) {
      double lse = 0;
      for (index_t k = 0; k < c; ++k) lse += std::exp(static_cast<double>(z[i * c + k]));
      lse = std::log(lse);
      double sum_logp = 0;
      for (index_t k = 0; k < c; ++k) sum_logp += z[i * c + k] - lse;
      want += -(1 - eps) * (z[i * c + y[i]] - lse) - eps / c * sum_logp;
    }
    EXPECT_NEAR(loss, want / b, 20 * test::Tol<Real>::rel) << "eps " << eps;
  }
}

TYPED_TEST(CrossEntropy, EmptyBatchGivesZeroLossAndNoGradient) {
  using Real = TypeParam;
  std::vector<Real> probs(3, Real(-7)), dlogits(3, Real(-7));
  EXPECT_EQ(cross_entropy_forward<Real>(probs.data(), nullptr, nullptr, 0, 3, Real(0.1)), Real(0));
  cross_entropy_backward<Real>(dlogits.data(), probs.data(), nullptr, 0, 3, Real(0.1), Real(1));
  for (Real v : probs) EXPECT_EQ(v, Real(-7));  // nothing written past an empty batch
  for (Real v : dlogits) EXPECT_EQ(v, Real(-7));
}

TYPED_TEST(CrossEntropy, LargeLogitsStayFinite) {
  using Real = TypeParam;
  const std::vector<Real> z = {1000, -1000, 0};
  const std::vector<std::int64_t> y = {1};
  std::vector<Real> p(3);
  const Real loss = cross_entropy_forward(p.data(), z.data(), y.data(), 1, 3, Real(0));
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, 2000, 1e-3);
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const index_t b = 4, c = 6;
  auto z = test::uniform_vector<double>(b * c, 1, "z", -3, 3);
  const std::vector<std::int64_t> y = {5, 0, 3, 3};
  for (double eps : {0.0, 0.2}) {
    std::vector<double> p(b * c), dz(b * c, 0.0);
    cross_entropy_forward(p.data(), z.data(), y.data(), b, c, eps);
    cross_entropy_backward(dz.data(), p.data(), y.data(), b, c, eps, 1.0);
    auto loss = [&] {
      std::vector<double> q(b * c);
      return cross_entropy_forward(q.data(), z.data(), y.data(), b, c, eps);
    };
    test::expect_gradient("dlogits", z.data(), dz, loss);
  }
}

}  // namespace
}  // namespace teo
