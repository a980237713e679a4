#include <cmath>

#include "support.hpp"
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

}  // namespace
}  // namespace teo
