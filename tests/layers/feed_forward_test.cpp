#include <cmath>
#include <cstring>
#include <limits>

#include "support.hpp"
#include "teo/backend.hpp"
#include "teo/layers/dropout.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/linear.hpp"

namespace teo {
namespace {

template <class Real>
class Activations : public ::testing::Test {};
TYPED_TEST_SUITE(Activations, test::Dtypes);

TYPED_TEST(Activations, KnownValues) {
  using Real = TypeParam;
  const std::vector<Real> x = {-2, -0.5, 0, 1, 3};
  std::vector<Real> y(x.size());
  activation_forward(y.data(), x.data(), 5, Activation::relu);
  EXPECT_EQ(y, (std::vector<Real>{0, 0, 0, 1, 3}));
  // gelu(1) = Phi(1) = 0.841344746068542948...; gelu_tanh(1) = 0.841191990608276...
  activation_forward(y.data(), x.data(), 5, Activation::gelu);
  EXPECT_NEAR(y[3], 0.8413447460685429, 4 * std::numeric_limits<Real>::epsilon());
  EXPECT_EQ(y[2], Real(0));
  activation_forward(y.data(), x.data(), 5, Activation::gelu_tanh);
  EXPECT_NEAR(y[3], 0.8411919906082768, 4 * std::numeric_limits<Real>::epsilon());
}

TEST(Activations, ReluDerivativeAtZeroIsZero) {
  const std::vector<double> x = {0.0, -0.0};
  const std::vector<double> g = {1.0, 1.0};
  std::vector<double> dx(2, 0.0);
  activation_backward(dx.data(), g.data(), x.data(), 2, Activation::relu);
  EXPECT_EQ(dx[0], 0.0);
  EXPECT_EQ(dx[1], 0.0);
}

TEST(Activations, BackwardMatchesFiniteDifferences) {
  // Inputs are drawn from [-3, 3] and any within 0.05 of relu's kink at 0 is moved away from it,
  // because the finite difference straddles the kink there; the test asserts the margin below.
  const index_t n = 101;
  auto x = test::uniform_vector<double>(n, 1, "x", -3, 3);
  for (auto& v : x)
    if (std::abs(v) < 0.05) v = v < 0 ? -0.5 : 0.5;
  for (double v : x) ASSERT_GE(std::abs(v), 0.05);
  const auto r = test::uniform_vector<double>(n, 2, "r");
  for (Activation a :
       {Activation::relu, Activation::gelu, Activation::gelu_tanh, Activation::silu}) {
    std::vector<double> dx(n, 0.0);
    activation_backward(dx.data(), r.data(), x.data(), n, a);
    auto loss = [&] {
      std::vector<double> y(n);
      activation_forward(y.data(), x.data(), n, a);
      return test::dot(y, r);
    };
    test::expect_gradient(to_string(a), x.data(), dx, loss);
  }
}

// GradWrite::overwrite gives the bits of accumulating into zeros (+0 where the term is -0) on
// every backend and activation, and never reads din (it starts as a value no result is near).
TYPED_TEST(Activations, OverwriteGivesTheBitsOfAccumulatingIntoZeros) {
  using Real = TypeParam;
  const index_t n = 203;
  auto x = test::uniform_vector<Real>(n, 1, "x", -4, 4);
  auto g = test::uniform_vector<Real>(n, 2, "g");
  x[0] = Real(0);
  x[1] = Real(-0.0);
  g[2] = Real(-0.0);  // a -0 term: +0 after the add
  x[3] = Real(-1);    // relu'(-1) * g = 0 * -1 = -0: +0 after the add
  g[3] = Real(-1);
  ScopedSettings restore;
  for (Backend be : {Backend::reference, Backend::simd}) {
    set_backend(be);
    for (Activation a :
         {Activation::relu, Activation::gelu, Activation::gelu_tanh, Activation::silu}) {
      std::vector<Real> acc(n, Real(0)), over(n, Real(1e30));
      activation_backward(acc.data(), g.data(), x.data(), n, a);
      activation_backward(over.data(), g.data(), x.data(), n, a, GradWrite::overwrite);
      EXPECT_EQ(std::memcmp(acc.data(), over.data(), n * sizeof(Real)), 0)
          << to_string(be) << " " << to_string(a);
      if (a == Activation::relu) {
        EXPECT_FALSE(std::signbit(over[3])) << "a -0 term adds to +0";
      }
    }
  }
}

// The fused FFN middle gives the bits of its separate passes (add_bias, activation_forward,
// dropout_forward; dropout_backward and activation_backward overwriting) on every backend and
// activation, with and without a mask, over row blocks of unequal sizes, and writes
// every output element (each starts as NaN).
TYPED_TEST(Activations, FusedHiddenPassGivesTheBitsOfTheSeparatePasses) {
  using Real = TypeParam;
  const index_t rows = 23, cols = 1000;  // on 2 threads, blocks of 12 and 11 rows
  const auto n = static_cast<std::size_t>(rows * cols);
  const Real nan = std::numeric_limits<Real>::quiet_NaN();
  const auto product = test::uniform_vector<Real>(rows * cols, 1, "fc1 product", -4, 4);
  const auto bias = test::uniform_vector<Real>(cols, 2, "bias");
  const auto ddropped = test::uniform_vector<Real>(rows * cols, 3, "ddropped");
  std::vector<std::uint8_t> mask(n);
  dropout_mask(mask.data(), rows * cols, 4, "ffn", 0.25);
  const Real scale = dropout_scale<Real>(0.25);
  ScopedSettings restore;
  for (Backend be : {Backend::reference, Backend::simd}) {
    set_backend(be);
    for (Activation a :
         {Activation::relu, Activation::gelu, Activation::gelu_tanh, Activation::silu}) {
      for (bool dropped : {false, true}) {
        const std::uint8_t* m = dropped ? mask.data() : nullptr;
        const std::string where = std::string(to_string(be)) + " " + to_string(a) +
                                  (dropped ? " with dropout" : " without dropout");
        // forward: the separate passes
        std::vector<Real> pre1(product), hidden1(n), out1(n, nan);
        add_bias(pre1.data(), bias.data(), rows, cols);
        activation_forward(hidden1.data(), pre1.data(), rows * cols, a);
        if (m) dropout_forward(out1.data(), hidden1.data(), m, rows * cols, scale);
        // forward: fused
        std::vector<Real> pre2(product), hidden2(n, nan), out2(n, nan);
        ffn_hidden_forward(pre2.data(), hidden2.data(), out2.data(), bias.data(), m, scale, rows,
                           cols, a);
        EXPECT_EQ(std::memcmp(pre1.data(), pre2.data(), n * sizeof(Real)), 0) << where;
        EXPECT_EQ(std::memcmp(hidden1.data(), hidden2.data(), n * sizeof(Real)), 0) << where;
        EXPECT_EQ(std::memcmp(out1.data(), out2.data(), n * sizeof(Real)), 0) << where;
        // backward: without a mask dhidden is the given gradient, read only
        std::vector<Real> dh1(m ? std::vector<Real>(n, nan) : ddropped), dpre1(n, nan);
        if (m)
          dropout_backward(dh1.data(), ddropped.data(), m, rows * cols, scale,
                           GradWrite::overwrite);
        activation_backward(dpre1.data(), dh1.data(), pre1.data(), rows * cols, a,
                            GradWrite::overwrite);
        std::vector<Real> dh2(m ? std::vector<Real>(n, nan) : ddropped), dpre2(n, nan);
        ffn_hidden_backward(dpre2.data(), dh2.data(), m ? ddropped.data() : nullptr, m, scale,
                            pre2.data(), rows, cols, a);
        EXPECT_EQ(std::memcmp(dh1.data(), dh2.data(), n * sizeof(Real)), 0) << where;
        EXPECT_EQ(std::memcmp(dpre1.data(), dpre2.data(), n * sizeof(Real)), 0) << where;
        EXPECT_FALSE(std::isnan(dpre2.back())) << where;
      }
    }
  }
}

}  // namespace
}  // namespace teo
