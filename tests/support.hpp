// Shared test helpers: deterministic random fills, per-dtype tolerances, finite differences.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "teo/model.hpp"
#include "teo/rng.hpp"
#include "test_paths.hpp"

namespace teo::test {

// An empty folder under the test temporary directory, one per process (two runs of the suite on
// one machine never share it).
inline std::filesystem::path fresh_dir(const std::string& name) {
  const auto d =
      std::filesystem::path(::testing::TempDir()) / (name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// A whole file's bytes ("" when it cannot be read).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Tolerance for comparing a dtype's result against the same computation in double, relative to
// the tensor's largest magnitude. float keeps 24 bits; a few hundred roundings in these small
// shapes stay well below 2^-13.
template <class Real>
struct Tol;
template <>
struct Tol<float> {
  static constexpr double rel = 2e-4;
};
template <>
struct Tol<double> {
  static constexpr double rel = 1e-12;
};

// Uniform values in [lo, hi) from the library's generator, keyed by (seed, name).
template <class Real>
void fill_uniform(Real* p, index_t n, std::uint64_t seed, const std::string& name, double lo,
                  double hi) {
  const std::uint64_t s = rng::stream_id(name);
  for (index_t i = 0; i < n; ++i)
    p[i] =
        static_cast<Real>(lo + (hi - lo) * rng::uniform01(seed, s, static_cast<std::uint64_t>(i)));
}
template <class Real>
std::vector<Real> uniform_vector(index_t n, std::uint64_t seed, const std::string& name,
                                 double lo = -1.0, double hi = 1.0) {
  std::vector<Real> v(static_cast<std::size_t>(n));
  fill_uniform(v.data(), n, seed, name, lo, hi);
  return v;
}

// Randomises every parameter (including LayerNorm weights and biases, which init() sets to 1 and
// 0) so that gradient checks exercise every term.
template <class Real>
void randomise(Params<Real>& p, std::uint64_t seed, double scale = 0.5) {
  p.visit([&](const std::string& name, Tensor<Real>& t) {
    const bool norm_weight =
        name.find("norm") != std::string::npos && name.find(".weight") != std::string::npos;
    fill_uniform(t.data(), t.numel(), seed, name, norm_weight ? 0.5 : -scale,
                 norm_weight ? 1.5 : scale);
  });
}

// max |a - b| / max(max |b|, floor): the normwise relative error of a against reference b.
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b,
                        double floor = 1e-300) {
  double num = 0, den = floor;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

// The derivative of f at x[i] by central differences with one Richardson step, which cancels the
// h^2 term: error O(h^4) + O(eps |f| / h). With h = 1e-4 * max(1, |x|) the truncation term is
// ~1e-16 and the rounding term ~1e-12 of |f| for the O(1) functions here, far below the 1e-6
// bound. A small h also keeps the probe within 1e-4 of x, so inputs kept 2e-3 away from a kink
// (ReLU at 0, a tie in max pooling) are never straddled.
inline double fd_derivative(double* x, const std::function<double()>& f) {
  const double x0 = *x;
  const double h = 1e-4 * std::max(1.0, std::abs(x0));
  auto central = [&](double step) {
    *x = x0 + step;
    const double fp = f();
    *x = x0 - step;
    const double fm = f();
    *x = x0;
    return (fp - fm) / (2 * step);
  };
  const double d1 = central(h);
  const double d2 = central(h / 2);
  return (4 * d2 - d1) / 3;
}

// Finite-difference gradient of f with respect to every element of x (n).
inline std::vector<double> fd_gradient(double* x, index_t n, const std::function<double()>& f) {
  std::vector<double> g(static_cast<std::size_t>(n));
  for (index_t i = 0; i < n; ++i) g[static_cast<std::size_t>(i)] = fd_derivative(x + i, f);
  return g;
}

template <class Real>
std::vector<double> to_double(const Real* p, index_t n) {
  return std::vector<double>(p, p + n);
}

// The same parameters in another dtype (float-valued weights widened to double, say), so that the
// two dtypes can be compared on identical inputs.
template <class To, class From>
Params<To> convert_params(const Params<From>& p) {
  Params<To> out = Params<To>::zeros(p.config);
  std::vector<const Tensor<From>*> src;
  p.visit([&](const std::string&, const Tensor<From>& t) { src.push_back(&t); });
  std::size_t k = 0;
  out.visit([&](const std::string&, Tensor<To>& t) {
    for (index_t i = 0; i < t.numel(); ++i) t[i] = static_cast<To>((*src[k])[i]);
    ++k;
  });
  return out;
}

using Dtypes = ::testing::Types<float, double>;

}  // namespace teo::test

namespace teo::test {

// The bound every finite-difference check in the suite uses: the normwise relative error of the
// analytic gradient against central differences with Richardson extrapolation, in double.
inline constexpr double kFdTolerance = 1e-6;

// Gradients smaller than this are judged against it instead of their own size: the finite
// differences' rounding noise is ~1e-12 absolute, and some gradients are exactly zero in exact
// arithmetic (attn.k.bias: softmax ignores a shift shared by a whole row of scores), so their
// relative error is meaningless. Such tensors must still match to 1e-6 * 1e-4 = 1e-10 absolute.
inline constexpr double kFdFloor = 1e-4;

// The largest error expect_gradient() has seen in this process, for reporting.
inline double& worst_fd_error() {
  static double worst = 0;
  return worst;
}

// Expects the analytic gradient g of loss() with respect to x to match finite differences:
// max |g - fd| <= 1e-6 * max(max |fd|, 1e-4).
inline void expect_gradient(const std::string& what, double* x, const std::vector<double>& g,
                            const std::function<double()>& loss) {
  const auto numeric = fd_gradient(x, static_cast<index_t>(g.size()), loss);
  double mx = 0;
  for (double v : numeric) mx = std::max(mx, std::abs(v));
  const double err = rel_error(g, numeric, kFdFloor);
  worst_fd_error() = std::max(worst_fd_error(), err);
  EXPECT_LE(err, kFdTolerance) << what << " (max |grad| " << mx << ")";
}

// sum(out * r): the scalar loss whose gradient with respect to out is r.
inline double dot(const std::vector<double>& out, const std::vector<double>& r) {
  double s = 0;
  for (std::size_t i = 0; i < out.size(); ++i) s += out[i] * r[i];
  return s;
}

}  // namespace teo::test

namespace teo::test {

// Compares two tensors holding the same quantity: positions equal in both (including matching
// infinities, such as masked scores) count as exact; elsewhere the error is taken relative to the
// largest finite magnitude of the reference. Returns +inf when a NaN or an infinity disagrees.
inline double compare(const std::vector<double>& a, const std::vector<double>& ref,
                      double floor = 1e-30) {
  double num = 0, den = floor;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isfinite(ref[i])) den = std::max(den, std::abs(ref[i]));
    if (a[i] == ref[i]) continue;
    if (!std::isfinite(a[i]) || !std::isfinite(ref[i])) return INFINITY;
    num = std::max(num, std::abs(a[i] - ref[i]));
  }
  return num / den;
}

template <class Real>
std::map<std::string, std::vector<double>> named(const Activations<Real>& a) {
  std::map<std::string, std::vector<double>> m;
  a.visit(
      [&](const std::string& n, const Tensor<Real>& t) { m[n] = to_double(t.data(), t.numel()); });
  return m;
}
template <class Real>
std::map<std::string, std::vector<double>> named(const Params<Real>& p) {
  std::map<std::string, std::vector<double>> m;
  p.visit(
      [&](const std::string& n, const Tensor<Real>& t) { m[n] = to_double(t.data(), t.numel()); });
  return m;
}

// True when every element of every named tensor is bitwise identical: of two Activations, or of
// two Params (gradients included).
template <template <class> class Named, class Real>
bool bitwise_equal(const Named<Real>& a, const Named<Real>& b) {
  std::vector<const Tensor<Real>*> ta, tb;
  a.visit([&](const std::string&, const Tensor<Real>& t) { ta.push_back(&t); });
  b.visit([&](const std::string&, const Tensor<Real>& t) { tb.push_back(&t); });
  if (ta.size() != tb.size()) return false;
  for (std::size_t i = 0; i < ta.size(); ++i) {
    if (!(ta[i]->shape() == tb[i]->shape())) return false;
    // an empty tensor's data() may be null, which memcmp must not be given even for 0 bytes
    if (ta[i]->numel() > 0 &&
        std::memcmp(ta[i]->data(), tb[i]->data(), sizeof(Real) * ta[i]->numel()) != 0)
      return false;
  }
  return true;
}

// fn() must throw E whose message contains `needle`.
template <class E, class F>
void expect_throw(F&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one naming \"" << needle << "\"";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" does not name \"" << needle << "\"";
  }
}

}  // namespace teo::test
