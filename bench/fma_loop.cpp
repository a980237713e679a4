// The plain yardstick for teo bench's FMA peak: 12 independent AVX-512 FMA chains per OpenMP
// thread, for about a second, in float or double. No teo code: it checks that the peak probe
// reports what the hardware does.
//
//   g++ -O2 -march=native -fopenmp bench/fma_loop.cpp -o /tmp/fma_loop
//   OMP_NUM_THREADS=2 /tmp/fma_loop float      (prints GFLOP/s, the best of 5 runs)
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstring>

// 12 chains of `iters` steps on one thread; returns their sum, so that none is optimised away.
template <class V, class Fma, class Set, class Sum>
double chains(long iters, Fma fma, Set set1, Sum sum) {
  V v[12];
#pragma GCC unroll 12
  for (int c = 0; c < 12; ++c) v[c] = set1(1.0 + c / 64.0);
  const V x = set1(0.999), y = set1(0.001);
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < 12; ++c) v[c] = fma(v[c], x, y);
  }
  double s = 0;
#pragma GCC unroll 12
  for (int c = 0; c < 12; ++c) s += sum(v[c]);
  return s;
}

int main(int argc, char** argv) {
  const bool dbl = argc > 1 && std::strcmp(argv[1], "double") == 0;
  const long iters = 100'000'000;
  double best = 0;
  for (int run = 0; run < 5; ++run) {
    double sink = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
    sink +=
        dbl ? chains<__m512d>(
                  iters, [](__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); },
                  [](double v) { return _mm512_set1_pd(v); },
                  [](__m512d a) { return _mm512_reduce_add_pd(a); })
            : chains<__m512>(
                  iters, [](__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); },
                  [](double v) { return _mm512_set1_ps(static_cast<float>(v)); },
                  [](__m512 a) { return static_cast<double>(_mm512_reduce_add_ps(a)); });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double flops = 2.0 * iters * 12 * (dbl ? 8 : 16) * omp_get_max_threads();
    if (flops / s / 1e9 > best) best = flops / s / 1e9;
    if (sink == 42) std::printf(" ");
  }
  std::printf("%.1f GFLOP/s (%s, %d threads, best of 5)\n", best, dbl ? "double" : "float",
              omp_get_max_threads());
}
