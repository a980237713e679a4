// teo_blocking_sweep: compares GEMM cache blockings (KC, MC) against OpenBLAS in one process.
//
//   build/bench/teo_blocking_sweep [--dtype float32|float64] [--shapes bert|small]
//                                  [--rounds N] [--threads N] [KC,MC[,NC[,shared|owned]] ...]
//
// Each round times OpenBLAS once and then every blocking once (3 calls each) on the same operands,
// starting the blockings at a different one each round, after one untimed teo call: OpenBLAS's
// threads keep spinning for a while after a call returns and slow whatever runs next, which would
// otherwise always penalise the first blocking. Per blocking it prints the median GFLOP/s and the
// median of its per-round ratios to OpenBLAS, which cancels the machine's drift between rounds.
// Each blocking is a copy of the tile teo::gemm would use, with KC, MC and NC replaced (0 keeps the
// table's value, so 0,0 is the table's own blocking) and, when named, the split among threads
// (simd/isa.hpp: shared or owned), run through the simd backend's GEMM. No blocking changes a
// result (Gemm.BlockingNeverChangesABit), only the time.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/kernels_internal.hpp"
#include "teo/backend.hpp"
#include "teo/kernels.hpp"
#include "teo/rng.hpp"

namespace {

using teo::index_t;
using teo::Trans;

struct Shape {
  Trans ta, tb;
  index_t m, n, k;
};

struct Blocking {
  index_t kc, mc, nc = 0;
  int split = -1;  // -1: the table's; else a teo::simd::Split
  std::string name;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

template <class Real>
class Sweep {
 public:
  explicit Sweep(const Shape& s) : s_(s), a_(s.m * s.k), b_(s.k * s.n), c_(s.m * s.n) {
    for (std::size_t i = 0; i < a_.size(); ++i)
      a_[i] = static_cast<Real>(teo::rng::uniform01(1, 1, i) - 0.5);
    for (std::size_t i = 0; i < b_.size(); ++i)
      b_[i] = static_cast<Real>(teo::rng::uniform01(1, 2, i) - 0.5);
  }

  // GFLOP/s of 3 calls, of teo's GEMM with kern or, when kern is null, of OpenBLAS.
  double time(const teo::simd::GemmKernel<Real>* kern) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < 3; ++r) call(kern);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 3 * 2.0 * static_cast<double>(s_.m * s_.n * s_.k) / s / 1e9;
  }
  void call(const teo::simd::GemmKernel<Real>* kern) {
    const index_t lda = s_.ta == Trans::no ? s_.k : s_.m, ldb = s_.tb == Trans::no ? s_.n : s_.k;
    if (kern) {
      teo::detail::simd_gemm(*kern, s_.ta, s_.tb, s_.m, s_.n, s_.k, Real(1), a_.data(), lda,
                             b_.data(), ldb, Real(0), c_.data(), s_.n);
      return;
    }
    const auto ta = s_.ta == Trans::no ? CblasNoTrans : CblasTrans;
    const auto tb = s_.tb == Trans::no ? CblasNoTrans : CblasTrans;
    const int m = static_cast<int>(s_.m), n = static_cast<int>(s_.n), k = static_cast<int>(s_.k);
    if constexpr (std::is_same_v<Real, float>) {
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, a_.data(), static_cast<int>(lda), b_.data(),
                  static_cast<int>(ldb), 0.0f, c_.data(), n);
    } else {
      cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, a_.data(), static_cast<int>(lda), b_.data(),
                  static_cast<int>(ldb), 0.0, c_.data(), n);
    }
  }

 private:
  Shape s_;
  std::vector<Real> a_, b_, c_;
};

