#include <cmath>
#include <cstring>
#include <limits>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/layer_norm.hpp"

namespace teo {
namespace {

template <class Real>
class LayerNorm : public ::testing::Test {};
TYPED_TEST_SUITE(LayerNorm, test::Dtypes);

TYPED_TEST(LayerNorm, ForwardMatchesDoubleDefinition) {
  using Real = TypeParam;
  const index_t rows = 6, cols = 13;
  const auto x = test::uniform_vector<Real>(rows * cols, 1, "x", -3, 5);
  const auto w = test::uniform_vector<Real>(cols, 2, "w");
  const auto b = test::uniform_vector<Real>(cols, 3, "b");
  std::vector<Real> y(x.size()), mean(rows), rstd(rows);
  layer_norm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, cols,
                     Real(1e-5));
  for (index_t r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (index_t c = 0; c < cols; ++c) m += x[r * cols + c];
    m /= cols;
    for (index_t c = 0; c < cols; ++c) v += (x[r * cols + c] - m) * (x[r * cols + c] - m);
    v /= cols;                                 // biased variance
    const double s = 1 / std::sqrt(v + 1e-5);  // eps inside the sqrt
    EXPECT_NEAR(mean[r], m, 10 * test::Tol<Real>::rel);
    EXPECT_NEAR(rstd[r], s, 10 * test::Tol<Real>::rel * s);
    for (index_t c = 0; c < cols; ++c)
      EXPECT_NEAR(y[r * cols + c], (x[r * cols + c] - m) * s * w[c] + b[c],
                  10 * test::Tol<Real>::rel);
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const index_t rows = 4, cols = 7;
  auto x = test::uniform_vector<double>(rows * cols, 1, "x", -2, 2);
  auto w = test::uniform_vector<double>(cols, 2, "w", 0.5, 1.5);
  auto b = test::uniform_vector<double>(cols, 3, "b");
  const auto r = test::uniform_vector<double>(rows * cols, 4, "r");
  std::vector<double> y(x.size()), mean(rows), rstd(rows);
  layer_norm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, cols,
                     1e-5);
  std::vector<double> dx(x.size(), 0.0), dw(cols, 0.0), db(cols, 0.0);
  layer_norm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), mean.data(),
                      rstd.data(), rows, cols);
  auto loss = [&] {
    std::vector<double> out(x.size()), m(rows), s(rows);
    layer_norm_forward(out.data(), m.data(), s.data(), x.data(), w.data(), b.data(), rows, cols,
                       1e-5);
    return test::dot(out, r);
  };
  test::expect_gradient("din", x.data(), dx, loss);
  test::expect_gradient("dweight", w.data(), dw, loss);
  test::expect_gradient("dbias", b.data(), db, loss);
}

TEST(LayerNorm, ConstantRowGivesBiasAndFiniteGradient) {
  const index_t cols = 5;
  std::vector<double> x(cols, 3.25), w(cols, 2.0), b = {1, 2, 3, 4, 5}, y(cols), m(1), s(1);
  layer_norm_forward(y.data(), m.data(), s.data(), x.data(), w.data(), b.data(), 1, cols, 1e-5);
  for (index_t c = 0; c < cols; ++c) EXPECT_EQ(y[c], b[c]);  // zero variance: eps keeps it finite
  std::vector<double> g(cols, 1.0), dx(cols, 0.0), dw(cols, 0.0), db(cols, 0.0);
  layer_norm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(), m.data(),
                      s.data(), 1, cols);
  // norm = 0 everywhere, so dx = rstd * (g w - mean(g w) - 0) = 0, dweight = g * norm = 0 and
  // dbias = g, all exactly.
  for (index_t c = 0; c < cols; ++c) {
    EXPECT_EQ(dx[c], 0.0);
    EXPECT_EQ(dw[c], 0.0);
    EXPECT_EQ(db[c], 1.0);
  }
}

// GradWrite::overwrite gives the bits of accumulating into zeros on every backend and never
// reads din (a buffer of NaN); the weight and bias gradients accumulate either way.
TYPED_TEST(LayerNorm, OverwriteGivesTheBitsOfAccumulatingIntoZeros) {
  using Real = TypeParam;
  const index_t rows = 5, cols = 37;  // a vector tail on every ISA
  const auto x = test::uniform_vector<Real>(rows * cols, 1, "x", -2, 2);
  const auto w = test::uniform_vector<Real>(cols, 2, "w", 0.5, 1.5);
  const auto b = test::uniform_vector<Real>(cols, 3, "b");
  auto g = test::uniform_vector<Real>(rows * cols, 4, "g");
  for (index_t c = 0; c < cols; ++c) g[static_cast<std::size_t>(2 * cols + c)] = Real(-0.0);
  std::vector<Real> y(x.size()), mean(rows), rstd(rows);
  ScopedSettings restore;
  for (Backend be : {Backend::reference, Backend::simd}) {
    set_backend(be);
    layer_norm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), rows, cols,
                       Real(1e-5));
    std::vector<Real> acc(x.size(), Real(0));
    std::vector<Real> over(x.size(), std::numeric_limits<Real>::quiet_NaN());
    std::vector<Real> dw1(cols, Real(1)), db1(cols, Real(2)), dw2(dw1), db2(db1);
    layer_norm_backward(acc.data(), dw1.data(), db1.data(), g.data(), x.data(), w.data(),
                        mean.data(), rstd.data(), rows, cols);
    layer_norm_backward(over.data(), dw2.data(), db2.data(), g.data(), x.data(), w.data(),
                        mean.data(), rstd.data(), rows, cols, GradWrite::overwrite);
    EXPECT_EQ(std::memcmp(acc.data(), over.data(), acc.size() * sizeof(Real)), 0) << to_string(be);
    EXPECT_EQ(dw1, dw2) << to_string(be);
    EXPECT_EQ(db1, db2) << to_string(be);
    EXPECT_NE(dw1, std::vector<Real>(cols, Real(1))) << "the weight gradient accumulated";
    // a row of -0 gradients gives +0 (0 + -0), as accumulating into zeros does
    for (index_t c = 0; c < cols; ++c)
      EXPECT_FALSE(std::signbit(over[static_cast<std::size_t>(2 * cols + c)])) << c;
  }
}

}  // namespace
}  // namespace teo
