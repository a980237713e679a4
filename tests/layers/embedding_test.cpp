#include "teo/layers/embedding.hpp"
#include "support.hpp"

namespace teo {
namespace {

template <class Real>
class Embedding : public ::testing::Test {};
TYPED_TEST_SUITE(Embedding, test::Dtypes);

TYPED_TEST(Embedding, ForwardGathersScaledRows) {
  using Real = TypeParam;
  const index_t v = 5, d = 3;
  const auto w = test::uniform_vector<Real>(v * d, 1, "w");
  const std::vector<std::int64_t> tok = {4, 0, 4, 2};
  std::vector<Real> out(tok.size() * d);
  embedding_forward(out.data(), tok.data(), w.data(), 4, d, Real(2));
  for (std::size_t t = 0; t < tok.size(); ++t)
    for (index_t c = 0; c < d; ++c) EXPECT_EQ(out[t * d + c], w[tok[t] * d + c] * Real(2));
}

TEST(Embedding, BackwardMatchesFiniteDifferencesAndAccumulatesRepeats) {
  const index_t v = 6, d = 4, n = 5;
  auto w = test::uniform_vector<double>(v * d, 1, "w");
  const std::vector<std::int64_t> tok = {1, 3, 1, 5, 1};  // token 1 three times
  const auto r = test::uniform_vector<double>(n * d, 2, "r");
  const double scale = 1.7;
  std::vector<double> dw(v * d, 0.0);
  embedding_backward(dw.data(), r.data(), tok.data(), n, d, scale);
  auto loss = [&] {
    std::vector<double> out(n * d);
    embedding_forward(out.data(), tok.data(), w.data(), n, d, scale);
    return test::dot(out, r);
  };
  test::expect_gradient("embedding.weight", w.data(), dw, loss);
  for (index_t c = 0; c < d; ++c) {
    EXPECT_EQ(dw[0 * d + c], 0.0);  // unused rows get exactly 0
    EXPECT_NEAR(dw[1 * d + c], scale * (r[0 * d + c] + r[2 * d + c] + r[4 * d + c]), 1e-15);
  }
}

}  // namespace
}  // namespace teo
