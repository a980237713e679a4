// The vector kernels of every ISA: accuracy of exp, erf and tanh against the C library in units
// of the last place; the stage kernels against the reference loops; and bitwise agreement of every
// ISA with the scalar fallback, at sizes 1, N-1, N, N+1 and primes around every vector width.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/kernels_internal.hpp"
#include "support.hpp"
#include "teo/bench.hpp"
#include "teo/layers/attention.hpp"
#include "teo/layers/feed_forward.hpp"
#include "teo/layers/layer_norm.hpp"

namespace teo {
namespace {

template <class Real>
const simd::VectorKernels<Real>& table(Isa i) {
  if constexpr (std::is_same_v<Real, float>) {
    return detail::isa_kernels(i).svec;
  } else {
    return detail::isa_kernels(i).dvec;
  }
}

// The distance between two values of Real in units in the last place, counted as the number of
// representable values between them (bit patterns in sign-magnitude order): 0 for equal values,
// and for NaN against NaN; infinite when exactly one is NaN.
template <class Real>
double ulp_distance(Real a, Real b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0 : INFINITY;
  using Bits = std::conditional_t<sizeof(Real) == 4, std::uint32_t, std::uint64_t>;
  const auto ordered = [](Real x) {
    Bits u;
    std::memcpy(&u, &x, sizeof u);
    const Bits sign = Bits{1} << (8 * sizeof(Bits) - 1);
    // +0 and -0 both map to 0; negatives count down from there.
    return (u & sign) ? -static_cast<long double>(u & ~sign) : static_cast<long double>(u);
  };
  return static_cast<double>(std::abs(ordered(a) - ordered(b)));
}

// The correctly rounded value, as near as long double (64-bit significand on x86-64) gets.
template <class Real>
Real reference(teo::MathFn fn, Real x) {
  const long double xl = x;
  const long double y = fn == teo::MathFn::exp   ? std::exp(xl)
                        : fn == teo::MathFn::erf ? std::erf(xl)
                                                 : std::tanh(xl);
  return static_cast<Real>(y);
}

// Inputs: a dense sweep of the interesting range plus the edges.
template <class Real>
std::vector<Real> inputs(double lo, double hi) {
  std::vector<Real> x;
  for (int i = 0; i <= 20000; ++i) x.push_back(static_cast<Real>(lo + (hi - lo) * i / 20000.0));
  for (double v : {0.0, -0.0, 1e-30, -1e-30, 1e-8, 0.5, 1.0, 2.0, 2.0000001, 3.9, 4.1, 5.9, 6.1})
    x.push_back(static_cast<Real>(v));
  x.push_back(std::numeric_limits<Real>::infinity());
  x.push_back(-std::numeric_limits<Real>::infinity());
  x.push_back(std::numeric_limits<Real>::quiet_NaN());
  return x;
}

template <class Real>
class VectorKernels : public ::testing::Test {
 protected:
  ScopedSettings restore_;
};
TYPED_TEST_SUITE(VectorKernels, test::Dtypes);

// Accuracy in true ulps: the bit distance between each result and the correctly rounded value
// (from long double). Measured worst cases (the sweep below, and a denser one per band of |x|):
//   exp   1 ulp everywhere, float and double (subnormal results included);
//   erf   5 ulp (float) and 7 ulp (double), at |x| in [1, 2); 2 ulp below 1;
//   tanh  5 ulp for |x| >= 0.3, but computed through exp(2|x|) its error is absolute, at most
//         1.5 eps everywhere: relative to a small tanh(x) that is about 1/x ulps (1000 ulp at
//         x = 0.001). GELU's tanh form only uses 1 + tanh, where that absolute error is what
//         counts.
// The bounds are those figures: the test fails when a change makes any of them worse.
TYPED_TEST(VectorKernels, ElementaryFunctionsAreAccurate) {
  using Real = TypeParam;
  constexpr bool is_float = std::is_same_v<Real, float>;
  const double big = is_float ? 88.0 : 700.0;
  const double eps = std::numeric_limits<Real>::epsilon();
  for (Isa i : supported_isas()) {
    const auto& k = table<Real>(i);
    for (teo::MathFn fn : {teo::MathFn::exp, teo::MathFn::erf, teo::MathFn::tanh}) {
      const auto x =
          fn == teo::MathFn::exp ? inputs<Real>(-big - 20, big + 1) : inputs<Real>(-7, 7);
      std::vector<Real> y(x.size());
      k.math(y.data(), x.data(), static_cast<index_t>(x.size()), fn);
      const char* name = fn == teo::MathFn::exp ? "exp" : fn == teo::MathFn::erf ? "erf" : "tanh";
      double worst = 0, worst_abs = 0;
      Real worst_x = 0;
      for (std::size_t e = 0; e < x.size(); ++e) {
        const Real want = reference(fn, x[e]);
        const double d = ulp_distance(y[e], want);
        if (fn == teo::MathFn::tanh && std::isfinite(x[e])) {
          worst_abs = std::max(worst_abs, std::abs(static_cast<double>(y[e]) - want) / eps);
          if (std::abs(x[e]) < Real(0.3)) continue;  // absolute accuracy only, checked below
        }
        if (d > worst) worst = d, worst_x = x[e];
      }
      std::cout << "[ measured ] " << to_string(i) << (is_float ? " float " : " double ") << name
                << ": worst " << worst << " ulp at x = " << worst_x;
      if (fn == teo::MathFn::tanh) std::cout << " (|x| >= 0.3); absolute " << worst_abs << " eps";
      std::cout << "\n";
      const double bound = fn == teo::MathFn::exp   ? 1
                           : fn == teo::MathFn::erf ? (is_float ? 5 : 7)
                                                    : 5;
      EXPECT_LE(worst, bound) << to_string(i) << " " << name << " at x = " << worst_x;
      if (fn == teo::MathFn::tanh) {
        EXPECT_LE(worst_abs, 1.5) << to_string(i) << " tanh";
      }
    }
  }
}

// The distance itself, on values whose spacing is known.
// The FMA peak probe (teo::bench::fma_peak) on every ISA this CPU runs: each lane computes the
// same chains as the scalar probe, and the probe reports the ISA's vector width, its chain count
// and a best round no slower than the median. (Its speed is measured by `teo bench`, not tested.)
TEST(VectorKernels, FmaPeakProbeRunsItsChainsOnTheWidestVectors) {
  ScopedSettings restore;
  const double one = table<double>(Isa::scalar).fma_chains(1000);
  EXPECT_GT(one, 11.0);  // 12 chains near 1: none optimised away
  for (Isa isa : supported_isas()) {
    const int lanes = isa == Isa::avx512 ? 8 : isa == Isa::avx2 ? 4 : isa == Isa::neon ? 2 : 1;
    const int flanes = isa == Isa::scalar ? 1 : 2 * lanes;
    EXPECT_EQ(table<double>(isa).lanes, lanes) << to_string(isa);
    EXPECT_EQ(table<float>(isa).lanes, flanes) << to_string(isa);
    EXPECT_NEAR(table<double>(isa).fma_chains(1000) / lanes, one, 1e-13 * one) << to_string(isa);
    set_isa(isa);
    set_num_threads(2);
    const bench::Peak p = bench::fma_peak<float>(3);
    EXPECT_EQ(p.isa, to_string(isa));
    EXPECT_EQ(p.lanes, flanes);
    EXPECT_EQ(p.chains, simd::kPeakChains);
    EXPECT_EQ(p.threads, 2);
    EXPECT_EQ(p.rounds, 3);
    EXPECT_GT(p.min_gflops, 0.0);
    EXPECT_LE(p.min_gflops, p.median_gflops);
    EXPECT_LE(p.median_gflops, p.gflops);
  }
  EXPECT_THROW(bench::fma_peak<double>(0), ConfigError);
}

TEST(VectorKernels, UlpDistanceCountsRepresentableValues) {
  EXPECT_EQ(ulp_distance(1.0f, std::nextafter(1.0f, 2.0f)), 1);
  EXPECT_EQ(ulp_distance(1.0, std::nextafter(std::nextafter(1.0, 0.0), 0.0)), 2);
  EXPECT_EQ(ulp_distance(-0.0, 0.0), 0);
  EXPECT_EQ(ulp_distance(std::numeric_limits<float>::denorm_min(),
                         -std::numeric_limits<float>::denorm_min()),
            2);
  EXPECT_EQ(ulp_distance(std::numeric_limits<double>::quiet_NaN(),
                         std::numeric_limits<double>::quiet_NaN()),
            0);
  EXPECT_TRUE(std::isinf(ulp_distance(1.0f, std::numeric_limits<float>::quiet_NaN())));
}

TYPED_TEST(VectorKernels, NaNPropagatesInEveryLane) {
  using Real = TypeParam;
  std::vector<Real> x(64, std::numeric_limits<Real>::quiet_NaN()), y(64);
  for (Isa i : supported_isas()) {
    const auto& k = table<Real>(i);
    for (int fn = 0; fn < 3; ++fn) {
      k.math(y.data(), x.data(), 64, static_cast<teo::MathFn>(fn));
      for (Real v : y) EXPECT_TRUE(std::isnan(v)) << to_string(i) << " fn " << fn;
      k.activation_forward(y.data(), x.data(), 64,
                           static_cast<teo::Activation>(fn));  // relu(NaN) = NaN, like PyTorch
      for (Real v : y) EXPECT_TRUE(std::isnan(v)) << to_string(i) << " activation " << fn;
    }
  }
}

TYPED_TEST(VectorKernels, EveryIsaMatchesScalarBitForBit) {
  using Real = TypeParam;
  const auto& s = table<Real>(Isa::scalar);
  for (index_t n : {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 37, 63, 64, 65, 127, 300}) {
    const auto x = test::uniform_vector<Real>(n, static_cast<std::uint64_t>(n), "x", -6, 6);
    const auto g = test::uniform_vector<Real>(n, static_cast<std::uint64_t>(n), "g", -1, 1);
    const auto w = test::uniform_vector<Real>(n, static_cast<std::uint64_t>(n), "w", 0.5, 1.5);
    auto p = test::uniform_vector<Real>(n, static_cast<std::uint64_t>(n), "p", 0, 1);
    // NaN, +-inf and -0 at every 5th element, so that they land in vector lanes, not only in the
    // scalar tail, for the element-wise kernels.
    auto xs = x;
    const Real specials[] = {std::numeric_limits<Real>::quiet_NaN(),
                             std::numeric_limits<Real>::infinity(),
                             -std::numeric_limits<Real>::infinity(), Real(-0.0),
                             -std::numeric_limits<Real>::quiet_NaN()};
    for (index_t j = 0; j < n; j += 5) xs[j] = specials[(j / 5) % 5];
    for (Isa i : supported_isas()) {
      const auto& k = table<Real>(i);
      // Bit for bit, except that a NaN's sign and payload are not specified (IEEE 754 leaves
      // them to the hardware, and x86 and ARM pick different operands): NaN must meet NaN.
      auto same = [&](const std::vector<Real>& a, const std::vector<Real>& b, const char* what) {
        for (std::size_t e = 0; e < a.size(); ++e) {
          const bool ok =
              std::isnan(a[e]) ? std::isnan(b[e]) : std::memcmp(&a[e], &b[e], sizeof(Real)) == 0;
          if (!ok) {
            ADD_FAILURE() << to_string(i) << " " << what << " n=" << n << " at " << e << ": "
                          << a[e] << " vs " << b[e];
            return;
          }
        }
      };
      for (const std::vector<Real>* in : {&x, static_cast<const std::vector<Real>*>(&xs)}) {
        for (int fn = 0; fn < 3; ++fn) {
          std::vector<Real> a(n), b(n);
          k.math(a.data(), in->data(), n, static_cast<teo::MathFn>(fn));
          s.math(b.data(), in->data(), n, static_cast<teo::MathFn>(fn));
          same(a, b, "math");
          k.activation_forward(a.data(), in->data(), n, static_cast<teo::Activation>(fn));
          s.activation_forward(b.data(), in->data(), n, static_cast<teo::Activation>(fn));
          same(a, b, "activation_forward");
          std::vector<Real> da(g), db(g);
          k.activation_backward(da.data(), g.data(), in->data(), n,
                                static_cast<teo::Activation>(fn), true);
          s.activation_backward(db.data(), g.data(), in->data(), n,
                                static_cast<teo::Activation>(fn), true);
          same(da, db, "activation_backward");
          // Overwriting never reads din and gives the bits of accumulating into zeros.
          std::vector<Real> zeros(n, Real(0)), poisoned(n, Real(1e30));
          k.activation_backward(zeros.data(), g.data(), in->data(), n,
                                static_cast<teo::Activation>(fn), true);
          k.activation_backward(poisoned.data(), g.data(), in->data(), n,
                                static_cast<teo::Activation>(fn), false);
          same(zeros, poisoned, "activation_backward overwriting");
        }
      }
      for (index_t nv : {index_t{0}, index_t{1}, n / 2, n}) {
        std::vector<Real> a(n), b(n);
        k.softmax_forward_row(a.data(), x.data(), nv, n);
        s.softmax_forward_row(b.data(), x.data(), nv, n);
        same(a, b, "softmax_forward_row");
      }
      std::vector<Real> a(n), b(n);
      k.softmax_backward_row(a.data(), p.data(), g.data(), n);
      s.softmax_backward_row(b.data(), p.data(), g.data(), n);
      same(a, b, "softmax_backward_row");
      Real ma, ra, mb, rb;
      k.layer_norm_forward_row(a.data(), &ma, &ra, x.data(), w.data(), g.data(), n, Real(1e-5));
      s.layer_norm_forward_row(b.data(), &mb, &rb, x.data(), w.data(), g.data(), n, Real(1e-5));
      same(a, b, "layer_norm_forward_row");
      EXPECT_EQ(std::memcmp(&ma, &mb, sizeof ma) | std::memcmp(&ra, &rb, sizeof ra), 0);
      std::vector<Real> dxa(g), dxb(g);
      k.layer_norm_backward_row(dxa.data(), p.data(), x.data(), w.data(), ma, ra, n, true);
      s.layer_norm_backward_row(dxb.data(), p.data(), x.data(), w.data(), mb, rb, n, true);
      same(dxa, dxb, "layer_norm_backward_row");
      // Overwriting a buffer of NaN gives the bits of accumulating into zeros.
      std::vector<Real> zeros(static_cast<std::size_t>(n), Real(0));
      std::vector<Real> nans(static_cast<std::size_t>(n), std::numeric_limits<Real>::quiet_NaN());
      k.layer_norm_backward_row(zeros.data(), p.data(), x.data(), w.data(), ma, ra, n, true);
      k.layer_norm_backward_row(nans.data(), p.data(), x.data(), w.data(), ma, ra, n, false);
      same(zeros, nans, "layer_norm_backward_row overwriting");
    }
  }
}

// The simd backend's stage kernels against the reference loops, on every ISA.
TYPED_TEST(VectorKernels, StagesMatchTheReference) {
  using Real = TypeParam;
  const double tol = std::is_same_v<Real, float> ? 1e-5 : 1e-13;
  const index_t rows = 7, cols = 45;
  const auto x = test::uniform_vector<Real>(rows * cols, 1, "x", -5, 5);
  const auto g = test::uniform_vector<Real>(rows * cols, 2, "g");
  const auto w = test::uniform_vector<Real>(cols, 3, "w", 0.5, 1.5);
  const auto b = test::uniform_vector<Real>(cols, 4, "b");
  auto run = [&](Backend be) {
    set_backend(be);
    std::vector<std::vector<double>> out;
    for (Activation act :
         {Activation::relu, Activation::gelu, Activation::gelu_tanh, Activation::silu}) {
      std::vector<Real> y(x.size()), dx(x.size(), Real(0));
      activation_forward(y.data(), x.data(), rows * cols, act);
      activation_backward(dx.data(), g.data(), x.data(), rows * cols, act);
      out.push_back(test::to_double(y.data(), rows * cols));
      out.push_back(test::to_double(dx.data(), rows * cols));
    }
    std::vector<Real> y(x.size()), m(rows), r(rows), dx(x.size(), Real(0)), dw(cols, Real(0)),
        db(cols, Real(0));
    layer_norm_forward(y.data(), m.data(), r.data(), x.data(), w.data(), b.data(), rows, cols,
                       Real(1e-5));
    layer_norm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), w.data(), m.data(),
                        r.data(), rows, cols);
    for (const auto* v : {&y, &dx, &dw, &db}) out.push_back(test::to_double(v->data(), v->size()));
    return out;
  };
  const auto want = run(Backend::reference);
  for (Isa i : supported_isas()) {
    set_isa(i);
    const auto got = run(Backend::simd);
    for (std::size_t t = 0; t < want.size(); ++t)
      EXPECT_LE(test::compare(got[t], want[t]), tol) << to_string(i) << " output " << t;
  }
}

}  // namespace
}  // namespace teo