template <class Real>
void sweep(const Shape& s, const std::vector<Blocking>& blockings, int rounds) {
  Sweep<Real> w(s);
  const std::size_t nb = blockings.size();
  std::vector<double> blas;
  std::vector<std::vector<double>> rate(nb), ratio(nb);
  const auto& tile = teo::detail::gemm_tile<Real>(teo::detail::isa_kernels(), s.m, s.n);
  std::vector<teo::simd::GemmKernel<Real>> kerns(nb, tile);
  for (std::size_t i = 0; i < nb; ++i) {
    if (blockings[i].kc > 0) kerns[i].kc = blockings[i].kc;
    if (blockings[i].mc > 0) kerns[i].mc = blockings[i].mc;
    if (blockings[i].nc > 0) kerns[i].nc = blockings[i].nc;
    if (blockings[i].split >= 0) kerns[i].split = static_cast<teo::simd::Split>(blockings[i].split);
  }
  for (int r = 0; r < rounds; ++r) {
    const double b = w.time(nullptr);
    blas.push_back(b);
    w.call(&tile);
    for (std::size_t j = 0; j < nb; ++j) {
      const std::size_t i = (j + static_cast<std::size_t>(r)) % nb;
      rate[i].push_back(w.time(&kerns[i]));
      ratio[i].push_back(rate[i].back() / b);
    }
  }
  std::printf("%s%s %5ld x %5ld x %5ld  OpenBLAS %6.1f", s.ta == Trans::no ? "N" : "T",
              s.tb == Trans::no ? "N" : "T", static_cast<long>(s.m), static_cast<long>(s.n),
              static_cast<long>(s.k), median(blas));
  for (std::size_t i = 0; i < nb; ++i)
    std::printf(" | %s %6.1f (%.3f)", blockings[i].name.c_str(), median(rate[i]), median(ratio[i]));
  std::printf("\n");
  std::fflush(stdout);
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "teo_blocking_sweep: %s\nusage: teo_blocking_sweep [--dtype float32|float64] "
               "[--shapes bert|small] [--rounds N] [--threads N] "
               "[KC,MC[,NC[,shared|owned]] ...]\n",
               why.c_str());
  std::exit(2);
}

long positive(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < 1 || x > 1000000) usage(flag + " needs a positive integer");
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dtype = "float64", shapes = "bert";
  int rounds = 8, threads = 2;
  std::vector<Blocking> blockings;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dtype") {
      dtype = value();
      if (dtype != "float32" && dtype != "float64") usage("--dtype is float32 or float64");
    } else if (a == "--shapes") {
      shapes = value();
      if (shapes != "bert" && shapes != "small") usage("--shapes is bert or small");
    } else if (a == "--rounds") {
      rounds = static_cast<int>(positive(a, value()));
    } else if (a == "--threads") {
      threads = static_cast<int>(positive(a, value()));
    } else {
      long kc = -1, mc = -1, nc = 0;
      char split[16] = {};
      const int got = std::sscanf(a.c_str(), "%ld,%ld,%ld,%15s", &kc, &mc, &nc, split);
      const std::string sp = split;
      if (got < 2 || kc < 0 || mc < 0 || nc < 0 || kc > 100000 || mc > 100000 || nc > 100000 ||
          (got == 4 && sp != "shared" && sp != "owned") ||
          a.find_first_not_of("0123456789,sharedown") != std::string::npos)
        usage("not a flag or a KC,MC[,NC[,shared|owned]] blocking: " + a);
      blockings.push_back({kc, mc, nc,
                           got < 4         ? -1
                           : sp == "owned" ? static_cast<int>(teo::simd::Split::owned)
                                           : static_cast<int>(teo::simd::Split::shared_panel),
                           a});
    }
  }
  if (blockings.empty()) blockings.push_back({0, 0, 0, -1, "0,0"});

  std::vector<Shape> list;
  if (shapes == "bert") {
    for (Trans ta : {Trans::no, Trans::yes})
      for (Trans tb : {Trans::no, Trans::yes}) {
        if (ta == Trans::yes && tb == Trans::yes) continue;
        list.push_back({ta, tb, 1024, 768, 768});
        list.push_back({ta, tb, 1024, 3072, 768});
        list.push_back({ta, tb, 1024, 768, 3072});
      }
  } else {
    list = {{Trans::no, Trans::yes, 2048, 768, 256},  {Trans::no, Trans::yes, 2048, 1024, 256},
            {Trans::no, Trans::yes, 2048, 256, 1024}, {Trans::no, Trans::no, 2048, 256, 1024},
            {Trans::no, Trans::no, 2048, 1024, 256},  {Trans::yes, Trans::no, 1024, 256, 2048},
            {Trans::yes, Trans::no, 256, 1024, 2048}, {Trans::yes, Trans::no, 256, 256, 2048}};
  }
  try {
    teo::set_backend(teo::Backend::simd);
    teo::set_num_threads(threads);
  } catch (const std::exception& e) {
    usage(e.what());
  }
  openblas_set_num_threads(threads);
  std::printf(
      "%s, %d threads, isa %s, %d rounds; per blocking KC,MC[,NC,split]: median GFLOP/s (median "
      "per-round ratio to OpenBLAS)\n",
      dtype.c_str(), threads, teo::to_string(teo::isa()), rounds);
  for (const Shape& s : list) {
    if (dtype == "float32")
      sweep<float>(s, blockings, rounds);
    else
      sweep<double>(s, blockings, rounds);
  }
}
