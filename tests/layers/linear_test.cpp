#include <cstring>
#include <limits>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/linear.hpp"

namespace teo {
namespace {

template <class Real>
class Linear : public ::testing::Test {};
TYPED_TEST_SUITE(Linear, test::Dtypes);

TYPED_TEST(Linear, ForwardIsXTimesWeightTransposedPlusBias) {
  using Real = TypeParam;
  const index_t rows = 5, in = 6, out = 3;
  const auto x = test::uniform_vector<Real>(rows * in, 1, "x");
  const auto w = test::uniform_vector<Real>(out * in, 2, "w");  // (out, in), PyTorch's layout
  const auto b = test::uniform_vector<Real>(out, 3, "b");
  std::vector<Real> y(rows * out);
  linear_forward(y.data(), x.data(), w.data(), b.data(), rows, in, out);
  for (index_t r = 0; r < rows; ++r)
    for (index_t o = 0; o < out; ++o) {
      double acc = b[o];
      for (index_t i = 0; i < in; ++i) acc += static_cast<double>(x[r * in + i]) * w[o * in + i];
      EXPECT_NEAR(y[r * out + o], acc, 10 * test::Tol<Real>::rel);
    }
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  const index_t rows = 4, in = 5, out = 3;
  auto x = test::uniform_vector<double>(rows * in, 1, "x");
  auto w = test::uniform_vector<double>(out * in, 2, "w");
  auto b = test::uniform_vector<double>(out, 3, "b");
  const auto r = test::uniform_vector<double>(rows * out, 4, "r");
  std::vector<double> dx(x.size(), 0.0), dw(w.size(), 0.0), db(b.size(), 0.0);
  linear_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), rows, in, out);
  auto loss = [&] {
    std::vector<double> y(rows * out);
    linear_forward(y.data(), x.data(), w.data(), b.data(), rows, in, out);
    return test::dot(y, r);
  };
  test::expect_gradient("din", x.data(), dx, loss);
  test::expect_gradient("dweight", w.data(), dw, loss);
  test::expect_gradient("dbias", b.data(), db, loss);
}

TEST(Linear, BackwardAccumulates) {
  // One row, so that each gradient is a single fresh sum added once: the second call must give
  // exactly twice the first.
  const index_t rows = 1, in = 3, out = 2;
  const auto x = test::uniform_vector<double>(rows * in, 1, "x");
  const auto w = test::uniform_vector<double>(out * in, 2, "w");
  const auto r = test::uniform_vector<double>(rows * out, 4, "r");
  std::vector<double> dx1(x.size(), 0.0), dw1(w.size(), 0.0), db1(out, 0.0);
  linear_backward(dx1.data(), dw1.data(), db1.data(), r.data(), x.data(), w.data(), rows, in, out);
  std::vector<double> dx2 = dx1, dw2 = dw1, db2 = db1;
  linear_backward(dx2.data(), dw2.data(), db2.data(), r.data(), x.data(), w.data(), rows, in, out);
  for (std::size_t i = 0; i < dx1.size(); ++i) EXPECT_EQ(dx2[i], 2 * dx1[i]);
  for (std::size_t i = 0; i < dw1.size(); ++i) EXPECT_EQ(dw2[i], 2 * dw1[i]);
  for (std::size_t i = 0; i < db1.size(); ++i) EXPECT_EQ(db2[i], 2 * db1[i]);
}

// Overwriting din (which the model does for gradients nothing else writes first, instead of
// zero-filling them) gives the bits of accumulating into zeros, on every backend, and never reads
// din: it starts as NaN.
TYPED_TEST(Linear, OverwritingDinGivesTheBitsOfAccumulatingIntoZeros) {
  using Real = TypeParam;
  const index_t rows = 37, in = 29, out = 41;
  const auto x = test::uniform_vector<Real>(rows * in, 1, "x");
  const auto w = test::uniform_vector<Real>(out * in, 2, "w");
  auto r = test::uniform_vector<Real>(rows * out, 4, "r");
  for (index_t o = 0; o < out; ++o) r[o] = Real(-0.0);  // a row of din is a sum of -0 products
  ScopedSettings restore;
  for (Backend be : {Backend::reference, Backend::simd, Backend::blas}) {
    set_backend(be);
    std::vector<Real> dx0(x.size(), Real(0)), dw0(w.size(), Real(0)), db0(out, Real(0));
    linear_backward(dx0.data(), dw0.data(), db0.data(), r.data(), x.data(), w.data(), rows, in,
                    out);
    std::vector<Real> dx1(x.size(), std::numeric_limits<Real>::quiet_NaN());
    std::vector<Real> dw1(w.size(), Real(0)), db1(out, Real(0));
    linear_backward(dx1.data(), dw1.data(), db1.data(), r.data(), x.data(), w.data(), rows, in, out,
                    GradWrite::overwrite);
    EXPECT_EQ(std::memcmp(dx0.data(), dx1.data(), dx0.size() * sizeof(Real)), 0) << to_string(be);
    EXPECT_EQ(std::memcmp(dw0.data(), dw1.data(), dw0.size() * sizeof(Real)), 0) << to_string(be);
    EXPECT_EQ(std::memcmp(db0.data(), db1.data(), db0.size() * sizeof(Real)), 0) << to_string(be);
  }
}

}  // namespace
}  // namespace teo
