#include "teo/layers/dropout.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "support.hpp"

namespace teo {
namespace {

template <class Real>
class Dropout : public ::testing::Test {};
TYPED_TEST_SUITE(Dropout, test::Dtypes);

TEST(Dropout, MaskIsAPureFunctionOfSeedSiteAndIndex) {
  std::vector<std::uint8_t> a(1000), b(1000), c(1000), d(1000), prefix(10);
  dropout_mask(a.data(), 1000, 42, "dropout.input", 0.3);
  dropout_mask(b.data(), 1000, 42, "dropout.input", 0.3);
  dropout_mask(c.data(), 1000, 43, "dropout.input", 0.3);
  dropout_mask(d.data(), 1000, 42, "dropout.layers.0.attn", 0.3);
  dropout_mask(prefix.data(), 10, 42, "dropout.input", 0.3);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), a.begin()));  // no dependence on n
}

TEST(Dropout, KeepRateMatchesProbability) {
  const index_t n = 200000;
  std::vector<std::uint8_t> m(n);
  for (double p : {0.0, 0.1, 0.5, 0.9}) {
    dropout_mask(m.data(), n, 7, "site", p);
    double kept = 0;
    for (auto v : m) kept += v;
    // binomial standard deviation is at most sqrt(n / 4) ~ 224 elements: allow 5 sigma
    EXPECT_NEAR(kept / n, 1 - p, 5 * 0.5 / std::sqrt(static_cast<double>(n))) << "p = " << p;
  }
}

TYPED_TEST(Dropout, ForwardScalesKeptAndZeroesDropped) {
  using Real = TypeParam;
  const index_t n = 64;
  const auto x = test::uniform_vector<Real>(n, 1, "x");
  std::vector<std::uint8_t> m(n);
  dropout_mask(m.data(), n, 3, "s", 0.25);
  const Real scale = dropout_scale<Real>(0.25);
  EXPECT_EQ(scale, static_cast<Real>(1 / 0.75));
  std::vector<Real> y(n);
  dropout_forward(y.data(), x.data(), m.data(), n, scale);
  for (index_t i = 0; i < n; ++i) EXPECT_EQ(y[i], m[i] ? x[i] * scale : Real(0));
  std::vector<Real> dx(n, Real(0));
  dropout_backward(dx.data(), x.data(), m.data(), n, scale);
  EXPECT_EQ(dx, y);  // linear: the backward of the mask is the mask
}

// GradWrite::overwrite gives the bits of accumulating into zeros (+0 for a dropped element or a
// -0 term) and never reads din.
TYPED_TEST(Dropout, OverwriteGivesTheBitsOfAccumulatingIntoZeros) {
  using Real = TypeParam;
  const index_t n = 101;
  auto g = test::uniform_vector<Real>(n, 1, "g");
  g[0] = Real(-0.0);
  g[1] = Real(-0.0);
  std::vector<std::uint8_t> m(n);
  dropout_mask(m.data(), n, 3, "s", 0.25);
  m[0] = 1;
  m[1] = 0;
  const Real scale = dropout_scale<Real>(0.25);
  std::vector<Real> acc(n, Real(0)), over(n, std::numeric_limits<Real>::quiet_NaN());
  dropout_backward(acc.data(), g.data(), m.data(), n, scale);
  dropout_backward(over.data(), g.data(), m.data(), n, scale, GradWrite::overwrite);
  EXPECT_EQ(std::memcmp(acc.data(), over.data(), acc.size() * sizeof(Real)), 0);
  EXPECT_FALSE(std::signbit(over[0]));
  EXPECT_FALSE(std::signbit(over[1]));
  EXPECT_NE(std::count(m.begin(), m.end(), 0), 0) << "some elements are dropped";
}

}  // namespace
}  // namespace teo
