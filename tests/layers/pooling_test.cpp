#include <cmath>
#include <limits>

#include "support.hpp"
#include "teo/layers/pooling.hpp"

namespace teo {
namespace {

template <class Real>
class PoolingT : public ::testing::Test {};
TYPED_TEST_SUITE(PoolingT, test::Dtypes);

TYPED_TEST(PoolingT, ForwardOverRealTokensOnly) {
  using Real = TypeParam;
  const index_t b = 3, s = 4, d = 2;
  const auto x = test::uniform_vector<Real>(b * s * d, 1, "x");
  const std::vector<std::int64_t> len = {4, 2, 0};
  std::vector<Real> out(b * d);
  std::vector<std::int64_t> arg(b * d);
  pooling_forward(out.data(), arg.data(), x.data(), len.data(), b, s, d, Pooling::mean);
  for (index_t c = 0; c < d; ++c) {
    EXPECT_NEAR(out[1 * d + c], (x[(4 + 0) * d + c] + x[(4 + 1) * d + c]) / 2, 1e-6);
    EXPECT_EQ(out[2 * d + c], Real(0));  // zero tokens: exactly 0
  }
  pooling_forward(out.data(), arg.data(), x.data(), len.data(), b, s, d, Pooling::cls);
  for (index_t c = 0; c < d; ++c) {
    EXPECT_EQ(out[1 * d + c], x[4 * d + c]);
    EXPECT_EQ(out[2 * d + c], Real(0));
  }
  pooling_forward(out.data(), arg.data(), x.data(), len.data(), b, s, d, Pooling::max);
  for (index_t c = 0; c < d; ++c) {
    EXPECT_EQ(out[1 * d + c], std::max(x[4 * d + c], x[5 * d + c]));
    EXPECT_EQ(out[2 * d + c], Real(0));
    EXPECT_EQ(arg[2 * d + c], -1);
  }
}

TEST(Pooling, MaxTiesSendGradientToFirstMaximum) {
  const std::vector<double> x = {1, 5, 5, 2};  // (B=1, S=4, D=1): maximum at s = 1 and s = 2
  const std::vector<std::int64_t> len = {4};
  std::vector<double> out(1);
  std::vector<std::int64_t> arg(1);
  pooling_forward(out.data(), arg.data(), x.data(), len.data(), 1, 4, 1, Pooling::max);
  EXPECT_EQ(arg[0], 1);
  std::vector<double> dx(4, 0.0), g = {3.0};
  pooling_backward(dx.data(), g.data(), arg.data(), len.data(), 1, 4, 1, Pooling::max);
  EXPECT_EQ(dx, (std::vector<double>{0, 3, 0, 0}));
}

// torch.max propagates NaN: the first NaN of a column is its maximum, wherever it is.
TEST(Pooling, MaxPropagatesNaNAsTorchMaxDoes) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // (B=1, S=4, D=3): column 0 has a NaN at s = 2, column 1 at s = 0 and 3, column 2 none.
  const std::vector<double> x = {1, nan, 0, 5, 2, 9, nan, 3, 1, 2, nan, 4};
  const std::vector<std::int64_t> len = {4};
  std::vector<double> out(3);
  std::vector<std::int64_t> arg(3);
  pooling_forward(out.data(), arg.data(), x.data(), len.data(), 1, 4, 3, Pooling::max);
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_EQ(arg[0], 2);
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_EQ(arg[1], 0) << "the first NaN";
  EXPECT_EQ(out[2], 9);
  EXPECT_EQ(arg[2], 1);
  // A NaN past the sequence's length is padding, and is not read.
  const std::vector<std::int64_t> short_len = {2};
  pooling_forward(out.data(), arg.data(), x.data(), short_len.data(), 1, 4, 3, Pooling::max);
  EXPECT_EQ(out[0], 5);
  EXPECT_EQ(arg[0], 1);
}

TEST(Pooling, BackwardMatchesFiniteDifferences) {
  // Random inputs have no ties; the test asserts a gap of 1e-2 between each feature's largest and
  // second-largest real value so that the finite difference never crosses a tie.
  const index_t b = 3, s = 5, d = 4;
  auto x = test::uniform_vector<double>(b * s * d, 11, "x");
  const std::vector<std::int64_t> len = {5, 3, 0};
  for (index_t bb = 0; bb < b; ++bb)
    for (index_t c = 0; c < d; ++c) {
      double first = -1e9, second = -1e9;
      for (index_t t = 0; t < len[bb]; ++t) {
        const double v = x[(bb * s + t) * d + c];
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      if (len[bb] > 1) {
        ASSERT_GT(first - second, 1e-2);
      }
    }
  const auto r = test::uniform_vector<double>(b * d, 12, "r");
  for (Pooling k : {Pooling::mean, Pooling::cls, Pooling::max}) {
    std::vector<double> out(b * d), dx(x.size(), 0.0);
    std::vector<std::int64_t> arg(b * d);
    pooling_forward(out.data(), arg.data(), x.data(), len.data(), b, s, d, k);
    pooling_backward(dx.data(), r.data(), arg.data(), len.data(), b, s, d, k);
    for (index_t t = 3; t < s; ++t)
      for (index_t c = 0; c < d; ++c) EXPECT_EQ(dx[(1 * s + t) * d + c], 0.0);  // padding: exact 0
    auto loss = [&] {
      std::vector<double> o(b * d);
      std::vector<std::int64_t> a(b * d);
      pooling_forward(o.data(), a.data(), x.data(), len.data(), b, s, d, k);
      return test::dot(o, r);
    };
    test::expect_gradient(to_string(k), x.data(), dx, loss);
  }
}

}  // namespace
}  // namespace teo
