#include <cmath>

#include "support.hpp"
#include "teo/layers/positional.hpp"

namespace teo {
namespace {

template <class Real>
class Positional : public ::testing::Test {};
TYPED_TEST_SUITE(Positional, test::Dtypes);

TYPED_TEST(Positional, SinusoidalTableMatchesDefinition) {
  using Real = TypeParam;
  for (index_t d : {1, 2, 7, 16}) {
    const index_t s = 11;
    std::vector<Real> pe(s * d);
    sinusoidal_table(pe.data(), s, d);
    for (index_t pos = 0; pos < s; ++pos)
      for (index_t c = 0; c < d; ++c) {
        const double angle = pos / std::pow(10000.0, (c - c % 2) / static_cast<double>(d));
        const double want = c % 2 == 0 ? std::sin(angle) : std::cos(angle);
        EXPECT_EQ(pe[pos * d + c], static_cast<Real>(want)) << "pos " << pos << " col " << c;
      }
  }
}

TYPED_TEST(Positional, OddModelWidthEndsWithSin) {
  using Real = TypeParam;
  const index_t d = 5, s = 4;
  std::vector<Real> pe(s * d);
  sinusoidal_table(pe.data(), s, d);
  // column 4 is PE(pos, 2i) with 2i = 4: sin(pos / 10000^(4/5))
  for (index_t pos = 0; pos < s; ++pos)
    EXPECT_EQ(pe[pos * d + 4], static_cast<Real>(std::sin(pos / std::pow(10000.0, 0.8))));
}

TYPED_TEST(Positional, AddBroadcastsOverBatch) {
  using Real = TypeParam;
  const index_t b = 3, s = 2, d = 4;
  const auto in = test::uniform_vector<Real>(b * s * d, 1, "in");
  const auto pe = test::uniform_vector<Real>(s * d, 2, "pe");
  std::vector<Real> out(in.size());
  add_positional_forward(out.data(), in.data(), pe.data(), b, s, d);
  for (index_t i = 0; i < b * s * d; ++i) EXPECT_EQ(out[i], in[i] + pe[i % (s * d)]);
}

TEST(Positional, LearnedBackwardMatchesFiniteDifferences) {
  const index_t b = 3, s = 4, d = 5;
  const auto in = test::uniform_vector<double>(b * s * d, 1, "in");
  auto pe = test::uniform_vector<double>(s * d, 2, "pe");
  const auto r = test::uniform_vector<double>(b * s * d, 3, "r");
  std::vector<double> dpe(s * d, 0.0);
  add_positional_backward(dpe.data(), r.data(), b, s, d);
  auto loss = [&] {
    std::vector<double> out(in.size());
    add_positional_forward(out.data(), in.data(), pe.data(), b, s, d);
    return test::dot(out, r);
  };
  test::expect_gradient("pos_embedding", pe.data(), dpe, loss);
}

}  // namespace
}  // namespace teo
